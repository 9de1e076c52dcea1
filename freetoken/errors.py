"""The project's user-facing error types.

Owns the exception classes that carry a one-line message meant for a person (the CLI prints
`str(err)` and exits non-zero, the server maps them to HTTP errors). Internal invariant
violations of the KV core have their own type, `freetoken.kv.errors.KVIntegrityError`.
"""


class FreeTokenError(Exception):
    """Base of the errors whose message is shown to the user as is."""


class ModelLoadError(FreeTokenError):
    """A model cannot be loaded: missing or corrupt file, unsupported architecture or quant type,
    a safetensors directory without config.json or tokenizer."""


class ConfigError(FreeTokenError):
    """A configuration that cannot work (flags out of range, a pool below its floor, ...)."""
