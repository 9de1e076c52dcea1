"""The whole suite's own check: a full default run's skips are only of the kinds, and at most the
counts, that README's Tests section states (tests/skip_policy.py). Partial runs are not judged.

The weight cache (`--weights-cache auto`, on by default) lives in a directory of this session's
own, deleted at the end: loads in the suite, engine processes included, use and test it as a
user's would, and never read or fill the user's cache."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Without a CUDA device the Triton kernels (freetoken/ops/triton_*.py) run on CPU tensors under
# Triton's interpreter, which triton reads when it is first imported: set it before anything does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from skip_policy import SkipPolicy  # noqa: E402

POLICY = pytest.StashKey[SkipPolicy]()


WEIGHT_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[POLICY] = SkipPolicy()
    config.stash[WEIGHT_CACHE] = os.environ["FREETOKEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="ft-test-cache-")


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[POLICY].sessionfinish(session)
    shutil.rmtree(session.config.stash[WEIGHT_CACHE], ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.config.stash[POLICY].terminal_summary(terminalreporter)


@pytest.fixture(scope="session")
def transformers_gguf() -> Callable[[Path], torch.nn.Module]:
    """transformers' own model of a GGUF file (float32, eager attention, eval), loaded once a
    session per file: its GGUF reader dequantizes in numpy (~85 s for the bundled Gemma, ~30 s for
    SmolLM2 on a Zen 3), and more than one module compares against the same file's."""
    loaded: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:
        if path not in loaded:
            import transformers

            loaded[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return loaded[path]

    return load
