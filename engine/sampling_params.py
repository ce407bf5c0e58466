"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from engine.sampler_settings import SETTINGS, default

# Limits that keep one request from monopolising the engine; the server maps
# violations to HTTP 400.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20

# Structured outputs (what engine/structured.py can enforce).
STRUCTURED_KINDS = ("json_object", "json", "regex", "choice", "grammar")
# A request's grammar source (schema JSON, regex, choices, Lark or GBNF text) at most this long.
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_CHOICES = 256

MAX_DRY_SEQUENCE_BREAKERS = 16
# The steps of llama.cpp's ``samplers`` chain that SamplingParams.samplers orders (its names).
SAMPLER_STEPS = ("top_k", "typ_p", "top_p", "min_p", "xtc", "temperature", "top_n_sigma")
MAX_DRY_BREAKER_CHARS = 40  # as llama.cpp: a longer breaker is cut to this many characters


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    ``kind`` is one of ``STRUCTURED_KINDS``: ``json_object`` (any JSON object, ``value``
    None), ``json`` (a JSON Schema: a dict, or its JSON text), ``regex`` (a
    regular expression the whole output matches), ``choice`` (a list of
    strings, the output is one of them), ``grammar`` (a Lark grammar, as
    llguidance reads it, with a ``start`` rule; or llama.cpp's GBNF, with a
    ``root`` rule, which ``engine.structured`` converts to Lark).
    """

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "json":
            if isinstance(self.value, str):
                try:
                    schema = json.loads(self.value)
                except ValueError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
                object.__setattr__(self, "value", schema)
            if not isinstance(self.value, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
        elif self.kind in ("regex", "grammar"):
            if not isinstance(self.value, str) or not self.value:
                raise ValueError(f"a {self.kind} must be a non-empty string")
        elif self.kind == "choice":
            if (not isinstance(self.value, (list, tuple)) or not self.value
                    or not all(isinstance(c, str) and c for c in self.value)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            if len(self.value) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} choices are allowed, got {len(self.value)}")
            object.__setattr__(self, "value", tuple(self.value))
        if len(self.source_text()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the {self.kind} is longer than {MAX_GRAMMAR_BYTES} bytes")

    def source_text(self) -> str:
        """The request's grammar source as text (what the size limit counts)."""
        if self.kind in ("regex", "grammar"):
            return self.value
        return json.dumps(self.value) if self.value is not None else ""


@dataclass(frozen=True)
class ThinkTokens:
    """A thinking model's reasoning block, by its marker tokens: a structured output
    then holds for the answer after the block, not for the reasoning in it.

    ``opens_in_prompt``: the template opened the block, so the output starts inside
    it (DeepSeek-R1); otherwise the output may open it with ``start`` as its first
    token (Qwen3), or answer at once under the grammar. While the block is open
    every token but an end of text is allowed; blanks right after ``end`` are too.
    ``end_after``: tokens that must come, in a row, before ``end`` closes the block
    (gpt-oss's harmony: ``<|channel|>`` then ``final``, and its ``<|message|>`` is
    ``end``); their first occurs only there, and it starts them over wherever it comes.
    """

    start: int
    end: int
    opens_in_prompt: bool = False
    end_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.end_after and self.end_after[0] in (*self.end_after[1:], self.end):
            raise ValueError("the first of end_after must occur only there")

    @property
    def token_ids(self) -> list[int]:
        """Every token the block names (what validation checks against the vocabulary)."""
        return [self.start, *self.end_after, self.end]


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: instead of generating, the request's answer is its prompt's
    last hidden state (after the model's final norm: last-token pooling, as vLLM pools a
    decoder-only model), its first ``dimensions`` values (a Matryoshka model's shorter
    embedding; None: all), L2-normalised when ``normalize``."""

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy decoding. ``max_tokens=None`` means "up to
    the rest of the context window" (the engine resolves it per request).
    Every field is validated in ``__post_init__``; an invalid value raises
    ``ValueError`` with a message a user can act on.
    """

    n: int = 1
    temperature: float = default("temperature")
    top_p: float = default("top_p")
    top_k: int = default("top_k")  # 0 (or -1) disables top-k
    min_p: float = default("min_p")
    repetition_penalty: float = default("repetition_penalty")
    presence_penalty: float = default("presence_penalty")
    frequency_penalty: float = default("frequency_penalty")
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled one
    # Logprobs of the prompt's own tokens (each given the tokens before it), with
    # this many top alternatives; None: none. Such a request's prompt is computed
    # whole, not served from the prefix cache: its rows' logits are needed.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's: the only tokens that may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated (their last token is masked where it would complete one).
    bad_words: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    # What the output must match (engine/structured.py enforces it); None: free text.
    structured: StructuredOutput | None = None
    # With ``structured``: the reasoning block the grammar waits out (ThinkTokens).
    think: ThinkTokens | None = None
    # An embedding request (PoolingParams): nothing is sampled; None: generate.
    pooling: PoolingParams | None = None
    # vLLM's scheduling priority: lower values are admitted first and preempted last. Only
    # an engine with the priority policy takes a value other than 0 (engine.validation).
    priority: int = 0
    # vLLM's cache_salt: the prefix cache shares this request's blocks only with requests
    # of the same salt (None: with every unsalted request), so tenants cannot probe each
    # other's prompts by timing cache hits.
    cache_salt: str | None = None
    # Which tokens the penalties count. None: vLLM's (and OpenAI's) way, the repetition
    # penalty over prompt and output, presence and frequency over the output. An int:
    # llama.cpp's repeat_last_n, all three over the last that many tokens of prompt and
    # output (-1: all of them; 0: no penalty).
    repeat_last_n: int | None = default("repeat_last_n")
    # llama.cpp's samplers beyond vLLM's (each off by default; engine/sampler.py has the order).
    # Locally typical sampling: the most typical tokens (log-probability nearest the entropy)
    # whose probability reaches typical_p (1: off).
    typical_p: float = default("typical_p")
    # llama.cpp's order: the temperature divides the logits after the truncations
    # (top-k ... XTC), not before them as in vLLM.
    temperature_last: bool = default("temperature_last")
    # Dynamic temperature: between temperature -/+ dynatemp_range (not below 0), higher the
    # flatter the distribution left after the truncations (dynatemp_exponent shapes how);
    # it comes last, as in llama.cpp. 0: the plain temperature.
    dynatemp_range: float = default("dynatemp_range")
    dynatemp_exponent: float = default("dynatemp_exponent")
    # Top-n-sigma: only logits within top_n_sigma standard deviations of the largest (<= 0: off).
    top_n_sigma: float = default("top_n_sigma")
    # XTC: with probability xtc_probability, every token at least xtc_threshold likely is
    # dropped but the least likely of them (a threshold above 0.5 turns it off).
    xtc_probability: float = default("xtc_probability")
    xtc_threshold: float = default("xtc_threshold")
    # DRY: a token that would extend a repeat of the context longer than dry_allowed_length
    # tokens loses dry_multiplier * dry_base ** (length - dry_allowed_length) from its logit;
    # a repeat ends at any of dry_sequence_breakers. dry_penalty_last_n: how many of the
    # last tokens (prompt included) are searched, -1 all. dry_multiplier 0: off.
    dry_multiplier: float = default("dry_multiplier")
    dry_base: float = default("dry_base")
    dry_allowed_length: int = default("dry_allowed_length")
    dry_penalty_last_n: int = default("dry_penalty_last_n")
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(default("dry_sequence_breakers")))
    # Mirostat (Basu et al.; llama.cpp's 1 and 2, 0: off): instead of the truncations above,
    # keep the tokens whose surprise (-log2 p, after the temperature) is within mu, and move
    # mu by mirostat_eta * (the sampled token's surprise - mirostat_tau) after each token,
    # so that the answer's surprise per token stays near mirostat_tau bits. Version 1 keeps
    # the top k tokens, k estimated from mu and the distribution's Zipf exponent.
    mirostat: int = default("mirostat")
    mirostat_tau: float = default("mirostat_tau")
    mirostat_eta: float = default("mirostat_eta")
    # llama.cpp's ``samplers``: the truncations and the temperature to run, in this order
    # (SAMPLER_STEPS' names), and no other; None: the default order (engine/sampler.py).
    # The penalties and DRY come first either way; mirostat ignores it, as llama.cpp's.
    samplers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.dry_sequence_breakers = list(self.dry_sequence_breakers)
        if self.samplers is not None:
            self.samplers = tuple(self.samplers)
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        for setting in SETTINGS:  # the sampler knobs: their rules are the table's
            setting.check(getattr(self, setting.name))
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError("cache_salt must be a non-empty string if given")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        self._validate_lists()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if self.think is not None and self.structured is None:
            raise ValueError("think only shapes a structured output: set structured too")
        if self.pooling is not None and (self.n != 1 or self.max_tokens != 1 or self.logprobs is not None
                                         or self.prompt_logprobs is not None or self.structured is not None):
            raise ValueError("an embedding request (pooling) samples nothing: n and max_tokens 1, "
                             "no logprobs, prompt_logprobs or structured output")
        if any(not w for w in self.bad_words):
            raise ValueError("bad_words must not hold an empty word")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        for tok, bias in self.logit_bias.items():
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias for token {tok} must be in [-100, 100], got {bias}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError("seed must fit in a signed 64-bit integer")

    def _validate_lists(self) -> None:
        if self.samplers is not None and (len(self.samplers) > 4 * len(SAMPLER_STEPS)
                                          or any(step not in SAMPLER_STEPS for step in self.samplers)):
            raise ValueError(f"samplers must list at most {4 * len(SAMPLER_STEPS)} of {', '.join(SAMPLER_STEPS)}, "
                             f"got {list(self.samplers)!r}")
        breakers = self.dry_sequence_breakers
        if len(breakers) > MAX_DRY_SEQUENCE_BREAKERS:
            raise ValueError(f"at most {MAX_DRY_SEQUENCE_BREAKERS} dry_sequence_breakers are allowed, "
                             f"got {len(breakers)}")
        if any(not isinstance(b, str) or not b for b in breakers):
            raise ValueError("dry_sequence_breakers must be non-empty strings")

    @property
    def dry_active(self) -> bool:
        """Whether DRY changes any logit (as llama.cpp: a multiplier and a window)."""
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def xtc_active(self) -> bool:
        """Whether XTC may drop tokens (and so draws its coin each sampled token)."""
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5 and not self.mirostat

    @classmethod
    def embedding(cls, pooling: PoolingParams | None = None, priority: int = 0,
                  cache_salt: str | None = None) -> "SamplingParams":
        """An embedding request's parameters: nothing sampled, ``pooling`` (default: the
        whole vector, normalised) the answer."""
        return cls(n=1, temperature=0.0, max_tokens=1, pooling=pooling or PoolingParams(), priority=priority,
                   cache_salt=cache_salt)

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax (no randomness). Mirostat
        replaces top-k (as in llama.cpp), and a ``samplers`` order may leave it out, so
        then only the temperature can make it greedy."""
        top_k_runs = not self.mirostat and (self.samplers is None or "top_k" in self.samplers)
        return self.temperature == 0 or (self.top_k == 1 and top_k_runs)
