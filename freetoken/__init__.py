"""FreeToken: an LLM serving engine."""
__version__ = "0.1.0"
