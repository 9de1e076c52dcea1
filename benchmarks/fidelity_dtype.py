"""SmolLM2's greedy agreement with transformers under FreeToken's activation dtypes: bf16 batched,
bf16 one prompt at a time, float32 batched (fidelity.py's prompts and reference).

    python benchmarks/fidelity_dtype.py
"""
import sys, torch
sys.path.insert(0, "benchmarks")
import fidelity as F
from pathlib import Path
from freetoken.models.load import load_tokenizer
from freetoken.weights.loader import resolve_model
from freetoken.weights.gguf_metadata import metadata_of, open_gguf
from freetoken.llm import LLM
from freetoken.request import SamplingParams
torch.set_num_threads(2)
src = resolve_model("smollm2-135m-instruct"); path = Path(src.path)
tok = load_tokenizer(src, metadata_of(open_gguf(path)))
prompts = [tok.encode(p) for p in F.PROMPTS]
ref = F.reference(path, prompts, 32)
p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
for label, kw, one in [("auto bf16 batched", {}, False), ("auto bf16 one at a time", {}, True), ("auto float32 batched", {"dtype": "float32"}, False)]:
    llm = LLM(str(path), weights="auto", num_tokens=8192, prefill_weights="quantized", **kw)
    outs = [llm.generate([q], p)[0].token_ids for q in prompts] if one else [o.token_ids for o in llm.generate(prompts, p)]
    pre = [F.common_prefix(o, r) for o, r in zip(outs, ref)]
    print(label, sum(x == 32 for x in pre), "/24", sum(pre)/len(pre), flush=True)
