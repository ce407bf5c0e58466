"""Tokenizer: text <-> token ids for one model, its special ids and chat template.

Two sources are supported:

* a Hugging Face checkpoint directory (``tokenizer.json`` and friends), loaded
  as-is with the ``tokenizers`` library;
* a GGUF file, whose ``tokenizer.ggml.*`` metadata (vocabulary, merges, token
  types) is rebuilt into a ``tokenizers`` pipeline that splits text the way
  llama.cpp does for the file's ``tokenizer.ggml.pre`` type (``models.gguf_tokenizer``).
  For "smollm" that means isolating every digit before the GPT-2 regex, as SmolLM2's
  own tokenizer.json does (transformers' GGUF converter skips that step).

BOS is added by this class, never by a ``tokenizers`` post-processor, so that
``encode(text, add_special_tokens=True)`` means exactly "prepend BOS if the
model asks for it" for both sources.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from gguf import TokenType
from tokenizers import decoders

from models.chat_template import render_chat_template, template_tool_syntax
from models.gguf_tokenizer import BPE_PRE_TYPES, BYTE_FALLBACK, byte_level_backend, char_to_byte, sentencepiece_backend


@dataclass(frozen=True)
class FimTokens:
    """A code model's fill-in-the-middle markers, as token ids: a prompt is
    ``prefix <code before> suffix <code after> middle``, and the model writes the
    code between. ``repo`` and ``file_sep`` (None where the model has none) name a
    repository and open each file of context before that (Qwen2.5-Coder's layout)."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None


# The markers' texts per model family (prefix, suffix, middle), as llama.cpp looks them up
# when a GGUF file does not declare them: Qwen2.5-Coder and most recent code models,
# StarCoder, CodeGemma, CodeLlama (and its SentencePiece spelling), DeepSeek-Coder.
_FIM_TEXTS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
              ("<|fim_begin|>", "<|fim_hole|>", "<|fim_end|>"),
              ("<PRE>", "<SUF>", "<MID>"), ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"),
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
_FIM_REPO_TEXTS = ("<|repo_name|>", "<repo_name>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>", "<file_sep>")
# GGUF's declared ids (tokenizer.ggml.<key>_token_id) -> FimTokens' fields.
_GGUF_FIM_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle", "fim_rep": "repo",
                  "fim_sep": "file_sep"}


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and special ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool = False,
        chat_template: str | None = None,
        fim_token_ids: Mapping[str, int] | None = None,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``; its post-processor is never used.

        Prefer ``from_gguf_fields`` or ``from_hf_dir``; this is for callers
        (and tests) that already hold a backend. ``fim_token_ids``: fill-in-the-middle
        markers a file declares (``FimTokens``' field names -> ids), over the ones
        found by their texts.
        """
        self._backend = backend
        self._fim_token_ids = dict(fim_token_ids or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.all_special_ids: set[int] = special | set(self.eos_token_ids) | (
            {bos_token_id} if bos_token_id is not None else set()
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the embedding rows the model needs)."""
        return self._vocab_size

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizers`` JSON (for grammar libraries that read it)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended only if the model says so.

        Special-token text inside ``text`` (e.g. ``<|im_start|>``) becomes the
        special token, as in Hugging Face and llama.cpp. Encode a rendered chat
        prompt with ``add_special_tokens=False``: the template writes any BOS.
        """
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, control tokens) are dropped by default."""
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {size})")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (byte-level spelling, e.g. ``Ġthe``), or None."""
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, as OpenAI's logprobs report them: a token
        holding part of a UTF-8 character (an emoji is often two) gives that part, which
        ``decode`` cannot (it gives U+FFFD). Byte-level vocabularies spell the bytes in
        GPT-2's table; SentencePiece ones write a byte as ``<0xAB>`` and a space as ``▁``
        (kept as a space, which ``decode`` drops at the start of a text); added tokens
        (the special ones among them) give their text."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_token_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            table = char_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        fallback = BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback[1], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        return isinstance(self._backend.decoder, decoders.ByteLevel)

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether ``other`` has this tokenizer's tokens under the same ids."""
        return self.vocab_size == other.vocab_size and all(
            self.id_to_token(i) == other.id_to_token(i) for i in range(self.vocab_size))

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer with another chat template (a copy: this one is unchanged)."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The fill-in-the-middle markers (None: the model has none): the ids the file
        declares, else the first family of ``_FIM_TEXTS`` whose three texts are tokens."""
        declared = self._fim_token_ids

        def first(texts: Sequence[str]) -> int | None:
            return next((i for i in map(self._backend.token_to_id, texts) if i is not None), None)

        found: dict[str, int | None] = {"repo": first(_FIM_REPO_TEXTS), "file_sep": first(_FIM_SEP_TEXTS)}
        for texts in _FIM_TEXTS:
            ids = [self._backend.token_to_id(t) for t in texts]
            if None not in ids:
                found.update(zip(("prefix", "suffix", "middle"), ids))
                break
        found.update(declared)
        if any(found.get(k) is None for k in ("prefix", "suffix", "middle")):
            return None
        return FimTokens(**{k: found.get(k) for k in ("prefix", "suffix", "middle", "repo", "file_sep")})

    @property
    def tool_call_syntax(self) -> str | None:
        """How the chat template writes tool calls (``chat_template.template_tool_syntax``)."""
        return template_tool_syntax(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None,
                            continue_final_message: bool = False) -> str:
        """Render ``messages`` with the model's template (ChatML if it has none);
        ``tools`` (OpenAI's tool objects) go to a template that renders them, and
        ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g. Qwen3's
        ``enable_thinking``) are more variables for it; ``continue_final_message``
        leaves the last message open for the model to continue.

        Raises:
            ValueError: malformed messages, template variables that would replace the
                server's own, or a template that fails to render.
        """
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
            tools=tools, context=template_kwargs, continue_final_message=continue_final_message,
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata
        (``fields``: ``models.gguf_reader.GGUFFile.fields``).

        Supports ``tokenizer.ggml.model`` "gpt2" (byte-level BPE, with the
        pre-tokenizer chosen by ``tokenizer.ggml.pre``) and "llama"
        (SentencePiece-style BPE with byte fallback). EOS ids are the ones the
        file declares: ``eos_token_id`` plus ``eot_token_id``/``eom_token_id``.

        Raises:
            ValueError: another tokenizer model or pre-tokenizer type, or
                missing vocabulary metadata.
        """

        def field(key: str, default: Any = None) -> Any:
            return fields.get(f"tokenizer.{key}", default)

        tokens = field("ggml.tokens")
        if not tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer to load")
        kind = field("ggml.model")
        types = field("ggml.token_type") or [TokenType.NORMAL] * len(tokens)
        if kind == "gpt2":
            pre = field("ggml.pre") or "default"
            backend = byte_level_backend(tokens, types, field("ggml.merges") or [], pre)
            add_bos_default = BPE_PRE_TYPES[pre].add_bos
        elif kind in ("llama", "gemma4"):  # (Gemma 4's: SentencePiece-style, its merges listed)
            backend = sentencepiece_backend(
                tokens, types, field("ggml.scores"), field("ggml.unknown_token_id"),
                add_space_prefix=field("ggml.add_space_prefix", kind == "llama"),
                merges=field("ggml.merges") if kind == "gemma4" else None,
            )
            add_bos_default = True
        else:
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                "'llama' and 'gemma4' (SentencePiece BPE). Use the model's Hugging Face directory instead."
            )
        eos_ids = [field(f"ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
        return cls(
            backend,
            bos_token_id=field("ggml.bos_token_id"),
            eos_token_ids=[i for i in eos_ids if i is not None],
            add_bos_token=field("ggml.add_bos_token", add_bos_default),
            chat_template=field("chat_template"),
            fim_token_ids={name: field(f"ggml.{key}_token_id") for key, name in _GGUF_FIM_KEYS.items()
                           if field(f"ggml.{key}_token_id") is not None},
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, generation_config: dict | None = None) -> "Tokenizer":
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` from a checkpoint directory.

        The chat template comes from ``chat_template.jinja`` or the config's
        ``chat_template``. EOS ids are the tokenizer's ``eos_token`` followed by
        ``generation_config["eos_token_id"]`` (an int or a list); when
        ``generation_config`` is None, ``generation_config.json`` is read if
        present.

        Raises:
            ValueError: no ``tokenizer.json`` in ``path`` or an unknown
                special token name.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(
                f"{path} has no tokenizer.json; kvserve needs the fast-tokenizer file "
                "(transformers' save_pretrained writes it)"
            )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        if generation_config is None:
            generation_config = _read_json(path / "generation_config.json")

        bos_id = _special_id(backend, config.get("bos_token"))
        eos_ids = [_special_id(backend, config.get("eos_token"))]
        declared = generation_config.get("eos_token_id")
        eos_ids += declared if isinstance(declared, list) else [declared]

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the tokenizer.json post-processor is the checkpoint's own answer (Llama 3 adds BOS there).
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            add_bos_token=bool(add_bos),
            chat_template=_hf_chat_template(path, config),
        )


# --- Hugging Face directory -----------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def _special_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    if token is None:
        return None
    content = token["content"] if isinstance(token, dict) else token
    token_id = backend.token_to_id(content)
    if token_id is None:
        raise ValueError(f"special token {content!r} from tokenizer_config.json is not in tokenizer.json")
    return token_id


def _hf_chat_template(path: Path, config: dict) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Older configs hold named templates; "default" is the one for plain chat.
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
