"""What CUDA runs, checked on CUDA (marked `gpu`; skipped without a CUDA device): the SDPA
paged-attention backend against the plain-torch reference (float64 on the CPU, the numerical
oracle), dequantization on the device against the CPU decoder, and a short engine run -- the
seed overlap of DESIGN.md §3 with its key step asserted, and greedy tokens equal to the same
engine's on the CPU, both in float64.

Run it where a device is lent: `python -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from test_engine_seed import B_PROMPT, SHARED, assert_key_step, balanced_at_idle, run_overlap  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

from freetoken.attention import attention_fn, sdpa_backend, torch_backend, triton_fn  # noqa: E402
from freetoken.attention.metadata import ForwardBatch  # noqa: E402
from freetoken.config import EngineConfig  # noqa: E402
from freetoken.engine.build import build_engine_for  # noqa: E402
from freetoken.models.load import LoadedModel, load_model  # noqa: E402
from freetoken.request import Request, SamplingParams  # noqa: E402
from freetoken.weights.dequant import dequantize  # noqa: E402
from freetoken.weights.source import resolve_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
Q = gguf.GGMLQuantizationType
HEAD_DIM = 16


# -- attention ------------------------------------------------------------------------------


def paged_case(seed: int, page_size: int, n_heads: int, n_kv: int, window: int | None, shapes: list[tuple[int, int]]):
    """Random K/V pools (NULL page 0 zero, unwritten tails NaN), tables and queries, on the CPU
    in float64, for requests of (cached, new) tokens; out-of-window SWA pages are NULL."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_pages = 600
    k = torch.randn(n_pages + 1, page_size, n_kv, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(n_pages + 1, page_size, n_kv, HEAD_DIM, generator=g, dtype=torch.float64)
    k[0] = v[0] = 0
    free = list(rng.permutation(np.arange(1, n_pages + 1)))
    specs = []
    for cached, new in shapes:
        total = cached + new
        table = np.array([free.pop() for _ in range(-(-total // page_size))], dtype=np.int32)
        if total % page_size:
            k[table[-1], total % page_size :] = float("nan")
            v[table[-1], total % page_size :] = float("nan")
        swa = table.copy()
        if window is not None:
            for i in range(len(swa)):
                if (i + 1) * page_size <= cached - window + 1:
                    swa[i] = 0
        specs.append((cached, new, table, swa if window is not None else None))
    q = torch.randn(sum(n for _, n in shapes), n_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v, specs


SHAPES = [
    [(37, 1)],
    [(0, 40)],
    [(37, 1), (0, 23), (16, 9), (130, 1)],
    [(200, 30), (5, 1), (64, 64)],
]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 7, 128])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_on_cuda_matches_reference(page_size: int, window: int | None, heads: tuple[int, int], dtype: torch.dtype, tol: float) -> None:
    default = attention_fn(torch.device(DEVICE))  # what CUDA runs: the Triton decode backend where triton imports
    assert default is (triton_fn() or sdpa_backend.paged_attention)
    for fn in {sdpa_backend.paged_attention, default}:
        check_backend(fn, page_size, window, heads, dtype, tol)


def check_backend(fn, page_size: int, window: int | None, heads: tuple[int, int], dtype: torch.dtype, tol: float) -> None:  # type: ignore[no-untyped-def]
    n_heads, n_kv = heads
    for i, shapes in enumerate(SHAPES):
        q, k, v, specs = paged_case(i, page_size, n_heads, n_kv, window, shapes)
        ref_batch = ForwardBatch.build(specs, page_size, sliding_window=window)
        ref_table = ref_batch.swa_table if window is not None else ref_batch.full_table
        want = torch_backend.paged_attention(q, k, v, ref_table, ref_batch, 0.25, window)
        batch = ForwardBatch.build(specs, page_size, device=DEVICE, sliding_window=window)
        table = batch.swa_table if window is not None else batch.full_table
        got = fn(q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), table, batch, 0.25, window)
        assert got.device.type == torch.device(DEVICE).type and got.dtype == dtype
        assert torch.isfinite(got).all(), "a NaN tail or the NULL page reached the output"
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


# -- dequantization -------------------------------------------------------------------------

# Byte offsets of the f16 scale fields in each block type (the rest of a block is quant bits,
# every pattern of which is valid).
F16_FIELDS: dict[Q, list[int]] = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int))
def test_dequantize_on_cuda_matches_cpu(qtype: Q) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    n_blocks = 4096
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = rng.uniform(-2.0, 2.0, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    shape = (16, n_blocks * block_size // 16)
    raw = raw.reshape(16, -1)
    want = dequantize(raw, qtype, shape, "random")
    got = dequantize(raw, qtype, shape, "random", device=DEVICE)
    assert got.device.type == torch.device(DEVICE).type and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-6)  # a fused multiply-add may round once less


def test_bundled_gemma_tensors_dequantize_on_cuda_as_on_cpu() -> None:
    reader = gguf.GGUFReader(resolve_model("gemma3-270m").path)
    by_type: dict[int, list[gguf.ReaderTensor]] = {}
    for t in reader.tensors:
        by_type.setdefault(int(t.tensor_type), []).append(t)
    assert len(by_type) >= 3
    for tensors in by_type.values():
        for t in sorted(tensors, key=lambda t: int(t.n_elements))[:2]:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            want = dequantize(t.data, t.tensor_type, shape, t.name)
            got = dequantize(t.data, t.tensor_type, shape, t.name, device=DEVICE, dtype=torch.bfloat16)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.cpu().float(), want, atol=1e-2, rtol=1e-2)


# -- a short engine run -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("gemma3", tmp_path_factory.mktemp("gpu_tiny_gemma"))


def tiny_engine(directory: Path, device: str):
    loaded: LoadedModel = load_model(str(directory), torch.float64, torch.device(device))
    config = EngineConfig(model=str(directory), dtype="float64", device=device, page_size=4, num_tokens=1024,
                          max_running_requests=4, max_prefill_length=12, debug_kv=True)
    return build_engine_for(config, loaded)


def test_seed_overlap_on_cuda(tiny_gemma_dir: Path) -> None:
    engine = tiny_engine(tiny_gemma_dir, DEVICE)
    assert engine.runner.device.type == torch.device(DEVICE).type
    run = run_overlap(engine, B_PROMPT, 4, head_pages=SHARED // 4)
    assert_key_step(run, head_pages=SHARED // 4, page_size=4, head_live=False, b_hit=0)
    balanced_at_idle(engine)


def test_engine_on_cuda_greedy_equals_cpu(tiny_gemma_dir: Path) -> None:
    prompts = [[10 + (i * 37 + 11 * r) % 300 for i in range(5 + 9 * r)] for r in range(5)]

    def greedy(device: str) -> list[list[int]]:
        engine = tiny_engine(tiny_gemma_dir, device)
        reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
        for r in reqs:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
        balanced_at_idle(engine)
        return [r.output_ids for r in reqs]

    assert greedy(DEVICE) == greedy("cpu")
