"""FreeToken: an LLM serving engine whose KV memory accounting is correct by construction.

`from freetoken import LLM, SamplingParams` is the offline API; `ft` is the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from freetoken.llm import LLM
    from freetoken.request import SamplingParams


def __getattr__(name: str) -> object:
    # Lazy, so that `ft --version` and the API process do not import torch.
    if name == "LLM":
        from freetoken.llm import LLM

        return LLM
    if name == "SamplingParams":
        from freetoken.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
