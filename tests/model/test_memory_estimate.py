"""Start-up memory: the weights' estimate from the checkpoint's headers against what a load holds,
and the refusal before loading of a configuration that cannot fit (engine/memory_check.py).

The estimate (models/memory.py) is what `ft serve` checks against the machine's available memory
before it reads a weight; it must be within 5% of the loaded model's bytes on the bundled files
under the policies users run, or the check refuses models that fit (or admits ones that do not).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.memory_check import GIB, WORKSPACE, check_fits
from freetoken.errors import ConfigError
from freetoken.models.load import load_model
from freetoken.models.memory import estimate_weights, weight_bytes
from freetoken.weights.inventory import inventory

CPU = torch.device("cpu")


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m-instruct"])
@pytest.mark.parametrize(
    "weights, prefill, dtype_name",
    [
        ("auto", "auto", "bfloat16"),
        ("auto", "quantized", "bfloat16"),
        ("int8", "quantized", "bfloat16"),
        ("auto", "auto", "float32"),  # no prefill copies in float32 (models.linear.keeps_dense_copy)
    ],
)
def test_the_estimate_is_within_five_percent_of_what_a_load_holds(
    name: str, weights: str, prefill: str, dtype_name: str
) -> None:
    dtype = getattr(torch, dtype_name)
    loaded = load_model(name, dtype, CPU, weights, prefill, weights_cache="off")
    held = weight_bytes(loaded.model)
    estimate = estimate_weights(inventory(loaded.source), weights, prefill, dtype)
    assert abs(estimate / held["weights"] - 1) < 0.05, f"estimate {estimate >> 20} MiB, held {held['weights'] >> 20} MiB"
    if dtype == torch.float32 and prefill == "auto":
        assert held["prefill_copies"] == 0


@pytest.mark.real_model
def test_a_configuration_that_cannot_fit_is_refused_with_its_parts_and_a_way_out() -> None:
    config = EngineConfig(model="gemma3-270m", num_tokens=65536)
    with pytest.raises(ConfigError) as err:
        check_fits(config, torch.bfloat16, CPU, available=WORKSPACE)
    message = str(err.value)
    assert message.startswith("gemma3-270m needs about ")
    assert "weights ~0.4 GiB under --weights auto --prefill-weights auto" in message
    assert "this machine has 0.5 GiB available" in message
    assert "--prefill-weights quantized (saves ~" in message and "a smaller --num-tokens" in message


@pytest.mark.real_model
def test_the_pools_asked_for_count_and_a_configuration_that_fits_passes() -> None:
    roomy = EngineConfig(model="gemma3-270m")
    check_fits(roomy, torch.bfloat16, CPU, available=2 * GIB)  # weights ~0.4 GiB + workspace: fits
    huge_pool = EngineConfig(model="gemma3-270m", num_tokens=4_000_000)  # ~ 26 KiB a token: ~100 GiB of K/V
    with pytest.raises(ConfigError, match="K/V"):
        check_fits(huge_pool, torch.bfloat16, CPU, available=2 * GIB)
