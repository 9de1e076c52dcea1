"""`ft`: the command line. Argparse to config objects, then one call; no logic of its own.

Errors meant for the user (`FreeTokenError`) are printed as one line on stderr with a non-zero
exit code, never as a traceback. `ft generate` prints the completion alone on stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys

from freetoken import __version__
from freetoken.errors import FreeTokenError

MODEL_HELP = "a .gguf file, a directory with config.json + safetensors + tokenizer.json, or gemma3-270m (default) / smollm2-135m-instruct"


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt (raw, no chat template) and print the completion")
    p.add_argument("prompt", help="the text to complete")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto = bfloat16 where the hardware is fast at it, else float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a model's architecture, layer kinds, vocabulary, quant types and size")
    p.add_argument("--model", default=None, help=MODEL_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft", description="FreeToken: an LLM serving engine")
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_inspect(sub)
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
    llm = LLM(args.model, dtype=args.dtype, threads=args.threads, max_running_requests=1)
    out = llm.generate([args.prompt], params)[0]
    sys.stdout.write(out.text + "\n")
    sys.stdout.flush()


def _inspect(args: argparse.Namespace) -> None:
    from freetoken.models.inspect import describe_model

    sys.stdout.write(describe_model(args.model) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"generate": _generate, "inspect": _inspect}
    try:
        handlers[args.command](args)
    except FreeTokenError as err:
        print(f"ft {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
