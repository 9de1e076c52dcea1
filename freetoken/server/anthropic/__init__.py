"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`), over the generation core.

`protocol` holds the request schemas and the conversion of content blocks into chat-template
messages, `messages` the routes (the `message` body and Anthropic's event stream), `tool_blocks`
tools and parsed output in Anthropic's shapes (`tool_use`, `thinking`, `input_json_delta`),
`errors` Anthropic's error bodies and `event: error`, `threads` the SDK tool runner's `thread`
store, and `pins` the `cache_control` breakpoints as retention pins. Conversations are rendered
by the core's `render_chat`, the same as chat completions, without importing that route: nothing
here imports `server.openai` or `server.responses` (tests/unit/test_layers.py).
"""
