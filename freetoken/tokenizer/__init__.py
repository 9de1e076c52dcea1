"""Tokenization: `Tokenizer` (from GGUF metadata or tokenizer.json), chat templates and the
incremental detokenizer. Re-exports the public names; owns no logic."""

from freetoken.tokenizer.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate
from freetoken.tokenizer.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from freetoken.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "DetokenizerDelta",
    "IncrementalDetokenizer",
    "NoChatTemplate",
    "Tokenizer",
]
