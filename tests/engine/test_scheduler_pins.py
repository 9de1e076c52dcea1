"""The scheduler's "a pin never starves a request" branches (engine/scheduler.py), driven on a
real KVManager (FULL pool only, 8 pages of 4 tokens, a fake pin clock) with no model: pinned pages
that would keep a request out are unpinned, and the request runs.

- Admission: nothing runs, the first waiting request does not fit beside a pinned path, so
  `schedule()` ends every pin and admits it (and a request that fits leaves the pins alone).
- Growth: the only running request needs a page that only unpinning can give, so `_grow` ends
  the pins instead of preempting the request itself.

Also the test hook of engine/hold.py: a `decode N` hold file keeps a request's decode row out of
the batch once it has N output tokens, and only while the file exists. Audited after each step."""

from __future__ import annotations

from pathlib import Path

from freetoken.config import EngineConfig, ResolvedConfig
from freetoken.engine.hold import HoldRule, parse_rule
from freetoken.engine.scheduler import Scheduler
from freetoken.kv.manager import KVManager
from freetoken.kv.pins import live_pins
from freetoken.request import Request, RequestStatus, SamplingParams

P = 4
PAGES = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(test_hold: str | None = None) -> tuple[KVManager, Scheduler]:
    kv = KVManager(full_pages=PAGES, swa_pages=None, page_size=P, window=None, cache_type="radix",
                   max_pinned_pages=PAGES, clock=Clock())
    engine = EngineConfig(page_size=P, max_prefill_length=64, max_running_requests=4, test_hold=test_hold)
    config = ResolvedConfig(engine, context_length=PAGES * P, cache_type="radix", full_pages=PAGES, swa_pages=None, swa_floor=None)
    return kv, Scheduler(kv, config)


def pin_a_path(kv: KVManager, pages: int) -> list[int]:
    """Commit a `pages`-page prompt no later request shares, release it, pin all of it."""
    tokens = list(range(1000, 1000 + pages * P))
    assert kv.admit("pinned", tokens) == 0 and kv.extend("pinned", len(tokens))
    kv.commit("pinned", tokens)
    kv.release("pinned")
    assert kv.pin(tokens, len(tokens), 300.0) == len(tokens)
    assert kv.tree is not None and sum(n.npages for n in live_pins(kv.tree)) == pages
    assert kv.audit(idle=True).ok
    return tokens


def request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def run_item(req: Request, n: int, token: int) -> None:
    """What the engine does after a step computed `n` tokens of `req` and sampled `token`."""
    req.num_computed += n
    req.output_ids.append(token)


def test_admission_unpins_when_pins_alone_keep_the_first_request_out() -> None:
    kv, sched = make()
    pin_a_path(kv, 6)  # 6 pinned pages: 2 free, none evictable
    assert kv.available("full") == 2
    small = request("small", 8)  # 2 pages: fits beside the pins
    sched.add(small)
    [item] = sched.schedule()
    assert item.req is small and kv.status()["pins"]["released"] == 0 and live_pins(kv.tree)  # type: ignore[arg-type]
    run_item(small, item.n, 7)
    sched.remove(small)
    kv.commit("small", small.all_ids[: small.num_computed])
    kv.release("small")
    kv.evict("full", PAGES)  # the unpinned `small` pages go; the pinned path stays
    assert kv.tree is not None and kv.tree.num_pages("full") == 6

    big = request("big", 16)  # 4 pages: only unpinning can make room
    sched.add(big)
    [item] = sched.schedule()
    assert item.req is big and (item.start, item.n) == (0, 16), item
    assert big.status is RequestStatus.RUNNING and sched.running == [big] and not sched.waiting
    assert kv.status()["pins"]["released"] == 1 and not live_pins(kv.tree)  # every pin went
    assert kv.tree.num_pages("full") <= PAGES - 4  # the unpinned path was evicted for `big`
    assert sched.preemptions == 0 and kv.audit(idle=False).ok


def test_admission_waits_rather_than_unpin_while_a_request_runs() -> None:
    """The unpinning is for a request nothing else could make room for: with one running, the
    waiting request waits (the running one will release its pages) and the pins stay."""
    kv, sched = make()
    pin_a_path(kv, 4)
    first = request("first", 12)  # 3 pages: 1 free left
    sched.add(first)
    [item] = sched.schedule()
    run_item(first, item.n, 7)
    sched.add(request("second", 8))  # 2 pages: does not fit beside the pins and `first`
    items = sched.schedule()
    assert [it.req.rid for it in items] == ["first"] and [r.rid for r in sched.waiting] == ["second"]
    assert kv.status()["pins"]["released"] == 0 and live_pins(kv.tree)  # type: ignore[arg-type]


def test_growth_unpins_instead_of_preempting_the_only_request() -> None:
    kv, sched = make()
    pin_a_path(kv, 5)  # 5 pinned pages: 3 free
    req = request("grower", 12)  # exactly the 3 free pages
    sched.add(req)
    [item] = sched.schedule()
    run_item(req, item.n, 7)  # 13 tokens now: its decode needs a 4th page
    assert kv.full_pool.num_free == 0 and kv.available("full") == 0
    [item] = sched.schedule()
    assert item.req is req and (item.start, item.n) == (12, 1), item
    assert req.status is RequestStatus.RUNNING and sched.preemptions == 0 and req.preemptions == 0
    assert kv.status()["pins"]["released"] == 1 and not live_pins(kv.tree)  # type: ignore[arg-type]
    assert kv.audit(idle=False).ok


def test_hold_rule_parses_only_what_it_documents() -> None:
    assert parse_rule("decode 3\n") == HoldRule(decode_after=3)
    assert parse_rule("step") == HoldRule(step=True)
    for bad in ("", "decode", "decode -1", "hold", "step 2"):
        try:
            parse_rule(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_a_decode_hold_keeps_the_row_out_only_while_the_file_exists(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    kv, sched = make(test_hold=str(hold))
    req = request("held", 8, max_tokens=8)
    sched.add(req)
    hold.write_text("decode 2")
    [item] = sched.schedule()  # the prefill is never held
    run_item(req, item.n, 7)
    [item] = sched.schedule()  # 1 output token < 2: decodes
    run_item(req, item.n, 8)
    assert sched.schedule() == [] and sched.running == [req]  # 2 tokens: held, still running
    assert sched.schedule() == []
    hold.write_text("decode 3")
    [item] = sched.schedule()
    assert (item.start, item.n) == (9, 1)
    run_item(req, item.n, 9)
    assert sched.schedule() == []
    hold.unlink()
    [item] = sched.schedule()
    assert item.req is req and (item.start, item.n) == (10, 1)
    assert kv.audit(idle=False).ok
