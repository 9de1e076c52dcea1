"""freetoken.ops asks MKL for float32 GEMMs whose rounding does not depend on the thread count
(freetoken/utils/blas.py): a tensor-parallel rank runs on its share of the cores, and its dense
prefill copies must round as one rank's do (issue 32). Each case runs in a fresh interpreter,
because MKL reads the mode once, at its first call."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, torch, torch.nn.functional as F
import freetoken.ops  # sets the mode before the first matmul
torch.manual_seed(0)
x, w = torch.randn(96, 1536), torch.randn(576, 1536)  # a prefill chunk against a SmolLM2 down_proj
torch.set_num_threads(1)
one = F.linear(x, w)
torch.set_num_threads(2)
two = F.linear(x, w)
print(os.environ["MKL_CBWR"], int((one != two).sum()))
"""


def run(env_mode: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if env_mode is not None:
        env["MKL_CBWR"] = env_mode
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    mode, differing = out.stdout.split()
    return mode, int(differing)


def test_float32_gemm_is_the_same_at_one_and_two_threads() -> None:
    # On an Intel Xeon (AVX-512 + AMX) without the mode, 16,387 of these 55,296 outputs differed.
    assert run(None) == ("AUTO,STRICT", 0)


def test_a_mode_the_user_exported_is_kept() -> None:
    assert run("COMPATIBLE")[0] == "COMPATIBLE"
