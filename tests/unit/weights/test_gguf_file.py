"""Our GGUF reader against the gguf package's GGUFReader, and on malformed input.

The metadata of both bundled files, and of a small file holding every value type, equals what
`gguf.GGUFReader` decodes, value for value and type for type; the tensor directory and the tensor
bytes are the same. Cut or corrupted files give a GGUFFormatError (a one-line ModelLoadError
through `open_gguf` / `read_metadata`), never another exception.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from freetoken.errors import ModelLoadError
from freetoken.weights.gguf_file import GGUFFile, GGUFFormatError, parse_layout, read_gguf_metadata
from freetoken.weights.gguf_metadata import forget_opened, open_gguf, read_metadata

VT = gguf.GGUFValueType


def reference_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_same_values(got: dict[str, object], want: dict[str, object]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key] == value, key
        assert type(got[key]) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got[key]] == [type(v) for v in value], key  # type: ignore[attr-defined]


def assert_same_tensors(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, ref in zip(ours.tensors, reader.tensors):
        assert mine.shape == tuple(int(x) for x in reversed(ref.shape.tolist())), mine.name
        assert mine.ggml_type == ref.tensor_type and mine.n_elements == int(ref.n_elements), mine.name
        assert (mine.offset, mine.n_bytes) == (ref.data_offset, int(ref.n_bytes)), mine.name
        data = ours.tensor_data(mine)
        assert data.dtype == np.uint8 and not data.flags.writeable
        assert data.tobytes() == np.asarray(ref.data).tobytes(), mine.name
    assert ours.data_offset == reader.data_offset and ours.alignment == reader.alignment


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_real_file_equals_gguf_reader(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(f"{which}_gguf")
    reader: gguf.GGUFReader = request.getfixturevalue(f"{which}_reader")
    ours = GGUFFile(path)
    want = reference_metadata(reader)
    assert_same_values(ours.metadata, want)
    assert_same_values(read_metadata(path), want)
    assert len(want["tokenizer.ggml.tokens"]) > 40_000  # type: ignore[arg-type]
    assert_same_tensors(ours, reader)


def every_type_file(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    scalars = {
        VT.UINT8: 200, VT.INT8: -100, VT.UINT16: 60_000, VT.INT16: -30_000, VT.UINT32: 4_000_000_000,
        VT.INT32: -2_000_000_000, VT.UINT64: 2**63 + 5, VT.INT64: -(2**62), VT.FLOAT32: 0.1,
        VT.FLOAT64: 0.1, VT.BOOL: True,
    }  # fmt: skip
    for vtype, value in scalars.items():
        w.add_key_value(f"scalar.{vtype.name}", value, vtype)
        items = [value, value, value] if vtype != VT.BOOL else [True, False, True]
        w.add_key_value(f"array.{vtype.name}", items, VT.ARRAY, sub_type=vtype)
    w.add_string("string.plain", "hello")
    w.add_string("string.empty", "")
    w.add_string("string.unicode", "\u2581\u00e9\U0001f600\x00<s>")
    w.add_array("array.strings", ["", "a", "\u2581b\u00e9", "\U0001f600" * 3, "x" * 300])
    w.add_custom_alignment(64)  # the key and the offsets the writer lays out agree
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.arange(7, dtype=np.float16))
    raw = np.random.default_rng(0).integers(0, 256, (2, 3 * 34), dtype=np.uint8)
    w.add_tensor("c", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    return every_type_file(tmp_path / "every.gguf")


def test_every_value_type_equals_gguf_reader(small_file: Path) -> None:
    reader = gguf.GGUFReader(small_file)
    ours = GGUFFile(small_file)
    assert_same_values(ours.metadata, reference_metadata(reader))
    assert ours.metadata["scalar.UINT64"] == 2**63 + 5 and ours.metadata["array.BOOL"] == [True, False, True]
    assert ours.metadata["string.unicode"] == "\u2581\u00e9\U0001f600\x00<s>"
    assert ours.alignment == 64
    assert_same_tensors(ours, reader)
    assert [t.shape for t in ours.tensors] == [(3, 4), (7,), (2, 96)]


def kv_file(*pairs: bytes, version: int = 3, n_kv: int | None = None) -> bytes:
    """A GGUF file with no tensors and the given raw key/value entries."""
    count = len(pairs) if n_kv is None else n_kv
    return b"GGUF" + struct.pack("<IQQ", version, 0, count) + b"".join(pairs)


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def test_empty_and_nested_arrays() -> None:
    empty = kv("empty", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0))
    empty_strings = kv("none", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0))
    inner = struct.pack("<IQ", VT.UINT8, 2) + b"\x01\x02"
    nested = kv("nested", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 2) + inner + inner)
    layout = parse_layout(memoryview(kv_file(empty, empty_strings, nested)))
    # gguf's reader flattens nested arrays; we keep their structure
    assert layout.metadata == {"empty": [], "none": [], "nested": [[1, 2], [1, 2]]}
    end = 24 + len(empty + empty_strings + nested)
    assert layout.tensors == [] and layout.data_offset == -(-end // 32) * 32


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"GGUF\x03\x00", "file ends inside the version"),
        (b"GGML" + bytes(20), "bad magic number"),
        (kv_file(version=1), "GGUF version 1 is not supported"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian GGUF files are not supported"),
        (kv_file(kv("x", 99, b"")), "x has unknown value type 99"),
        (kv_file(kv("x", VT.ARRAY, struct.pack("<IQ", 77, 1))), "x is an array of unknown value type 77"),
        (kv_file(kv("x", VT.UINT8, b"\x01"), kv("x", VT.UINT8, b"\x02")), "key x appears twice"),
        (kv_file(kv("x", VT.STRING, struct.pack("<Q", 2) + b"\xff\xfe")), "x is not UTF-8"),
        (kv_file(kv("x", VT.ARRAY, struct.pack("<IQQ", VT.STRING, 1, 1) + b"\xff")), "x holds a string that is not UTF-8"),
        (kv_file(kv("x", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**60))), "file ends inside x"),
        (kv_file(kv("x", VT.ARRAY, struct.pack("<IQQ", VT.STRING, 2, 2**40))), "file ends inside x"),
        (kv_file(kv("x", VT.ARRAY, struct.pack("<IQ", VT.FLOAT64, 2**61))), "file ends inside x"),
        (kv_file(kv("general.alignment", VT.UINT32, struct.pack("<I", 48))), "general.alignment 48 is not a power of two"),
        (kv_file(kv("general.alignment", VT.UINT64, struct.pack("<Q", 64))), "general.alignment is not a uint32"),
        (kv_file(n_kv=2**40), "file ends inside key 0"),
    ],
)
def test_malformed_header(data: bytes, reason: str) -> None:
    with pytest.raises(GGUFFormatError, match=reason):
        parse_layout(memoryview(data))


def test_bad_tensor_directory(small_file: Path) -> None:
    data = bytearray(small_file.read_bytes())
    layout = parse_layout(memoryview(bytes(data)))
    name_at = bytes(data).index(b"\x01\x00\x00\x00\x00\x00\x00\x00c")  # tensor "c": its name's length
    type_at = name_at + 9 + 4 + 2 * 8
    assert struct.unpack_from("<I", data, type_at)[0] == gguf.GGMLQuantizationType.Q8_0
    struct.pack_into("<I", data, type_at, 1234)
    with pytest.raises(GGUFFormatError, match="tensor c has unknown GGML type 1234"):
        parse_layout(memoryview(bytes(data)))
    struct.pack_into("<I", data, type_at, gguf.GGMLQuantizationType.Q8_0)
    data[name_at + 8 : name_at + 9] = b"b"  # two tensors named "b"
    with pytest.raises(GGUFFormatError, match="tensor b appears twice"):
        parse_layout(memoryview(bytes(data)))
    last = layout.tensors[-1]
    parse_layout(memoryview(small_file.read_bytes()[: last.offset + last.n_bytes]))
    with pytest.raises(GGUFFormatError, match="the data of tensor c runs past the end of the file"):
        parse_layout(memoryview(small_file.read_bytes()[: last.offset + last.n_bytes - 1]))


def test_every_cut_is_a_format_error(small_file: Path) -> None:
    data = small_file.read_bytes()
    header_end = parse_layout(memoryview(data)).data_offset
    for cut in range(header_end):
        with pytest.raises(GGUFFormatError) as info:
            parse_layout(memoryview(data[:cut]))
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("reader", [open_gguf, read_metadata])
def test_load_errors_are_one_line(reader: object, tmp_path: Path, small_file: Path) -> None:
    cases = {"empty.gguf": b"", "cut.gguf": small_file.read_bytes()[:100], "junk.gguf": b"PK\x03\x04" + bytes(64)}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ModelLoadError) as info:
            reader(path)  # type: ignore[operator]
        message = str(info.value)
        assert message.startswith(f"{path} is not a readable GGUF file (") and "\n" not in message
    with pytest.raises(ModelLoadError, match="model file not found"):
        reader(tmp_path / "missing.gguf")  # type: ignore[operator]


def test_metadata_only_read_ignores_a_broken_tensor_directory(small_file: Path) -> None:
    full = small_file.read_bytes()
    header_end = parse_layout(memoryview(full)).data_offset
    small_file.write_bytes(full[: header_end - 40])  # cut inside the tensor directory
    assert read_gguf_metadata(small_file)["string.plain"] == "hello"
    with pytest.raises(ModelLoadError):
        open_gguf(small_file)


def test_reopening_an_unchanged_file_reuses_its_parse(tmp_path: Path) -> None:
    """An engine start opens its model several times; the parse is made once per file version."""
    import os
    import shutil

    from freetoken.weights.source import resolve_model

    copy = tmp_path / "model.gguf"
    shutil.copyfile(resolve_model("gemma3-270m").path, copy)
    first = open_gguf(copy)
    assert open_gguf(copy) is first and open_gguf(str(copy)) is first
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten, as far as anyone can tell
    again = open_gguf(copy)
    assert again is not first and again.metadata == first.metadata
    forget_opened()  # what a finished load calls: the map is not kept alive for a reopen
    assert open_gguf(copy) is not again
    other = tmp_path / "other.gguf"
    shutil.copyfile(copy, other)
    assert open_gguf(other) is not again
    other.write_bytes(b"GGUF")  # a changed file is parsed again: here, refused
    with pytest.raises(ModelLoadError):
        open_gguf(other)
