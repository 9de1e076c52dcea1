"""The shared generation core: the one request recipe every wire protocol uses, in no protocol's shape.

A generation route is `endpoint.run_endpoint` (drain gate, body, model name, --request-timeout,
disconnects, errors in the route's `Dialect`) around a handler that translates its request into
a `recipe.ChatInput` (or `PromptInput`), then `recipe.prepare_chat` (engine facts, tool handling
and rendering, context check, final sampling parameters, admission, pins), `run.start` (the
choices as merged text pieces), and `Run.collect` or `Run.events` with the protocol's `Framing`
(`streaming`), the bodies being the protocol's. Below them: rendering through the chat template
(`chat_prompt`, fitted by `system_messages` and `tool_messages`), the length checks (`limits`),
one engine choice as text pieces (`generation`: incremental detokenization, stop strings,
abort), tool-call and reasoning handling and forced-call grammars (`tool_calling`),
`response_format` -> grammar (`response_format`, `grammar_check`), token logprob items
(`logprobs`), retention pins at message boundaries (`pins`) and the server's error type
(`errors`). The protocol sub-packages (`openai`, `responses`, `anthropic`) translate their wire
shapes to and from these; nothing here imports one of them (tests/unit/test_layers.py).
"""
