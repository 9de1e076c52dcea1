"""The OpenAI Responses API (`/v1/responses`), over the generation core.

`protocol` holds the request schema, `items` the input items -> chat messages (and stored output
back), `tools` function / hosted tools and `text.format`, `prompt` the rendered prompt with an
earlier turn's exact tokens spliced in (`previous_response_id`), `output` the `output` items and
their events, `stream` the event stream, `reasoning` the `encrypted_content` token, `store` the
bounded response store, `create` the request as the core recipe's input and its answer, and
`routes` the package's `APIRouter` with the stored responses' reads. It shares the core with
the chat route, not the chat route itself: nothing here imports `server.openai` or
`server.anthropic` (tests/unit/test_layers.py).
"""
