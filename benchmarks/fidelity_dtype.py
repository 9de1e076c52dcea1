"""SmolLM2's greedy agreement with transformers under FreeToken's activation dtypes: bfloat16
batched, bfloat16 one prompt at a time, float32 batched (fidelity.py's prompts and reference).

    python benchmarks/fidelity_dtype.py [--model smollm2-135m-instruct] [--tokens 32]

Separates the causes of a gap in fidelity.py's table: batch composition (batched vs alone) and
the activations' dtype between ops (bfloat16 vs float32), with the quantized weights unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity  # noqa: E402 - the sibling script: its prompts, reference and prefix measure


def main() -> None:
    from freetoken.llm import LLM
    from freetoken.models.load import load_tokenizer
    from freetoken.request import SamplingParams
    from freetoken.weights.gguf_metadata import metadata_of, open_gguf
    from freetoken.weights.loader import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    source = resolve_model(args.model)
    path = Path(source.path)
    tokenizer = load_tokenizer(source, metadata_of(open_gguf(path)))
    prompts = [tokenizer.encode(p) for p in fidelity.PROMPTS]
    ref = fidelity.reference(path, prompts, args.tokens)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for label, dtype, alone in [("bfloat16, batched", "auto", False), ("bfloat16, one at a time", "auto", True),
                                ("float32, batched", "float32", False)]:
        llm = LLM(str(path), weights="auto", dtype=dtype, num_tokens=8192, prefill_weights="quantized")
        if alone:
            outs = [llm.generate([q], params)[0].token_ids for q in prompts]  # type: ignore[list-item]
        else:
            outs = [o.token_ids for o in llm.generate(prompts, params)]  # type: ignore[arg-type]
        prefixes = [fidelity.common_prefix(o, r) for o, r in zip(outs, ref)]
        print(f"{label}: {sum(p == args.tokens for p in prefixes)}/{len(prompts)} equal, "
              f"mean common prefix {sum(prefixes) / len(prefixes):.1f}", flush=True)


if __name__ == "__main__":
    main()
