"""TP=2 over two gloo ranks (spawned processes, one thread each) computes the TP=1 logits, within
float32 tolerance, for a mixed prefill batch and paged decode, on tiny random-weight Llama,
Gemma 3 (sliding layers, soft-capping), gpt-oss (sinks, experts split by width) and Qwen3-MoE
(whole experts split between the ranks) models; also a Gemma 3 with
one KV head (replicated on both ranks, as in Gemma 3 270M) under int8 weights, whose logits are
equal bit for bit (quantized matrices sharded by rows; the closing projections gathered), a
Llama under int4 and a Qwen3-MoE under int4, equal bit for bit too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_script import PROMPTS, cache_dtype, load, run_script

HERE = Path(__file__).resolve().parent
RANK_DEADLINE_S = 300  # a hang guard for two processes importing torch on a busy machine
# int8: quantized weights close each block by gathering (models/shard.py, ROW_GATHER), so every
# value is the one-rank kernel's: the logits are equal bit for bit. Float weights all-reduce partial
# sums: equal up to float32 summation order.
TOL = {"gemma3_kv1_int8": 0.0, "gemma3_kv1_int8_kv8": 0.0, "llama_int4": 0.0, "qwen3_moe_int4": 0.0}


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from model_harness import VOCAB, make_reference
    from tiny_models import write_tiny_model

    from freetoken.tokenizer.testing import write_tiny_tokenizer

    root = tmp_path_factory.mktemp("tp_models")
    out = []
    for family in ("llama", "gemma3", "gpt_oss"):
        make_reference(family, root / family)
        write_tiny_tokenizer(root / family, vocab_size=VOCAB)
        out.append(f"{family}={root / family}")
    kv1 = write_tiny_model("gemma3", root / "gemma3_kv1", num_key_value_heads=1, intermediate_size=128)
    out.append(f"gemma3_kv1_int8={kv1}:int8")
    out.append(f"gemma3_kv1_int8_kv8={kv1}:int8:int8")  # and 8-bit K/V on both ranks
    # GQA: 4 heads, 2 KV heads split across the ranks. MLP width 128: each rank's 64 columns are
    # whole 32-element blocks of torch's vectorized activation (a shorter tail takes its scalar
    # loop, whose last bits differ; docs/scale-out.md, "Numerics").
    gqa = write_tiny_model("llama", root / "llama_gqa", intermediate_size=128)
    out.append(f"llama_int4={gqa}:int4")
    # Qwen3-MoE: 4 experts, 2 whole ones per rank (expert parallelism), top-2 routing; float weights
    # (attention all-reduced) and int4 (gathered: bit for bit, the experts' all-reduce exact too).
    moe = write_tiny_model("qwen3_moe", root / "qwen3_moe")
    out.append(f"qwen3_moe={moe}")
    out.append(f"qwen3_moe_int4={moe}:int4")
    return out


@pytest.fixture(scope="module")
def tp2_logits(specs: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[torch.Tensor]]:
    from serving import free_port

    out = tmp_path_factory.mktemp("tp_out")
    port = str(free_port())
    cmd = [sys.executable, str(HERE / "tp_script.py")]
    procs = [subprocess.Popen([*cmd, str(rank), "2", port, str(out), *specs]) for rank in (0, 1)]
    codes = [p.wait(RANK_DEADLINE_S) for p in procs]
    assert codes == [0, 0]
    return {s.partition("=")[0]: torch.load(out / f"{s.partition('=')[0]}.pt") for s in specs}


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt_oss", "gemma3_kv1_int8", "gemma3_kv1_int8_kv8", "llama_int4",
                                  "qwen3_moe", "qwen3_moe_int4"])
def test_tp2_logits_equal_tp1(name: str, specs: list[str], tp2_logits: dict[str, list[torch.Tensor]]) -> None:
    spec = next(s for s in specs if s.startswith(f"{name}="))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (tp_script.py): a kernel's sums may split by thread
    try:
        reference = run_script(load(spec)[1], cache_dtype(spec))
    finally:
        torch.set_num_threads(threads)
    got = tp2_logits[name]
    assert len(got) == len(reference)
    assert got[0].shape == (sum(len(p) for p in PROMPTS), reference[0].shape[1])
    tol = TOL.get(name, 1e-4)
    torch.testing.assert_close(got, reference, atol=tol, rtol=tol)  # every step, in order
    assert reference[0].std() > 0.1  # the logits are spread: equality is not trivially met
