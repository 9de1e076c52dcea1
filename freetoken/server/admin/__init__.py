"""The routes operators and routers call, beside the wire protocols.

`routes` (`/health`, `/v1/cache/status`, `/metrics`, `POST /admin/drain`, `POST
/admin/cache/resize`), `probes` (what sglang-router and vllm-router ask of a worker:
`/server_info`, `/model_info`, `/get_load`, `/health_generate`, ...) and `status` (the engine's
status document both read). The work behind them is the plumbing's (`operations/`); these
modules only route to it. Nothing here imports a protocol package.
"""
