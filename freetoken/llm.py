"""The offline API: `LLM(model).generate(prompts, params)`, and `LLM(model).stream(prompt, params)`.

Owns running the engine in-process until the given prompts are done, with the same tokenizer
and incremental detokenizer (stop strings) the server uses. It has no scheduling logic of its
own: it adds requests, steps the engine and collects outputs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for, load_for
from freetoken.engine.engine import Engine, RequestUpdate
from freetoken.errors import ConfigError
from freetoken.models.load import LoadedModel
from freetoken.request import FinishReason, Request, RequestOutput, SamplingParams
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.detokenizer import IncrementalDetokenizer
from freetoken.weights.sampling_defaults import FIELDS, MODES, SamplingDefaults, checkpoint_sampling_defaults

Prompt = str | list[int]


class LLM:
    """A model and an engine in this process. Options are the engine flags, or `config=`."""

    def __init__(
        self,
        model: str | None = None,
        *,
        cache_type: str = "radix",
        dtype: str = "auto",
        weights: str = "auto",
        prefill_weights: str = "auto",
        weights_cache: str = "auto",
        device: str | None = None,
        page_size: int = 16,
        max_running_requests: int = 16,
        max_prefill_length: int = 1024,
        num_tokens: int | None = None,
        memory_ratio: float = 0.3,
        context_length: int | None = None,
        swa_full_tokens_ratio: float | None = None,
        swa_pool_tokens: int | str | None = None,
        debug_kv: bool = False,
        threads: int | None = None,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        sampling_defaults: str = "model",
    ) -> None:
        if config is None:
            config = EngineConfig(
                model=model,
                dtype=dtype,
                weights=weights,
                prefill_weights=prefill_weights,
                weights_cache=weights_cache,
                device=device,
                cache_type=cache_type,
                page_size=page_size,
                max_running_requests=max_running_requests,
                max_prefill_length=max_prefill_length,
                num_tokens=num_tokens,
                memory_ratio=memory_ratio,
                context_length=context_length,
                swa_full_tokens_ratio=swa_full_tokens_ratio,
                swa_pool_tokens=swa_pool_tokens,
                debug_kv=debug_kv,
                threads=threads,
            )
        if sampling_defaults not in MODES:
            raise ConfigError(f"sampling_defaults must be one of {', '.join(MODES)}, got {sampling_defaults!r}")
        self.config = config
        self.loaded = loaded if loaded is not None else load_for(config)
        self.engine: Engine = build_engine_for(config, self.loaded)
        self._ids = itertools.count()
        self._sampling_mode = sampling_defaults

    @functools.cached_property
    def sampling_defaults(self) -> SamplingDefaults:
        """The checkpoint's recommended sampling (generation_config.json or GGUF general.sampling.*),
        as `ft serve --sampling-defaults model` uses it; read when first needed (a GGUF's metadata
        is parsed again), none with `sampling_defaults="none"`."""
        if self._sampling_mode == "none":
            return SamplingDefaults()
        return checkpoint_sampling_defaults(self.loaded.source)

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` / `stream` use when given no params: `SamplingParams()` with the
        checkpoint's own temperature, top_p, top_k, min_p and penalties where it gives them."""
        return self.sampling_defaults.apply(SamplingParams(), FIELDS)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or self.default_sampling_params()] * len(prompt_list)
        else:
            param_list = list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        tok = self.tokenizer
        reqs: list[Request] = []
        detoks: dict[str, IncrementalDetokenizer] = {}
        eos = frozenset(tok.stop_ids)
        for prompt, p in zip(prompt_list, param_list):
            ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            req = Request(rid, ids, p, eos_ids=eos)
            self.engine.add_request(req)
            reqs.append(req)
            detoks[rid] = IncrementalDetokenizer(tok, stop=p.stop, skip_special_tokens=p.skip_special_tokens)
        texts = {r.rid: "" for r in reqs}
        stopped: set[str] = set()
        pending = {r.rid for r in reqs}
        while pending:
            for upd in self.engine.step():
                if upd.rid not in pending:
                    continue
                self._consume(upd, detoks[upd.rid], texts, stopped)
                if upd.finished:
                    pending.discard(upd.rid)
        outputs = []
        for req in reqs:
            reason = FinishReason.STOP if req.rid in stopped else req.finish_reason
            text = texts[req.rid] if req.rid in stopped else texts[req.rid] + detoks[req.rid].finish().text
            outputs.append(
                RequestOutput(
                    rid=req.rid,
                    prompt_ids=req.prompt_ids,
                    token_ids=list(req.output_ids),
                    text=text,
                    finish_reason=reason.value if reason is not None else None,
                    cached_tokens=req.report.cached_tokens,
                    logprobs=req.logprobs if req.params.logprobs is not None else None,
                    prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
                    error=req.error,
                    drafted_tokens=req.report.drafted_tokens,
                    accepted_tokens=req.report.accepted_tokens,
                )
            )
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Complete one prompt, yielding its text as it is decoded: each piece as soon as the
        detokenizer is sure of it (stop strings held back until they cannot match). The pieces
        join to what `generate` returns as `text` for the same prompt and params. Closing the
        iterator early (or an exception in the caller) aborts the request and frees its pages."""
        params = params or self.default_sampling_params()
        tok = self.tokenizer
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(Request(rid, ids, params, eos_ids=frozenset(tok.stop_ids)))
        detok = IncrementalDetokenizer(tok, stop=params.stop, skip_special_tokens=params.skip_special_tokens)
        stopped = finished = False
        try:
            while not finished:
                for upd in self.engine.step():
                    if upd.rid != rid:
                        continue
                    for tid in upd.new_token_ids:
                        if stopped:
                            break
                        piece = detok.add(tid).text
                        if detok.stopped:
                            stopped = True
                            self.engine.finish(rid, FinishReason.STOP)
                        if piece:
                            yield piece
                    finished = upd.finished
            if not stopped:
                tail = detok.finish().text
                if tail:
                    yield tail
        finally:
            if not finished:  # the caller stopped reading: end the request now (its pages released)
                self.engine.abort(rid)

    def _consume(
        self, upd: RequestUpdate, detok: IncrementalDetokenizer, texts: dict[str, str], stopped: set[str]
    ) -> None:
        for tid in upd.new_token_ids:
            if upd.rid in stopped:
                break
            texts[upd.rid] += detok.add(tid).text
            if detok.stopped:
                stopped.add(upd.rid)
                self.engine.finish(upd.rid, FinishReason.STOP)


__all__ = ["LLM", "SamplingParams"]
