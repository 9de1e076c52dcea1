"""`ft serve`: the HTTP API process, the engine process, and the supervisor between them.

The package in layers, bottom to top (docs/architecture.md, "The server package"):

- `process/`: the engine process (`worker`), its start / watch / restart (`supervisor`), the API
  process's `EngineClient` (`client`) and the messages between them. It imports only itself.
- `settings`, `errors` (`APIError`: every failure as an OpenAI error body), `context`
  (`ServingContext`: what every route gets), `preflight`, `middleware`, `request_body`,
  `request_hygiene` (request ids, `--request-timeout`, disconnects), and `operations/`' drain and
  metrics: the server's plumbing, shared by all routes.
- `core/`: the generation core every wire protocol uses: chat rendering, context checks, engine
  generation as text pieces, streams and usage, tool-call and reasoning parsing.
- `openai/` (chat completions, completions), `responses/` (OpenAI Responses), `anthropic/`
  (Messages): one thin package per wire protocol, translating its shapes to and from the core;
  beside them the admin and router-probe routes (`operations/admin_cache`,
  `operations/worker_info`). None of these imports another, and the core imports none of them.
- `app` (the FastAPI app: the only module that imports every protocol package) and `serve` (the
  `ft serve` process: settings -> preflight -> engine client -> app -> uvicorn).

tests/unit/test_layers.py checks these import rules.
"""
