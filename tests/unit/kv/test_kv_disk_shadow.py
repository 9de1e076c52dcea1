"""The content oracle covers disk loads: a page loaded from the disk tier holds the prefix it claims.

`ShadowKV` is the shadow-checked KV manager (shadow.py: the shadow check and the full audit after
every call) over real K/V tensors (tensor_shadow.py: each slot's K/V encodes the id of the token
prefix it was computed from). A first "engine" runs a few conversations sharing a prefix, with
chunked prefill, writing pages behind through a real `DiskTier`; a second one, over fresh pools
and fresh tensors (a restart), admits their next turns and loads their prefixes from the same
directory. Every holder's pages (the requests' loaded pages, the tree's after the load's commit)
must decode as the prefix they claim, and every key the next forward reads too. A tier that
loads a well-formed file holding another page's K/V (valid checksum, right header) is caught by
the oracle: the negative control shows the check can fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from freetoken.kv.disk import DiskStore
from freetoken.kv.disk_cost import LoadPolicy
from freetoken.kv.disk_file import PageHeader, decode, encode, identity_key
from freetoken.kv.disk_tier import DiskTier
from shadow import CheckedKV, ShadowViolation
from tensor_shadow import TensorShadow

P = 4


class ShadowKV(CheckedKV):
    """A shadow-checked manager over real tensors, with the disk tier's two manager calls."""

    def __init__(self, cache_dtype: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.shadow = TensorShadow(
            self.page_size,
            self.window,
            self.full_pool.capacity,
            self.swa_pool.capacity if self.swa_pool else None,
            cache_dtype,
        )

    def extend(self, rid: str, num_tokens: int, swa_from: int = 0) -> bool:
        ok = super(CheckedKV, self).extend(rid, num_tokens, swa_from)
        if not swa_from:  # a load's extend (NULL SWA entries below its window) is checked at `loaded`,
            self.verify(f"extend({rid}, {num_tokens}) -> {ok}")  # which ends it within the same admission
        return ok

    def loaded(self, rid: str, length: int) -> None:
        super().loaded(rid, length)
        self.shadow.requests[rid].valid = length  # the request now claims the loaded K/V
        self.shadow._decoded = {"full": None, "swa": None}  # the load wrote the tensors
        self.verify(f"loaded({rid}, {length})")


def make(window: int | None, cache_dtype: str) -> ShadowKV:
    return ShadowKV(
        cache_dtype, full_pages=64, swa_pages=32 if window else None, page_size=P, window=window, cache_type="radix"
    )


def tier(kv: ShadowKV, root: Path) -> DiskTier:
    store = DiskStore(root, identity_key(["shadow", kv.window, str(kv.shadow.tensors.dtype)]), 1 << 24)
    return DiskTier(store, kv.shadow.tensors, P, kv.window, LoadPolicy("always"))


def serve(kv: ShadowKV, disk: DiskTier, rid: str, tokens: Sequence[int], chunk: int = 8) -> int:
    """Admit (memory hit, then the disk load), prefill in chunks with write-behind commits,
    release; returns the cached length."""
    cached = kv.admit(rid, tokens)
    cached = disk.load(kv, rid, tokens, cached, chunk).length
    pos = cached
    while pos < len(tokens):
        n = min(chunk, len(tokens) - pos)
        assert kv.extend(rid, pos + n)
        kv.forward(rid, tokens, pos, n)
        pos += n
        kv.commit(rid, tokens[:pos])
        disk.save(kv, rid, tokens[:pos])
        kv.release_out_of_window(rid, pos)
    kv.release(rid)
    return cached


def conversations() -> list[list[int]]:
    system = [7 + i % 13 for i in range(22)]
    return [system + [100 + c * 10 + i for i in range(9 + c)] for c in range(3)]


@pytest.mark.parametrize(("window", "cache_dtype"), [(None, "auto"), (6, "auto"), (6, "int8")])
def test_pages_loaded_after_a_restart_hold_the_prefix_they_claim(tmp_path: Path, window, cache_dtype) -> None:  # type: ignore[no-untyped-def]
    first = make(window, cache_dtype)
    disk = tier(first, tmp_path)
    convs = conversations()
    for i, c in enumerate(convs):
        serve(first, disk, f"a{i}", c)
    assert disk.store.flush(10) and disk.store.audit() == []

    second = make(window, cache_dtype)  # a restart: empty pools, zeroed tensors
    second.shadow.ids = first.shadow.ids  # prefix ids name token prefixes in both (what the bytes encode)
    disk2 = tier(second, tmp_path)
    assert disk2.store.entries == disk.store.entries
    for i, c in enumerate(convs):
        nxt = [*c, 200 + i, 201, 202, 203, 204]
        cached = serve(second, disk2, f"b{i}", nxt)
        assert cached >= (len(c) // P) * P - (P if window else 0)  # at most the window's last page short
    assert disk2.counters.hits >= 1 and disk2.counters.loaded_pages > 0
    assert second.checks > 0


def test_a_well_formed_file_of_another_page_is_caught_by_the_oracle(tmp_path: Path) -> None:
    first = make(None, "auto")
    disk = tier(first, tmp_path)
    c = conversations()[0]
    serve(first, disk, "a", c)
    assert disk.store.flush(10)
    keys = disk.keys(c)
    # Page 3's file now carries page 2's K/V under a valid checksum: only the content is wrong.
    target = disk.store._path(("full", keys[3]))
    header, tokens, _ = decode(target.read_bytes())
    _, _, other = decode(disk.store._path(("full", keys[2])).read_bytes())
    forged = PageHeader(header.identity, header.key, header.parent, "full", 3, P, header.payload_len)
    target.write_bytes(b"".join(bytes(x) for x in encode(forged, tokens, bytes(other))))

    second = make(None, "auto")
    second.shadow.ids = first.shadow.ids
    with pytest.raises(ShadowViolation, match="holds"):
        serve(second, tier(second, tmp_path), "b", [*c, 1, 2, 3])
