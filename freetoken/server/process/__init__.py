"""The engine process and the API process's one way to it.

`worker` is the engine process's main (scheduler + model, token ids only), `supervisor` starts
it (`spawn`), watches its sentinel and restarts it, `client` (`EngineClient`) is what the API
process calls, `messages` the typed msgpack messages between the two over ZMQ, `heartbeat` the
engine's liveness beat and the API side's hang watch (the exit statuses the worker returns and
the supervisor reads are `freetoken.errors`'). This package knows nothing of HTTP, of the
generation core or of any wire protocol: it imports only itself (and the engine, in the worker),
so the engine side of the server can be read on its own (docs/architecture.md, "Processes").
"""
