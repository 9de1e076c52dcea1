"""Loading a model for serving: checkpoint -> ModelConfig -> model with weights -> tokenizer.

Owns the one path every entry point (`ft generate`, `LLM`, the engine process) uses to turn
`--model` into a ready model and its tokenizer. It does not size KV memory or schedule anything.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from freetoken.errors import ModelLoadError
from freetoken.models import shard
from freetoken.models.bind import bind_submodules
from freetoken.models.config import ModelConfig
from freetoken.models.experts import offload_experts
from freetoken.models.experts_cache import GIB, ExpertCache
from freetoken.models.formats import summary, weight_formats
from freetoken.models.linear import check_policy
from freetoken.models.registry import build_model, config_from_hf
from freetoken.tokenizer import Tokenizer
from freetoken.utils.heap import return_freed_memory
from freetoken.weights.loader import ModelSource, load_checkpoint, resolve_model

log = logging.getLogger("freetoken.models")


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    quant_types: dict[str, int]
    weights: str = "bf16"  # the --weights policy the model was loaded with
    formats: dict[str, str] = field(default_factory=dict)  # matrix -> what it runs as (models.formats)


def load_tokenizer(source: ModelSource, metadata: dict[str, object] | None) -> Tokenizer:
    if source.kind == "gguf":
        assert metadata is not None  # a GGUF checkpoint always carries its metadata
        return Tokenizer.from_gguf_metadata(metadata)
    return Tokenizer.from_pretrained_dir(source.path)


def load_model(
    spec: str | None, dtype: torch.dtype, device: torch.device, weights: str = "bf16", prefill_weights: str = "quantized",
    rank: int = 0, world: int = 1, moe_strategy: str = "resident", expert_cache_gb: float = 0.0,
) -> LoadedModel:
    """Resolve `spec`, read its weights, build the model on `device` with activations in `dtype`
    and each matrix as the `weights` policy says (`models.linear.apply_policy`; `bf16`, the
    default here, is every weight in `dtype`; the serving default is `auto`). `prefill_weights`
    says which quantized linear layers also keep a copy dequantized to `dtype` for prefill batches
    (`models.linear.keeps_dense_copy`: `bf16` all, `auto` where the kernel is slower, `quantized` none).
    With `world` > 1 the model is rank `rank`'s tensor-parallel shard (`models.shard`; the
    process group must be joined): `config` stays the whole model's, `model.config` is the shard's.
    `moe_strategy` `offload` leaves the experts in the checkpoint (the GGUF memory map) and decodes
    them on demand into an LRU cache of `expert_cache_gb` GiB (models/experts.py)."""
    check_policy(weights)
    t0 = time.perf_counter()
    source = resolve_model(spec)
    log.info("loading %s from %s", source.name, source.path)
    ckpt = load_checkpoint(source, dtype, keep_quantized=weights != "bf16")
    config = config_from_hf(ckpt.hf_config)
    tensors = ckpt.tensors
    plan = None
    if world > 1:
        plan = shard.ShardPlan(rank, world, config, shard.row_parallel_for(tensors, weights))
        shard.check_shardable(config, world, plan.row_parallel)
        tensors = shard.shard_tensors(tensors, plan)
    model = build_model(config if plan is None else plan.local_config(), dtype, device)
    if plan is not None:
        shard.gather_row_projections(model, plan)
    if moe_strategy == "offload":
        offload_experts(model, ExpertCache(int(expert_cache_gb * GIB)))
    try:
        model.load_weights(tensors, weights, prefill_weights)
    except (KeyError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{source.path}: weights do not fit the {config.architecture} model ({err})") from None
    if plan is not None:
        shard.install_collectives(model, plan)
    model.eval()
    bind_submodules(model)
    tokenizer = load_tokenizer(source, ckpt.metadata)
    quant_types = ckpt.quant_types
    del ckpt, tensors  # the checkpoint's temporaries: freed, then returned to the system
    return_freed_memory()
    formats = weight_formats(model)
    log.info("loaded %s (%s, %s, weights %s) in %.1f s", source.name, config.architecture, dtype, weights,
             time.perf_counter() - t0)
    log.info("weights of rank %d of %d run as %s%s", rank, world, summary(formats),
             "" if plan is None else f" (block outputs: {plan.row_parallel})")
    return LoadedModel(source, config, model, tokenizer, dtype, device, quant_types, weights, formats)
