"""Prefix-cache share of a hybrid model's agent workload (recurrent-state snapshots,
docs/kv-cache.md, "Recurrent-state pool and snapshots"). No model: the real Engine, Scheduler and
KVManager with a state pool over the null runner of the KV tests (tests/unit/kv/engine_sim.py),
so the figure is the snapshot policy's alone, and the shadow model checks that every hit starts
from the state of its own prefix.

Workload: C conversations over one 1,600-token system prompt (about 1,200 words), each opening
with an 80-token user message, then 4 requests per conversation, each the previous prompt + its
150-token reply + a 200-token tool result, message ends marked as a chat request marks them;
every round sends one request per conversation at once. Pages of 16, 4 running requests,
prefill chunks of 1024, 16 snapshot slots (4 + 2 + 16 state slots). Prints, for 4 and 8
conversations, the share of prompt tokens of turns 2-4 read from the cache: with each reply
repeated token for token in the next prompt, and re-rendered (other tokens of the same length,
as a template that drops a reply's reasoning renders it: the next turn leaves the path right
after the previous prompt).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "kv")]

from engine_sim import Setup, drain, make_engine, submit  # noqa: E402
from shadow import CheckedKV  # noqa: E402

SYSTEM, FIRST, REPLY, TOOL, TURNS, RUNNING, SNAPSHOTS, PAGE = 1600, 80, 150, 200, 4, 4, 16, 16


class ShadowOnly(CheckedKV):
    """The shadow check of every call without the full audit (the engine audits each step)."""

    audit_each_call = False


def run(conversations: int, seed: int = 0, rerendered: bool = False) -> float:
    rng = random.Random(seed)
    setup = Setup(PAGE, None, 6000, max_running=RUNNING, chunk=1024, state_slots=RUNNING + 2 + SNAPSHOTS)
    engine = make_engine(setup, ShadowOnly)
    system = [rng.randrange(128) for _ in range(SYSTEM)]
    convs = {c: (system + [rng.randrange(128) for _ in range(FIRST)], (SYSTEM, SYSTEM + FIRST))
             for c in range(conversations)}
    prompt_tokens = cached = 0
    for turn in range(TURNS):
        reqs = {c: submit(engine, f"c{c}t{turn}", prompt, REPLY, bounds) for c, (prompt, bounds) in convs.items()}
        drain(engine)
        for c, req in reqs.items():
            if turn:
                prompt_tokens += len(req.prompt_ids)
                cached += req.report.cached_tokens
            prompt, bounds = convs[c]
            reply_end = len(prompt) + len(req.output_ids)
            reply = [rng.randrange(128) for _ in req.output_ids] if rerendered else req.output_ids
            nxt = prompt + reply + [rng.randrange(128) for _ in range(TOOL)]
            convs[c] = (nxt, (*bounds, reply_end, len(nxt)))
    return cached / prompt_tokens


if __name__ == "__main__":
    for rerendered in (False, True):
        how = "re-rendered" if rerendered else "repeated"
        for n in (4, 8):
            share = 100 * run(n, rerendered=rerendered)
            print(f"{n} conversations on {RUNNING} running slots, replies {how}: turns 2-{TURNS} read {share:.1f}% from the cache")
