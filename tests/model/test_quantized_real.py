"""The bundled real models with their weights kept quantized (`--weights auto`) against the bf16
path (every weight dequantized to bfloat16) and the float32 path (the file's values exactly,
float32 activations: the truth both approximate), on a fixed prompt set.

Measured when this test was written (10 prompts, 8 greedy tokens; logits error = norm of the
difference of the logits after each prompt over the float32 norm):

| model | bf16 vs f32 | auto vs f32 | auto vs bf16 |
|---|---|---|---|
| Gemma 3 270M | 8/10, 0.014 | 9/10, 0.036 | 7/10, 0.038 |
| SmolLM2-135M | 8/10, 0.025 | 8/10, 0.058 | 6/10, 0.050 |

So the quantized path (whose kernel also rounds activations to int8 per 32 values) follows the
file as closely as the bf16 path does token by token, with 2-3x its logits error. The test asks:
auto agrees with float32 on at least as many prompts as bf16 does, less one, and on at least 7;
with bf16 on at least 6 (most); and its logits error stays under 0.08.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.llm import LLM
from freetoken.models.load import load_model
from freetoken.request import SamplingParams
from model_harness import PagedRunner, Seq

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
    "Translate to French: I like apples.",
    "The quick brown fox",
    "Q: What is 12 times 7?\nA:",
    "List three colors:",
    "In 1969, the first humans",
]
NEW_TOKENS = 8
MIN_AGREEMENT = 7
MIN_WITH_BF16 = 6
MAX_LOGITS_ERROR = 0.08


def run(name: str, weights: str, dtype: torch.dtype = torch.bfloat16) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations of PROMPTS, and the logits [prompts, vocab] after each prompt."""
    loaded = load_model(name, dtype, torch.device("cpu"), weights)
    dtype_name = str(dtype).removeprefix("torch.")
    llm = LLM(config=EngineConfig(model=name, dtype=dtype_name, weights=weights, num_tokens=4096), loaded=loaded)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    logits = []
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        logits.append(PagedRunner(loaded.model, page_size=16, dtype=dtype, pages=8).step([(Seq(), ids)])[0][-1])
    return [o.token_ids for o in outs], torch.stack(logits).double()


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m-instruct"])
def test_quantized_weights_agree_with_bf16_and_float32(name: str) -> None:
    truth_ids, truth = run(name, "bf16", torch.float32)
    bf16_ids, _ = run(name, "bf16")
    ids, logits = run(name, "auto")
    with_truth, bf16_with_truth = agreement(ids, truth_ids), agreement(bf16_ids, truth_ids)
    with_bf16 = agreement(ids, bf16_ids)
    err = float((logits - truth).norm() / truth.norm())
    print(f"{name}: auto~f32 {with_truth}/10, bf16~f32 {bf16_with_truth}/10, auto~bf16 {with_bf16}/10, error {err:.4f}")
    assert with_truth >= max(bf16_with_truth - 1, MIN_AGREEMENT), f"{name}: {with_truth}/10 agree with float32"
    assert with_bf16 >= MIN_WITH_BF16, f"{name}: {with_bf16}/10 agree with bf16"
    assert 0 < err < MAX_LOGITS_ERROR, f"{name}: logits differ from float32 by {err:.3f}"
