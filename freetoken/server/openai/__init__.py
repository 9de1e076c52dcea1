"""The OpenAI wire protocol's chat completions and completions routes, over the generation core.

`protocol` holds the request schemas (pydantic) and their range checks, `chat` and
`completions` the two generation routes (translation into the core's recipe, and the bodies and
chunks), `tool_shapes` chat's `message` / `delta` / `finish_reason` of parsed tool calls and
reasoning, `pins` `prompt_cache_key`, `render` / `tokenize` vLLM's render routes and
`/v1/tokenize` / `/v1/detokenize` (they take these same request shapes), and `routes` the
package's `APIRouter` (with `/v1/models`). The Responses API is its own package (`server.responses`): it shares the core,
not this package. Nothing here imports another protocol package (tests/unit/test_layers.py).
"""
