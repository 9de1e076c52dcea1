"""Recorded model outputs for the tool-parser tests, per format: (text, expected content,
expected reasoning, expected calls as (name, arguments dict)). Malformed ones expect the text back."""

from __future__ import annotations

from typing import Any

Case = tuple[str, str, str, list[tuple[str, dict[str, Any]]]]
TOOLS = ["get_weather", "search"]

HERMES: list[Case] = [
    # Qwen 2.5 style: a call and nothing else
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>', "", "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # text before, two parallel calls
    ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search", "arguments": {"q": "Paris events"}}\n</tool_call>', "Let me check both.", "",
     [("get_weather", {"city": "Paris"}), ("search", {"q": "Paris events"})]),
    # arguments double-encoded as a JSON string (seen from small models)
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"tea\\"}"}</tool_call>', "", "", [("search", {"q": "tea"})]),
    # no call
    ("The weather in Paris is mild today.", "The weather in Paris is mild today.", "", []),
    # text that only looks like the start of a marker
    ("Use <tool> tags or a < b.", "Use <tool> tags or a < b.", "", []),
]
HERMES_MALFORMED: list[str] = [
    '<tool_call>\n{"name": "get_weather", "arguments" {"city": "Paris"}}\n</tool_call>',  # broken JSON before the arguments
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object (a string)
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # unknown tool
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "search", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    "<tool_call></tool_call>",
]

# Hermes calls whose head (the tool's name, then the arguments object) was written: announced and
# streamed, they stay calls when what follows breaks (arguments as written).
HERMES_ANNOUNCED: list[tuple[str, str]] = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>', '{"city": "Paris"\n'),  # closed early
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"city": "Paris"}'),  # never closed
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),  # cut off
    ('<tool_call>{"name": "search", "arguments": {"q": "a</tool_call>b"}}</tool_call>', '{"q": "a</tool_call>b"}'),  # marker in a string
]

GEMMA: list[Case] = [
    ('```tool_call\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```', "", "",
     [("get_weather", {"city": "Oslo"})]),
    ('I will look that up.\n\n```json\n{"name": "search", "parameters": {"q": "fjords"}}\n```\n', "I will look that up.", "",
     [("search", {"q": "fjords"})]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', "", "", [("get_weather", {"city": "Rome"})]),
    ('```tool_call\n[{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "search", "arguments": {"q": "B"}}]\n```',
     "", "", [("get_weather", {"city": "A"}), ("search", {"q": "B"})]),
    ("Rome is sunny.", "Rome is sunny.", "", []),
    ('Here is JSON:\n```json\n{"a": 1}\n```', 'Here is JSON:\n```json\n{"a": 1}\n```', "", []),  # JSON, not a call
]
GEMMA_MALFORMED: list[str] = [
    '```tool_call\n{"name": "get_weather", "parameters" {"city": }\n```',  # broken JSON before the arguments
    '```tool_call\n{"parameters": {"city": "Oslo"}, "name": "get_weather"',  # arguments before the name, never closed
    '{"name": "unknown_tool", "parameters": {}}',
    '```json\n{"name": "get_weather", "parameters": "Oslo"}\n```',  # arguments not an object
]

# Gemma 4: `<|tool_call>call:NAME{...}<tool_call|>`, values as its template's format_argument writes them
Q = '<|"|>'
GEMMA4: list[Case] = [
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}celsius{Q}}}<tool_call|>", "", "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # text before, two parallel calls, then the hand-over to the tool's response
    (f"Let me check both.\n<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
     f"<|tool_call>call:search{{q:{Q}Paris events{Q}}}<tool_call|><|tool_response>", "Let me check both.", "",
     [("get_weather", {"city": "Paris"}), ("search", {"q": "Paris events"})]),
    # nested mapping and list, a string holding quotes, a backslash and a newline (written literally)
    (f"<|tool_call>call:search{{filters:{{max:10,open:true,tags:[{Q}a{Q},{Q}b c{Q}]}},q:{Q}say \"hi\" \\ now\n{Q}}}<tool_call|>",
     "", "", [("search", {"filters": {"max": 10, "open": True, "tags": ["a", "b c"]}, "q": 'say "hi" \\ now\n'})]),
    # JSON written inside the block (keys and strings double-quoted)
    ('<|tool_call>call:get_weather{"city": "Oslo", "days": [1, 2]}<tool_call|>', "", "", [("get_weather", {"city": "Oslo", "days": [1, 2]})]),
    # bare words: a number, None, and a word that is no JSON literal (a string)
    ("<|tool_call>call:search{q:tea,n:-2.5,page:None}<tool_call|>", "", "", [("search", {"q": "tea", "n": -2.5, "page": None})]),
    ("<|tool_call>call:search{}<tool_call|>", "", "", [("search", {})]),
    ("The weather in Paris is mild today.", "The weather in Paris is mild today.", "", []),
    # text that only looks like the start of a marker
    ("Use <|tool> tags or a < b <|x.", "Use <|tool> tags or a < b <|x.", "", []),
]
GEMMA4_MALFORMED: list[str] = [
    "<|tool_call>call:launch_rockets{now:true}<tool_call|>",  # unknown tool
    f"<|tool_call>get_weather{{city:{Q}Paris{Q}}}<tool_call|>",  # no call: prefix
    '<|tool_call>call:get_weather(city="Paris")<tool_call|>',  # no arguments object
    "<|tool_call>call:",  # cut off before the name
    "<|tool_call><tool_call|>",
]
# Gemma 4 calls whose head was written: announced and streamed, they stay calls whatever follows.
GEMMA4_ANNOUNCED: list[tuple[str, str]] = [
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},<tool_call|>", '{"city":"Paris",'),  # closed early
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}", '{"city":"Paris"}'),  # never closed
    (f"<|tool_call>call:get_weather{{city:{Q}Pa", '{"city":"Pa'),  # cut off
    (f"<|tool_call>call:search{{q:{Q}a<tool_call|>b{Q}}}<tool_call|>", '{"q":"a<tool_call|>b"}'),  # marker in a string
]

LLAMA3: list[Case] = [
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', "", "", [("get_weather", {"city": "Lima"})]),
    ('<|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}', "", "", [("search", {"q": "llamas"})]),
    ('{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "search", "parameters": {"q": "B"}}', "", "",
     [("get_weather", {"city": "A"}), ("search", {"q": "B"})]),
    ('  \n{"name": "search", "arguments": {"q": "x"}}', "", "", [("search", {"q": "x"})]),
    ("Lima is in Peru.", "Lima is in Peru.", "", []),
    ('Checking.<|python_tag|>{"name": "search", "parameters": {"q": "z"}}', "Checking.", "", [("search", {"q": "z"})]),
]
LLAMA3_MALFORMED: list[str] = [
    '{"name": "get_weather", "parameters": ["Lima"]}',
    '{"name": "nuke", "parameters": {}}',
    '<|python_tag|>{"name": "search"; "parameters": 1}',
    "[1, 2, 3]",
]

# Gemma and Llama 3 calls whose head (a known tool's name, then the arguments object) was written
# are announced and streamed like Hermes ones: they stay calls when what follows breaks, and text
# after a bare call object is content again. (parser, output, content, [(name, arguments)]).
ANNOUNCED_JSON: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("gemma", '```tool_call\n{"name": "get_weather", "parameters": {"city": }\n```', "", [("get_weather", '{"city": }')]),
    ("gemma", '```tool_call\n{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ("gemma", '{"name": "get_weather", "parameters": {"city": "Rome"}} and then some text', "and then some text",
     [("get_weather", '{"city": "Rome"}')]),
    ("gemma", '```json\n{"name": "search", "arguments": {"q": "a```b"}}\n```', "", [("search", '{"q": "a```b"}')]),  # marker in a string
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}', "", [("get_weather", '{"city": "Lima"}')]),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "ll', "", [("search", '{"q": "ll')]),  # cut off
    ("llama3_json", '{"name": "search", "parameters": {"q": "a"}}, {"name": "get_weather", "parameters": {}}', "",
     [("search", '{"q": "a"}'), ("get_weather", "{}")]),
]

HARMONY: list[Case] = [
    ("<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"San Francisco"}<|call|>',
     "", "User wants weather. Call the tool.", [("get_weather", {"city": "San Francisco"})]),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 20 C.<|return|>",
     "It is 20 C.", "Easy.", []),
    # recipient in the header before the channel, call token cut by the server (stop token)
    ('<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"q": "oss"}', "", "", [("search", {"q": "oss"})]),
    ("<|channel|>final<|message|>Hi there", "Hi there", "", []),
    ("no harmony at all", "no harmony at all", "", []),
    # commentary preamble then a call
    ("<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant<|channel|>commentary to=functions.search"
     ' <|constrain|>json<|message|>{}<|call|>', "Checking now.", "", [("search", {})]),
]
# A Harmony call of a known tool is announced with its header: it stays a call, arguments as written.
HARMONY_ANNOUNCED: list[tuple[str, str]] = [
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"<|call|>', '{"city": "SF"'),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "S', '{"city": "S'),  # cut off
    ('<|channel|>commentary to=functions.search <|constrain|>json<|message|> \n<|call|>', "{}"),  # no arguments
]
HARMONY_MALFORMED: list[str] = [
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message', # a header that never ends
    '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>',
    '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q": 1}<|call|>',
]

# Qwen3-Coder / Qwen3.5: `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>`
# (as their chat templates write calls). Without the tools' schemas every value is a string.
QWEN3_CODER: list[Case] = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "", "",
     [("get_weather", {"city": "Paris"})]),
    # text before, two calls, a value over several lines
    ("Let me check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=search>\n<parameter=q>\nline one\n\nline two\n</parameter>\n</function>\n</tool_call>",
     "Let me check both.", "", [("get_weather", {"city": "Paris"}), ("search", {"q": "line one\n\nline two"})]),
    # the function without the <tool_call> around it (models drop it)
    ("<function=search>\n<parameter=q>\ntea\n</parameter>\n</function>", "", "", [("search", {"q": "tea"})]),
    ("<tool_call>\n<function=search>\n</function>\n</tool_call>", "", "", [("search", {})]),
    # a parameter left open: the next one (or the function's end) ends it
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=unit>\nc\n</function>\n</tool_call>", "", "",
     [("get_weather", {"city": "Rome", "unit": "c"})]),
    # markup and quotes inside a value are text
    ('<tool_call>\n<function=search>\n<parameter=q>\na < b, <b>"bold"</b> \\ done\n</parameter>\n</function>\n</tool_call>',
     "", "", [("search", {"q": 'a < b, <b>"bold"</b> \\ done'})]),
    ("Use <tool> or <function> tags.", "Use <tool> or <function> tags.", "", []),
]
QWEN3_CODER_MALFORMED: list[str] = [
    "<tool_call>\n<function=launch_rockets>\n<parameter=when>\nnow\n</parameter>\n</function>\n</tool_call>",  # unknown tool
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # Hermes JSON, not this format
    "<function=get weather>\n</function>",  # no valid name
    "<tool_call>\n<function=",  # cut off before the name
]

# GLM-4.5+: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>` (its template's form).
GLM45: list[Case] = [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "", "",
     [("get_weather", {"city": "Paris"})]),
    ("Let me check both.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
     "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>Paris\nevents</arg_value>\n</tool_call>", "Let me check both.", "",
     [("get_weather", {"city": "Paris"}), ("search", {"q": "Paris\nevents"})]),
    # spaces instead of newlines between the tags (seen from quantized GLM-4.5-Air)
    ("<tool_call>search <arg_key>q</arg_key> <arg_value>a b</arg_value> </tool_call>", "", "", [("search", {"q": "a b"})]),
    ("<tool_call>search\n</tool_call>", "", "", [("search", {})]),
    ("GLM says hi.", "GLM says hi.", "", []),
]
GLM45_MALFORMED: list[str] = [
    "<tool_call>launch_rockets\n<arg_key>when</arg_key>\n<arg_value>now</arg_value>\n</tool_call>",  # unknown tool
    "<tool_call>\n</tool_call>",  # no name
    "<tool_call>",  # cut off before the name
]

# Mistral: `[TOOL_CALLS]NAME[ARGS]{...}` (Mistral Small 3.2, Devstral, Magistral) or a JSON list (7B v0.3, Nemo).
MISTRAL: list[Case] = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", "", [("get_weather", {"city": "Paris"})]),
    ('Let me check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "Paris events"}',
     "Let me check both.", "", [("get_weather", {"city": "Paris"}), ("search", {"q": "Paris events"})]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "search", "arguments": {"q": "B"}}]', "", "",
     [("get_weather", {"city": "A"}), ("search", {"q": "B"})]),
    ('[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"q": "x"}', "", "", [("search", {"q": "x"})]),  # Mistral Small 3.2's id
    # Nemo's history form: keys sorted, arguments double-encoded, an id (read whole)
    ('[TOOL_CALLS][{"arguments": "{\\"q\\": \\"tea\\"}", "id": "abcdefghi", "name": "search"}]', "", "", [("search", {"q": "tea"})]),
    ("Paris is in France.", "Paris is in France.", "", []),
]
MISTRAL_MALFORMED: list[str] = [
    "[TOOL_CALLS]launch_rockets[ARGS]{}",  # unknown tool
    '[TOOL_CALLS][{"name": "nuke", "arguments": {}}]',
    "[TOOL_CALLS]get weather now",  # no valid name
    "[TOOL_CALLS]",
]

# Calls of these formats whose head (a known tool's name) was written: they stay calls whatever
# follows, with the arguments written so far. (parser, output, content, [(name, arguments)]).
ANNOUNCED_NAMED: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa", "", [("get_weather", '{"city": "Pa"}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=ci", "", [("get_weather", "{}")]),
    ("qwen3_coder", "<function=search>\n<parameter=q>\na</parameter>\n</function>\nthen text", "then text",
     [("search", '{"q": "a"}')]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa", "", [("get_weather", '{"city": "Pa"}')]),
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>a</tool_call>", "", [("search", '{"q": "a"}')]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ("mistral", "[TOOL_CALLS]search[ARGS]", "", [("search", "{}")]),
    ("mistral", '[TOOL_CALLS]search[ARGS]{"q": "a"} and text', "and text", [("search", '{"q": "a"}')]),
]
