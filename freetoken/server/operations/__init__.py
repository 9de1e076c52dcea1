"""What operators and routers ask of a running server, beside the wire protocols.

`drain` (graceful shutdown: the admission gate and the drain sequence), `metrics` with
`metrics_experts` and `metrics_speculative` (the Prometheus families, vLLM aliases included),
`admin_cache` (what `POST /admin/cache/resize` does) and `worker_info` (the answers to the probes
sglang-router and vllm-router send: `/server_info`, `/get_load`, `/health_generate`, ...); their
routes are `server.admin`'s. docs/operations.md and docs/scale-out.md describe them. Nothing here imports the generation core (beyond its error type)
or a protocol package.
"""
