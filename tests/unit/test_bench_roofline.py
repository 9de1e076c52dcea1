"""`ft bench roofline`'s accounting: which weights a decode step reads and how many bytes, and the
bandwidth probe's plumbing. No speed is asserted."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.bench.roofline import read_bandwidth, step_matrices
from freetoken.cli import build_parser
from freetoken.models.linear import Embedding, Linear
from freetoken.ops.quantized import quantize_int8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Linear(64, 128, False, torch.float32, "cpu")
        self.down = Linear(128, 64, False, torch.float32, "cpu")


class _Model(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(1000, 64, torch.float32, "cpu")
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.lm_head = None if tied else Linear(64, 1000, False, torch.float32, "cpu")


def test_step_reads_every_linear_once_and_the_head() -> None:
    model = _Model(tied=False)
    model.layers[0].up.load_quantized(quantize_int8(torch.randn(128, 64)))
    rows = {(m.name, m.runs_as): (m.count, m.bytes_each) for m in step_matrices(model)}
    up_packed = model.layers[0].up.packed.nbytes
    assert rows[("layers.*.up", "int8 (group 32)")] == (1, up_packed)
    assert rows[("layers.*.up", "float32")] == (1, 128 * 64 * 4)
    assert rows[("layers.*.down", "float32")] == (2, 64 * 128 * 4)
    assert rows[("lm_head", "float32")] == (1, 1000 * 64 * 4)
    assert not any("embed" in name for name, _ in rows)  # one row a token: not counted


def test_a_tied_head_counts_the_embedding_table() -> None:
    names = [m.name for m in step_matrices(_Model(tied=True))]
    assert "embed_tokens (tied head)" in names


def test_read_bandwidth_reads_the_buffer() -> None:
    assert read_bandwidth(size_bytes=1 << 20, repeats=1) > 0


def test_cli_has_bench_kinds() -> None:
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--peer-url", "http://127.0.0.1:2"])
    assert (args.bench, args.paired_rounds, args.peer_url) == ("serve", 5, "http://127.0.0.1:2")
    assert build_parser().parse_args(["bench", "roofline", "--model", "m"]).bench == "roofline"


def test_a_step_reads_the_routed_experts_of_each_layer() -> None:
    from freetoken.models.experts import Experts

    class _Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Module(), nn.Module()])
            for layer in self.layers:
                layer.experts = Experts(8, 64, 32, lambda g, u: g * u, False, torch.float32, "cpu")
                layer.experts.load(torch.randn(8, 32, 64), torch.randn(8, 32, 64), torch.randn(8, 64, 32))

    rows = {m.name: (m.count, m.bytes_each) for m in step_matrices(_Moe(), active_experts=2)}
    per_expert = (64 * 64 + 64 * 32) * 4  # gate_up [2I, H] + down [H, I], float32
    assert rows["layers.*.experts (2 of 8)"] == (2, 2 * per_expert)
    assert not step_matrices(_Moe())  # k unknown: no experts counted
