"""Test harness for the models: tiny seeded transformers references saved to disk, and a paged
runner that hands each request distinct, shuffled pages and runs the model step by step."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.registry import CausalLM, build_model, config_from_hf
from freetoken.weights.safetensors import load_safetensors_dir

VOCAB = 300

LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    rope_theta=5000.0,
)
# Window 5 (P = 4 does not divide it), pattern 3 -> sliding, sliding, full, sliding.
GEMMA3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24,
    final_logit_softcapping=30.0,
    rope_local_base_freq=100.0,
    rope_theta=10_000.0,
)
GPT_OSS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=6,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    swiglu_limit=0.5,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 1000.0,
    },
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, GPT_OSS),
}


def make_reference(family: str, directory: Path) -> torch.nn.Module:
    """A seeded random-weight transformers model (eager attention), saved to `directory`."""
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(1234)
    config = config_cls(**kwargs, attn_implementation="eager")
    if family == "gpt_oss":  # the default grouped-mm experts do not run in float64
        config._experts_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():  # default inits leave norms at 1 (or 0) and sinks near 0: make them matter
        for name, p in model.named_parameters():
            scale = 1.0 if name.endswith("sinks") else 0.1 if "norm" in name else 0.0
            p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(directory)
    return model


def load_freetoken(directory: Path, dtype: torch.dtype) -> CausalLM:
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, dtype, "cpu")
    model.load_weights(load_safetensors_dir(directory, dtype=dtype))
    return model


def reference_logits(model: torch.nn.Module, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits at every position of `ids` [L, vocab] from transformers in `dtype`."""
    with torch.no_grad():
        return model.to(dtype)(torch.tensor([ids])).logits[0].to(dtype)


@dataclass
class Seq:
    full: list[int] = field(default_factory=list)
    swa: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V is in the cache
    state: int = 0  # hybrid models: the sequence's state slot (0: none yet)


class PagedRunner:
    """Runs steps of a model over a shared KVTensors, pages taken from shuffled free lists."""

    def __init__(self, model: CausalLM, page_size: int, dtype: torch.dtype, pages: int = 96, seed: int = 0) -> None:
        self.model, self.config, self.P = model, model.config, page_size
        self.kv = KVTensors(self.config.kv_layout(), pages, pages, page_size, dtype, "cpu", state_slots=16)
        self.next_state = 1  # hybrid models: one state slot per sequence, in the order they first run
        rng = np.random.default_rng(seed)
        self.free_full = [int(p) for p in rng.permutation(np.arange(1, pages + 1))]
        self.free_swa = [int(p) for p in rng.permutation(np.arange(1, pages + 1))]

    def step(self, work: list[tuple[Seq, list[int]]], all_logits: bool = False) -> list[torch.Tensor]:
        """Run each (sequence, new token ids) in one batch; logits per sequence."""
        specs, ids = [], []
        for seq, new in work:
            need = -(-(seq.length + len(new)) // self.P)
            while len(seq.full) < need:
                seq.full.append(self.free_full.pop())
                seq.swa.append(self.free_swa.pop() if self.config.has_swa else 0)
            swa = np.array(seq.swa, dtype=np.int32) if self.config.has_swa else None
            specs.append((seq.length, len(new), np.array(seq.full, dtype=np.int32), swa))
            ids.extend(new)
            if self.config.has_linear and not seq.state:
                seq.state, self.next_state = self.next_state, self.next_state + 1
        slots = [seq.state for seq, _ in work] if self.config.has_linear else None
        batch = ForwardBatch.build(
            specs, self.P, all_logits=all_logits, sliding_window=self.config.sliding_window, state_slots=slots
        )
        logits = self.model(torch.tensor(ids), batch, self.kv)
        out, row = [], 0
        for seq, new in work:
            n = len(new) if all_logits else 1
            out.append(logits[row : row + n])
            row += n
            seq.length += len(new)
        return out

    def release_out_of_window(self, seq: Seq, poison: bool) -> None:
        """NULL the SWA entries whose tokens no future query can see; optionally fill the released
        pages with NaN, as if another request had reused them."""
        W = self.config.sliding_window
        if W is None:
            return
        first_visible = seq.length - W + 1  # the next query sits at position seq.length
        for i, page in enumerate(seq.swa):
            if page and (i + 1) * self.P <= first_visible:
                seq.swa[i] = 0
                if poison:
                    for layer in self.config.swa_layers:
                        self.kv.k[layer][page] = float("nan")
                        self.kv.v[layer][page] = float("nan")
                self.free_swa.append(page)  # reused next: its NaN tail must never be read


def chunked_last_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """The logits after `ids`, run as a prefill chunk of 8 then decode steps through 4-token pages
    (float32 cache): float64 [vocab]."""
    runner = PagedRunner(model, page_size=4, dtype=torch.float32)
    seq = Seq()
    runner.step([(seq, ids[:8])])
    runner.step([(seq, ids[8:9])])
    return runner.step([(seq, ids[9:])])[0][-1].double()


def paged_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, decoded one at a time through 4-token pages."""
    runner = PagedRunner(model, page_size=4, dtype=torch.float32)
    seq, out, new = Seq(), [], prompt
    for _ in range(n):
        token = int(runner.step([(seq, new)])[0][-1].argmax())
        out.append(token)
        new = [token]
    return out
