"""Corrupt GGUF files are refused cleanly: a fixed family of mutations of a small, complete Llama
GGUF (written here: tokenizer, two blocks, one Q8_0 matrix) — header magic / version / counts,
metadata values, types and lengths, tensor dims / types / offsets, truncation at several points —
each either refused with one single-line ModelLoadError naming the file, or loaded exactly as the
unmutated file (same tensors). Never another exception, never a hang (an alarm guards each load).

The load is the whole of `load_model` (container, metadata, config, model build, weights,
tokenizer), so a mutation that slips past the checks and breaks something later shows up here.
Mutations of the tensor directory that move or reshape data are always refused: a file whose data
does not sit where its own directory says is never read.
"""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import write_gguf

from freetoken.errors import ModelLoadError
from freetoken.models.load import LoadedModel, load_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 64, 2
SPM_HEAD = ["<pad>", "<eos>", "<bos>", "<unk>"]
PIECES = ["\u2581", "a", "b", "\u2581a", "ab"]
TOKENS = SPM_HEAD + [f"<0x{b:02X}>" for b in range(256)] + PIECES
VT = gguf.GGUFValueType
LOAD_GUARD_S = 60  # a hang guard, not a timing claim


def model_kv() -> dict[str, object]:
    return {
        "block_count": LAYERS, "context_length": 128, "embedding_length": HIDDEN, "feed_forward_length": FFN,
        "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0, "rope.dimension_count": HEAD_DIM,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(TOKENS))],
        "tokenizer.ggml.token_type": [3, 3, 3, 2] + [6] * 256 + [1] * len(PIECES),
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
    }  # fmt: skip


def q8_0(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A Q8_0 matrix [rows, cols] as raw blocks: a float16 scale and 32 int8 quants per block."""
    blocks = np.zeros((rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, (rows, cols // 32, 32), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 34), gguf.GGMLQuantizationType.Q8_0


def write_model(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors: dict[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]] = {
        "token_embd.weight": w(len(TOKENS), HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32),
    }
    for i in range(LAYERS):
        tensors |= {
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32), f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN), f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": q8_0(HIDDEN, FFN, rng) if i == 1 else w(HIDDEN, FFN),
        }  # fmt: skip
    return write_gguf(path, "llama", model_kv(), tensors)


class Hang(Exception):
    pass


@contextmanager
def alarm(seconds: int) -> Iterator[None]:
    def ring(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def load(path: Path) -> LoadedModel:
    with alarm(LOAD_GUARD_S):
        return load_model(str(path), torch.float32, torch.device("cpu"), "bf16")


def state(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}


# -- locating fields in the file's bytes ----------------------------------------------------------


def _named(data: bytes, name: str) -> int:
    """Where the length-prefixed string `name` ends (keys and tensor names are unique in the file)."""
    raw = name.encode()
    at = data.find(struct.pack("<Q", len(raw)) + raw)
    assert at >= 0, name
    return at + 8 + len(raw)


def kv_type_at(data: bytes, key: str) -> int:
    return _named(data, key)


def kv_value_at(data: bytes, key: str) -> int:
    return _named(data, key) + 4


def tensor_field_at(data: bytes, name: str, field: str) -> int:
    """`n_dims`, `dim0` (the innermost, GGUF's ne[0]), `type` or `offset` of a directory entry."""
    n_dims_at = _named(data, name)
    (n_dims,) = struct.unpack_from("<I", data, n_dims_at)
    return {"n_dims": n_dims_at, "dim0": n_dims_at + 4, "type": n_dims_at + 4 + 8 * n_dims,
            "offset": n_dims_at + 4 + 8 * n_dims + 4}[field]  # fmt: skip


Mutation = Callable[[bytes], bytes]


def put(fmt: str, where: Callable[[bytes], int], value: int | Callable[[int], int]) -> Mutation:
    def mutate(data: bytes) -> bytes:
        out = bytearray(data)
        at = where(data)
        new = value(struct.unpack_from(fmt, data, at)[0]) if callable(value) else value
        struct.pack_into(fmt, out, at, new % (1 << (8 * struct.calcsize(fmt))))
        return bytes(out)

    return mutate


def put_float(where: Callable[[bytes], int], value: float) -> Mutation:
    def mutate(data: bytes) -> bytes:
        out = bytearray(data)
        struct.pack_into("<f", out, where(data), value)
        return bytes(out)

    return mutate


def cut(where: Callable[[bytes], int]) -> Mutation:
    return lambda data: data[: where(data)]


def header(offset: int) -> Callable[[bytes], int]:
    return lambda data: offset


def data_start(data: bytes) -> int:
    ends = [tensor_field_at(data, n, "offset") + 8 for n in ("blk.1.ffn_down.weight", "token_embd.weight")]
    return -(-max(ends) // 32) * 32  # the directory ends before the data; the file's alignment is 32


KEY = "llama.attention.head_count"
Q = "blk.0.attn_q.weight"  # float32
Q8 = "blk.1.ffn_down.weight"  # Q8_0
EMBD = "token_embd.weight"

# Mutations after which the file must be refused; name -> mutation.
REFUSED: dict[str, Mutation] = {
    "magic": lambda d: b"GGUX" + d[4:],
    "version-1": put("<I", header(4), 1),
    "version-4": put("<I", header(4), 4),
    "version-big-endian": put("<I", header(4), 3 << 24),
    "tensor-count+1": put("<Q", header(8), lambda v: v + 1),
    "tensor-count-huge": put("<Q", header(8), 1 << 63),
    "kv-count+1": put("<Q", header(16), lambda v: v + 1),
    "kv-count-huge": put("<Q", header(16), 1 << 40),
    "block_count-0": put("<I", lambda d: kv_value_at(d, "llama.block_count"), 0),
    "block_count-1": put("<I", lambda d: kv_value_at(d, "llama.block_count"), 1),
    "block_count-3": put("<I", lambda d: kv_value_at(d, "llama.block_count"), 3),
    "block_count-1000000": put("<I", lambda d: kv_value_at(d, "llama.block_count"), 1_000_000),
    "block_count-max": put("<I", lambda d: kv_value_at(d, "llama.block_count"), (1 << 32) - 1),
    "head_count-0": put("<I", lambda d: kv_value_at(d, KEY), 0),
    "head_count-3": put("<I", lambda d: kv_value_at(d, KEY), 3),
    "head_count-8": put("<I", lambda d: kv_value_at(d, KEY), 8),
    "head_count-huge": put("<I", lambda d: kv_value_at(d, KEY), 1 << 31),
    "head_count_kv-0": put("<I", lambda d: kv_value_at(d, "llama.attention.head_count_kv"), 0),
    "head_count_kv-3": put("<I", lambda d: kv_value_at(d, "llama.attention.head_count_kv"), 3),
    "head_count_kv-8": put("<I", lambda d: kv_value_at(d, "llama.attention.head_count_kv"), 8),
    "embedding_length-0": put("<I", lambda d: kv_value_at(d, "llama.embedding_length"), 0),
    "embedding_length-33": put("<I", lambda d: kv_value_at(d, "llama.embedding_length"), 33),
    "embedding_length-huge": put("<I", lambda d: kv_value_at(d, "llama.embedding_length"), (1 << 32) - 1),
    "context_length-0": put("<I", lambda d: kv_value_at(d, "llama.context_length"), 0),
    "context_length-huge": put("<I", lambda d: kv_value_at(d, "llama.context_length"), 1 << 31),
    "feed_forward_length-0": put("<I", lambda d: kv_value_at(d, "llama.feed_forward_length"), 0),
    "feed_forward_length-63": put("<I", lambda d: kv_value_at(d, "llama.feed_forward_length"), 63),
    "rope_dims-0": put("<I", lambda d: kv_value_at(d, "llama.rope.dimension_count"), 0),
    "rope_base-0": put_float(lambda d: kv_value_at(d, "llama.rope.freq_base"), 0.0),
    "rope_base-nan": put_float(lambda d: kv_value_at(d, "llama.rope.freq_base"), float("nan")),
    "rms_eps-inf": put_float(lambda d: kv_value_at(d, "llama.attention.layer_norm_rms_epsilon"), float("inf")),
    "value-type-string": put("<I", lambda d: kv_type_at(d, KEY), VT.STRING),
    "value-type-array": put("<I", lambda d: kv_type_at(d, KEY), VT.ARRAY),
    "value-type-bool": put("<I", lambda d: kv_type_at(d, KEY), VT.BOOL),
    "value-type-unknown": put("<I", lambda d: kv_type_at(d, KEY), 99),
    "arch-length+1": put("<Q", lambda d: _named(d, "general.architecture") + 4, lambda v: v + 1),
    "arch-length-huge": put("<Q", lambda d: _named(d, "general.architecture") + 4, 1 << 40),
    "key-length-huge": put("<Q", lambda d: _named(d, "general.architecture") - 8 - len("general.architecture"), 1 << 40),
    "tokens-count+1": put("<Q", lambda d: kv_value_at(d, "tokenizer.ggml.tokens") + 4, lambda v: v + 1),
    "tokens-count-1": put("<Q", lambda d: kv_value_at(d, "tokenizer.ggml.tokens") + 4, lambda v: v - 1),
    "tokens-count-huge": put("<Q", lambda d: kv_value_at(d, "tokenizer.ggml.tokens") + 4, 1 << 40),
    "tokens-item-type-unknown": put("<I", lambda d: kv_value_at(d, "tokenizer.ggml.tokens"), 99),
    "tokens-item-type-u32": put("<I", lambda d: kv_value_at(d, "tokenizer.ggml.tokens"), VT.UINT32),
    "n_dims-0": put("<I", lambda d: tensor_field_at(d, Q, "n_dims"), 0),
    "n_dims-5": put("<I", lambda d: tensor_field_at(d, Q, "n_dims"), 5),
    "n_dims-1000": put("<I", lambda d: tensor_field_at(d, Q, "n_dims"), 1000),
    "dim-0": put("<Q", lambda d: tensor_field_at(d, Q, "dim0"), 0),
    "dim+1": put("<Q", lambda d: tensor_field_at(d, Q, "dim0"), lambda v: v + 1),
    "dim-1": put("<Q", lambda d: tensor_field_at(d, Q, "dim0"), lambda v: v - 1),
    "dim-huge": put("<Q", lambda d: tensor_field_at(d, Q, "dim0"), 1 << 40),
    "dim-q8-not-blocks": put("<Q", lambda d: tensor_field_at(d, Q8, "dim0"), 48),
    "embd-dim-half": put("<Q", lambda d: tensor_field_at(d, EMBD, "dim0"), HIDDEN // 2),
    "type-unknown": put("<I", lambda d: tensor_field_at(d, Q, "type"), 99),
    "type-f16": put("<I", lambda d: tensor_field_at(d, Q, "type"), gguf.GGMLQuantizationType.F16),
    "type-q8_0": put("<I", lambda d: tensor_field_at(d, Q, "type"), gguf.GGMLQuantizationType.Q8_0),
    "type-q8-as-f32": put("<I", lambda d: tensor_field_at(d, Q8, "type"), gguf.GGMLQuantizationType.F32),
    "offset+1": put("<Q", lambda d: tensor_field_at(d, Q, "offset"), lambda v: v + 1),
    "offset+4": put("<Q", lambda d: tensor_field_at(d, Q, "offset"), lambda v: v + 4),
    "offset+32": put("<Q", lambda d: tensor_field_at(d, Q, "offset"), lambda v: v + 32),
    "offset-32": put("<Q", lambda d: tensor_field_at(d, Q8, "offset"), lambda v: v - 32),
    "offset-huge": put("<Q", lambda d: tensor_field_at(d, Q, "offset"), 1 << 62),
    "offset-embd+4": put("<Q", lambda d: tensor_field_at(d, EMBD, "offset"), lambda v: v + 4),
    "cut-0": cut(header(0)),
    "cut-3": cut(header(3)),
    "cut-8": cut(header(8)),
    "cut-20": cut(header(20)),
    "cut-in-metadata": cut(lambda d: kv_value_at(d, "tokenizer.ggml.tokens") + 100),
    "cut-in-directory": cut(lambda d: tensor_field_at(d, Q, "offset")),
    "cut-at-data": cut(data_start),
    "cut-in-data": cut(lambda d: data_start(d) + 1000),
    "cut-last-byte": cut(lambda d: len(d) - 1),
}

# Mutations that do not move or reshape data: the file may be refused or load as the original.
EITHER: dict[str, Mutation] = {
    "trailing-bytes": lambda d: d + bytes(100),
    "context_length-1": put("<I", lambda d: kv_value_at(d, "llama.context_length"), 1),
    "rms-eps-float-type": put("<I", lambda d: kv_type_at(d, "llama.attention.layer_norm_rms_epsilon"), VT.INT32),
    "bos-id-huge": put("<I", lambda d: kv_value_at(d, "tokenizer.ggml.bos_token_id"), 1 << 31),
    "eos-id-type-string": put("<I", lambda d: kv_type_at(d, "tokenizer.ggml.eos_token_id"), VT.STRING),
    "token-type-count-1": put("<Q", lambda d: kv_value_at(d, "tokenizer.ggml.token_type") + 4, lambda v: v - 1),
}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, torch.Tensor]]:
    path = write_model(tmp_path_factory.mktemp("gguf_validation") / "tiny.gguf")
    return path.read_bytes(), state(load(path))


def outcome(tmp_path: Path, data: bytes) -> tuple[Path, LoadedModel | str]:
    """The loaded model, or the refusal's message (checked to be one line naming the file)."""
    path = tmp_path / "mutated.gguf"
    path.write_bytes(data)
    try:
        return path, load(path)
    except ModelLoadError as err:
        message = str(err)
        assert "\n" not in message and str(path) in message, message
        return path, message


def test_the_original_loads(original: tuple[bytes, dict[str, torch.Tensor]]) -> None:
    data, tensors = original
    assert struct.unpack_from("<Q", data, 8)[0] == 2 + 9 * LAYERS  # embedding, final norm, 9 per block
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values())


@pytest.mark.parametrize("name", list(REFUSED))
def test_mutation_is_refused(name: str, original: tuple[bytes, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    data, _ = original
    mutated = REFUSED[name](data)
    assert mutated != data
    _, result = outcome(tmp_path, mutated)
    assert isinstance(result, str), f"{name}: the corrupt file was loaded"


@pytest.mark.parametrize("name", list(EITHER))
def test_mutation_is_refused_or_harmless(name: str, original: tuple[bytes, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    data, tensors = original
    _, result = outcome(tmp_path, EITHER[name](data))
    if isinstance(result, str):
        return
    got = state(result)
    assert got.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("head_count-0", "llama.attention.head_count"),
        ("context_length-0", "llama.context_length"),
        ("block_count-1000000", "llama.block_count"),
        ("offset+4", Q),
        ("embedding_length-33", "llama.embedding_length"),
    ],
)
def test_refusal_names_the_field(name: str, field: str, original: tuple[bytes, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, result = outcome(tmp_path, REFUSED[name](original[0]))
    assert isinstance(result, str) and field in result and str(path) in result, result


def test_every_cut_is_refused(original: tuple[bytes, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    """Truncation at 64 points spread over the whole file (header, metadata, directory, data)."""
    data, _ = original
    for at in np.linspace(0, len(data) - 1, 64).astype(int).tolist():
        _, result = outcome(tmp_path, data[:at])
        assert isinstance(result, str), f"cut at {at} of {len(data)} loaded"


@pytest.mark.parametrize(
    ("command", "mutation", "field"),
    [
        (["serve", "--port", "0"], "head_count-0", "llama.attention.head_count"),
        (["generate", "hi", "--max-tokens", "1"], "context_length-0", "llama.context_length"),
        (["inspect"], "block_count-1000000", "llama.block_count"),
        (["inspect"], "offset+4", Q),
    ],
)
def test_cli_refuses_a_corrupt_file_in_one_line(
    command: list[str], mutation: str, field: str, original: tuple[bytes, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """`ft serve | generate | inspect` on a corrupt file: exit 1, the last stderr line names the
    file and the field, no traceback (the subprocess timeout is a hang guard)."""
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(REFUSED[mutation](original[0]))
    cmd = [sys.executable, "-m", "freetoken.cli", command[0], "--model", str(path), *command[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr
    assert last.startswith(f"ft {command[0]}: error: {path}") and field in last, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
