"""Fixtures for engine tests: tiny models loaded once per session (float64, so a last-bit
difference in a batched matmul cannot flip an argmax), and a factory of engines over them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import write_tiny_model  # noqa: E402

from freetoken.config import EngineConfig  # noqa: E402
from freetoken.llm import LLM  # noqa: E402
from freetoken.models.load import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = write_tiny_model("gemma3", tmp_path_factory.mktemp("tiny_gemma"))
    return load_model(str(directory), torch.float64, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = write_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama"))
    return load_model(str(directory), torch.float64, torch.device("cpu"))


MakeLLM = Callable[..., LLM]


@pytest.fixture(scope="session")
def make_llm() -> MakeLLM:
    """`make_llm(loaded, **engine_flags)`: a fresh engine (empty pools and tree) over a model."""

    def make(loaded: LoadedModel, **flags: object) -> LLM:
        flags.setdefault("page_size", 4)
        flags.setdefault("debug_kv", True)
        config = EngineConfig(model=str(loaded.source.path), dtype="float64", **flags)  # type: ignore[arg-type]
        return LLM(config=config, loaded=loaded)

    return make


@pytest.fixture(scope="session")
def real_gemma_loaded() -> LoadedModel:
    return load_model("gemma3-270m", torch.float32, torch.device("cpu"))
