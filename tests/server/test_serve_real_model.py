"""`ft serve` with no --model: the bundled Gemma 3 270M over HTTP (chat through the built-in
Gemma 3 template, a stream ending at the length limit), pools balanced at idle; its ready block
notes that it is a base model."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from serving import ServeProcess, serving


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    flags = ["--num-tokens", "4096", "--max-running-requests", "2", "--enable-cache-report"]
    with serving("gemma3-270m", flags, tmp_path_factory.mktemp("real_logs") / "real.log", deadline_s=900) as proc:
        yield proc


@pytest.mark.real_model
def test_default_model_chat_over_http(default_server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{default_server.base}/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == ["gemma3-270m"]
    # the ready block (logged before /health said 200) tells a person this is no chat model
    assert "  note           gemma3-270m is a base model: it continues text rather than answering; to chat, use smollm2-135m-instruct" \
        in default_server.log_path.read_text()
    messages: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens >= 1 and out.choices[0].message.content
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == out.choices[0].message.content
    again = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt hits the prefix cache
    default_server.assert_balanced_idle()
