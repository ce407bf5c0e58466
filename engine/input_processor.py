"""Request preparation: an API request's checks and token-level settings, before the engine.

Everything here works out what a request needs from what the engine fixed at
start-up (the tokenizer, the limits, the served adapters): the default
sampling, the validation, the grammar, ``bad_words`` and DRY's breakers as
tokens, the LoRA adapter's key, and at last the request's ``n`` sequences. It
runs on the caller's thread (``prepare``) so that the engine loop never waits
on a tokenizer scan or a grammar compile.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from engine.config import EngineConfig
from engine.lora_registry import LoRARegistry
from engine.request import EngineRequest, Request
from engine.sampler import dry_breakers
from engine.sampling_params import SamplingParams
from engine.structured import GrammarCompiler
from engine.validation import RequestLimits, check_request
from models.config import ModelConfig
from models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Sets of DRY breakers whose tokens are kept: a scan of the vocabulary each.
DRY_BREAKER_SETS_KEPT = 32


def sampling_overrides(config: EngineConfig) -> dict[str, Any]:
    """The operator's part of the default sampling (``override_generation_config``'s,
    checked with the rest by :func:`sampling_defaults`): llama.cpp's /completion applies
    it too, as llama-server applies its own command line's sampling, and keeps
    llama.cpp's defaults over the model's."""
    return {k: v for k, v in config.override_generation_config.items() if k != "max_new_tokens"}


def sampling_defaults(config: EngineConfig, model: ModelConfig) -> dict[str, Any]:
    """The default sampling of requests that leave it out: the model's recommended
    values (``generation_config.json``; none with ``generation_config="vllm"`` or when
    they are invalid), under ``override_generation_config``'s, as vLLM's."""
    defaults: dict[str, Any] = dict(model.sampling_defaults) if config.generation_config == "auto" else {}
    if defaults:
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            logger.warning("ignoring the model's generation_config.json sampling %s: %s", defaults, e)
            defaults = {}
        else:
            logger.info("default sampling from the model's generation_config.json (a request's own values "
                        "win; --generation-config vllm ignores them): %s", defaults)
    override = sampling_overrides(config)
    if override:
        logger.info("default sampling from --override-generation-config (a request's own values win): %s",
                    override)
        defaults.update(override)
        try:  # each part was valid alone; together they may not be (top_k from one, ...)
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"--override-generation-config with the model's generation_config.json: {e}") from None
    return defaults


def default_max_tokens(config: EngineConfig, model: ModelConfig) -> int | None:
    """The longest answer of a request that sets no length: ``override_generation_config``'s
    max_new_tokens, else generation_config.json's (with ``generation_config="auto"``)."""
    override = config.override_generation_config.get("max_new_tokens")
    if override is not None:
        logger.info("default answer length from --override-generation-config: at most %d tokens "
                    "where a request sets none", override)
        return override
    if config.generation_config != "auto" or model.max_new_tokens is None:
        return None
    logger.info("default answer length from the model's generation_config.json: at most %d tokens "
                "where a request sets none", model.max_new_tokens)
    return model.max_new_tokens


class InputProcessor:
    """Checks requests and works out their token-level settings (``prepare``), then
    makes their sequences (``sequences``).

    ``limits`` bound every request; ``grammars`` compiles structured outputs;
    ``adapters`` resolves a request's LoRA adapter; ``eos_token_ids`` end every
    sequence. ``prepare`` may run on any thread at once: what it caches is locked.
    """

    def __init__(self, tokenizer: Tokenizer, limits: RequestLimits, grammars: GrammarCompiler,
                 adapters: LoRARegistry, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammars = grammars
        self.adapters = adapters
        self.eos_token_ids = eos_token_ids
        self._dry_breakers_found: dict[tuple[str, ...], dict[int, tuple[tuple[int, ...], ...]]] = {}
        self._dry_breakers_lock = threading.Lock()

    def prepare(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: float | None = None, group: str | None = None,
                adapter: str | None = None) -> EngineRequest:
        """Check a request against the model's limits (``engine.validation``) and work
        out what its sequences need; see ``LLMEngine.prepare``. Raises
        ``InvalidRequestError`` if the request can never run (or its grammar cannot be
        enforced, or no adapter is loaded by the name ``adapter``)."""
        key, lora = self.adapters.lookup(adapter) if adapter is not None else (None, None)
        max_tokens = check_request(prompt_token_ids, params, self.limits)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        if params.think is not None:
            self.grammars.blanks()  # worked out once, here rather than on the engine loop
        breakers = self.dry_breakers(tuple(params.dry_sequence_breakers)) if params.dry_active else {}
        return EngineRequest(request_id, list(prompt_token_ids), params, max_tokens,
                             time.monotonic() if arrival_time is None else arrival_time,
                             group or request_id, grammar, key, lora,
                             self.bad_words_token_ids(params.bad_words), breakers)

    def sequences(self, request: EngineRequest) -> list[Request]:
        """The request's ``params.n`` sequences (samples), each with its own grammar matcher;
        with ``n > 1`` sample i's id is ``request_id#i``."""
        params = request.params
        return [
            Request(request_id=f"{request.request_id}#{i}" if params.n > 1 else request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids), sampling_params=params,
                    max_tokens=request.max_tokens, eos_token_ids=self.eos_token_ids,
                    group=request.group, sample_index=i, arrival_time=request.arrival_time,
                    adapter=request.adapter, bad_words_token_ids=request.bad_words_token_ids,
                    dry_breakers=request.dry_breakers,
                    grammar=(self.grammars.grammar(request.grammar, params.think)
                             if request.grammar is not None else None))
            for i in range(params.n)
        ]

    def dry_breakers(self, breakers: tuple[str, ...]) -> dict[int, tuple[tuple[int, ...], ...]]:
        """DRY's sequence breakers as tokens (``engine.sampler.dry_breakers``), found once
        per set of breakers (a scan of the vocabulary), the last ``DRY_BREAKER_SETS_KEPT`` sets kept."""
        with self._dry_breakers_lock:
            found = self._dry_breakers_found.get(breakers)
            if found is None:
                vocab = [self.tokenizer.token_bytes(t) for t in range(self.limits.vocab_size)]
                found = dry_breakers(vocab, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                                     breakers)
                if len(self._dry_breakers_found) >= DRY_BREAKER_SETS_KEPT:
                    self._dry_breakers_found.pop(next(iter(self._dry_breakers_found)))
                self._dry_breakers_found[breakers] = found
            return found

    def bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token sequences: each word as it is and after a space
        (how it is tokenized mid-text), without special tokens."""
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, word if word.startswith(" ") else " " + word):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    found[ids] = None
        return tuple(found)
