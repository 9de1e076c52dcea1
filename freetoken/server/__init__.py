"""`ft serve`: the HTTP API process, the engine process, and the supervisor between them.

The package in layers, bottom to top (docs/architecture.md, "The server package"):

- `process/`: the engine process (`worker`), its start / watch / restart (`supervisor`), the API
  process's `EngineClient` (`client`) and the messages between them. It imports only itself (its
  exit statuses are `freetoken.errors`').
- `settings`, `errors` (`APIError`: every failure as an OpenAI error body), `context` (`ServingContext`: what every route gets), `preflight`, `middleware`,
  `request_body`, `request_hygiene` (request ids, `--request-timeout`, disconnects), and
  `operations/` (drain, metrics, the cache resize and the router probes' answers): the server's
  plumbing, shared by all routes.
- `core/`: the one request recipe every wire protocol uses: the generation endpoint's HTTP life,
  a protocol-neutral request prepared (rendering, limits, sampling, tool and reasoning handling,
  admission, pins), run as text pieces, collected or streamed, with usage.
- `openai/` (chat completions, completions), `responses/` (OpenAI Responses), `anthropic/`
  (Messages): one thin package per wire protocol, translating its shapes to and from the core,
  with its own `APIRouter`; and `admin/`, the operator and router-probe routes' router. No
  protocol package imports another, and the core imports none of them.
- `app` (the FastAPI app: middleware + `include_router`; the only module that imports every
  protocol package) and `serve` (the `ft serve` process: settings -> preflight -> engine client
  -> app -> uvicorn).

tests/unit/test_layers.py checks these import rules.
"""
