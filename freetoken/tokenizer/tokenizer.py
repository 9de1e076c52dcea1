"""The tokenizer: text <-> token ids for one model, with its special ids and chat template.

Owns `Tokenizer`, a thin wrapper over a Hugging Face `tokenizers.Tokenizer` (the Rust library does
all the BPE work), built from GGUF metadata or from a directory holding `tokenizer.json`. It decides
which ids are added around a prompt (BOS/EOS as the model says), which ids end a generation, and
which chat template applies. It does not stream text (see `detokenizer.py`) and does not read
tensor data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as Backend

from freetoken.errors import ModelLoadError
from freetoken.tokenizer.cache import TokenizerCache
from freetoken.tokenizer.chat_template import ChatTemplate, NoChatTemplate, builtin_chat_template
from freetoken.tokenizer.gguf_vocab import backend_from_gguf_metadata, byte_fallback_ids

# Tokens that end a turn in the chat formats we know; each becomes a stop id when the vocabulary
# has it as a special token.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|return|>", "<|call|>", "<turn|>")
# ... and ones that stop even when not special: Gemma 4's hand-over to a tool after its calls
# (llama.cpp ends the generation there; its converter marks the token user-defined).
HAND_OVER_TOKENS = ("<|tool_response>",)


class Tokenizer:
    """Encode/decode for one model. `prefix_ids`/`suffix_ids` are added around the text when
    `encode(..., add_special_tokens=True)` (normally `[bos_id]` and `[]`)."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
        extra_stop_ids: Iterable[int] = (),
        pad_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.prefix_ids: tuple[int, ...] = tuple(prefix_ids)
        self.suffix_ids: tuple[int, ...] = tuple(suffix_ids)
        self.chat_template = chat_template
        self._compiled_template: ChatTemplate | None = None
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        self.byte_fallback_ids: frozenset[int] = byte_fallback_ids(backend)
        stops = set(extra_stop_ids)
        if eos_id is not None:
            stops.add(eos_id)
        for text in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None and token_id in self.special_ids:
                stops.add(token_id)
        for text in HAND_OVER_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None:
                stops.add(token_id)
        self.stop_ids: frozenset[int] = frozenset(stops)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, object], cache: TokenizerCache | None = None) -> Tokenizer:
        """The tokenizer a GGUF file describes (`metadata` as `read_metadata` returns it); with
        `cache`, a SentencePiece vocabulary's merges are read from it when they were derived before
        (cache.py), else derived and kept."""
        meta = dict(metadata)
        backend = backend_from_gguf_metadata(meta, cache)
        size = backend.get_vocab_size(with_added_tokens=True)

        def special(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < size else None

        bos_id, eos_id = special("bos_token_id"), special("eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        extra_stops = [i for i in (special("eot_token_id"), special("eom_token_id")) if i is not None]
        template = meta.get("tokenizer.chat_template")
        if not isinstance(template, str) or not template:
            template = builtin_chat_template(str(meta.get("general.architecture", "")))
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            prefix_ids=[bos_id] if add_bos and bos_id is not None else [],
            suffix_ids=[eos_id] if add_eos and eos_id is not None else [],
            extra_stop_ids=extra_stops,
            pad_id=special("padding_token_id"),
            chat_template=template,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory: `tokenizer.json`, plus the optional
        `tokenizer_config.json`, `chat_template.jinja`/`chat_template.json`,
        `generation_config.json` and `config.json` (for the model type)."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{root} has no tokenizer.json")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"{tokenizer_file} is not a readable tokenizer ({err})") from None
        # Some tokenizer.json files carry padding/truncation settings; ids must be the text's only.
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(root / "tokenizer_config.json")
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        prefix, suffix = _added_by_post_processor(backend)
        if "add_bos_token" in config:
            prefix = [bos_id] if config["add_bos_token"] and bos_id is not None else []
        if "add_eos_token" in config:
            suffix = [eos_id] if config["add_eos_token"] and eos_id is not None else []
        # The backend's own post-processor is replaced by prefix/suffix, so it must not add twice.
        backend.post_processor = None
        generation = _read_json(root / "generation_config.json")
        gen_eos = generation.get("eos_token_id")
        listed = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        extra_stops = [i for i in listed if isinstance(i, int) and not isinstance(i, bool)]
        model_type = str(_read_json(root / "config.json").get("model_type", ""))
        template = _dir_chat_template(root, config) or builtin_chat_template(model_type)
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id if eos_id is not None else (extra_stops[0] if extra_stops else None),
            prefix_ids=prefix,
            suffix_ids=suffix,
            extra_stop_ids=extra_stops,
            pad_id=_token_id(backend, config.get("pad_token")),
            chat_template=template,
        )

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised. With
        `add_special_tokens`, BOS/EOS are added as the model's metadata says."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and (self.prefix_ids or self.suffix_ids):
            return [*self.prefix_ids, *ids, *self.suffix_ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` (invalid UTF-8 becomes U+FFFD)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (None if out of range)."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry `token` (None if absent)."""
        return self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.id_to_token(self.eos_id)

    @property
    def backend(self) -> Backend:
        """The underlying `tokenizers.Tokenizer` (no BOS/EOS post-processing)."""
        return self._backend

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
        extra_context: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text for `messages` (encode it with `add_special_tokens=False`: templates write
        their own BOS). Raises NoChatTemplate when the model has none."""
        if self.chat_template is None:
            raise NoChatTemplate("this model has no chat template; use a raw completion instead")
        if self._compiled_template is None:
            self._compiled_template = ChatTemplate(self.chat_template)
        return self._compiled_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            extra_context=extra_context,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
        extra_context: Mapping[str, object] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (no BOS/EOS added beyond what the template writes)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, extra_context=extra_context
        )
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def _token_id(backend: Backend, token: object) -> int | None:
    """Id of a tokenizer_config special token, written as a string or as a serialized AddedToken."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _added_by_post_processor(backend: Backend) -> tuple[list[int], list[int]]:
    """The ids the backend's post-processor puts before and after a single sequence."""
    bare = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []


def _dir_chat_template(root: Path, config: Mapping[str, object]) -> str | None:
    """The chat template of a model directory: chat_template.jinja, chat_template.json, then
    tokenizer_config.json (a string, or a list of named templates where "default" wins)."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None
