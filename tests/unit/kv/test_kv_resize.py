"""Run-time pool resizes through the real engine over a null model (engine_sim), every KV call
shadow-checked and audited: grow adds free pages; a shrink drops the tree's pages above the new
size at once, then waits for running requests to release theirs while new admissions already
see the new size; refusals (floor, held pages, a shrink in progress, no SWA pool) change nothing.
A hybrid model's state pool (slots) resizes the same way: a shrink keeps the snapshots that fit
below the new size, evicting the others in the snapshot eviction order, and moves them there (the
shadow checks each still holds its prefix's state); running requests' slots above it retire when
they release them."""

from __future__ import annotations

import pytest

from engine_sim import Setup, drain, make_engine, step, submit
from freetoken.engine.engine import RequestRefused
from freetoken.engine.resize import ResizeRefused
from freetoken.kv.snapshots import eviction_order

P = 4


def pools(engine) -> dict:  # type: ignore[no-untyped-def]
    out = engine.kv.status()["pools"]
    for pool in out.values():
        assert pool["capacity"] == pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"], pool
    return out


def test_grow_adds_free_pages_to_both_pools() -> None:
    engine = make_engine(Setup(P, 6, 24))
    before = pools(engine)
    out = engine.resize(full_tokens=32 * P, swa_tokens=(before["swa"]["capacity"] + 5) * P)
    assert out["full"] == {"capacity": 32, "tokens": 32 * P, "pending_release": 0}
    after = pools(engine)
    assert after["full"]["free"] == before["full"]["free"] + 8 and after["full"]["capacity"] == 32
    assert after["swa"]["free"] == before["swa"]["free"] + 5
    assert engine.kv.tensor_pages == {"full": 32, "swa": before["swa"]["capacity"] + 5, "state": 0}
    submit(engine, "a", list(range(1, 90)), 4)  # 93 tokens: 24 pages, more than the old pool
    drain(engine)


def test_shrink_drops_tree_pages_above_the_new_size_at_once() -> None:
    engine = make_engine(Setup(P, None, 24))
    for i in range(4):
        submit(engine, f"r{i}", [10 * i + k for k in range(1, 18)], 3)
    drain(engine)
    assert pools(engine)["full"]["cached"] > 12
    out = engine.resize(full_tokens=12 * P)
    assert out["full"]["pending_release"] == 0
    status = pools(engine)["full"]
    assert status["capacity"] == status["target"] == 12 and engine.kv.tensor_pages["full"] == 12
    assert all(p <= 12 for n in engine.kv.tree.nodes() for p in n.full)
    submit(engine, "after", list(range(1, 30)), 3)
    drain(engine)


def test_shrink_waits_for_running_requests_and_admissions_see_the_new_size() -> None:
    engine = make_engine(Setup(P, 6, 24, max_running=2))
    for i in range(3):  # the tree takes the low pages
        submit(engine, f"r{i}", [10 * i + k for k in range(1, 18)], 3)
    drain(engine)
    submit(engine, "a", list(range(1, 11)), 30)  # 40 tokens: 10 pages each, above the tree's
    submit(engine, "b", list(range(50, 60)), 30)
    while engine.kv.held_pages("full") < 14:
        step(engine)
    held = engine.kv.held_pages("full")
    with pytest.raises(ValueError, match="running requests hold"):  # the manager's own check
        engine.kv.resize("full", held - 1)
    assert pools(engine)["full"]["target"] == 24  # the refusal changed nothing
    target = max(held, 20)  # the floor: twice a's (or b's) 10 pages
    out = engine.resize(full_tokens=target * P)
    assert out["full"]["pending_release"] > 0, "a and b hold pages above the target"
    status = pools(engine)["full"]
    assert status["target"] == target and status["capacity"] > target
    assert engine.kv.tensor_pages["full"] == 24  # the tensors wait for the pages above to go
    assert all(p <= target for n in engine.kv.tree.nodes() for p in n.full)
    with pytest.raises(RequestRefused, match=f"the pool holds {target * P}"):  # new admissions see it at once
        submit(engine, "big", list(range(1, target * P)), 10)
    with pytest.raises(ResizeRefused, match="still shrinking"):
        engine.resize(full_tokens=16 * P)
    drain(engine)
    status = pools(engine)["full"]
    assert status["capacity"] == target and status["pending_release"] == 0 and engine.kv.tensor_pages["full"] == target
    assert not engine.requests


def test_refusals_name_the_key_and_change_nothing() -> None:
    engine = make_engine(Setup(P, 6, 24))
    floor = engine.config.swa_floor
    before = pools(engine)
    with pytest.raises(ResizeRefused, match="floor") as err:
        engine.resize(swa_tokens=(floor - 1) * P)
    assert err.value.param == "swa_tokens" and err.value.conflict
    with pytest.raises(ResizeRefused, match="at least one page") as err:
        engine.resize(full_tokens=2)
    assert err.value.param == "full_tokens" and not err.value.conflict
    submit(engine, "long", list(range(1, 60)), 20)  # needs 20 pages alone
    with pytest.raises(ResizeRefused, match="twice the pages the largest request"):
        engine.resize(full_tokens=39 * P)
    assert pools(engine) == before
    drain(engine)
    three = make_engine(Setup(P, None, 40, max_running=3))
    for i in range(3):
        submit(three, f"t{i}", [20 * i + k for k in range(1, 11)], 30)  # 10 pages each, floor 20
    while three.kv.held_pages("full") < 22:
        step(three)
    with pytest.raises(ResizeRefused, match="running requests hold") as err:
        three.resize(full_tokens=21 * P)
    assert err.value.param == "full_tokens" and err.value.conflict
    drain(three)
    full_only = make_engine(Setup(P, None, 24))
    with pytest.raises(ResizeRefused, match="no sliding-window layers") as err:
        full_only.resize(swa_tokens=64)
    assert err.value.param == "swa_tokens" and not err.value.conflict
    drain(engine)


def hybrid(state_slots: int, max_running: int = 2):  # type: ignore[no-untyped-def]
    return make_engine(Setup(P, None, 64, max_running=max_running, chunk=12, state_slots=state_slots))


def conversations(engine, n: int, turns: int = 2) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """n conversations of `turns` requests each (each extending the last, message ends marked):
    snapshots at their boundaries, caps and replies. Returns each one's last sequence."""
    seqs = [[60 + 13 * c + k for k in range(9)] for c in range(n)]
    for _ in range(turns):
        reqs = [submit(engine, f"c{c}.{len(s)}", s, 6, (len(s),)) for c, s in enumerate(seqs)]
        drain(engine)
        seqs = [r.all_ids + [1 + c, 2, 3, 4, 5] for c, r in enumerate(reqs)]
    return seqs


def snapshot_positions(engine) -> dict[int, tuple[int, ...]]:  # type: ignore[no-untyped-def]
    """slot -> the tokens of the path ending at its snapshot."""
    out = {}
    for slot, node in engine.kv.tree.owned("state").items():
        end = node.start + (node.state.index(slot) + 1) * P
        path, n = [], node
        while n is not None and n.parent is not None:
            path[:0] = n.key
            n = n.parent
        out[slot] = tuple(path[:end])
    return out


def test_state_pool_grows_with_new_free_slots() -> None:
    engine = hybrid(6)
    conversations(engine, 3)
    before = pools(engine)["state"]
    out = engine.resize(state_slots=10)
    assert out["state"] == {"capacity": 10, "pending_release": 0}
    after = pools(engine)["state"]
    assert after["capacity"] == after["target"] == 10 and after["free"] == before["free"] + 4
    assert engine.kv.tensor_pages["state"] == 10
    conversations(engine, 5)  # room for more snapshots: every slot usable, the shadow checks them
    assert engine.kv.tree.num_pages("state") > before["cached"]


def test_state_shrink_keeps_the_snapshots_that_fit_in_eviction_order_below_the_new_size() -> None:
    engine = hybrid(16)
    seqs = conversations(engine, 4)
    kv = engine.kv
    paths = snapshot_positions(engine)
    assert len(paths) > 6 and max(paths) > 6
    order = eviction_order(kv.tree, pinned_too=True)
    kept = {paths[s] for s in order[len(order) - 6 :]}  # the 6 that go last
    out = engine.resize(state_slots=6)
    assert out["state"] == {"capacity": 6, "pending_release": 0}
    status = pools(engine)["state"]
    assert status["capacity"] == status["target"] == 6 and status["cached"] == 6 and status["free"] == 0
    assert engine.kv.tensor_pages["state"] == 6
    after = snapshot_positions(engine)
    assert set(after.values()) == kept and max(after) <= 6  # moved below the new size
    for c, seq in enumerate(seqs):  # each continuation hits its moved snapshot; the shadow checks the state
        submit(engine, f"next{c}", seq + [9, 9, 9], 3)
    drain(engine)


def test_state_shrink_waits_for_running_requests_slots() -> None:
    engine = hybrid(12)
    conversations(engine, 3, turns=1)  # the tree takes the low slots
    a = submit(engine, "a", list(range(1, 30)), 30)
    b = submit(engine, "b", list(range(40, 70)), 30)
    while len(a.output_ids) < 2 or len(b.output_ids) < 2:
        step(engine)
    above = sum(engine.kv.state_slot(r) > 4 for r in ("a", "b"))
    assert above >= 1  # a slot above the target below: the shrink must wait for it
    out = engine.resize(state_slots=4)  # the floor: 2 running + 2 spare
    assert out["state"]["pending_release"] == above
    status = pools(engine)["state"]
    assert status["target"] == 4 and status["capacity"] > 4 and status["pending_release"] == above
    assert max(engine.kv.tree.owned("state"), default=0) <= 4
    assert engine.kv.tensor_pages["state"] == 12  # the tensors wait for the slots above to go
    with pytest.raises(ResizeRefused, match="still shrinking") as err:
        engine.resize(state_slots=8)
    assert err.value.param == "state_slots" and err.value.conflict
    drain(engine)
    status = pools(engine)["state"]
    assert status["capacity"] == 4 and status["pending_release"] == 0 and engine.kv.tensor_pages["state"] == 4
    assert (a.finished, b.finished) == (True, True)
    conversations(engine, 2)  # serves on with 4 slots: 2 running, snapshots in the rest


def test_state_resize_refusals_name_the_key_and_change_nothing() -> None:
    engine = hybrid(8)
    conversations(engine, 2, turns=1)
    before = pools(engine)
    with pytest.raises(ResizeRefused, match="floor of 4 slots") as err:
        engine.resize(state_slots=3)
    assert err.value.param == "state_slots" and err.value.conflict
    with pytest.raises(ResizeRefused, match="at least 1") as err:
        engine.resize(state_slots=0)
    assert err.value.param == "state_slots" and not err.value.conflict
    assert pools(engine) == before
    with pytest.raises(ResizeRefused, match="no linear-attention layers") as err:
        make_engine(Setup(P, None, 24)).resize(state_slots=8)
    assert err.value.param == "state_slots" and not err.value.conflict
    drain(engine)
