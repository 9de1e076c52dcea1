"""The model families' facts stay in their modules (freetoken/families/, docs/architecture.md,
"Adding a model family"): the generic modules that read them name no family, every family the
models know has facts and a model, each family's GGUF facts are ones the weights package can act
on, its tool parser, template and split are ones the tokenizer and the shard plan know, and the
whole package imports without torch (the API process reads it)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import freetoken
from freetoken.families import all_families, by_model_type, find_gguf, gguf_architectures, named
from freetoken.families.base import (
    A_LOG,
    CONV_KERNEL,
    EXPERTS_TRANSPOSE,
    INTERLEAVE,
    LINEAR_A_LOG,
    LINEAR_CONV,
    LINEAR_QKV_ROWS,
    LINEAR_V_COLUMNS,
    LINEAR_V_ROWS,
    LINEAR_V_SCALARS,
    NORM_MINUS_ONE,
    ONE_ROW,
    ROWS,
    SPLIT_EXPERTS,
    SPLIT_WIDTH,
    UNPERMUTE_K_ROWS,
    UNPERMUTE_Q_ROWS,
)

ROOT = Path(freetoken.__file__).parent

# The modules that look a family up instead of knowing it.
GENERIC = (
    "weights/gguf_config.py",
    "weights/gguf.py",
    "weights/names.py",
    "server/preflight.py",
    "models/config.py",
    "models/shard.py",  # the family's `tensor_parallel`
    "tokenizer/chat_template.py",  # its `chat_template`
    "tokenizer/tool_parsers/registry.py",  # its `tool_parser`
)

# Modules that read a GGUF vocabulary, and llama.cpp's names of vocabularies in them that are also a
# family's name: `tokenizer.ggml.model` "llama" (SentencePiece) and "gemma4", `tokenizer.ggml.pre`
# "qwen2". A file of any architecture may carry them; an architecture is looked up (the family's
# `gguf.vocab_by_position`).
VOCABULARY_READERS = ("tokenizer/gguf_vocab.py", "tokenizer/tokenizer.py")
VOCABULARY_NAMES = frozenset({"llama", "gemma4", "qwen2"})


def family_words() -> set[str]:
    """Every name a family goes by: its own, its config.json model_types, its GGUF architecture."""
    return {name for fam in all_families() for name in fam.names}


def family_literals(source: str, words: set[str]) -> list[str]:
    """The string literals of `source` (f-string pieces included, docstrings left out) that name one
    of `words` as a whole word (`qwen3` in "qwen3", not in "qwen3_next"), as `line: text`."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    pattern = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True)) + r")(?![\w-])")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if pattern.search(node.value):
                found.append((node.lineno, node.col_offset, f"{node.lineno}: {node.value!r}"))
    return [text for *_, text in sorted(found)]


@pytest.mark.parametrize("path", GENERIC)
def test_the_generic_modules_name_no_family(path: str) -> None:
    assert family_literals((ROOT / path).read_text(), family_words()) == []


@pytest.mark.parametrize("path", VOCABULARY_READERS)
def test_the_vocabulary_readers_name_no_architecture(path: str) -> None:
    assert family_literals((ROOT / path).read_text(), family_words() - VOCABULARY_NAMES) == []


def test_the_literal_check_finds_a_leak() -> None:
    """Negative control: what the modules held before the families had their own modules."""
    source = '''"""Reads gemma3 files."""
_GGUF_SWA = {"gemma3", "gpt-oss"}
def f(arch):
    """llama's rows."""
    if arch == "llama":
        return f"{arch}.qwen3moe.key"
    return "qwen9_next" if arch else "not a family: llama3"
'''
    assert family_literals(source, family_words()) == [
        "2: 'gemma3'", "2: 'gpt-oss'", "5: 'llama'", "6: '.qwen3moe.key'"
    ]
    # what gguf_vocab.py held before `vocab_by_position`: an architecture is found beside a vocabulary name
    vocab = '''_POSITION_RANKED = frozenset({"gemma", "gemma3"})
if kind == "llama":
    pass
'''
    assert family_literals(vocab, family_words() - VOCABULARY_NAMES) == ["1: 'gemma3'"]


def test_every_family_has_a_model_and_every_model_a_family() -> None:
    from freetoken.models.config import ARCHITECTURES
    from freetoken.models.registry import CONFIG_READERS, MODELS

    names = [f.name for f in all_families()]
    assert sorted(MODELS) == sorted(names) == sorted(ARCHITECTURES)
    assert sorted(CONFIG_READERS) == sorted(t for f in all_families() for t in f.model_types)
    assert {by_model_type(t).name for t in CONFIG_READERS} == set(names)  # type: ignore[union-attr]


def test_every_name_finds_its_family() -> None:
    for fam in all_families():
        assert fam.names[0] == fam.name and set(fam.model_types) <= set(fam.names)
        for name in fam.names:
            assert named(name) is fam
    assert named("mamba") is None


def test_each_family_names_only_what_the_tokenizer_and_the_shard_plan_know() -> None:
    """A family's tool parser is one `--tool-call-parser` takes, its built-in chat template
    compiles, and its split is one `models/shard.py` does (or None: no plan)."""
    from freetoken.tokenizer.chat_template import ChatTemplate, builtin_chat_template
    from freetoken.tokenizer.tool_parsers import TOOL_PARSERS, detect_tool_parser

    for fam in all_families():
        assert fam.tensor_parallel in (SPLIT_WIDTH, SPLIT_EXPERTS, None), fam.name
        assert fam.tool_parser is None or fam.tool_parser in TOOL_PARSERS, fam.name
        if fam.chat_template is not None:
            ChatTemplate(fam.chat_template)
        for name in fam.names:
            assert builtin_chat_template(name) == fam.chat_template
            chosen = detect_tool_parser(chat_template=None, special_tokens=[], architecture=name)
            assert chosen == (fam.tool_parser or "hermes"), (fam.name, name)


def test_the_gguf_architectures_are_the_families() -> None:
    assert sorted(gguf_architectures()) == ["gemma3", "gemma4", "glm4moe", "gpt-oss", "llama", "qwen2", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next"]
    for arch in gguf_architectures():
        assert find_gguf(arch) is not None and find_gguf(arch).arch == arch  # type: ignore[union-attr]
    assert find_gguf("mamba") is None


def test_each_family_names_only_what_the_weights_package_does() -> None:
    layouts = {None, UNPERMUTE_Q_ROWS, UNPERMUTE_K_ROWS, NORM_MINUS_ONE, EXPERTS_TRANSPOSE, ONE_ROW}
    layouts |= {LINEAR_QKV_ROWS, LINEAR_CONV, LINEAR_V_ROWS, LINEAR_V_SCALARS, LINEAR_A_LOG, LINEAR_V_COLUMNS}
    layouts |= {A_LOG, CONV_KERNEL}
    for fam in all_families():
        if fam.gguf is None:
            continue
        g = fam.gguf
        assert g.experts_join in (ROWS, INTERLEAVE), fam.name
        # a name after `blk.N.`: a weight, bias or scale, or a bare parameter (Qwen3.5's `ssm_a`)
        assert all(not rest.startswith("blk.") and (rest.endswith((".weight", ".bias", ".scale")) or "." not in rest)
                   for rest in g.tensors)
        for rest in [*g.tensors, "output_norm.weight", "token_embd.weight"]:
            assert g.layout(rest) in layouts, (fam.name, rest)


def borrowed_helpers(source: str, families: set[str]) -> list[str]:
    """What `source` (a family's model file) imports from another family's model file other than
    a class it builds on or a constant (a name that begins with a capital): a function, as
    `line: module.name`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            module = node.module.removeprefix("freetoken.models.")
            if module in families:
                found += [f"{node.lineno}: {module}.{a.name}" for a in node.names if not a.name[:1].isupper()]
    return found


def test_a_family_model_borrows_no_function_from_another() -> None:
    """Shared model code lives in models/layers.py or models/experts.py, not in the first family
    that needed it: a family's model file takes only classes (and constants) from another's."""
    names = {f.name for f in all_families()}
    models = [path for path in sorted((ROOT / "models").glob("*.py")) if path.stem in names]
    assert len(models) >= 8  # a family may share another's file (Qwen3.5-MoE is in qwen3_5.py)
    for path in models:
        assert borrowed_helpers(path.read_text(), names) == [], path.name
    # negative control: glm4_moe.py before rotate_partial_ moved to layers.py
    source = "from freetoken.models.llama import LlamaBlock\nfrom freetoken.models.qwen3_5 import rotate_partial_\n"
    assert borrowed_helpers(source, names) == ["2: qwen3_5.rotate_partial_"]


def test_the_package_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from freetoken.families import all_families\n"
        "import freetoken.weights.gguf_config, freetoken.server.preflight\n"
        "assert len(all_families()) >= 8\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
