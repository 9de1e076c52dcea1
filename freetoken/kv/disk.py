"""The disk tier's store: its directory, its index, its LRU bound and its writer thread.

Owns the files under `--kv-disk-dir` (`DIR/<identity>/<kind>/<xx>/<key>.kvp`, one page each, or
on a hybrid model one recurrent-state snapshot each for kind `state`, kv/disk_file.py) and the
index of them: (kind, key) -> bytes, in least-recently-used order, bounded by `--kv-disk-gb` (a
write past the bound deletes the oldest files). Disk entries are not
pages: no pool counts them and the pool audit does not see them; `audit` here checks every
entry's file (it exists and its checksum matches) and drops the ones that fail, and the writer
thread, whenever it has had nothing to write for `audit_idle_s`, checks the next batch of entries
(a rolling audit, cycling over the index, off the engine's thread).

Writes are off the engine's critical path: `submit` hands a page (already copied to host memory
by the engine thread) to the writer thread and returns at once; when the backlog is over its
byte bound the page is dropped and counted, never waited for. A file is written under a
temporary name and renamed, so a killed process leaves a whole file or none (a left-over
temporary file is removed at the next start). Reads (`read`) are synchronous and verify the file;
a file that fails is removed from the index and from the disk, and is a miss.

On start the index is rebuilt from the files' headers (LRU order from their modification times,
which a load renews); a directory of another identity (another model, weight format, K/V dtype
or page size) is deleted: the tier belongs to one engine configuration at a time. It does not
know tensors, requests or the radix tree (kv/disk_tier.py joins them).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from freetoken.kv.disk_file import HEADER_SIZE, FileProblem, PageHeader, decode, encode, parse_header

log = logging.getLogger("freetoken.kv.disk")

GIB = 1 << 30
AUDIT_IDLE_S = 2.0  # the writer's rolling audit: a batch after this long without a write
AUDIT_BATCH = 16  # entries per batch
SUFFIX = ".kvp"
_IDENTITY_DIR = re.compile(r"[0-9a-f]{32}")
Key = tuple[str, bytes]  # (pool kind, page key)


@dataclass
class DiskCounters:
    writes: int = 0  # page files written
    written_bytes: int = 0
    dropped_writes: int = 0  # pages not written: the backlog was full
    write_errors: int = 0
    evicted: int = 0  # files deleted to stay within the bound
    corrupt: int = 0  # files found unreadable, truncated, corrupt or not the page expected
    invalidated: int = 0  # files of another identity deleted at start
    audited: int = 0  # entries the writer's rolling audit checked
    audit_cycles: int = 0  # passes of that audit over the index begun
    audit_failures: int = 0  # entries an audit found wrong (and dropped)


@dataclass
class _Write:
    header: PageHeader
    tokens: list[int]
    payload: object  # a host buffer with the buffer protocol (the engine's copy of the page)


class DiskStore:
    """Page files of one identity under `root`, at most `max_bytes` of them."""

    def __init__(
        self,
        root: str | Path,
        identity: bytes,
        max_bytes: int,
        max_backlog_bytes: int | None = None,
        audit_idle_s: float = AUDIT_IDLE_S,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the disk tier needs a positive size, got {max_bytes} bytes")
        self.root = Path(root)
        self.identity = identity
        self.dir = self.root / identity.hex()
        self.max_bytes = max_bytes
        # The writer's backlog: host copies waiting for the disk, at most this many bytes.
        self.max_backlog_bytes = max_backlog_bytes if max_backlog_bytes is not None else min(max_bytes, GIB // 4)
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, int] = OrderedDict()  # LRU order: oldest first
        self._bytes = 0
        self._stamp = 0  # the last modification time given a file (ns, strictly increasing)
        self._pending: dict[Key, int] = {}  # submitted, not yet written (key -> bytes)
        self._backlog_bytes = 0
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self.audit_idle_s = audit_idle_s  # the writer audits a batch after this long without a write
        self.audit_batch = AUDIT_BATCH
        self._audit_todo: list[Key] = []
        self._closed = False
        self.gate = threading.Event()  # a test hook: the writer waits while it is clear
        self.gate.set()
        self._open()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # -- start ------------------------------------------------------------------------------

    def _open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for other in self.root.iterdir():
            if other.is_dir() and _IDENTITY_DIR.fullmatch(other.name) and other != self.dir:
                count = sum(1 for _ in other.rglob(f"*{SUFFIX}"))
                shutil.rmtree(other, ignore_errors=True)
                self.counters.invalidated += count
                log.info("disk tier: deleted %d pages of another model or K/V format (%s)", count, other.name)
        found: list[tuple[int, Key, int]] = []
        for path in self.dir.rglob("*"):
            if path.is_dir():
                continue
            if path.suffix != SUFFIX:
                path.unlink(missing_ok=True)  # a write a killed process left unfinished
                continue
            try:
                st = path.stat()
                with path.open("rb") as f:
                    header = parse_header(f.read(HEADER_SIZE))
                if header.identity != self.identity or path != self._path((header.kind, header.key)):
                    raise FileProblem("misplaced")
                if st.st_size != header.file_size:
                    raise FileProblem("truncated")
            except (OSError, FileProblem):
                self.counters.corrupt += 1
                path.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime_ns, (header.kind, header.key), st.st_size))
        for stamp, key, size in sorted(found, key=lambda f: f[0]):
            self._index[key] = size
            self._bytes += size
            self._stamp = max(self._stamp, stamp)
        with self._lock:
            self._evict_over(0)
        if self._index:
            log.info("disk tier: %d pages, %.1f MiB in %s", len(self._index), self._bytes / (1 << 20), self.dir)

    def _path(self, key: Key) -> Path:
        kind, digest = key
        h = digest.hex()
        return self.dir / kind / h[:2] / f"{h}{SUFFIX}"

    # -- the index --------------------------------------------------------------------------

    def has(self, kind: str, digest: bytes) -> bool:
        """True when the page is on disk or waiting to be written."""
        key = (kind, digest)
        with self._lock:
            return key in self._index or key in self._pending

    def on_disk(self, kind: str, digest: bytes) -> bool:
        """True when the page is on disk (a load can read it now)."""
        with self._lock:
            return (kind, digest) in self._index

    def room_for(self, nbytes: int) -> bool:
        """True when the backlog can take `nbytes` more now."""
        with self._lock:
            return self._backlog_bytes + nbytes <= self.max_backlog_bytes

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def backlog(self) -> tuple[int, int]:
        """(pages, bytes) submitted and not yet written."""
        with self._lock:
            return len(self._pending), self._backlog_bytes

    def _evict_over(self, incoming: int) -> None:
        """Delete the oldest files until `incoming` more bytes fit (lock held)."""
        while self._index and self._bytes + incoming > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self.counters.evicted += 1
            self._path(key).unlink(missing_ok=True)

    def _touch(self, path: Path) -> None:
        """Stamp a file as just used (lock held): the LRU order survives a restart. The stamps
        strictly increase, so two uses within one tick of the file system's clock keep their order."""
        self._stamp = max(time.time_ns(), self._stamp + 1)
        os.utime(path, ns=(self._stamp, self._stamp))

    def _forget(self, key: Key) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        self._path(key).unlink(missing_ok=True)

    # -- writing ----------------------------------------------------------------------------

    def submit(self, header: PageHeader, tokens: Sequence[int], payload: object, nbytes: int) -> bool:
        """Queue one page for the writer; False (counted as dropped) when the backlog is full or
        the page is already on disk or queued. Never blocks."""
        key = (header.kind, header.key)
        with self._lock:
            if key in self._index or key in self._pending:
                return False
            if self._closed or self._backlog_bytes + nbytes > self.max_backlog_bytes:
                self.counters.dropped_writes += 1
                return False
            self._pending[key] = nbytes
            self._backlog_bytes += nbytes
        self._queue.put(_Write(header, list(tokens), payload))
        return True

    def count_dropped(self) -> None:
        with self._lock:
            self.counters.dropped_writes += 1

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.audit_idle_s)
            except queue.Empty:
                self._rolling_audit()
                continue
            if item is None:
                return
            self.gate.wait()
            key = (item.header.kind, item.header.key)
            size = item.header.file_size
            try:
                if size <= self.max_bytes:
                    self._write(key, item)
            except OSError as err:
                log.warning("disk tier: writing a page failed: %s", err)
                with self._lock:
                    self.counters.write_errors += 1
            finally:
                with self._lock:
                    self._backlog_bytes -= self._pending.pop(key, 0)
                    self._idle.notify_all()

    def _write(self, key: Key, item: _Write) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("wb") as f:
                for piece in encode(item.header, item.tokens, memoryview(item.payload).cast("B")):  # type: ignore[arg-type]
                    f.write(piece)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
            raise
        size = item.header.file_size
        with self._lock:
            self._evict_over(size)
            os.replace(tmp, path)
            self._touch(path)
            self._index[key] = size
            self._bytes += size
            self.counters.writes += 1
            self.counters.written_bytes += size

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted page is written (a drain, a test); True when done."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._pending, timeout=timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Write what is queued (up to `timeout_s`), then stop the writer. True when nothing was
        left unwritten."""
        done = self.flush(timeout_s)
        with self._lock:
            self._closed = True  # a page submitted from now on is dropped: no writer would take it
        self._queue.put(None)
        self._thread.join(timeout=0 if not done else timeout_s)
        return done

    # -- reading ----------------------------------------------------------------------------

    def read(self, kind: str, digest: bytes) -> tuple[PageHeader, list[int], memoryview] | None:
        """The page file of (kind, key), checked whole; None when it is not on disk or fails (then
        it is forgotten and deleted, counted as corrupt). A read renews the entry's LRU place."""
        key = (kind, digest)
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            raw = path.read_bytes()
            header, tokens, payload = decode(raw)
            if header.identity != self.identity or header.key != digest or header.kind != kind:
                raise FileProblem("not the page its name says")
            with self._lock:
                self._touch(path)
        except FileNotFoundError:
            self._forget(key)
            return None
        except (OSError, FileProblem) as err:
            log.warning("disk tier: %s is unusable (%s); dropped", path.name, err)
            self.drop(kind, digest)
            return None
        return header, tokens, payload

    def drop(self, kind: str, digest: bytes) -> None:
        """Forget and delete an entry a reader found wrong (counted as corrupt)."""
        with self._lock:
            self.counters.corrupt += 1
        self._forget((kind, digest))

    # -- audit ------------------------------------------------------------------------------

    def audit(self) -> list[str]:
        """Check every entry: its file exists, parses, is the page its name says and its checksum
        matches. Entries that fail are dropped; returns one line per failure."""
        with self._lock:
            keys = list(self._index)
        return self._audit(keys)

    def _rolling_audit(self) -> None:
        """The writer's idle work: check the next `audit_batch` entries (a cycle over the index,
        so every entry is checked again and again while the tier is idle; the engine never waits
        for it)."""
        if not self._audit_todo:
            with self._lock:
                self._audit_todo = list(self._index)
            if not self._audit_todo:
                return
            self.counters.audit_cycles += 1
        batch, self._audit_todo = self._audit_todo[: self.audit_batch], self._audit_todo[self.audit_batch :]
        problems = self._audit(batch)
        with self._lock:
            self.counters.audited += len(batch)
            self.counters.audit_failures += len(problems)
        for line in problems:
            log.warning("disk tier audit: %s; dropped", line)

    def _audit(self, keys: list[Key]) -> list[str]:
        problems: list[str] = []
        for kind, digest in keys:
            path = self._path((kind, digest))
            try:
                header, _, _ = decode(path.read_bytes())
                if header.identity != self.identity or header.key != digest or header.kind != kind:
                    raise FileProblem("not the page its name says")
            except (OSError, FileProblem) as err:
                with self._lock:
                    if (kind, digest) not in self._index:
                        continue  # evicted meanwhile
                problems.append(f"{kind} {digest.hex()}: {err}")
                self.drop(kind, digest)
        return problems

    def status(self) -> dict[str, int]:
        with self._lock:
            c = self.counters
            return {
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "entries": len(self._index),
                "write_backlog": len(self._pending),
                "write_backlog_bytes": self._backlog_bytes,
                "writes": c.writes,
                "written_bytes": c.written_bytes,
                "dropped_writes": c.dropped_writes,
                "write_errors": c.write_errors,
                "evicted": c.evicted,
                "corrupt": c.corrupt,
                "invalidated": c.invalidated,
                "audited": c.audited,
                "audit_cycles": c.audit_cycles,
                "audit_failures": c.audit_failures,
            }
