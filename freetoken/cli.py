"""`ft`: the command line (`ft serve | generate | chat | inspect | bench | launch`). Argparse to config objects, then one call; no logic of its own.

Errors meant for the user (`FreeTokenError`) are printed as one line on stderr with a non-zero
exit code (2 for a configuration that cannot work, `ConfigError`; else 1), never as a traceback. `ft generate` prints the completion alone on stdout, streamed as it is decoded.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken import __version__
from freetoken.errors import ConfigError, FreeTokenError
from freetoken.utils.logs import FORMATS, LogSettings
from freetoken.utils.logs import configure as configure_logging

if TYPE_CHECKING:
    from freetoken.server.settings import ServerConfig

MODEL_HELP = "a .gguf file, a directory with config.json + safetensors + tokenizer.json, or gemma3-270m (default) / smollm2-135m-instruct"


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = _subparser(sub, "generate", help="complete a prompt (raw, no chat template) and print the completion")
    p.add_argument("prompt", help="the text to complete")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto = bfloat16 where the hardware is fast at it, else float32",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the physical cores this process may use)"
    )
    p.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "bf16", "int8", "int4"],
        help="what matrices run as: auto = the file's precision class (4-bit types int4, 5/6/8-bit int8, float bf16), bf16 = the --dtype, int8/int4 = quantized (default auto)",
    )


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = _subparser(
        sub,
        "chat",
        help="chat with a model in the terminal, streamed, through its chat template (a running server, or --model)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--url", default=None, help="the server to talk to (default http://127.0.0.1:1919, ft serve's default)"
    )
    where.add_argument(
        "--model",
        default=None,
        help="start `ft serve --model M` on a free local port for this chat instead of using --url: a .gguf "
        "file, a directory with config.json + safetensors + tokenizer.json, or smollm2-135m-instruct (gemma3-270m, "
        "the other bundled model, is a base model: it continues text rather than answering)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="sent as 'Authorization: Bearer KEY' (with --model: the child server requires it)",
    )
    p.add_argument("--system", default=None, help="the system prompt to start with (/system changes it)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="per answer (default: the server's, the rest of the context)"
    )
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")
    p.add_argument(
        "--tools",
        default=None,
        metavar="FILE.json",
        help="a JSON list of OpenAI tool definitions sent with every turn; calls are shown",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --model: an extra `ft serve` argument (repeatable, e.g. --serve-arg=--threads --serve-arg=2)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the server's next bytes (default 600)"
    )


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = _subparser(
        sub,
        "inspect",
        help="print a model's architecture, layer kinds, vocabulary, quant types, size and what each weight runs as",
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "bf16", "int8", "int4"],
        help="what matrices run as: auto = the file's precision class (4-bit types int4, 5/6/8-bit int8, float bf16), bf16 = the --dtype, int8/int4 = quantized (default auto)",
    )


def _swa_pool_tokens(value: str) -> int | str:
    if value == "floor":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'floor', got {value!r}") from None


SERVE_EPILOG = """\
environment (a flag, or the MODEL argument, wins over its variable):
  FT_MODEL    the model, as --model takes it
  FT_HOST     --host
  FT_PORT     --port
  FT_API_KEY  --api-key (--api-key-file reads it from a file instead; both keep it out of `ps`)

examples:
  ft serve                                      the default model (gemma3-270m, a base model) on 127.0.0.1:1919
  ft serve smollm2-135m-instruct                an instruction-tuned model to chat with
  ft serve ./Qwen3-4B-Q4_K_M.gguf --context-length 32768 --max-running-requests 8
  ft serve model.gguf --host 0.0.0.0 --api-key-file ~/.config/ft-key
  FT_MODEL=model.gguf FT_PORT=8000 ft serve --log-format json
  vllm-style: ft serve model.gguf --max-model-len 8192 --max-num-seqs 4 --enable-auto-tool-choice

then: ft chat (a terminal chat), ft launch codex|claude|opencode (a coding agent); docs/server.md
"""


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI- and Anthropic-compatible HTTP APIs (default: gemma3-270m on 127.0.0.1:1919)",
        description="Serve a model over OpenAI- and Anthropic-compatible HTTP APIs.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it (`ft serve FILE.gguf`)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="a .gguf file, a directory with config.json + safetensors + tokenizer.json, "
        "or a short name: gemma3-270m, smollm2-135m-instruct (default: $FT_MODEL, else gemma3-270m)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the short name or file stem)"
    )
    g.add_argument(
        "--chat-template", default=None, metavar="FILE", help="a jinja2 chat template overriding the model's"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto = bfloat16 where the hardware is fast at it, else float32",
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs: auto = cuda when a CUDA device is present, else cpu",
    )
    g.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "bf16", "int8", "int4"],
        help="what matrices run as: auto = the file's precision class (4-bit types int4, 5/6/8-bit int8, float bf16), bf16 = the --dtype, int8/int4 = quantized (default auto)",
    )
    g.add_argument(
        "--prefill-weights",
        default="auto",
        choices=["auto", "bf16", "quantized"],
        help="which quantized linear layers also keep a --dtype copy for prefill batches: auto = where the kernel is slower than the copy (q6_k, group-32; not q4_k or the LM head) and the --dtype is 16-bit, bf16 = all (~2 bytes per weight more), quantized = none (default auto)",
    )
    g.add_argument(
        "--weights-cache",
        default="auto",
        metavar="auto|off|DIR",
        help="where what a load makes of the checkpoint is kept, memory-mapped on the next start with the same file, options and version: auto = ~/.cache/freetoken/weights (or $FREETOKEN_CACHE_DIR/weights), off = none (docs/operations.md; default auto)",
    )
    g.add_argument(
        "--moe-strategy",
        default="resident",
        choices=["resident", "offload"],
        help="MoE experts: resident = all decoded at load; offload = kept in the file, the hot ones in an LRU cache of --expert-cache-gb (docs/moe.md; default resident)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the engine process's torch threads (default: the physical cores it may use)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine processes, one per rank, each holding 1/N of every layer (gloo on CPU, nccl on CUDA; default 1)",
    )

    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default=None,
        help="address to listen on (default: $FT_HOST, else 127.0.0.1; 0.0.0.0 for every interface)",
    )
    g.add_argument("--port", type=int, default=None, help="port to listen on (default: $FT_PORT, else 1919)")
    g.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 routes (default: $FT_API_KEY, else none)",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="--api-key read from a file holding the key alone (kept out of `ps`)",
    )
    g.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated origins browsers may call from (CORS), or '*' (default: none, no CORS headers)",
    )
    g.add_argument(
        "--unprefixed-routes",
        action="store_true",
        help="the OpenAI routes also answer without the /v1 prefix (/chat/completions, /completions, /models, ...)",
    )
    g.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="report prefix-cache hits in usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a generation request running longer than this with an error and free its pages (default: no limit)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 * 1024 * 1024,
        metavar="N",
        help="a request body larger than this is refused with 413 before it is read or parsed (default 33554432 = 32 MiB)",
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        metavar="N",
        help="finished /v1/responses kept for GET and previous_response_id, least recently used dropped first (default 1024; 0 = none)",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="how long a stored response is kept (default 3600)",
    )

    g = p.add_argument_group("memory")
    g.add_argument(
        "--num-tokens", type=int, default=None, help="FULL KV pool size in tokens (default: from --memory-ratio)"
    )
    g.add_argument(
        "--memory-ratio", type=float, default=0.3, help="share of free memory the FULL KV pool may use (default 0.3)"
    )
    g.add_argument(
        "--context-length",
        "--max-model-len",
        type=int,
        default=None,
        help="cap the model's context length (--max-model-len: vLLM's spelling)",
    )
    g.add_argument(
        "--cache-type",
        default="radix",
        choices=["naive", "radix", "swa_radix"],
        help="prefix cache (default radix; swa_radix on SWA models)",
    )
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    g.add_argument(
        "--swa-full-tokens-ratio", type=float, default=None, help="SWA pool size as a share of the FULL pool"
    )
    g.add_argument(
        "--swa-pool-tokens",
        type=_swa_pool_tokens,
        default=None,
        metavar="N|floor",
        help="SWA pool size in tokens, or 'floor'",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16", "int8", "q8_0", "fp8_e4m3"],
        help="K/V storage: auto = the model's dtype; int8 (q8_0) / fp8_e4m3 (CUDA) hold about twice the tokens per byte",
    )
    g.add_argument(
        "--state-snapshots",
        type=int,
        default=None,
        metavar="N",
        help="hybrid models (Qwen3.5): recurrent-state snapshots the prefix cache may keep, one state slot each "
        "(default: sized from memory, at most 4 per running request; 0 = no prefix hits on such models)",
    )
    g.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=2048,
        metavar="TOKENS",
        help="hybrid models: a state snapshot at least every TOKENS tokens of a long prompt, besides message "
        "boundaries and branch points (default 2048; 0 = none)",
    )
    g.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="a disk tier under the prefix cache: committed KV pages are written here and loaded back "
        "after an eviction or a restart (docs/kv-cache.md); off by default",
    )
    g.add_argument(
        "--kv-disk-gb",
        type=float,
        default=16.0,
        metavar="N",
        help="the disk tier's bound in GiB (least recently used pages are deleted past it)",
    )
    g.add_argument(
        "--kv-disk-load",
        default="auto",
        choices=["auto", "always"],
        help="auto: load pages from disk when reading is measured cheaper than prefilling them; always",
    )
    g.add_argument(
        "--max-pinned-tokens",
        type=int,
        default=None,
        metavar="N",
        help="cap on prefix-cache tokens held by cache_control / prompt_cache_key pins (default: a quarter of the FULL pool; 0 = no pins)",
    )
    g.add_argument(
        "--expert-cache-gb",
        type=float,
        default=4.0,
        metavar="GB",
        help="offload: the expert cache's budget in GiB (default 4; POST /admin/cache/resize moves it at run time)",
    )

    g = p.add_argument_group("scheduling")
    g.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        type=int,
        default=16,
        help="requests decoded together (default 16; --max-num-seqs: vLLM's spelling)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued beyond the running ones; more get 429 (default 256)",
    )
    g.add_argument(
        "--max-prefill-length", type=int, default=1024, help="prompt tokens prefilled per step (default 1024)"
    )
    g.add_argument(
        "--speculative",
        default="off",
        choices=["off", "ngram"],
        help="ngram: draft tokens from the prompt and output (n-gram lookup), verified in the batched forward; exact (docs/speculative.md; default off)",
    )
    g.add_argument(
        "--spec-max-draft",
        type=int,
        default=16,
        metavar="K",
        help="drafted tokens per verified chunk at most (default 16)",
    )
    g.add_argument("--spec-ngram-min", type=int, default=2, metavar="N", help="shortest n-gram looked up (default 2)")
    g.add_argument(
        "--spec-ngram-max", type=int, default=4, metavar="N", help="longest n-gram looked up, tried first (default 4)"
    )
    g.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every decode step eagerly on CUDA instead of replaying graphs captured per batch size (default: graphs on CUDA)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="every row computed alike, alone or batched, prefilled, decoded, verified or cached: greedy outputs repeat exactly; prefill slower (docs/engine.md; default off)",
    )

    g = p.add_argument_group("agents")
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "gemma", "gemma4", "llama3_json", "harmony", "qwen3_coder", "glm45", "mistral"],
        help="the tool-call format to parse (default: from the model's chat template and architecture)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines and ignored: tool calling is always on",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["think", "gemma4", "mistral", "none"],
        help="split <think>...</think> (think), <|channel>thought...<channel|> (gemma4) or [THINK]...[/THINK] "
        "(mistral: Magistral) reasoning off the output (default: from the model's template or vocabulary)",
    )

    g.add_argument(
        "--sampling-defaults",
        default="model",
        choices=["model", "none"],
        help="model: a request that leaves temperature, top_p, top_k, min_p, repetition_penalty or presence_penalty "
        "out gets the checkpoint's (generation_config.json, GGUF general.sampling.*); none: the APIs' defaults "
        "(default model; docs/server.md)",
    )

    g = p.add_argument_group("operations")
    _add_logging(g, defaults=False)
    g.add_argument(
        "--engine-hang-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="no engine heartbeat for this long = hung: /health 503, in-flight requests end with an error, "
        "the engine is killed and restarted (default 30; docs/operations.md)",
    )
    g.add_argument(
        "--load-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="an engine process that has not loaded the model and said Ready this long after its start is killed; "
        "at start-up ft serve then exits 1 (default 600; docs/operations.md)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or POST /admin/drain, how long in-flight requests may finish before they are aborted (default 30)",
    )
    g.add_argument(
        "--debug-kv", action="store_true", help="audit the KV cache after every step; a violation is fatal (for tests)"
    )
    g.add_argument(
        "--test-hold",
        default=None,
        metavar="PATH",
        help="a test hook, off by default: while PATH exists the engine holds what it says (freetoken/engine/hold.py)",
    )


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = _subparser(
        sub,
        "bench",
        help="measure: `roofline` (decode against the machine's read bandwidth), `serve` (a server over HTTP, optionally paired with a peer), `load` (time to ready and memory)",
    )
    kinds = p.add_subparsers(dest="bench", metavar="KIND", required=True)
    r = kinds.add_parser(
        "roofline",
        help="read bandwidth, bytes a decode step reads, in-process decode tok/s and the fraction of the roofline",
    )
    r.add_argument("--model", default=None, help=MODEL_HELP)
    r.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the physical cores this process may use)"
    )
    r.add_argument("--weights", default="auto", choices=["auto", "bf16", "int8", "int4"])
    r.add_argument("--tokens", type=int, default=64, help="decode tokens per timed request (default 64)")
    r.add_argument("--repeats", type=int, default=3, help="timed repeats, median quoted (default 3)")
    s = kinds.add_parser(
        "serve",
        help="the serving scenarios against a running server; with --peer-url, paired rounds against a second one",
    )
    s.add_argument("--base-url", required=True, help="the server measured, e.g. http://127.0.0.1:1919")
    s.add_argument(
        "--peer-url",
        default=None,
        help="a second server (llama-server, ik_llama.cpp, ...): paired rounds, ratios base / peer",
    )
    s.add_argument(
        "--paired-rounds", type=int, default=5, help="rounds with --peer-url, the order swapped each round (default 5)"
    )
    s.add_argument(
        "--scenarios",
        nargs="+",
        choices=["single", "sweep", "prefill", "agent"],
        default=None,
        help="default: all four alone; single + prefill paired",
    )
    s.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="sweep stream counts (default 1 2 4 8 16; paired 4 8)"
    )
    s.add_argument("--quick", action="store_true", help="a smoke run: every scenario, a fraction of the work")
    s.add_argument("--out", default=None, help="write the result JSON here")
    ld = kinds.add_parser(
        "load", help="launch to ready and peak memory of `ft serve`, first and later starts, beside a peer binary"
    )
    ld.add_argument("--model", required=True, help="a GGUF file both servers load")
    ld.add_argument(
        "--peer",
        default=None,
        metavar="BINARY",
        help="a llama-server binary started on the same file (-m FILE -t N -c N)",
    )
    ld.add_argument("--starts", type=int, default=3, help="launches of each server, alternating (default 3)")
    ld.add_argument(
        "--first-starts",
        type=int,
        default=1,
        help="how many of them are first starts (ft: each with an empty weight cache); their median is reported apart (default 1)",
    )
    ld.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of both servers (default: the physical cores this process may use)",
    )
    ld.add_argument(
        "--num-tokens", type=int, default=16384, help="KV capacity of both (ft --num-tokens, peer -c; default 16384)"
    )
    ld.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take to be ready (default 600)")
    ld.add_argument(
        "--ft-arg", action="append", default=[], metavar="ARG", help="an extra `ft serve` argument (repeatable)"
    )


def _add_launch(sub: argparse._SubParsersAction) -> None:
    from freetoken.launch import add_arguments

    p = _subparser(
        sub,
        "launch",
        help="point Codex, Claude Code or OpenCode at a running ft serve (config written, backed up) and start it",
    )
    add_arguments(p)


def _add_logging(p: argparse.ArgumentParser | argparse._ArgumentGroup, defaults: bool) -> None:
    """`-v` and `--log-format`, accepted before the subcommand and after it: the subcommands'
    copies default to SUPPRESS, so that they set the value only when given (argparse would
    otherwise overwrite what was given before the subcommand with the subcommand's default)."""
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="debug logging on stderr (ft serve: in the engine process too)",
    )
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text" if defaults else argparse.SUPPRESS,
        help="text: one line per record with a timestamp (default); json: one JSON object per line",
    )


def _subparser(sub: argparse._SubParsersAction, name: str, **kwargs: object) -> argparse.ArgumentParser:
    p = sub.add_parser(name, **kwargs)  # type: ignore[arg-type]
    _add_logging(p, defaults=False)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft", description="FreeToken: an LLM serving engine")
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    _add_logging(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_chat(sub)
    _add_inspect(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_launch(sub)
    return parser


def _generate(args: argparse.Namespace) -> None:
    from freetoken.llm import LLM
    from freetoken.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    try:
        params.validate()
    except ValueError as err:
        raise FreeTokenError(str(err)) from None
    llm = LLM(args.model, dtype=args.dtype, weights=args.weights, threads=args.threads, max_running_requests=1)
    for piece in llm.stream(args.prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _chat(args: argparse.Namespace) -> None:
    from freetoken.chat_cli import run_chat

    run_chat(
        args.url,
        args.model,
        args.api_key,
        args.system,
        args.max_tokens,
        args.temperature,
        args.tools,
        args.serve_arg,
        args.timeout,
    )


def _inspect(args: argparse.Namespace) -> None:
    from freetoken.models.inspect import describe_model

    sys.stdout.write(describe_model(args.model, args.weights) + "\n")


def _bench(args: argparse.Namespace) -> None:
    from freetoken.bench.command import bench_load, bench_roofline, bench_serve

    if args.bench == "roofline":
        bench_roofline(args.model, args.threads, args.weights, args.tokens, args.repeats)
    elif args.bench == "load":
        bench_load(
            args.model,
            args.peer,
            args.starts,
            args.threads,
            args.num_tokens,
            args.timeout,
            args.ft_arg,
            args.first_starts,
        )
    else:
        bench_serve(
            args.base_url, args.peer_url, args.paired_rounds, args.scenarios, args.concurrency, args.quick, args.out
        )


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


def _env(environ: Mapping[str, str], name: str) -> str | None:
    """`environ[name]`, None when unset; ConfigError naming it when set but empty."""
    value = environ.get(name)
    if value is not None and not value.strip():
        raise ConfigError(f"{name} is set but empty: unset it or give a value")
    return value


def read_api_key_file(path: str) -> str:
    """The key in `path`: its one line (a trailing newline is fine); ConfigError naming
    --api-key-file when it cannot be read, is empty or holds more than the key."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"--api-key-file: cannot read {path} ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--api-key-file: {path} is not UTF-8 text") from None
    key = text.strip()
    if not key:
        raise ConfigError(f"--api-key-file: {path} is empty")
    if any(c.isspace() for c in key):
        raise ConfigError(f"--api-key-file: {path} must hold the key alone, on one line without spaces")
    return key


def serve_options(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str | None, str, int, str | None]:
    """(model, host, port, API key) from the flags, else from FT_MODEL, FT_HOST, FT_PORT and
    FT_API_KEY, else the defaults. ConfigError names the flag or variable that cannot work."""
    if args.model is not None and args.model_arg is not None and args.model != args.model_arg:
        raise ConfigError(f"the model is given twice, as {args.model_arg!r} and --model {args.model!r}: give it once")
    model = args.model if args.model is not None else args.model_arg
    if model is None:
        model = _env(environ, "FT_MODEL")
    host = args.host if args.host is not None else (_env(environ, "FT_HOST") or DEFAULT_HOST)
    port = args.port
    if port is None:
        text = _env(environ, "FT_PORT")
        try:
            port = DEFAULT_PORT if text is None else int(text)
        except ValueError:
            raise ConfigError(f"FT_PORT must be a port number in [0, 65535], got {text!r}") from None
        if not 0 <= port <= 65535:
            raise ConfigError(f"FT_PORT must be a port number in [0, 65535], got {text!r}")
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("--api-key and --api-key-file both give the key: give one")
    if args.api_key_file is not None:
        api_key = read_api_key_file(args.api_key_file)
    elif args.api_key is not None:
        api_key = args.api_key
    else:
        api_key = _env(environ, "FT_API_KEY")
    return model, host, port, api_key


def _serve(args: argparse.Namespace) -> None:
    import time

    from freetoken.config import EngineConfig
    from freetoken.server.process.supervisor import EarlyEngine
    from freetoken.weights.source import resolve_model

    began = time.monotonic()
    model, host, port, api_key = serve_options(args, os.environ)
    engine = EngineConfig(
        model=model,
        dtype=args.dtype,
        device=None if args.device == "auto" else args.device,
        weights=args.weights,
        prefill_weights=args.prefill_weights,
        weights_cache=args.weights_cache,
        cache_type=args.cache_type,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_waiting_requests=args.max_waiting_requests,
        max_prefill_length=args.max_prefill_length,
        num_tokens=args.num_tokens,
        memory_ratio=args.memory_ratio,
        context_length=args.context_length,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        swa_pool_tokens=args.swa_pool_tokens,
        debug_kv=args.debug_kv,
        test_hold=args.test_hold,
        max_pinned_tokens=args.max_pinned_tokens,
        state_snapshots=args.state_snapshots,
        state_snapshot_interval=args.state_snapshot_interval,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gb=args.kv_disk_gb,
        kv_disk_load=args.kv_disk_load,
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        moe_strategy=args.moe_strategy,
        expert_cache_gb=args.expert_cache_gb,
        speculative=args.speculative,
        spec_max_draft=args.spec_max_draft,
        spec_ngram_min=args.spec_ngram_min,
        spec_ngram_max=args.spec_ngram_max,
        deterministic=args.deterministic,
        cuda_graphs=args.cuda_graphs,
    )
    engine.validate()
    # The engine process first, held: its ~3 s of torch imports overlap everything below (this
    # process's own imports, the checks, the web stack); a check that fails ends it unreleased.
    early = EarlyEngine.start(engine, args.served_model_name or resolve_model(engine.model).name, held=True)
    try:
        server = _server_config(args, host, port, api_key)
        from freetoken.distributed.checks import check_model_heads
        from freetoken.server.startup import start

        check_model_heads(engine.model, engine.tensor_parallel_size)  # before listening: one line
        # preflight, the port, the engine released: before the web stack's imports
        started = start(engine, server, engine=early, began=began)
    except BaseException:
        early.abandon()
        raise
    try:
        from freetoken.server.serve import run_server
    except BaseException:
        started.abandon()
        raise
    run_server(engine, server, started)


def _server_config(args: argparse.Namespace, host: str, port: int, api_key: str | None) -> ServerConfig:
    from freetoken.server.settings import ServerConfig

    return ServerConfig(
        host=host,
        port=port,
        api_key=api_key,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        enable_cache_report=args.enable_cache_report,
        tool_call_parser=args.tool_call_parser,
        request_timeout_s=args.request_timeout,
        responses_store_size=args.responses_store_size,
        responses_store_ttl_s=args.responses_store_ttl,
        reasoning_parser=args.reasoning_parser,
        sampling_defaults=args.sampling_defaults,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",")) if args.allowed_origins else (),
        unprefixed_routes=args.unprefixed_routes,
        engine_hang_timeout_s=args.engine_hang_timeout,
        load_timeout_s=args.load_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        max_request_bytes=args.max_request_bytes,
        max_running_requests=args.max_running_requests,
        max_waiting_requests=args.max_waiting_requests,
    )


def _launch(args: argparse.Namespace) -> None:
    from freetoken.launch import command

    code = command(args)
    if code:
        raise SystemExit(code)  # the agent's exit status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(LogSettings(args.verbose, args.log_format), "api" if args.command == "serve" else "ft")
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {
        "generate": _generate,
        "chat": _chat,
        "inspect": _inspect,
        "serve": _serve,
        "bench": _bench,
        "launch": _launch,
    }
    try:
        handlers[args.command](args)
    except FreeTokenError as err:
        print(f"ft {args.command}: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
