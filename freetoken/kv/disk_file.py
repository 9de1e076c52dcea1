"""One page of the disk tier as a file: its key, its bytes, and checking them on the way back.

Owns the content address of a page on disk and the file format. A page's key is a chained
digest of the token path that produced it: key[i] = blake2b(key[i-1] + tokens of page i) under
the tier's identity (the model, the weight format, the K/V dtype, the page size: `identity`), so
equal keys mean the same tokens from position 0 on, for the same model and the same bytes per
page. It is the same chain as the miss reason's prefix hash (kv/miss.py), made stable across
processes and Python versions (a restart must find its pages) and long enough that a collision is
not a concern. A hybrid model's recurrent-state snapshot at position n*P is a file of kind
`state` under the key of page n - 1 (the page that ends there): the same header, tokens (that
page's) and checksum, its payload the state of every linear layer (float32, `state_bytes`). The file stores the page's own tokens and its parent's key beside the K/V, so the
token path of every file can be followed back to position 0 and each load checks what it claims.

Layout (little-endian): a fixed header (magic, identity, key, parent key, pool kind, page index,
page size, payload length, CRC-32 of everything after the header and of the header's fields
before it), the page's tokens (int32), then the payload: the page's K/V bytes as kv/tensors.py
lays them out (`page_bytes`). Anything that does not parse, does not match what the reader
expected, or fails its checksum is a miss (`FileProblem`), never a page. It does no I/O
scheduling, keeps no index and touches no tensor (kv/disk.py, kv/disk_tier.py do).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAGIC = b"FTKVPG01"
KINDS = ("full", "swa", "state")
DIGEST = 16  # bytes of a key
ROOT = bytes(DIGEST)  # the parent key of page 0
_HEADER = struct.Struct(f"<8s{DIGEST}s{DIGEST}s{DIGEST}sBxxxIIQI")
HEADER_SIZE = _HEADER.size


class FileProblem(ValueError):
    """A disk page that cannot be used: unreadable, truncated, corrupt or not the page expected."""


def identity_key(parts: Sequence[object]) -> bytes:
    """The tier's identity: a digest of everything that makes a page's bytes mean something (the
    model's files, its weight format, the K/V dtype and shape, the page size, this format)."""
    return hashlib.blake2b(repr((MAGIC, *parts)).encode(), digest_size=DIGEST).digest()


def chain_keys(tokens: Sequence[int], page_size: int, identity: bytes, pages: int | None = None) -> list[bytes]:
    """Keys of the first `pages` whole pages of `tokens` (all whole pages by default)."""
    n = len(tokens) // page_size if pages is None else min(pages, len(tokens) // page_size)
    arr = np.asarray(tokens[: n * page_size], dtype=np.int32)
    out: list[bytes] = []
    prev = ROOT
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=DIGEST, key=identity)
        h.update(arr[i * page_size : (i + 1) * page_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


@dataclass(frozen=True)
class PageHeader:
    identity: bytes
    key: bytes
    parent: bytes
    kind: str
    index: int  # the page's position in its token path (page i covers tokens [i*P, (i+1)*P); a state: after it)
    page_size: int
    payload_len: int

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + 4 * self.page_size + self.payload_len


def _crc(fields: bytes, tokens: bytes, payload: memoryview | bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(fields)))


def encode(header: PageHeader, tokens: Sequence[int], payload: memoryview | bytes) -> list[bytes | memoryview]:
    """The file's bytes, in pieces (the payload is not copied)."""
    if len(tokens) != header.page_size or len(payload) != header.payload_len:
        raise ValueError("a page file needs exactly page_size tokens and payload_len payload bytes")
    tok = np.asarray(tokens, dtype=np.int32).tobytes()
    fields = _fields(header)
    crc = _crc(fields[:-4], tok, payload)
    return [fields[:-4] + struct.pack("<I", crc), tok, payload]


def _fields(header: PageHeader, crc: int = 0) -> bytes:
    return _HEADER.pack(
        MAGIC,
        header.identity,
        header.key,
        header.parent,
        KINDS.index(header.kind),
        header.index,
        header.page_size,
        header.payload_len,
        crc,
    )


def parse_header(raw: bytes) -> PageHeader:
    """The header of a page file (its first HEADER_SIZE bytes); FileProblem if it is not one."""
    if len(raw) < HEADER_SIZE:
        raise FileProblem("truncated header")
    magic, identity, key, parent, kind, index, page_size, payload_len, _ = _HEADER.unpack_from(raw)
    if magic != MAGIC or kind >= len(KINDS):
        raise FileProblem("not a page file of this format")
    return PageHeader(identity, key, parent, KINDS[kind], index, page_size, payload_len)


def decode(raw: bytes) -> tuple[PageHeader, list[int], memoryview]:
    """(header, tokens, payload) of a whole file; FileProblem when truncated or corrupt."""
    header = parse_header(raw)
    if len(raw) != header.file_size:
        raise FileProblem(f"{len(raw)} bytes, the header says {header.file_size}")
    view = memoryview(raw)
    tok = view[HEADER_SIZE : HEADER_SIZE + 4 * header.page_size]
    payload = view[HEADER_SIZE + 4 * header.page_size :]
    (crc,) = struct.unpack_from("<I", raw, HEADER_SIZE - 4)
    if _crc(raw[: HEADER_SIZE - 4], tok, payload) != crc:
        raise FileProblem("checksum mismatch")
    return header, np.frombuffer(tok, dtype=np.int32).tolist(), payload
