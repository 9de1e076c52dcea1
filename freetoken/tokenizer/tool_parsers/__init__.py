"""Tool-call formats: one module per model family, a registry, and the shared result shapes.
Re-exports the public names; owns no logic. Imports nothing from the server or the engine."""

from freetoken.tokenizer.tool_parsers.base import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_call_id,
)
from freetoken.tokenizer.tool_parsers.registry import TOOL_PARSERS, detect_tool_parser, make_tool_parser

__all__ = [
    "TOOL_PARSERS",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "detect_tool_parser",
    "make_tool_parser",
    "new_call_id",
]
