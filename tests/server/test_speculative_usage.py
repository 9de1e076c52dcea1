"""`ft serve --speculative ngram` over HTTP: a request's drafts come back in its usage as OpenAI's
predicted-output counts (`completion_tokens_details.accepted_prediction_tokens` /
`rejected_prediction_tokens`, streamed and not), the same tokens as a request that opted out
(`"speculative": false`, which reports none), and `/metrics` counts what the usage reported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from serving import serving

FLAGS = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "2", "--dtype", "float32",
         "--threads", "1", "--speculative", "ngram", "--spec-max-draft", "8"]
# A looping prompt: the greedy continuation of a random model settles into a cycle, and the drafts
# come from the prompt and the output so far.
BODY = {"model": "default", "prompt": [5, 6, 7, 8] * 12, "max_tokens": 64, "temperature": 0, "ignore_eos": True}


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def test_drafts_are_reported_in_usage(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    with serving(str(tiny_gemma_dir), FLAGS, tmp_path / "serve.log") as server, server.http() as c:
        plain = c.post("/v1/completions", json={**BODY, "speculative": False}).json()
        assert "completion_tokens_details" not in plain["usage"]
        r = c.post("/v1/completions", json=BODY).json()
        assert r["choices"][0]["text"] == plain["choices"][0]["text"]  # greedy: the same tokens
        details = r["usage"]["completion_tokens_details"]
        accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
        assert accepted > 0 and accepted < r["usage"]["completion_tokens"], details
        events = []
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True, "stream_options": {"include_usage": True}}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        assert events[-1]["usage"]["completion_tokens_details"] == details  # the same request again
        metrics = httpx.get(f"{server.base}/metrics", headers=server.headers).text
        # The engine's totals are these two requests' (the opted-out one drafted nothing): every
        # drafted token was either accepted or rejected, and the usage reported both.
        assert _metric(metrics, "freetoken_spec_accepted_tokens") == 2 * accepted
        assert _metric(metrics, "freetoken_spec_drafted_tokens") == 2 * (accepted + rejected)
        server.assert_balanced_idle()
