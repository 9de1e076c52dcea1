"""What operators and routers ask of a running server, beside the wire protocols.

`drain` (graceful shutdown: the admission gate and the drain sequence), `metrics` with
`metrics_experts` and `metrics_speculative` (the Prometheus families, vLLM aliases included),
`admin_cache` (`POST /admin/cache/resize`) and `worker_info` (the probes sglang-router and
vllm-router send: `/server_info`, `/get_load`, `/health_generate`, ...). docs/operations.md and
docs/scale-out.md describe them. Drain and the metrics are plumbing (the context holds them); the
two route modules sit beside the protocol packages. Nothing here imports the generation core or a
protocol package.
"""
