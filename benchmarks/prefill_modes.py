"""Load time, prefill time and memory of one `--prefill-weights` setting, in-process.

    for m in quantized auto bf16 auto quantized; do python benchmarks/prefill_modes.py --mode $m --model FILE.gguf; done

Loads FILE with `LLM(prefill_weights=MODE)` on two threads, then prefills four prompts of random
words (max_tokens 1, no shared prefix) one at a time and prints the load time, the median of the
last three prefills, and the process's RSS and VmHWM. Run the settings alternately (as above) on
an idle machine and compare within a run (docs/engineering/kernels.md, "Prefill copies").
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from freetoken.llm import LLM
from freetoken.request import SamplingParams


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", required=True, choices=["auto", "bf16", "quantized"])
    p.add_argument("--model", required=True)
    p.add_argument("--words", type=int, default=341, help="words per prompt (default 341)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, prefill_weights=args.mode, threads=args.threads, num_tokens=8192, max_running_requests=1)
    load_s = time.perf_counter() - t0
    rnd = random.Random(0)
    vocabulary = [f"w{i}" for i in range(5000)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for _ in range(4):
        prompt = " ".join(rnd.choice(vocabulary) for _ in range(args.words))
        t = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - t)
    print(f"{args.mode}: load {load_s:.1f} s, prefill {statistics.median(times[1:]):.2f} s "
          f"(runs {[round(x, 2) for x in times]}), RSS {status_mib('VmRSS'):.0f} MiB, HWM {status_mib('VmHWM'):.0f} MiB")


if __name__ == "__main__":
    main()
