"""The `speculative` extension field of the OpenAI routes: false opts the request out of
`--speculative ngram` (SamplingParams.speculative), absent or true leaves it in, and a value
that is not a boolean fails validation naming the field (the routes answer that with a 400 naming it)."""

from __future__ import annotations

import pytest

from freetoken.server.openai.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("value", "drafts"), [(None, True), (True, True), (False, False)])
def test_speculative_field_reaches_the_sampling_params(value: bool | None, drafts: bool) -> None:
    extra = {} if value is None else {"speculative": value}
    for req in (CompletionRequest(model="m", prompt="x", **extra), ChatCompletionRequest(model="m", messages=MESSAGES, **extra)):
        assert req.sampling_params(8, logprobs=None).speculative is drafts


def test_a_non_boolean_speculative_is_refused() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="speculative"):
        CompletionRequest(model="m", prompt="x", speculative="sometimes")
