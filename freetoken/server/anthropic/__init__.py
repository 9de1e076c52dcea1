"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`), over the generation core.

`protocol` holds the request schemas and the conversion of content blocks into chat-template
messages, `messages` the two routes' work (the request as the core recipe's input, the `message`
body and Anthropic's event stream), `tool_blocks` tools and parsed output in Anthropic's shapes
(`tool_use`, `thinking`, `input_json_delta`), `errors` Anthropic's error bodies, `event: error`
and the dialect, `threads` the SDK tool runner's `thread` store, `pins` the `cache_control`
breakpoints as retention-pin marks, and `routes` the package's `APIRouter`. Conversations go
through the core's recipe, the same as chat completions, without importing that route: nothing
here imports `server.openai` or `server.responses` (tests/unit/test_layers.py).
"""
