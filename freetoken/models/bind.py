"""Submodules as plain instance attributes, for the decode step's many small lookups.

Owns one step of finishing a loaded model. nn.Module keeps its submodules in `_modules` and
finds `self.mlp` through `Module.__getattr__`, which Python calls only after the ordinary lookup
has failed: ~0.4 us a lookup, and a decode step makes 8-12 of them per layer (~0.15 ms of a
SmolLM2 step, a tenth of everything outside its linear layers). It changes nothing else: the
module tree, parameter names and hooks (tensor parallelism's on `self_attn` and `mlp`) are
nn.Module's as before.
"""

from __future__ import annotations

from torch import nn


def bind_submodules(model: nn.Module) -> None:
    """Copy every submodule of `model` (recursively) into its parent's instance `__dict__`, where
    the ordinary attribute lookup finds it first.

    Call it on a finished model (after loading and tensor-parallel wrapping). A later
    `parent.child = other_module` stays right (nn.Module.__setattr__ drops the copy before
    registering the new child); setting a child to None or deleting it would leave the copy
    behind, so a model is not restructured after this.
    """
    for module in model.modules():
        for name, child in module._modules.items():
            if child is not None:
                module.__dict__[name] = child
