"""The disk tier under the prefix cache (`--kv-disk-dir`, kv/disk_tier.py) on real engines.

- a restart: a new engine over the same directory hits a conversation's prefix from disk and
  samples the same greedy tokens as a cold engine without the tier, on a full-attention model
  (tiny Llama) and a sliding-window one (tiny Gemma), with float and int8 K/V;
- a conversation evicted from memory by other traffic comes back with its hit from disk;
- a corrupt or missing file is a miss (the hit stops before it), never a wrong token;
- pages on disk that the load policy does not load are reported as `on_disk`, not `evicted`;
- a model or K/V dtype change invalidates the tier (no hit from the other's pages).

Every engine runs with debug_kv (the pool audit after each step) and the disk audit at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from freetoken.kv.disk_cost import LoadPolicy
from freetoken.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 37 + i * 11) % 250 for i in range(n)]


def run(llm, ids: list[int]) -> Request:  # type: ignore[no-untyped-def]
    """One greedy request through the engine; the finished Request (with its cache report)."""
    engine = llm.engine
    req = Request(f"r{engine.steps}-{len(ids)}-{ids[-1]}", list(ids), GREEDY)
    engine.add_request(req)
    while not req.finished:
        engine.step()
    return req


def check(llm, close: bool = False) -> None:  # type: ignore[no-untyped-def]
    """The pool audit, and the disk tier's writes done and its audit clean; `close`: then stop its
    writer (an engine another one replaces over the same directory: one engine per directory)."""
    assert llm.engine.kv.audit(idle=True).ok
    if llm.engine.disk is not None:
        assert llm.engine.disk.store.flush(30)
        assert llm.engine.disk.store.audit() == []
        if close:
            assert llm.engine.close(30)


def conversation(llm, system: list[int], turns: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Turns of one conversation: each prompt is the last prompt, its answer and a new message."""
    prompts, ids = [], list(system)
    for t in range(turns):
        ids = ids + prompt(100 + t, 9)
        prompts.append(ids)
        ids = ids + run(llm, ids).output_ids
    return prompts


MODELS = [("tiny_llama", "auto"), ("tiny_llama", "int8"), ("tiny_gemma", "auto"), ("tiny_gemma", "int8")]


@pytest.mark.parametrize(("model", "cache_dtype"), MODELS)
def test_a_restart_hits_from_disk_with_the_same_tokens(request, make_llm, tmp_path: Path, model, cache_dtype) -> None:  # type: ignore[no-untyped-def]
    loaded = request.getfixturevalue(model)
    flags = dict(kv_cache_dtype=cache_dtype, num_tokens=1024, max_prefill_length=16)
    first = make_llm(loaded, kv_disk_dir=str(tmp_path), kv_disk_load="always", **flags)
    turns = conversation(first, prompt(1, 41), 3)
    check(first, close=True)  # everything written: a SIGKILL now loses nothing (an unflushed backlog would be)
    assert first.engine.disk.store.entries > 0
    nxt = turns[-1] + prompt(7, 10)

    restarted = make_llm(loaded, kv_disk_dir=str(tmp_path), kv_disk_load="always", **flags)
    assert restarted.engine.disk.store.entries == first.engine.disk.store.entries
    warm = run(restarted, nxt)
    cold = run(make_llm(loaded, **flags), nxt)
    assert cold.report.cached_tokens == 0
    assert warm.output_ids == cold.output_ids
    # The previous turn's whole prompt (and all but the last token of its answer) was committed.
    assert warm.report.cached_tokens >= (len(turns[-1]) // 4) * 4
    assert restarted.engine.disk.counters.hits == 1
    check(restarted)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma"])
def test_an_evicted_conversation_comes_back_from_disk(request, make_llm, tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    loaded = request.getfixturevalue(model)
    flags = dict(num_tokens=256, max_prefill_length=32, max_running_requests=2)
    llm = make_llm(loaded, kv_disk_dir=str(tmp_path), kv_disk_load="always", **flags)
    turns = conversation(llm, prompt(2, 60), 2)
    for other in range(5):  # other traffic evicts the conversation from the pools
        run(llm, prompt(50 + other, 90))
    nxt = turns[-1] + prompt(8, 10)
    assert llm.engine.kv.tree.match(tuple(nxt)).length < len(nxt) // 2  # really gone from memory
    back = run(llm, nxt)
    cold = run(make_llm(loaded, **flags), nxt)
    assert back.output_ids == cold.output_ids
    assert back.report.cached_tokens >= 0.9 * (len(turns[-1]) // 4) * 4
    assert llm.engine.disk.counters.hits >= 1
    check(llm)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_a_damaged_page_is_a_miss_never_a_wrong_token(tiny_gemma, make_llm, tmp_path: Path, damage: str) -> None:  # type: ignore[no-untyped-def]
    flags = dict(num_tokens=1024, max_prefill_length=16)
    first = make_llm(tiny_gemma, kv_disk_dir=str(tmp_path), kv_disk_load="always", **flags)
    ids = prompt(3, 40)
    run(first, ids)
    check(first, close=True)
    keys = first.engine.disk.keys(ids)
    victim = first.engine.disk.store._path(("full", keys[5]))  # page 5: tokens [20, 24)
    data = victim.read_bytes()
    if damage == "corrupt":
        victim.write_bytes(data[:-3] + bytes(b ^ 0x55 for b in data[-3:]))
    elif damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    nxt = ids + prompt(9, 8)
    restarted = make_llm(tiny_gemma, kv_disk_dir=str(tmp_path), kv_disk_load="always", **flags)
    warm = run(restarted, nxt)
    assert warm.report.cached_tokens <= 20  # the hit stops before the damaged page
    assert warm.output_ids == run(make_llm(tiny_gemma, **flags), nxt).output_ids
    check(restarted)


def test_pages_left_on_disk_are_reported_as_such(tiny_llama, make_llm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    flags = dict(num_tokens=1024, max_prefill_length=64)
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path), **flags)
    ids = prompt(4, 40)
    run(first, ids)
    check(first, close=True)
    restarted = make_llm(tiny_llama, kv_disk_dir=str(tmp_path), **flags)
    policy: LoadPolicy = restarted.engine.disk.policy
    policy.observe_read(1, 1.0)  # a disk of one byte a second: recomputing is cheaper
    policy.observe_prefill(10**6, 1.0)
    req = run(restarted, ids + [5, 6, 7])
    assert req.report.cached_tokens == 0 and req.report.miss_reason == "on_disk"
    assert restarted.engine.disk.counters.declined == 1
    policy.observe_read(10**12, 1.0)  # now a fast disk
    again = run(restarted, ids + [5, 6, 8])
    assert again.report.cached_tokens == 40 and again.report.miss_reason == "capped"


@pytest.mark.parametrize("change", ["model", "kv_dtype"])
def test_a_model_or_kv_dtype_change_invalidates_the_tier(request, make_llm, tmp_path: Path, change: str) -> None:  # type: ignore[no-untyped-def]
    flags = dict(num_tokens=1024, max_prefill_length=64, kv_disk_dir=str(tmp_path), kv_disk_load="always")
    first = make_llm(request.getfixturevalue("tiny_llama"), **flags)
    ids = prompt(5, 40)
    run(first, ids)
    check(first, close=True)
    if change == "model":
        other = make_llm(request.getfixturevalue("tiny_gemma"), **flags)
    else:
        other = make_llm(request.getfixturevalue("tiny_llama"), kv_cache_dtype="int8", **flags)
    assert other.engine.disk.store.status()["invalidated"] > 0 and other.engine.disk.store.entries == 0
    assert run(other, ids + [5, 6]).report.cached_tokens == 0


def test_an_unusable_directory_is_refused_naming_the_flag(tiny_llama, make_llm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from freetoken.errors import ConfigError

    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match="--kv-disk-dir"):
        make_llm(tiny_llama, kv_disk_dir=str(not_a_dir))
