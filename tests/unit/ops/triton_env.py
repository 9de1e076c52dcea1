"""What the Triton kernel tests share: where they run and whether they can.

On a CUDA device the kernels are compiled and run there; without one they run on CPU tensors under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported). Without
triton installed the modules skip with one reason the skip policy names (tests/skip_policy.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SKIP_REASON = "needs triton (the `test` extra installs it)"


def require_triton() -> None:
    """Skip the calling module where triton is absent; fail loudly where it would run compiled on a CPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("no CUDA device and TRITON_INTERPRET is not 1: tests/conftest.py sets it; run from the repo")
