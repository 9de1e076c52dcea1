"""Issue 27's agent workload on the tiny Qwen3.5 with the default state pool: more conversations
than running requests, each turn extending the last, every later turn hits its own
conversation's last snapshot.

8 conversations over one shared system prompt, `max_running_requests` 4, 4 turns each, rendered
by the chat template (message ends marked) and decoded as a client would (special tokens
skipped), the next turn added the moment a reply finishes, so 4 conversations always wait. The
default pool is 4 running + 2 spare + 16 snapshot slots. A reply re-rendered in the history does
not reproduce its tokens here (as Qwen3.5's template drops a reply's reasoning), so a later turn
leaves the previous request's path right after its prompt and hits at that prompt's resend cap;
the snapshot in the reply's last page is never hit. Before the snapshot policy knew a request's
ends (kv/snapshots.py), that reply snapshot counted as its path's last one and the cap's as one
a continuation passes: the caps went first and the later turns fell back to the system prompt.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from freetoken.bench.serving import tool_result, words_text
from freetoken.config import EngineConfig
from freetoken.kv.window import floor_to_page
from freetoken.llm import LLM
from freetoken.request import Request, SamplingParams
from freetoken.server.core.chat_prompt import render_chat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_model  # noqa: E402

CONVERSATIONS, RUNNING, TURNS, REPLY = 8, 4, 4, 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), max_position_embeddings=4096)


def last_snapshot(prev: Request, prompt: list[int], page: int) -> int:
    """Where the previous request of a conversation left its last snapshot on the path of the
    next prompt: the last page boundary its state passed (the reply's) when the next prompt
    repeats the reply, else its resend cap (the end of its prompt)."""
    written = prev.prompt_ids + prev.output_ids[:-1]
    for end in (floor_to_page(len(written), page), floor_to_page(len(prev.prompt_ids) - 1, page)):
        if end < len(prompt) and prompt[:end] == written[:end]:
            return end
    return 0


def test_every_later_turn_hits_its_conversations_last_snapshot(checkpoint: Path) -> None:
    config = EngineConfig(model=str(checkpoint), dtype="float32", max_running_requests=RUNNING,
                          num_tokens=RUNNING * 4096, debug_kv=True, threads=1)  # fmt: skip
    llm = LLM(str(checkpoint), config=config)
    engine, tok, page = llm.engine, llm.tokenizer, config.page_size
    assert engine.kv.state_pool.capacity == RUNNING + 2 + 4 * RUNNING  # the default sizing
    system = "You are a coding agent. Follow the project notes below.\n" + words_text(7, 150)
    rngs = [random.Random(k) for k in range(CONVERSATIONS)]
    messages = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Task {k}: find the bug."}]
        for k in range(CONVERSATIONS)
    ]
    params = SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True)
    history: list[list[Request]] = [[] for _ in range(CONVERSATIONS)]
    system_end = 0

    def add(k: int) -> None:
        nonlocal system_end
        ids, bounds = render_chat(tok, messages[k])
        system_end = bounds[0]
        req = Request(f"c{k}t{len(history[k]) + 1}", ids, params, boundaries=bounds)
        history[k].append(req)
        engine.add_request(req)

    for k in range(CONVERSATIONS):
        add(k)
    while engine.has_work():
        engine.step()
        for k, turns in enumerate(history):
            req = turns[-1]
            if req.finish_reason is not None and len(turns) < TURNS:
                reply = tok.decode(req.output_ids, skip_special_tokens=True)
                messages[k] += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_result(rngs[k])}]
                add(k)
    assert all(len(t) == TURNS and t[-1].finish_reason is not None for t in history)
    got, want = {}, {}
    for k, turns in enumerate(history):
        for prev, req in zip(turns, turns[1:]):
            got[req.rid] = req.report.cached_tokens
            want[req.rid] = last_snapshot(prev, req.prompt_ids, page)
            assert want[req.rid] > system_end, (req.rid, want[req.rid])  # beyond the shared prompt
    assert got == want
    kv = engine.kv
    assert kv.state_pool.num_free + kv.tree.num_pages("state") == kv.state_pool.capacity
    assert kv.audit(idle=True).ok and kv.violations == 0
