"""`ft bench roofline`: how close decode runs to the memory-bandwidth limit on this machine.

Owns three measurements and their report: the machine's read bandwidth on the threads the engine
uses (STREAM-style: a 1 GiB buffer read once per repeat with 64-byte loads, split between torch's
threads as the matmul kernels split a weight, median of repeats), the bytes a decode step reads
(every linear layer's weight as it is held, the output head, and of each layer's resident experts
the k a token is routed to, at their mean size; the embedding reads one row a token and is left
out), and greedy single-stream decode in-process. The roofline is bandwidth /
bytes per step (the lower of the bandwidths measured before and after the decode); the fraction
is measured tok/s over it. It starts no server.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.models.experts import Experts, matrix_nbytes
from freetoken.models.linear import Embedding, Linear, QuantizableWeight


@dataclass(frozen=True)
class Matrix:
    name: str  # the module's name with layer numbers folded: layers.*.mlp.down_proj
    runs_as: str
    count: int
    bytes_each: int


def _nbytes(module: QuantizableWeight) -> int:
    if module.packed is not None:
        return int(module.packed.nbytes)
    assert module.weight is not None
    return module.weight.numel() * module.weight.element_size()


def step_matrices(model: torch.nn.Module, active_experts: int = 0) -> list[Matrix]:
    """The weights a decode step reads once, grouped by kind (layer numbers folded); of a layer's
    resident experts, `active_experts` (the model's k) at their mean size."""
    import re

    seen: dict[tuple[str, str, int], int] = {}
    has_head = any(name.endswith("lm_head") for name, _ in model.named_modules())
    for name, module in model.named_modules():
        if isinstance(module, Linear) or (isinstance(module, Embedding) and not has_head):
            label = re.sub(r"\.\d+\.", ".*.", name) + (" (tied head)" if isinstance(module, Embedding) else "")
            key = (label, module.runs_as(), _nbytes(module))
            seen[key] = seen.get(key, 0) + 1
        elif isinstance(module, Experts) and module.cache is None and module.gate_up and active_experts:
            label = re.sub(r"\.\d+\.", ".*.", name) + f" ({active_experts} of {module.num_experts})"
            total = sum(matrix_nbytes(m) for _, _, m in module.resident())
            key = (label, module.runs_as(), total * active_experts // len(module.held()))
            seen[key] = seen.get(key, 0) + 1
    return [Matrix(n, r, c, b) for (n, r, b), c in seen.items()]


def read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of one read of a `size_bytes` buffer on torch's threads (median of `repeats`)."""
    from freetoken.ops.qlinear import _KERNEL

    buf = torch.ones(size_bytes, dtype=torch.uint8)
    read: Callable[[torch.Tensor], object] = getattr(_KERNEL, "stream_read", None) or (
        lambda t: t.view(torch.int64).sum()
    )
    read(buf)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read(buf)
        times.append(time.perf_counter() - t0)
    return size_bytes / statistics.median(times) / 1e9


def decode_rate(llm: object, tokens: int, repeats: int = 3) -> float:
    """Greedy single-stream tok/s after the first token (EOS ignored): the time of a request for
    1 + tokens minus one for 1, on the same (then cached) prompt; median of `repeats`."""
    from freetoken.request import SamplingParams

    prompt = "The history of the printing press begins"

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    timed(1 + tokens)  # warm-up: the prompt enters the prefix cache
    rates = []
    for _ in range(repeats):
        rates.append(tokens / max(1e-9, timed(1 + tokens) - timed(1)))
    return statistics.median(rates)


def report(model: str, threads: int, tokens: int, repeats: int, weights: str = "auto") -> str:
    from freetoken.llm import LLM

    torch.set_num_threads(threads)
    bandwidth = read_bandwidth(repeats=repeats)
    llm = LLM(
        model, weights=weights, prefill_weights="quantized", threads=threads, num_tokens=4096, max_running_requests=1
    )
    matrices = step_matrices(llm.loaded.model, int(getattr(llm.loaded.config, "num_experts_per_tok", 0) or 0))
    total = sum(m.count * m.bytes_each for m in matrices)
    rate = decode_rate(llm, tokens, repeats)
    bandwidth_after = read_bandwidth(repeats=repeats)
    # The lower of the two: a 1 GiB read right after start can be served partly from pages the
    # allocator just touched; the roofline should not flatter the engine.
    roofline = min(bandwidth, bandwidth_after) * 1e9 / total
    width = max(len(m.name) for m in matrices)
    lines = [
        f"model: {model}  threads: {threads}  weights: {weights}",
        f"read bandwidth: {bandwidth:.1f} GB/s before, {bandwidth_after:.1f} GB/s after (1 GiB, {repeats} repeats, median)",
        "bytes read per decode step:",
    ]
    for m in sorted(matrices, key=lambda m: -m.count * m.bytes_each):
        lines.append(
            f"  {m.name:<{width}}  {m.runs_as:<22} x{m.count:<3} {m.bytes_each / 1e6:9.2f} MB each  "
            f"{m.count * m.bytes_each / 1e6:9.1f} MB"
        )
    lines += [
        f"  total {total / 1e6:.1f} MB",
        f"roofline: {roofline:.1f} tok/s (the lower bandwidth / bytes per step)",
        f"decode (greedy, 1 stream, in-process, {tokens} tokens): {rate:.1f} tok/s = "
        f"{rate / roofline:.0%} of the roofline ({rate * total / 1e9:.1f} GB/s of weights)",
    ]
    return "\n".join(lines)
