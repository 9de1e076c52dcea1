"""The disk tier's store (kv/disk.py) and file format (kv/disk_file.py), without a model.

A page file round-trips; a truncated, corrupt or misplaced file is a miss (and is dropped), never
a page; the store stays within its byte bound, least recently used first, and its order
survives a reopen; a full write backlog drops pages without blocking the caller (the writer is
held by its test gate, not by timing); another identity's directory is deleted at start; the
audit finds a file changed behind the index's back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from freetoken.kv.disk import DiskStore
from freetoken.kv.disk_cost import LoadPolicy
from freetoken.kv.disk_file import HEADER_SIZE, ROOT, FileProblem, PageHeader, chain_keys, decode, encode, identity_key

P = 4
IDENT = identity_key(["test-model", "float32", P])
PAYLOAD = 64


def page(i: int, key: bytes, parent: bytes, kind: str = "full") -> tuple[PageHeader, list[int], np.ndarray]:
    header = PageHeader(IDENT, key, parent, kind, i, P, PAYLOAD)
    return header, [i * 10 + j for j in range(P)], np.full(PAYLOAD, i + 1, dtype=np.uint8)


def write_pages(store: DiskStore, n: int, kind: str = "full") -> list[bytes]:
    tokens = [i * 10 + j for i in range(n) for j in range(P)]
    keys = chain_keys(tokens, P, IDENT)
    for i, key in enumerate(keys):
        header, toks, payload = page(i, key, keys[i - 1] if i else ROOT, kind)
        assert store.submit(header, toks, payload, PAYLOAD)
    assert store.flush(10)
    return keys


def test_chain_keys_are_prefix_keys() -> None:
    a = chain_keys(list(range(12)), P, IDENT)
    b = chain_keys([*range(8), 99, 9, 10, 11], P, IDENT)
    assert a[:2] == b[:2] and a[2] != b[2]  # a page's key depends on every token before it
    assert chain_keys([9, 9, 9, 9, *range(4, 12)], P, IDENT)[1] != a[1]
    assert chain_keys(list(range(12)), P, identity_key(["other-model"]))[0] != a[0]  # and on the identity


def test_file_round_trip_and_every_damage_is_a_problem() -> None:
    header, toks, payload = page(3, b"k" * 16, b"p" * 16, "swa")
    raw = b"".join(bytes(x) for x in encode(header, toks, memoryview(payload)))
    got, got_tokens, got_payload = decode(raw)
    assert got == header and got_tokens == toks and bytes(got_payload) == payload.tobytes()
    for bad in (raw[:-1], raw[: HEADER_SIZE - 1], raw + b"x"):
        with pytest.raises(FileProblem):
            decode(bad)
    for at in (20, HEADER_SIZE + 1, len(raw) - 1):  # a flipped bit in the header, the tokens, the payload
        flipped = bytearray(raw)
        flipped[at] ^= 1
        with pytest.raises(FileProblem):
            decode(bytes(flipped))


def test_store_reads_back_and_a_damaged_file_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, IDENT, 1 << 20)
    keys = write_pages(store, 3)
    got = store.read("full", keys[1])
    assert got is not None and bytes(got[2]) == bytes([2]) * PAYLOAD
    path = store._path(("full", keys[2]))
    path.write_bytes(path.read_bytes()[:-5])  # truncated behind the index's back
    assert store.read("full", keys[2]) is None
    assert not store.on_disk("full", keys[2]) and not path.exists()
    assert store.status()["corrupt"] == 1
    assert store.read("swa", keys[0]) is None  # never written


def test_audit_finds_a_changed_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, IDENT, 1 << 20)
    keys = write_pages(store, 3)
    assert store.audit() == []
    path = store._path(("full", keys[0]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    store._path(("full", keys[1])).unlink()
    problems = store.audit()
    assert len(problems) == 2
    assert store.entries == 1 and store.audit() == []


def test_lru_bound_and_order_survive_a_reopen(tmp_path: Path) -> None:
    size = HEADER_SIZE + 4 * P + PAYLOAD
    store = DiskStore(tmp_path, IDENT, 4 * size)
    keys = write_pages(store, 4)
    assert store.read("full", keys[0]) is not None  # page 0 becomes the most recently used
    store.close(10)
    reopened = DiskStore(tmp_path, IDENT, 4 * size)
    assert reopened.entries == 4
    tokens = [i * 10 + j for i in range(6) for j in range(P)]
    more = chain_keys(tokens, P, IDENT)
    for i in (4, 5):
        header, toks, payload = page(i, more[i], more[i - 1])
        assert reopened.submit(header, toks, payload, PAYLOAD)
    assert reopened.flush(10)
    assert reopened.nbytes <= 4 * size and reopened.entries == 4
    assert [reopened.on_disk("full", k) for k in keys] == [True, False, False, True]  # 1 and 2 were oldest
    assert reopened.status()["evicted"] == 2


def test_a_full_backlog_drops_without_blocking(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, IDENT, 1 << 20, max_backlog_bytes=2 * PAYLOAD)
    store.gate.clear()  # the writer takes one page and then waits: the disk "hangs"
    tokens = [i * 10 + j for i in range(5) for j in range(P)]
    keys = chain_keys(tokens, P, IDENT)
    results: list[bool] = []

    def submit_all() -> None:
        for i, key in enumerate(keys):
            header, toks, payload = page(i, key, keys[i - 1] if i else ROOT)
            results.append(store.submit(header, toks, payload, PAYLOAD))

    caller = threading.Thread(target=submit_all)
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "submit blocked on a writer that cannot write"
    assert results == [True, True, False, False, False]
    assert store.status()["dropped_writes"] == 3 and store.backlog() == (2, 2 * PAYLOAD)
    store.gate.set()
    assert store.flush(10) and store.entries == 2


def test_another_identity_is_deleted_at_start(tmp_path: Path) -> None:
    old = DiskStore(tmp_path, identity_key(["old model"]), 1 << 20)
    tokens = list(range(8))
    key = chain_keys(tokens, P, old.identity)[0]
    assert old.submit(PageHeader(old.identity, key, ROOT, "full", 0, P, PAYLOAD), tokens[:P], bytes(PAYLOAD), PAYLOAD)
    assert old.close(10)
    (tmp_path / old.identity.hex() / "full" / "x.kvp.123.tmp").write_bytes(b"half")
    new = DiskStore(tmp_path, IDENT, 1 << 20)
    assert new.status()["invalidated"] == 1 and new.entries == 0
    assert not (tmp_path / old.identity.hex()).exists()


def test_load_policy_compares_the_measured_rates() -> None:
    policy = LoadPolicy("auto")
    assert policy.should_load(10**9, 1)  # nothing measured yet: load (and measure)
    policy.observe_read(100 * 10**6, 1.0)  # 100 MB/s
    policy.observe_prefill(1000, 1.0)  # 1000 tokens/s
    assert policy.should_load(50 * 10**6, 1000)  # 0.5 s of reading against 1 s of prefill
    assert not policy.should_load(200 * 10**6, 1000)
    assert LoadPolicy("always").should_load(10**12, 1)


def test_the_writer_audits_while_idle(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, IDENT, 1 << 20, audit_idle_s=0.01)
    keys = write_pages(store, 3)
    path = store._path(("full", keys[1]))
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # a bit flipped behind the index's back
    deadline = time.monotonic() + 30  # a bound on the wait, not a timing assertion
    while store.status()["audit_failures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    status = store.status()
    assert status["audit_failures"] == 1 and status["audited"] >= 3, status
    assert not store.on_disk("full", keys[1]) and store.on_disk("full", keys[0])


def test_a_state_file_sits_beside_its_page_and_survives_a_reopen(tmp_path: Path) -> None:
    """A recurrent-state snapshot is a `state` entry under the key of the page ending at it: its
    own file, read back by kind, checked like a page, kept across a reopen."""
    store = DiskStore(tmp_path, IDENT, 1 << 20)
    keys = write_pages(store, 2)
    header, toks, _ = page(1, keys[1], keys[0], "state")
    state = np.arange(PAYLOAD, dtype=np.uint8)
    assert store.submit(header, toks, state, PAYLOAD)
    assert store.flush(10)
    assert store.on_disk("state", keys[1]) and not store.on_disk("state", keys[0])
    store.close(10)
    store = DiskStore(tmp_path, IDENT, 1 << 20)
    assert store.entries == 3 and store.audit() == []
    got = store.read("state", keys[1])
    assert got is not None and got[0].kind == "state" and bytes(got[2]) == state.tobytes()
    assert bytes(store.read("full", keys[1])[2]) == bytes([2]) * PAYLOAD  # type: ignore[index]


def test_a_state_slot_round_trips_through_its_bytes() -> None:
    import torch

    from freetoken.kv.tensors import KVLayout, KVTensors

    layout = KVLayout((False, False), 1, 4, linear=(True, False), conv_shape=(3, 2), recurrent_shape=(2, 2, 2))
    t = KVTensors(layout, 2, 0, P, torch.float32, "cpu", state_slots=3)
    assert t.state_nbytes() == layout.state_bytes() == 4 * (6 + 8)
    t.conv[0][2].normal_()
    t.recurrent[0][2].normal_()
    payload = t.state_bytes(2).numpy()
    t.load_state(3, memoryview(payload))
    assert torch.equal(t.conv[0][3], t.conv[0][2]) and torch.equal(t.recurrent[0][3], t.recurrent[0][2])
    with pytest.raises(ValueError):
        t.load_state(3, payload[:-1].tobytes())
