"""`models.bind.bind_submodules`: submodules found without nn.Module.__getattr__, and nothing
else about the module tree changed (names, parameters, hooks, reassignment)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.models.bind import bind_submodules


class AddOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = AddOne()
        self.layers = nn.ModuleList([AddOne(), AddOne()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_children_are_instance_attributes_and_the_tree_is_unchanged() -> None:
    block = Block()
    names, keys = [n for n, _ in block.named_modules()], list(block.state_dict())
    bind_submodules(block)
    assert block.__dict__["inner"] is block._modules["inner"]
    assert block.layers.__dict__["0"] is block.layers[0]  # recursive
    assert [n for n, _ in block.named_modules()] == names  # no child counted twice
    assert list(block.state_dict()) == keys
    assert torch.equal(block(torch.zeros(1)), torch.full((1,), 3.0))


def test_hooks_still_run_and_a_reassigned_child_is_the_one_found() -> None:
    block = Block()
    bind_submodules(block)
    calls: list[str] = []
    block.inner.register_forward_hook(lambda _m, _a, out: calls.append("inner") or out * 10)
    assert torch.equal(block(torch.zeros(1)), torch.full((1,), 12.0))  # (0 + 1) * 10 + 1 + 1
    assert calls == ["inner"]
    replacement = AddOne()
    block.inner = replacement
    assert block.inner is replacement and block._modules["inner"] is replacement
    assert torch.equal(block(torch.zeros(1)), torch.full((1,), 3.0))  # the hooked child is gone
