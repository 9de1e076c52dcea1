"""Reading the binary layout of a GGUF file: header, key/value metadata, tensor infos.

Owns the parse of the GGUF container (versions 2 and 3, little-endian): every key/value type,
including arrays, decoded to plain Python values in bulk (numeric arrays through numpy, arrays of
strings in one pass over the bytes), the tensor directory (name, shape, GGML type, data offset),
and read-only numpy views of the tensor bytes over one memory map of the file. It does not
dequantize, rename tensors or interpret metadata keys. Any malformed or truncated input is a
GGUFFormatError carrying a one-line reason: a tensor with no
or too many dimensions, a zero dimension, a row that is not whole quant blocks, a data offset off
the alignment or not where the tensors before it end (so a tensor's type or shape cannot change
without its neighbours' offsets saying so), data past the end of the file.
"""

from __future__ import annotations

import mmap
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

VT = gguf.GGUFValueType
# Fixed-size value types: struct format and numpy dtype (both little-endian).
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    VT.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    VT.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    VT.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    VT.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    VT.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    VT.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    VT.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    VT.BOOL: (struct.Struct("<?"), np.dtype("<u1")),
    VT.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    VT.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    VT.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file; the message is one line saying why."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory."""

    name: str
    shape: tuple[int, ...]  # torch order, outermost first (the reverse of GGUF's ne)
    ggml_type: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class _Cursor:
    """Reads little-endian values from a buffer, checking every read against its end."""

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFFormatError(f"file ends inside {what} at byte {self.pos}")

    def unpack(self, fmt: struct.Struct, what: str) -> object:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack(_U32, what))  # type: ignore[call-overload]

    def u64(self, what: str) -> int:
        return int(self.unpack(_U64, what))  # type: ignore[call-overload]

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        start = self.pos
        self.pos += n
        return _utf8(self.buf[start : self.pos], what)

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings, each a u64 byte length and its UTF-8 bytes, read in one tight loop."""
        self.need(8 * count, what)  # each string takes at least its length field
        buf, pos, end = self.buf, self.pos, self.end
        unpack_from = _U64.unpack_from
        spans: list[tuple[int, int]] = []
        append = spans.append
        try:
            for _ in range(count):
                (n,) = unpack_from(buf, pos)
                pos += 8
                append((pos, pos + n))
                pos += n
        except struct.error:
            raise GGUFFormatError(f"file ends inside {what}") from None
        if pos > end:
            raise GGUFFormatError(f"file ends inside {what}")
        self.pos = pos
        raw = bytes(buf[spans[0][0] : pos]) if spans else b""
        base = spans[0][0] if spans else 0
        try:
            return [raw[a - base : b - base].decode("utf-8") for a, b in spans]
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"{what} holds a string that is not UTF-8 ({err.reason})") from None

    def numbers(self, vtype: int, count: int, what: str) -> list[object]:
        fmt, dtype = _SCALARS[vtype]
        self.need(count * fmt.size, what)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * fmt.size
        return (values != 0).tolist() if vtype == VT.BOOL else values.tolist()

    def value(self, vtype: int, what: str) -> object:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0], what)
        if vtype == VT.STRING:
            return self.string(what)
        if vtype == VT.ARRAY:
            item_type = self.u32(what)
            count = self.u64(what)
            if item_type in _SCALARS:
                return self.numbers(item_type, count, what)
            if item_type == VT.STRING:
                return self.strings(count, what)
            if item_type == VT.ARRAY:
                self.need(12 * count, what)  # each inner array takes at least its type and length
                return [self.value(VT.ARRAY, what) for _ in range(count)]
            raise GGUFFormatError(f"{what} is an array of unknown value type {item_type}")
        raise GGUFFormatError(f"{what} has unknown value type {vtype}")


def _utf8(raw: memoryview, what: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as err:
        raise GGUFFormatError(f"{what} is not UTF-8 ({err.reason})") from None


def _header(cur: _Cursor) -> tuple[int, int, int]:
    """Magic, version, tensor count and key/value count -> (version, n_tensors, n_kv)."""
    cur.need(4, "the magic number")
    if bytes(cur.buf[0:4]) != GGUF_MAGIC:
        raise GGUFFormatError(f"bad magic number {bytes(cur.buf[0:4])!r} (expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version != 0:
        raise GGUFFormatError("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
    return version, cur.u64("the tensor count"), cur.u64("the key/value count")  # a count past the file ends at its end


def _read_kv(cur: _Cursor, count: int) -> tuple[dict[str, object], dict[str, int]]:
    """`count` key/value pairs -> (key -> value, key -> GGUF value type)."""
    kv: dict[str, object] = {}
    types: dict[str, int] = {}
    for i in range(count):
        key = cur.string(f"key {i}")
        vtype = cur.u32(f"the type of {key}")
        if key in kv:
            raise GGUFFormatError(f"key {key} appears twice")
        types[key] = vtype
        kv[key] = cur.value(vtype, key)
    return kv, types


def parse_metadata(buf: memoryview) -> dict[str, object]:
    """The key/value section of the GGUF file in `buf`, in file order."""
    cur = _Cursor(buf)
    _, _, n_kv = _header(cur)
    return _read_kv(cur, n_kv)[0]


@dataclass(frozen=True)
class GGUFLayout:
    """Everything before the tensor data: version, metadata, tensor directory, data start."""

    version: int
    metadata: dict[str, object]
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int


def _alignment(metadata: dict[str, object], raw_types: dict[str, int]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata["general.alignment"]
    if raw_types["general.alignment"] != VT.UINT32:
        raise GGUFFormatError("general.alignment is not a uint32")
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise GGUFFormatError(f"general.alignment {value} is not a power of two")
    return value


def _tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos = []
    for i in range(count):
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.u32(f"tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        cur.need(8 * n_dims, f"the shape of tensor {name}")
        ne = np.frombuffer(cur.buf, dtype="<u8", count=n_dims, offset=cur.pos).tolist()
        cur.pos += 8 * n_dims
        ggml_type = cur.u32(f"tensor {name}")
        offset = cur.u64(f"tensor {name}")
        infos.append((name, tuple(reversed(ne)), ggml_type, offset))
    return infos


def parse_layout(buf: memoryview) -> GGUFLayout:
    """Header, metadata and tensor directory of the GGUF file in `buf`, checked against itself
    before anything reads a tensor: every dimension positive and a whole number of its type's
    blocks, every data offset a multiple of the file's alignment and exactly where the tensors
    before it end (their data in directory order, each padded to the alignment, as llama.cpp lays
    out and requires), and every tensor's data inside the file."""
    cur = _Cursor(buf)
    version, n_tensors, n_kv = _header(cur)
    metadata, raw_types = _read_kv(cur, n_kv)
    alignment = _alignment(metadata, raw_types)
    infos = _tensor_infos(cur, n_tensors)
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: list[GGUFTensorInfo] = []
    seen: set[str] = set()
    expected = 0  # where the next tensor's data must start, relative to data_offset
    for name, shape, type_id, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"tensor {name} appears twice")
        seen.add(name)
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown GGML type {type_id}") from None
        if ggml_type not in gguf.GGML_QUANT_SIZES:
            raise GGUFFormatError(f"tensor {name} has GGML type {ggml_type.name}, which has no known size")
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if any(d == 0 for d in shape):
            raise GGUFFormatError(f"tensor {name} has a zero dimension (shape {list(shape)})")
        if shape[-1] % block_size:
            raise GGUFFormatError(
                f"tensor {name}: its rows of {shape[-1]} elements are not whole {ggml_type.name} blocks of {block_size}"
            )
        n_elements = 1
        for d in shape:
            n_elements *= d
        n_bytes = n_elements * type_size // block_size
        if offset % alignment:
            raise GGUFFormatError(
                f"tensor {name} has data offset {offset}, not a multiple of the alignment {alignment}"
            )
        if offset != expected:  # llama.cpp's rule too: a changed type or shape shows here
            raise GGUFFormatError(
                f"tensor {name} has data offset {offset}, but the tensors before it end at {expected} "
                f"(their data, in directory order, each padded to the alignment {alignment})"
            )
        expected = offset + -(-n_bytes // alignment) * alignment
        start = data_offset + offset
        if start + n_bytes > len(buf):
            raise GGUFFormatError(f"the data of tensor {name} runs past the end of the file")
        tensors.append(GGUFTensorInfo(name, shape, ggml_type, start, n_bytes))
    return GGUFLayout(version, metadata, tensors, alignment, data_offset)


class GGUFFile:
    """An open GGUF file: its layout, and its tensor bytes as views over one memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        layout = parse_layout(memoryview(self._map))
        self.version = layout.version
        self.metadata = layout.metadata
        self.tensors = layout.tensors
        self.alignment = layout.alignment
        self.data_offset = layout.data_offset
        _OPEN.add(self)

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as stored: a read-only flat uint8 view of the file (no copy)."""
        return self._map[info.offset : info.offset + info.n_bytes].view(np.ndarray)

    def release_pages(self, address: int, length: int) -> bool:
        """Drop the whole pages of [address, address + length) from this process's page tables
        if the range lies in this file's map (False otherwise). The map is shared and read only:
        the page cache keeps the pages and a later read faults them back unchanged; until then
        they no longer count as this process's resident memory."""
        base = self._map.ctypes.data
        if not base <= address <= address + length <= base + self._map.size:
            return False
        page = mmap.PAGESIZE
        start, stop = -(-(address - base) // page) * page, (address + length - base) // page * page
        if stop > start:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, start, stop - start)  # type: ignore[attr-defined]
        return True


_OPEN: weakref.WeakSet[GGUFFile] = weakref.WeakSet()  # the files this process has open


def release_mapped_pages(address: int, length: int) -> bool:
    """`GGUFFile.release_pages` on whichever open file maps [address, address + length); False
    (nothing done) for memory no open file maps, such as a copy."""
    return any(f.release_pages(address, length) for f in list(_OPEN))


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """Only the key/value section of the file at `path` (the tensor directory is not read)."""
    return parse_metadata(memoryview(np.memmap(path, dtype=np.uint8, mode="r")))
