"""`ft bench`: the measurements every speed claim goes through (the HTTP scenarios against a server
and a peer, the decode roofline in-process). Top layer beside `llm` and `server`: it may use any
layer below; nothing imports it but the CLI and the scripts in benchmarks/."""
