"""Constrained decoding: a grammar per request, enforced on the logits with llguidance.

Owns turning `SamplingParams.grammar` — `(kind, text)`, kinds in `freetoken.request.GRAMMAR_KINDS`
— into an llguidance matcher (`GrammarCompiler`, which compiles each distinct grammar once and
hands every request its own copy), and the per-request matchers of one engine (`GrammarSet`):
before sampling it masks the logits of the constrained rows to the tokens the grammar allows
(batched, on the logits' device), after sampling it advances each matcher by the chosen token and
says when the grammar is complete. It never samples, schedules or touches KV memory.

Semantics the engine relies on:

- A matcher follows a request's `output_ids` exactly: one `advance` per sampled token. Output
  ids survive preemption (only K/V is recomputed), so the matcher needs no rollback there.
- EOS (any of the tokenizer's stop ids) is allowed only where the grammar accepts; once the
  grammar is complete (`advance` returns True) the engine finishes the request as "stop",
  without waiting for an EOS token.
- Ids past the tokenizer's vocabulary (a padded embedding) are never allowed.
- JSON schemas compile with compact separators (`", "`, `": "`) and no free whitespace, so a weak
  model cannot spend its tokens on blank space; a schema's own `x-guidance` options override that.

For tool calling (`tool_choice: "required"` or a named function), force the model's tool-call
format with a Lark grammar whose body is a JSON schema, sent as `grammar=("lark", text)`. For
Hermes-style markers, with `NAME` the function and `PARAMS` its parameters schema:

    start: "<tool_call>\n" call "\n</tool_call>"
    call: %json {"type": "object", "properties": {"name": {"const": NAME}, "arguments": PARAMS},
                 "required": ["name", "arguments"], "additionalProperties": false}

(several tools: `"anyOf"` of one such object per tool). A marker that is one special token of the
vocabulary is written bare, `<|im_start|>`, or by id, `<[1]>`; a quoted string matches text only.
`freetoken.tokenizer.tool_parsers.grammar.forced_call_grammar` builds exactly this.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from freetoken.errors import FreeTokenError
from freetoken.grammar_text import grammar_text
from freetoken.request import GRAMMAR_KINDS
from freetoken.tokenizer import Tokenizer

CACHE_SIZE = 64  # distinct compiled grammars kept per engine
_BITS = 32  # tokens per bitmask word


class GrammarError(FreeTokenError):
    """A grammar that does not compile, or a matcher that rejected a token."""


def llg_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (GGUF-derived or tokenizer.json: both are a HF
    `tokenizers.Tokenizer`), with every stop id as an end-of-sequence token. Costs ~1 s per
    100k vocabulary entries."""
    eos = sorted(tokenizer.stop_ids) or None
    try:
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    except Exception as err:  # the Rust side raises plain exceptions
        raise GrammarError(f"llguidance cannot use this model's tokenizer ({err})") from None


def grammar_definition(kind: str, text: str) -> str:
    """llguidance's grammar text for `(kind, text)`; GrammarError on an unknown kind or bad JSON."""
    try:
        return grammar_text(kind, text)
    except ValueError as err:
        raise GrammarError(f"the {kind} grammar is not valid: {err}") from None
    except KeyError:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer. The tokenizer (given, or made by a callable: the
    engine's is built only when a grammar first needs it) and the llguidance tokenizer are built
    on first use (a large vocabulary takes seconds), and compiled grammars are kept by
    `(kind, text)`, least recently used dropped first."""

    def __init__(self, tokenizer: Tokenizer | Callable[[], Tokenizer], cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.cache_size = cache_size
        self._llg: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.compilations = 0  # grammars compiled (cache misses), for tests and status

    @property
    def tokenizer(self) -> Tokenizer:
        if not isinstance(self._tokenizer, Tokenizer):
            self._tokenizer = self._tokenizer()
        return self._tokenizer

    @property
    def llg(self) -> llguidance.LLTokenizer:
        if self._llg is None:
            self._llg = llg_tokenizer(self.tokenizer)
        return self._llg

    @property
    def vocab_size(self) -> int:
        """Ids the grammar knows; the model's vocabulary may be larger (padding) or smaller."""
        return int(self.llg.vocab_size)

    def matcher(self, grammar: tuple[str, str]) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar`; GrammarError if it does not compile."""
        key = (grammar[0], grammar[1] if grammar[0] != "json_object" else "")
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(*key)
            self._compiled[key] = template
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        definition = grammar_definition(kind, text)
        error = llguidance.LLMatcher.validate_grammar(definition, self.llg)
        if error:
            raise GrammarError(f"the {kind} grammar does not compile: {error.strip()}")
        matcher = llguidance.LLMatcher(self.llg, definition, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {kind} grammar does not compile: {matcher.get_error().strip()}")
        self.compilations += 1
        return matcher


class GrammarSet:
    """The matchers of one engine's constrained requests, by request id."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None

    def __contains__(self, rid: str) -> bool:
        return rid in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def start(self, rid: str, grammar: tuple[str, str]) -> None:
        """Give `rid` a matcher at the start of `grammar`; GrammarError if it does not compile
        (or this engine has no tokenizer to compile with)."""
        if self.compiler is None:
            raise GrammarError("this engine was built without a tokenizer, so it cannot enforce grammars")
        self._matchers[rid] = self.compiler.matcher(grammar)

    def drop(self, rid: str) -> None:
        self._matchers.pop(rid, None)

    def mask(self, logits: torch.Tensor, rids: Sequence[str]) -> list[int]:
        """Set to -inf, in place, every logit a row's grammar does not allow next; `logits[i]`
        belongs to `rids[i]` and rows of unconstrained requests are left alone. Returns the rows
        that cannot go on: a matcher in an error state, or a grammar that allows no token."""
        # logits: [N, V]
        rows = [(i, self._matchers[rid]) for i, rid in enumerate(rids) if rid in self._matchers]
        if not rows or self.compiler is None:  # a matcher exists only when a compiler made it
            return []
        tok_vocab = self.compiler.vocab_size
        words = (tok_vocab + _BITS - 1) // _BITS
        bitmask = np.zeros((len(rows), words), dtype=np.int32)  # [R, W]: bit b of word w = id 32w + b
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(m, j) for j, (_, m) in enumerate(rows)], bitmask)
        allowed = unpack_bitmask(torch.from_numpy(bitmask).to(logits.device), logits.shape[1])  # [R, V]
        index = torch.tensor([i for i, _ in rows], dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        dead = set((~allowed.any(dim=1)).nonzero().flatten().tolist())
        dead |= {j for j, (_, m) in enumerate(rows) if m.is_error()}  # an errored matcher still offers EOS
        return sorted(rows[j][0] for j in dead)

    def advance(self, rid: str, token_id: int) -> bool:
        """Feed `rid`'s sampled token to its matcher (a no-op for unconstrained requests). True
        when the grammar is now complete; GrammarError if the matcher rejected the token."""
        matcher = self._matchers.get(rid)
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            raise GrammarError(f"the grammar rejected token {token_id}: {matcher.get_error().strip()}")
        return bool(matcher.is_stopped())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Booleans [R, vocab_size] from int32 words [R, W] (bit b of word w is id 32w + b); ids past
    32W — a model vocabulary padded beyond the tokenizer's — are False."""
    # bitmask: [R, W] int32
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool()  # [R, W, 32]
    flat = bits.reshape(bitmask.shape[0], -1)  # [R, 32W]
    if flat.shape[1] >= vocab_size:
        return flat[:, :vocab_size].contiguous()
    pad = torch.zeros(bitmask.shape[0], vocab_size - flat.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([flat, pad], dim=1)
