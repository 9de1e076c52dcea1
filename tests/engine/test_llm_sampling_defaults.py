"""The offline `LLM` samples as the checkpoint recommends when a call passes no params (its
`generation_config.json`, as `ft serve --sampling-defaults model` fills what a request leaves
out), and as the API's own defaults with `sampling_defaults="none"`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import write_tiny_model  # noqa: E402

from freetoken.errors import ConfigError  # noqa: E402
from freetoken.llm import LLM  # noqa: E402
from freetoken.models.load import load_model  # noqa: E402
from freetoken.request import SamplingParams  # noqa: E402

PROMPTS = [[2, 5, 7, 11], [3, 4]]


@pytest.fixture(scope="module")
def greedy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose generation_config.json recommends greedy decoding, top_k 20, top_p 0.9."""
    directory = write_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama"))
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 20, "top_p": 0.9}))
    return directory


def test_no_params_means_the_checkpoint_s_defaults(greedy_checkpoint: Path) -> None:
    loaded = load_model(str(greedy_checkpoint), torch.float64, torch.device("cpu"))
    llm = LLM(str(greedy_checkpoint), dtype="float64", page_size=4, num_tokens=512, threads=1, loaded=loaded)
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 20, 0.9)
    assert defaults.max_tokens == SamplingParams().max_tokens  # not a sampling field: the API's own
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    # no params: greedy by the checkpoint (max_tokens and ignore_eos are not its to say)
    got = [o.token_ids[:8] for o in llm.generate(PROMPTS)]
    assert all(w[: len(g)] == g for w, g in zip(want, got))
    assert "".join(llm.stream(PROMPTS[0])) == llm.generate([PROMPTS[0]])[0].text

    plain = LLM(str(greedy_checkpoint), dtype="float64", page_size=4, num_tokens=512, threads=1, loaded=loaded,
                sampling_defaults="none")  # fmt: skip
    assert plain.default_sampling_params() == SamplingParams()


def test_a_wrong_mode_is_refused_naming_it(greedy_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="sampling_defaults must be one of model, none"):
        LLM(str(greedy_checkpoint), sampling_defaults="auto")
