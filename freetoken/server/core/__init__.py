"""The shared generation core: what every wire protocol uses, in no protocol's shape.

Rendering a conversation through the chat template (`chat_prompt`, fitted by `system_messages`
and `tool_messages`), the context checks (`limits`), the engine generation of one choice as
text pieces (`generation`: incremental detokenization, stop strings, abort), the SSE stream and
usage accounting (`streaming`), tool-call and reasoning parsing and forced-call grammars
(`tool_calling`), `response_format` -> grammar, token logprob items (`logprobs`) and retention
pins at message boundaries (`pins`); the error type it raises is the plumbing's
(`server/errors.py`). The protocol sub-packages (`openai`, `responses`, `anthropic`) translate
their wire shapes to and from these; nothing here imports one of them (tests/unit/test_layers.py
checks it).
"""
