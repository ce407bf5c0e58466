"""OpenAI request bodies (pydantic v2) and their conversion to ``SamplingParams``.

Models are strict (no ``"16"`` for an int, no ``true`` for a number) and
ignore unknown fields, as OpenAI does. Range checks live in one place,
``SamplingParams``; this module only checks shapes and maps its ``ValueError``
to a 400. Response bodies are in ``server.protocol_responses``; the chat request is
``server.protocol_chat``'s, the embeddings, score and rerank ones ``server.protocol_pooling``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from engine.sampler_settings import SETTINGS
from engine.sampling_params import SamplingParams, StructuredOutput
from server.engine_client import TokenizerLike
from server.errors import APIError, bad_request

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}

# Prompts in one completions request. Each becomes an engine request, and the
# engine lets the prompts of one request take turns with other requests
# (engine/waiting_queue.py); the bound keeps one body from queueing thousands.
MAX_PROMPTS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far, not only the last.
    continuous_usage_stats: bool | None = False


class _Exact(BaseModel):
    # Structured-output options: an option kvserve does not know is a 400, never ignored.
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Exact):
    """``response_format.json_schema`` (OpenAI): the schema the answer must match."""

    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # kvserve always enforces the schema
    description: str | None = None


class ResponseFormat(_Exact):
    """``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class StructuredOutputs(_Exact):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self) -> StructuredOutput:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": True if self.json_object else None}
        kinds = [k for k, v in given.items() if v is not None]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(given)}, got "
                             f"{', '.join(kinds) or 'none'}")
        kind = kinds[0]
        return StructuredOutput(kind, None if kind == "json_object" else given[kind])


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the
    model's context length; None: the whole prompt)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def encode_prompts(tokenizer: TokenizerLike, prompts: list[str | list[int]], keep: int | None,
                   max_model_len: int, add_special_tokens: bool = True) -> list[list[int]]:
    """Each prompt as token ids (a text encoded, a list of ids as it is), cut to its last
    ``keep`` tokens as ``truncate_prompt`` cuts them."""
    return [truncate_prompt(tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p,
                            keep, max_model_len) for p in prompts]


def _check_truncate(value: int | None) -> int | None:
    if value is not None and value != -1 and value < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {value}")
    return value


# Every sampler setting (engine.sampler_settings: OpenAI's temperature, top_p and penalties,
# vLLM's top_k, min_p and repetition_penalty, llama.cpp's samplers by its names), each an
# optional field: None means the default.
_SamplerFields = create_model("_SamplerFields", __base__=_Strict,
                              **{s.name: (s.annotation | None, None) for s in SETTINGS})


class _SamplingRequest(_SamplerFields):
    """Fields shared by completions and chat completions (OpenAI + vLLM extras), beside
    the sampler settings."""

    model: str | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    # vLLM extensions.
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the answer's token ids too
    bad_words: list[str] | None = None
    priority: int | None = None  # vLLM's: lower is admitted first (--scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests of the same salt
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # The prompt's own logprobs with this many alternatives, in vLLM's shape (not streamed).
    prompt_logprobs: int | None = None
    # Logprob entries name their tokens "token_id:<id>" rather than by their text.
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or
    # llama.cpp's server's grammar (GBNF, or Lark) and json_schema.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # llama.cpp's sampler chain, its names or letters ("kypmxt"): only these, in this order.
    samplers: list[str] | str | None = None

    # Fields that ask for a constraint in another API's words. Unknown fields are
    # ignored, but ignoring one of these would answer without the constraint asked
    # for (structured outputs fail closed), so each is a 400 saying what to send.
    # (vLLM's guided_decoding_backend and the like carry no constraint: ignored.)
    REPLACED_FIELDS: ClassVar[dict[str, str]] = {
        f"guided_{k}": f'structured_outputs: {{"{k}": ...}}' for k in ("json", "regex", "choice", "grammar")}

    _truncate = field_validator("truncate_prompt_tokens")(_check_truncate)

    @model_validator(mode="before")
    @classmethod
    def _refuse_replaced_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, instead in cls.REPLACED_FIELDS.items():
                if data.get(name) is not None:
                    raise bad_request(f"{name} is not supported; use {instead}", name)
        return data

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (``stream_options.continuous_usage_stats``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with its JSON string keys turned into token ids."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                  "logit_bias") from None
        return out

    def _structured_fields(self) -> list[str]:
        """The body fields that ask for a structured output."""
        given = {"response_format": self.response_format is not None and self.response_format.type != "text",
                 "structured_outputs": self.structured_outputs is not None,
                 "grammar": self.grammar is not None, "json_schema": self.json_schema is not None}
        return [name for name, asked in given.items() if asked]

    @property
    def structured_param(self) -> str:
        """The body field a structured output comes from, for errors about it."""
        return next(iter(self._structured_fields()), "response_format")

    def structured_output(self) -> StructuredOutput | None:
        """What the answer must match, from exactly one of ``response_format``,
        ``structured_outputs``, ``grammar`` and ``json_schema`` (a 400 for more)."""
        fields = self._structured_fields()
        if len(fields) > 1:
            raise bad_request(f"send one of {', '.join(fields)}, not several", fields[1])
        try:
            if not fields:
                return None
            if self.structured_outputs is not None:
                return self.structured_outputs.spec()
            if self.grammar is not None:
                return StructuredOutput("grammar", self.grammar)
            if self.json_schema is not None:
                return StructuredOutput("json", self.json_schema)
            fmt = self.response_format
            assert fmt is not None
            if fmt.type == "json_object":
                return StructuredOutput("json_object")
            return StructuredOutput("json", fmt.json_schema.schema_)
        except ValueError as e:
            raise bad_request(str(e), self.structured_param) from None

    def to_sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None) -> SamplingParams:
        """Build the engine's params; an invalid value becomes a 400 naming the field."""
        given: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens, "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words, "priority": self.priority, "cache_salt": self.cache_salt,
            **{s.name: getattr(self, s.name) for s in SETTINGS},
            "samplers": llamacpp_sampler_order(self.samplers),
        }
        # None means "the default", so only pass what the client set.
        kwargs = {k: v for k, v in given.items() if v is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  logit_bias=self.logit_bias_ids(), structured=self.structured_output(),
                                  **kwargs)
        except ValueError as e:
            raise sampling_error(e) from None


# llama.cpp's names (and alternative names) of its samplers -> SamplingParams.samplers' steps.
# "dry", "penalties" and "infill" are known and have no place in the order here (the
# penalties and DRY always come first).
_SAMPLER_NAMES = {
    "top_k": "top_k", "top-k": "top_k", "typ_p": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "typical_p": "typ_p",
    "typical-p": "typ_p", "typical": "typ_p", "top_p": "top_p", "top-p": "top_p", "nucleus": "top_p",
    "min_p": "min_p", "min-p": "min_p", "xtc": "xtc", "temperature": "temperature", "temp": "temperature",
    "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma"}
# llama.cpp's one-letter names ("dkypmxts"; d, e and i: DRY, the penalties, infill).
_SAMPLER_LETTERS = {"k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature",
                    "s": "top_n_sigma"}


def llamacpp_sampler_order(samplers: list[str] | str | None) -> tuple[str, ...] | None:
    """llama.cpp's ``samplers`` (a list of names, or a string of its letters) as the
    order of the steps to run; as llama.cpp, a name it does not know is skipped."""
    if samplers is None:
        return None
    if isinstance(samplers, str):
        return tuple(_SAMPLER_LETTERS[c] for c in samplers if c in _SAMPLER_LETTERS)
    return tuple(_SAMPLER_NAMES[name] for name in samplers if name in _SAMPLER_NAMES)


def sampling_error(err: ValueError) -> APIError:
    """A 400 for a ``SamplingParams`` error, naming the field when the message starts with it."""
    message = str(err)
    first = message.split(" ", 1)[0]
    return bad_request(message, first if first in _SAMPLING_FIELDS else None)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    # The code after the completion: a fill-in-the-middle prompt (server.fim; a code model's).
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, p: Any) -> Any:
        items = p if isinstance(p, list) else []
        if p == "" or p == [] or any(x == "" or x == [] for x in items):
            raise ValueError("prompt must not be empty")
        if items and not isinstance(items[0], int) and len(items) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, "
                             f"got {len(items)}; split them over several requests")
        return p

    @model_validator(mode="after")
    def _check_combinations(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        if self.echo_only and (self.min_tokens or 0) > 0:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens (0)")
        if self.suffix and self.echo:
            raise ValueError("echo does not go with suffix (the prompt runs around the suffix)")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt back (with its logprobs when asked:
        scoring a text), nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        """With ``echo`` and ``logprobs``, the prompt's own logprobs are asked for too (with
        ``prompt_logprobs`` alternatives where it is given)."""
        # NOTE: the engine always samples at least one token; an echo_only request's
        # is dropped (as vLLM does).
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        return self.to_sampling_params(max_tokens=1 if self.echo_only else self.max_tokens,
                                       logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)


class LoadLoRAAdapterRequest(_Strict):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter at ``lora_path`` as ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Strict):
    """``POST /v1/unload_lora_adapter`` (vLLM's); its ``lora_int_id`` is accepted and ignored."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
