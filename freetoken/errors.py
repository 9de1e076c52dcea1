"""The project's user-facing error types and process exit codes.

Owns the exception classes that carry a one-line message meant for a person (the CLI prints
`str(err)` and exits non-zero, the server maps them to HTTP errors), and the exit statuses of an
engine process (`server/process/worker.py` returns them, the supervisor reads them to decide
whether a restart can help, a tensor-parallel rank passes them on to rank 0). They live here, at
the bottom of the layers, so that every layer that starts, runs or watches a process reads them
from one place without importing the others. Internal invariant violations of the KV core have
their own type, `freetoken.kv.errors.KVIntegrityError`. This module imports nothing.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # a fatal error while serving: a restart may help
EXIT_STARTUP = 3  # the model or the configuration cannot work: a restart will not help


class FreeTokenError(Exception):
    """Base of the errors whose message is shown to the user as is."""


class ModelLoadError(FreeTokenError):
    """A model cannot be loaded: missing or corrupt file, unsupported architecture or quant type,
    a safetensors directory without config.json or tokenizer."""


class ConfigError(FreeTokenError):
    """A configuration that cannot work (flags out of range, a pool below its floor, ...)."""
