"""What `ft bench roofline`, `ft bench serve` and `ft bench load` do with their arguments: run the measurement and
print its report (the CLI only parses). Owns no measurement of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from freetoken.errors import ConfigError
from freetoken.utils.hardware import default_threads


def bench_roofline(model: str | None, threads: int | None, weights: str, tokens: int, repeats: int) -> None:
    from freetoken.bench.roofline import report

    print(report(model or "gemma3-270m", threads or default_threads(), tokens, repeats, weights))


def bench_serve(
    base_url: str,
    peer_url: str | None,
    rounds: int,
    scenarios: list[str] | None,
    concurrency: list[int] | None,
    quick: bool,
    out: str | None,
) -> None:
    from freetoken.bench import paired, serving

    settings = serving.Settings(base_url=base_url, scenarios=tuple(scenarios or serving.SCENARIOS))
    settings = serving.quick(settings) if quick else settings
    if concurrency:
        settings = dataclasses.replace(settings, concurrency=tuple(concurrency))
    if peer_url is None:
        result = asyncio.run(serving.run(settings))
        print(serving.summary(result))
        data: object = result
    else:
        if not concurrency:
            settings = dataclasses.replace(settings, concurrency=(4, 8))
        chosen = tuple(scenarios or paired.PAIRED_SCENARIOS)
        results = paired.run_rounds({"base": base_url, "peer": peer_url}, rounds, settings, chosen)
        print(paired.paired_table(results, "base", "peer"))
        data = results
    if out:
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
    sys.stdout.flush()


def bench_load(
    model: str,
    peer: str | None,
    starts: int,
    threads: int | None,
    num_tokens: int,
    timeout_s: float,
    ft_extra: list[str],
    first_starts: int = 1,
) -> None:
    from freetoken.bench import load

    if not 1 <= first_starts <= starts:
        raise ConfigError(f"--first-starts must be in [1, --starts {starts}], got {first_starts}")
    results = load.run(model, peer, starts, threads or default_threads(), num_tokens, timeout_s, ft_extra, first_starts)
    print(load.table(results, first_starts))
    sys.stdout.flush()
