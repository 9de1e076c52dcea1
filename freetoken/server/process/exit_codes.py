"""Exit codes of the engine process: what `worker.run_worker` returns and what the supervisor
reads to decide whether a restart can help. A module of their own so that neither side imports
the other for them (the supervisor starts the worker; the worker does not know the supervisor)."""

EXIT_OK = 0
EXIT_FAILED = 1  # a fatal error while serving: a restart may help
EXIT_STARTUP = 3  # the model or the configuration cannot work: a restart will not help
