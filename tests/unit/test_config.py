"""EngineConfig: flag validation and pool sizing, including the SWA floor at start-up."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError

GiB = 1 << 30


def resolve(config: EngineConfig, window: int | None = 6, context: int = 4096):
    return config.resolve(model_context_length=context, window=window, kv_bytes_per_token=1024, available_bytes=GiB)


def test_default_swa_pool_is_max_of_floor_and_a_quarter_of_full() -> None:
    small = resolve(EngineConfig(page_size=4, num_tokens=400, max_running_requests=2, max_prefill_length=10))
    assert small.swa_floor == 2 * (2 + 1) + 3 + 1 == 10
    assert small.swa_pages == 25  # 100 // 4
    tiny = resolve(EngineConfig(page_size=4, num_tokens=16, max_running_requests=2, max_prefill_length=10))
    assert tiny.swa_pages == tiny.swa_floor == 10


def test_swa_pool_below_floor_is_refused_with_the_floor_and_the_flags() -> None:
    cfg = EngineConfig(page_size=4, num_tokens=400, max_running_requests=2, max_prefill_length=10, swa_pool_tokens=36)
    with pytest.raises(ConfigError, match=r"floor of 10 pages.*--max-running-requests 2.*--max-prefill-length 10"):
        resolve(cfg)
    assert resolve(EngineConfig(page_size=4, num_tokens=400, max_running_requests=2, max_prefill_length=10,
                                swa_pool_tokens=40)).swa_pages == 10
    with pytest.raises(ConfigError, match="floor"):
        resolve(EngineConfig(page_size=4, num_tokens=400, max_running_requests=8, swa_full_tokens_ratio=0.05))


def test_flags_are_validated() -> None:
    with pytest.raises(ConfigError, match="mutually exclusive"):
        EngineConfig(swa_full_tokens_ratio=0.5, swa_pool_tokens="floor").validate()
    with pytest.raises(ConfigError, match="--cache-type"):
        EngineConfig(cache_type="lru").validate()
    with pytest.raises(ConfigError, match="--page-size"):
        EngineConfig(page_size=0).validate()
    with pytest.raises(ConfigError, match="swa_radix"):
        resolve(EngineConfig(cache_type="swa_radix"), window=None)


def test_cache_type_and_context_resolution() -> None:
    assert resolve(EngineConfig(num_tokens=4096)).cache_type == "swa_radix"
    assert resolve(EngineConfig(num_tokens=4096), window=None).cache_type == "radix"
    assert resolve(EngineConfig(num_tokens=4096, context_length=100)).context_length == 100
    assert resolve(EngineConfig(num_tokens=4096, context_length=10**6)).context_length == 4096
    # Without --num-tokens the FULL pool is the smaller of memory and max_running x context.
    r = resolve(EngineConfig(page_size=16, max_running_requests=2, memory_ratio=0.5), context=1024)
    assert r.full_pages == 2 * 1024 // 16


@pytest.mark.parametrize("fields,flag", [
    ({"prefill_weights": "bf16"}, "--prefill-weights bf16"),
    ({"page_size": 8}, "--page-size a multiple of 16"),
    ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype int8"),
    ({"device": "cuda"}, "CPU only"),
])
def test_deterministic_refuses_what_would_break_it_by_name(fields: dict, flag: str) -> None:
    EngineConfig(**fields).validate() if fields.get("device") != "cuda" else None  # fine without it
    with pytest.raises(ConfigError, match=f"--deterministic.*{flag}|{flag}.*--deterministic"):
        EngineConfig(deterministic=True, **fields).validate()


def test_deterministic_attends_every_chunk_alone_and_keeps_no_prefill_copies() -> None:
    on = EngineConfig(deterministic=True)
    assert on.alone_max >= 1 << 20 and on.copies_for_prefill == "quantized"
    # Without it: decode rows only, or a verified chunk's length when speculating; the flag as given.
    assert EngineConfig().alone_max == 1
    assert EngineConfig(speculative="ngram", spec_max_draft=5).alone_max == 6
    assert EngineConfig(prefill_weights="bf16").copies_for_prefill == "bf16"
