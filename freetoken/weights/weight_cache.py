"""The weight cache on disk: what a load made of a checkpoint, kept so the next start maps it.

Owns one entry per key in the cache directory (`--weights-cache`: utils/disk_cache.py says where
it is and how the code that packs weights is identified): `<digest>.pt` (the
value, `torch.save`d) beside `<digest>.json` (its key, size and an XXH3-64 digest per 64 MiB chunk).

An entry is never trusted blindly: `read` checks the manifest's key against the one asked for,
the file's size, and every chunk's digest (two threads over a read-only map of the file, ~20 GB/s
here: 0.05 s for a 1 GB entry, where CRC-32 over `read()` copies took 0.46 s) before `torch.load(mmap=True,
weights_only=True)` maps it — its tensors are then the file's pages, shared with the page cache,
not a copy. A missing, stale or corrupt entry is a miss (a corrupt one is deleted and logged); the
caller loads the checkpoint and writes a new entry. Writes go to a temporary file renamed into
place, so a crash mid-write leaves no entry; writing an entry deletes the entries of the same
checkpoint files made from other file versions or other code. It does not know what the value
holds (models/snapshot.py) or which options make a key (models/load.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import torch
import xxhash

from freetoken.weights.progress import ProgressCallback

log = logging.getLogger("freetoken.weights")

CHUNK = 64 << 20  # bytes per digest
DIGEST = "xxh3_64"  # the manifest's field: an entry written with another checksum is a miss
SPARE_DISK = 512 << 20  # bytes left free on the cache's disk after a write, at least
STALE_TMP_S = 3600  # a temporary file older than this is a crashed write's: deleted


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _checksums(path: Path, size: int, progress: ProgressCallback | None = None) -> list[int]:
    """XXH3-64 of each CHUNK bytes of the file, read through a read-only map on two plain threads
    (xxhash frees the GIL; plain threads, not an executor, so a write still running while the
    interpreter exits can finish). `progress(0, 0, bytes checked, size)` after each chunk: this
    pass is what reads the entry from the disk, so it is a cached load's loading bar."""
    if size == 0:
        return []
    starts = list(range(0, size, CHUNK))
    out = [0] * len(starts)
    checked = [0]  # bytes, summed over both threads under `lock`
    lock = threading.Lock()
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)

        def digest(which: range) -> None:
            for i in which:
                length = min(CHUNK, size - starts[i])
                out[i] = xxhash.xxh3_64_intdigest(view[starts[i] : starts[i] + length])
                # out of this process's page tables again (the page cache keeps them): a GB-sized
                # entry read once must not count as resident memory of the engine (VmHWM)
                mm.madvise(mmap.MADV_DONTNEED, starts[i], length)
                if progress is not None:
                    with lock:  # one count at a time, so the bytes reported never go down
                        checked[0] += length
                        progress(0, 0, checked[0], size)

        workers = [threading.Thread(target=digest, args=(range(t, len(starts), 2),)) for t in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        view.release()
    return out


def nbytes(value: object) -> int:
    """Bytes of the tensors in a nested value of dicts, lists and tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


class WeightCache:
    """Entries in `directory`, one per key (a JSON-able dict naming the checkpoint's files under
    `"source"` and the packing code under `"code"`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def paths(self, key: dict) -> tuple[Path, Path]:
        digest = _digest(key)
        return self.directory / f"{digest}.pt", self.directory / f"{digest}.json"

    def read(self, key: dict, progress: ProgressCallback | None = None) -> dict | None:
        """The value stored under `key`, memory-mapped, or None (a miss: absent, or stale or
        corrupt, which is logged and deleted). `progress` as the entry's bytes are checked
        (no tensor count: `progress(0, 0, bytes checked, bytes)`, weights/progress.py)."""
        data, manifest = self.paths(key)
        if not manifest.exists() or not data.exists():
            return None
        try:
            meta = json.loads(manifest.read_text())
            if meta.get("key") != key:
                raise ValueError("its manifest names another key")
            size = data.stat().st_size
            if size != meta["size"]:
                raise ValueError(f"{size} bytes, its manifest says {meta['size']}")
            if _checksums(data, size, progress) != meta[DIGEST]:
                raise ValueError("a checksum does not match")
            return torch.load(data, mmap=True, weights_only=True, map_location="cpu")
        except (OSError, ValueError, KeyError, RuntimeError, TypeError, EOFError, pickle.UnpicklingError) as err:
            log.warning("weight cache entry %s is unusable (%s): deleted, loading from the checkpoint", data.name, err)
            self._remove(data, manifest)
            return None

    def write(self, key: dict, value: dict) -> Path | None:
        """Store `value` under `key` (replacing any entry), then delete the entries of the same
        checkpoint files from other file versions or code. Returns the entry's path, or None
        when it was not written (no room on the disk, or an OS error; logged)."""
        data, manifest = self.paths(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._prune(key)
            need = nbytes(value)
            free = shutil.disk_usage(self.directory).free
            if free < need + SPARE_DISK:
                log.warning(
                    "weight cache: %d MiB free in %s, %d MiB needed: not written",
                    free >> 20,
                    self.directory,
                    (need + SPARE_DISK) >> 20,
                )
                return None
            tmp = data.with_name(f"{data.name}.{os.getpid()}.tmp")
            torch.save(value, tmp)
            size = tmp.stat().st_size
            meta = {"key": key, "size": size, DIGEST: _checksums(tmp, size), "created": time.time()}
            tmp_manifest = manifest.with_name(f"{manifest.name}.{os.getpid()}.tmp")
            tmp_manifest.write_text(json.dumps(meta))
            os.replace(tmp, data)
            os.replace(tmp_manifest, manifest)
        except OSError as err:
            log.warning("weight cache: could not write %s (%s)", data, err)
            return None
        return data

    def _prune(self, key: dict) -> None:
        """Delete crashed writes' temporary files and the entries `key` makes stale: same
        checkpoint paths, other file identity or other code."""
        paths = [s[0] for s in key["source"]]
        now = time.time()
        for p in self.directory.glob("*.tmp"):
            if now - p.stat().st_mtime > STALE_TMP_S:
                p.unlink(missing_ok=True)
        for manifest in self.directory.glob("*.json"):
            try:
                other = json.loads(manifest.read_text())["key"]
            except (OSError, ValueError, KeyError, TypeError):
                self._remove(manifest.with_suffix(".pt"), manifest)
                continue
            if [s[0] for s in other.get("source", [])] == paths and (
                other.get("source") != key["source"] or other.get("code") != key["code"]
            ):
                self._remove(manifest.with_suffix(".pt"), manifest)

    @staticmethod
    def _remove(data: Path, manifest: Path) -> None:
        manifest.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
