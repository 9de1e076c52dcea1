"""The disk tier (`--kv-disk-dir`, kv/disk_tier.py) on a hybrid model (Qwen3.5, tiny random
weights): recurrent-state snapshots go to disk beside the pages, and a hit from disk ends only
where a state file is. Every hit's greedy tokens are checked against transformers' generate on
the whole prompt, with the pool audit after every step (`--debug-kv`) and the disk audit:

- a restart over the same directory hits a conversation from disk (pages and the state at the
  hit's end, into the request's own slot) with the same tokens as a cold run;
- a corrupt state file is a miss: the hit stops at the previous position with a state on disk;
- without a state file at a position the hit stops at the previous one too.

The first turn (37 tokens, chunks of 16) leaves states on disk at 16, 32, 36 (its chunk ends) and
40 (a decode step's page boundary, in its reply); the second turn (48 tokens) can hit at 40.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from freetoken.config import EngineConfig
from freetoken.llm import LLM
from freetoken.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_model

NEW = 6
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
TURN1 = list(range(3, 40))  # 37 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("qwen3_5", Path(tmp_path_factory.mktemp("qwen3_5")))


@pytest.fixture(scope="module")
def oracle(checkpoint: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation="eager"
    )

    def greedy(prompt: list[int]) -> list[int]:
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return gen[0, len(prompt) :].tolist()

    return greedy


def engine(checkpoint: Path, **overrides: object) -> LLM:
    config = EngineConfig(model=str(checkpoint), dtype="float64", page_size=4, max_prefill_length=16,
                          num_tokens=1024, debug_kv=True, threads=1, **overrides)  # fmt: skip
    return LLM(str(checkpoint), config=config)


def run(llm: LLM, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt, PARAMS)
    llm.engine.add_request(req)
    while llm.engine.has_work():
        llm.engine.step()
    return req


def check(llm: LLM) -> None:
    """The pool balanced at idle, the disk tier's writes done and its audit clean."""
    kv = llm.engine.kv
    assert kv.state_pool.num_free + kv.tree.num_pages("state") == kv.state_pool.capacity
    assert kv.audit(idle=True).ok
    assert llm.engine.disk.store.flush(30)
    assert llm.engine.disk.store.audit() == []


def same_state(warm: LLM, cold: LLM, tokens: list[int], end: int) -> bool:
    """The two engines' tree snapshots at `end` on the path of `tokens` hold the same state (up
    to the rounding of other chunk boundaries)."""
    a, b = (llm.engine.kv.snapshot_at(tokens, end) for llm in (warm, cold))
    assert a and b
    tensors = warm.engine.runner.kv_tensors, cold.engine.runner.kv_tensors
    x, y = (t.state_bytes(s).view(torch.float32) for t, s in zip(tensors, (a, b)))
    return torch.allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.fixture
def first_turn(checkpoint: Path, oracle, tmp_path: Path) -> list[int]:
    """Turn 1 through an engine with the tier, closed (everything written); turn 2's prompt."""
    llm = engine(checkpoint, kv_disk_dir=str(tmp_path), kv_disk_load="always")
    t1 = run(llm, "t1", TURN1)
    assert t1.output_ids == oracle(TURN1)
    check(llm)
    assert llm.engine.close(30)
    return TURN1 + t1.output_ids + list(range(70, 75))  # 48 tokens: the cap is 44


def run_cold(checkpoint: Path, tokens: list[int]) -> LLM:
    llm = engine(checkpoint)
    assert run(llm, "cold", tokens).report.cached_tokens == 0
    return llm


def state_file(llm: LLM, tokens: list[int], end: int) -> Path:
    disk = llm.engine.disk
    return disk.store._path(("state", disk.keys(tokens)[end // 4 - 1]))


def test_a_restart_hits_a_hybrid_from_disk_with_the_same_tokens(checkpoint: Path, oracle, tmp_path, first_turn) -> None:
    """(The tiny model's greedy tokens barely depend on the state at the hit, so the state is
    checked too: both engines' snapshots at the cap, 44, computed on from 40 or from 0.)"""
    restarted = engine(checkpoint, kv_disk_dir=str(tmp_path), kv_disk_load="always")
    assert state_file(restarted, first_turn, 40).exists()
    warm = run(restarted, "t2", first_turn)
    cold_llm = engine(checkpoint)
    cold = run(cold_llm, "t2", first_turn)
    assert cold.report.cached_tokens == 0
    assert warm.output_ids == cold.output_ids == oracle(first_turn)
    assert warm.report.cached_tokens == 40
    assert restarted.engine.disk.counters.loaded_states == 1
    assert same_state(restarted, cold_llm, first_turn, 44)
    check(restarted)
    # The load committed the state as a tree snapshot: a resend hits it in memory.
    again = run(restarted, "t2-again", first_turn)
    assert (again.report.cached_tokens, again.output_ids) == (44, warm.output_ids)
    assert restarted.engine.disk.counters.hits == 1


def test_a_corrupt_state_file_is_a_miss(checkpoint: Path, oracle, tmp_path, first_turn) -> None:
    restarted = engine(checkpoint, kv_disk_dir=str(tmp_path), kv_disk_load="always")
    path = state_file(restarted, first_turn, 40)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a state byte: only the checksum can tell
    path.write_bytes(bytes(raw))
    got = run(restarted, "t2", first_turn)
    assert got.output_ids == oracle(first_turn)
    assert got.report.cached_tokens == 36  # the previous state on disk: turn 1's last chunk end
    assert restarted.engine.disk.store.counters.corrupt == 1
    assert same_state(restarted, run_cold(checkpoint, first_turn), first_turn, 44)
    assert not path.exists()
    check(restarted)


def test_without_a_state_file_the_hit_stops_at_the_previous_one(checkpoint: Path, oracle, tmp_path, first_turn) -> None:
    probe = engine(checkpoint, kv_disk_dir=str(tmp_path), kv_disk_load="always")
    for end in (36, 40):
        state_file(probe, first_turn, end).unlink()
    assert probe.engine.close(30)
    restarted = engine(checkpoint, kv_disk_dir=str(tmp_path), kv_disk_load="always")
    got = run(restarted, "t2", first_turn)
    assert got.output_ids == oracle(first_turn)
    assert got.report.cached_tokens == 32  # pages to 40 on disk, states at 16 and 32 only
    assert restarted.engine.disk.store.counters.corrupt == 0
    assert same_state(restarted, run_cold(checkpoint, first_turn), first_turn, 44)
    check(restarted)
