"""The device figures of scripts/gpu_check.sh: a random Llama-3-8B-shaped model built on the GPU, in
bf16 and in int4 (group 32, the Triton kernel), timed at decode and prefill.

    python scripts/gpu_bench.py --out OUT/bench.json            # on a CUDA device (about 3 minutes)
    python scripts/gpu_bench.py --dry-run --out /tmp/bench.json # tiny shapes on the CPU: the plumbing only

For each weight form: decode tokens/s at batch 1 / 8 / 32 / 64 (every request `--context` tokens
in, one new token a step), eager and through CUDA graphs (engine/cuda_graphs.py's replay over
static buffers); prefill tokens/s of one 4096-token chunk; and at batch 1 the fraction of the HBM
roofline: (weight bytes + K/V bytes read per step) x steps/s over the device's bandwidth, both as
measured by a device-to-device copy and as the card's nominal figure. The timings are of the
model's forward alone (the runner's batch building included on the eager path), not of the
scheduler or the HTTP server. Weights are random: speed does not depend on their values.
Prints one line per figure and writes them all as one JSON object to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.attention.metadata import ForwardBatch  # noqa: E402
from freetoken.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from freetoken.kv.tensors import KVTensors  # noqa: E402
from freetoken.models.linear import Linear  # noqa: E402
from freetoken.models.llama import config_from_hf  # noqa: E402
from freetoken.models.registry import build_model  # noqa: E402
from freetoken.ops.quantized import quantize_int4  # noqa: E402

LLAMA3_8B = dict(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500_000.0,
    max_position_embeddings=8192,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
)
NOMINAL_HBM = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s
PAGE = 16


def log(line: str) -> None:
    print(line, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(shape: dict, form: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model with random weights (normal, std 0.02; norms 1); `int4`: every linear layer
    quantized to the group-32 int4 form, as --weights int4 makes it."""
    model = build_model(config_from_hf(shape), dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        if form == "int4":
            for module in model.modules():
                if isinstance(module, Linear) and module.weight is not None and module.quantizable:
                    module.load_quantized(quantize_int4(module.weight.float()))
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the matrices a decode step reads (every linear layer and the head; one embedding row aside)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.packed.nbytes if module.packed is not None else module.weight.numel() * module.weight.element_size()
    return total


def decode_specs(batch: int, context: int) -> list:
    per = -(-(context + 1) // PAGE)
    return [(context, 1, np.arange(1 + b * per, 1 + (b + 1) * per, dtype=np.int32), None) for b in range(batch)]


def timed(fn, steps: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of fn, after two warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), 5, device)
    del a, b
    return 2 * nbytes / s


def nominal_hbm(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bw in NOMINAL_HBM.items():
        if key in name:
            return bw
    return None


def bench_form(shape: dict, form: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    model = build(shape, form, dtype, device)  # outside inference mode: parameters are filled in place
    with torch.inference_mode():
        return measure(model, form, args, device, dtype)


def measure(model: torch.nn.Module, form: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = model.config
    layout = cfg.kv_layout()
    batches = [int(b) for b in args.batches.split(",")]
    per = -(-(args.context + 1) // PAGE)
    pages = max(max(batches) * per, -(-args.prefill // PAGE)) + 1
    kv = KVTensors(layout, pages, 0, PAGE, dtype, device)
    wbytes = weight_bytes(model)
    kv_token_bytes = KVTensors.bytes_per_page(layout, 1, dtype, False)
    out: dict = {"weight_bytes": wbytes, "decode_tok_s": {}, "context": args.context}
    log(f"[{form}] weights read per step: {wbytes / 1e9:.2f} GB; K/V {kv.nbytes / 1e9:.2f} GB")

    def forward(ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return model(ids, batch, kv)

    graphs = None
    if device.type == "cuda":
        graphs = DecodeGraphs(forward, device, PAGE, per, False, None)
    for b in batches:
        specs = decode_specs(b, args.context)
        ids = [1] * b

        def eager() -> None:
            batch = ForwardBatch.build(specs, PAGE, device=device)
            forward(torch.tensor(ids, device=device), batch)

        row = {"eager": b / timed(eager, args.steps, device)}
        if graphs is not None:
            graphs.run(ids, specs, list(range(b)))  # the capture of this bucket
            if graphs.graphs.get(b) is not None:
                row["graphs"] = b / timed(lambda: graphs.run(ids, specs, list(range(b))), args.steps, device)
            else:
                row["graphs"] = None  # the capture failed: the log says why
        out["decode_tok_s"][str(b)] = row
        log(f"[{form}] decode batch {b}: " + ", ".join(f"{k} {v:.1f} tok/s" if v else f"{k} n/a" for k, v in row.items()))

    table = np.arange(1, 1 + -(-args.prefill // PAGE), dtype=np.int32)
    pre = [(0, args.prefill, table, None)]
    ids = torch.ones(args.prefill, dtype=torch.long, device=device)
    s = timed(lambda: forward(ids, ForwardBatch.build(pre, PAGE, device=device)), max(1, args.steps // 10), device)
    out["prefill_tok_s"] = args.prefill / s
    out["prefill_tokens"] = args.prefill
    log(f"[{form}] prefill {args.prefill} tokens: {args.prefill / s:.0f} tok/s")

    b1 = out["decode_tok_s"].get("1")
    if b1 is not None:
        best = max(v for v in b1.values() if v)
        step_bytes = wbytes + args.context * kv_token_bytes
        out["b1_bytes_per_step"] = step_bytes
        out["b1_bandwidth"] = step_bytes * best
        out["roofline_b1_of_copy"] = step_bytes * best / args.copy_bw
        if args.nominal_bw:
            out["roofline_b1_of_nominal"] = step_bytes * best / args.nominal_bw
        log(
            f"[{form}] batch 1: {step_bytes * best / 1e9:.0f} GB/s = {out['roofline_b1_of_copy']:.0%} of the measured copy"
            + (f", {out['roofline_b1_of_nominal']:.0%} of nominal" if args.nominal_bw else "")
        )
    del graphs, kv
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (checks the plumbing, no figures)")
    p.add_argument("--forms", default="bf16,int4")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512, help="tokens each decoding request has in (default 512)")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per figure (default 20)")
    args = p.parse_args(argv)
    if args.dry_run:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        args.context, args.prefill, args.steps, args.batches = 32, 128, 2, "1,8"
    else:
        if not torch.cuda.is_available():
            log("gpu_bench: no CUDA device (use --dry-run on a CPU)")
            return 2
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA3_8B
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"}
    result["torch"] = torch.__version__
    args.copy_bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    args.nominal_bw = nominal_hbm(device)
    result["hbm_copy_bytes_per_s"] = args.copy_bw
    result["hbm_nominal_bytes_per_s"] = args.nominal_bw
    log(f"device {result['device']}: copy {args.copy_bw / 1e9:.0f} GB/s; nominal {args.nominal_bw or 0:.3g} B/s")
    result["models"] = {}
    for form in args.forms.split(","):
        try:
            result["models"][form] = bench_form(shape, form, args, device, dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the form's model is gone: its memory back for the next
        except Exception as err:  # noqa: BLE001 - one form failing still reports the other
            log(f"[{form}] FAILED: {type(err).__name__}: {err}")
            result["models"][form] = {"error": f"{type(err).__name__}: {err}"}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))  # after each form: a timeout keeps what was measured
    ok = all("error" not in m for m in result["models"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
