"""The synchronous engine: add requests, step, collect deltas."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig, SpeculativeConfig, available_memory, step_budget
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.request import EngineRequest, Request, RequestStatus
from engine.sampler import Sampler, SamplerOutput, dry_breakers, picks_argmax, prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.draft import DraftProposer
from engine.speculative import NgramProposals, Proposer, Speculator
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from engine.stats import FinishedRequestStats, StatLogger, StepStats, StructuredRequestStats
from engine.structured import BitmaskFiller, GrammarCompiler
from engine.validation import InvalidRequestError, RequestLimits, check_request
from engine.workers import WorkerGroup
from models.chat_template import read_chat_template
from models.config import ModelConfig
from models.kv_cache import cdiv, resolve_dtype
from models.loader import LoadedModel, load_model
from models.lora import LoRAAdapter, load_adapter

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """One finished sample of an offline ``generate`` call."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int]
    # With ``SamplingParams.prompt_logprobs``: one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Proposed:
    """What the model picked after each of a request's proposals, and its generator's
    state before those picks (None: not seeded)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    generator_state: torch.Tensor | None


@dataclass
class _ApiRequest:
    """An API request: its ``n`` sequences and their detokenizers."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    counted_prompt: bool = False
    done: set[int] = field(default_factory=set)


class LLMEngine:
    """Schedules, runs and detokenizes requests, one ``step()`` at a time.

    Not thread-safe: one caller (the AsyncEngine's loop, or ``generate``).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 draft: LoadedModel | None = None) -> None:
        """``loaded`` and ``draft`` (``--speculative draft``'s model): already loaded
        models to use instead of loading ``config.model`` and the draft model."""
        self.config = config
        # Read first: a bad --chat-template fails before the model loads.
        template = read_chat_template(config.chat_template) if config.chat_template else None
        # Tensor parallel: this process is rank 0; the other ranks load their slices meanwhile.
        self.workers: WorkerGroup | None = None
        if config.parallel.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("a tensor-parallel engine loads its model on every rank: pass no model")
            self.workers, spec, tp = WorkerGroup.start(config)
        try:
            if self.workers is not None:
                loaded = load_model(config.model, spec.dtype, config.device, max_positions=config.max_model_len,
                                    quantization=spec.quantization, tp=tp)
            elif loaded is None:
                loaded = load_model(config.model, config.dtype, config.device,
                                    max_positions=config.max_model_len, quantization=config.quantization)
            self._build(config, loaded, draft, template)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None,
               template: str | None) -> None:
        self.tokenizer = loaded.tokenizer if template is None else loaded.tokenizer.with_chat_template(template)
        self.model_config = loaded.config
        self.model_name = config.served_model_name or config.model
        self.sampling_defaults = self._sampling_defaults(config, loaded.config)
        self.sampling_overrides = self._sampling_overrides(config)
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        if config.max_model_len and config.max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length "
                             f"({loaded.config.max_position_embeddings})")
        kv_dtype = resolve_dtype(config.kv_cache_dtype, loaded.dtype)
        tp_size = config.parallel.tensor_parallel_size
        block_bytes = kv_bytes_per_block(loaded.config, kv_dtype, config.block_size, tp_size)
        free = torch.cuda.mem_get_info(loaded.device)[0] if loaded.device.type == "cuda" else available_memory()
        self.budget = step_budget(config, loaded.device.type, self.max_model_len,
                                  cdiv(block_bytes, config.block_size), free)
        # NOTE: the budget is per rank (as vLLM's per GPU): N ranks cache N times the tokens.
        num_blocks = self.budget.kv_cache_memory // block_bytes
        needed = cdiv(self.max_model_len, config.block_size)
        if num_blocks < needed and config.max_model_len is None and num_blocks > 0:
            # The model's own context does not fit: serve what does, as llama-server picks
            # its context (a length the user asked for stays an error below).
            shrunk = num_blocks * config.block_size
            logger.warning("the model's context (%d tokens) does not fit the KV cache budget (%.0f MiB); "
                           "serving max_model_len=%d (raise --kv-cache-memory for more)",
                           self.max_model_len, self.budget.kv_cache_memory / 2**20, shrunk)
            self.max_model_len, needed = shrunk, num_blocks
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache budget ({self.budget.kv_cache_memory / 2**20:.0f} MiB = {num_blocks} blocks of "
                f"{config.block_size} tokens) cannot hold one sequence of max_model_len={self.max_model_len} "
                f"({needed} blocks); raise --kv-cache-memory or lower --max-model-len")
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=self.max_model_len, max_num_seqs=self.budget.max_num_seqs,
                            max_num_batched_tokens=self.budget.max_num_batched_tokens,
                            max_loras=config.max_loras),
            self.kv_cache)
        if self.workers is not None:
            self.workers.set_num_blocks(num_blocks)
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, kv_dtype,
                                  peers=self.workers)
        self._loaded = loaded
        # Served adapter name -> its directory (/v1/models lists them), and -> the key its
        # requests carry (``Request.adapter``; the runner's weights are keyed by it). A key
        # is the name for adapters of the start-up (what the tensor-parallel ranks know them
        # by), ``name@N`` for the N-th loaded while serving: requests of an adapter unloaded
        # and loaded again never share the old one's weights or cached blocks.
        self.lora_adapters: dict[str, str] = {}
        self._adapter_keys: dict[str, str] = {}
        self._retired_adapters: set[str] = set()
        self._adapter_loads = 0
        for module in config.lora_modules:
            self.install_adapter(self.read_adapter(module.name, module.path), module.path, key=module.name)
        # Ids both the tokenizer and the model's rows know (see RequestLimits).
        self.vocab_size = min(self.tokenizer.vocab_size, loaded.config.vocab_size)
        self.limits = RequestLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                                    hidden_size=loaded.config.hidden_size,
                                    priority_scheduling=config.scheduling_policy == "priority",
                                    default_max_tokens=self._default_max_tokens(config, loaded.config))
        self.sampler = Sampler(self.vocab_size)
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self._dry_breakers_found: dict[tuple[str, ...], dict[int, tuple[tuple[int, ...], ...]]] = {}
        self._dry_breakers_lock = threading.Lock()
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, sorted(self.eos_token_ids))
        self._masks = BitmaskFiller(self.vocab_size)
        self.speculator = (Speculator(config.speculative, self.max_model_len, self._proposer(config.speculative, draft))
                           if config.speculative else None)
        self.stat_loggers: list[StatLogger] = []
        self._requests: dict[str, _ApiRequest] = {}
        self._seq_to_api: dict[str, _ApiRequest] = {}
        self._last_kv_queries = 0
        self._last_kv_hits = 0
        self._last_preemptions = 0
        self._pending_finished: list[FinishedRequestStats] = []
        self._pending_structured: list[StructuredRequestStats] = []
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s; steps of up to %d sequences and %d tokens",
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    str(kv_dtype).removeprefix("torch."), self.budget.max_num_seqs,
                    self.budget.max_num_batched_tokens)

    def _proposer(self, spec: SpeculativeConfig, draft: LoadedModel | None) -> Proposer:
        """Prompt lookup, or the draft model loaded as the target was (same dtype,
        quantization and device settings) with as many KV blocks as the target's."""
        if spec.method == "ngram":
            return NgramProposals(spec)
        c = self.config
        if draft is None:
            draft = load_model(spec.draft_model, c.dtype, c.device, max_positions=self.max_model_len,
                               quantization=c.quantization)
        if not draft.tokenizer.same_vocabulary(self.tokenizer):
            raise ValueError(f"the draft model {spec.draft_model!r} has another vocabulary than "
                             f"{c.model!r}: its proposals would be other tokens")
        kv_dtype = resolve_dtype(c.kv_cache_dtype, draft.dtype)
        logger.info("speculative: draft model %s, %d KV blocks of its own", spec.draft_model, self.num_blocks)
        return DraftProposer(draft, self.num_blocks, self.block_size, kv_dtype, spec.num_speculative_tokens,
                             self.vocab_size, max_catch_up=self.budget.max_num_batched_tokens)

    # -- tensor-parallel ranks --------------------------------------------

    def add_fault_listener(self, listener) -> None:
        """Call ``listener(message)`` from another thread if a tensor-parallel rank is lost
        (the forward in flight, if any, then fails too). Without ranks, never called."""
        if self.workers is not None:
            self.workers.add_fault_listener(listener)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (idempotent); the engine cannot step after."""
        if self.workers is not None:
            self.workers.shutdown()

    # -- requests ---------------------------------------------------------

    def prepare(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: float | None = None, group: str | None = None,
                adapter: str | None = None) -> EngineRequest:
        """Check a request against the model's limits (``engine.validation``).

        ``group`` (default: the request alone) names the requests that take
        turns together with other groups for admission, e.g. the prompts of one
        API request. ``adapter``: the LoRA adapter to run (one of
        ``lora_adapters``; None: the base model). A structured output is
        compiled here, on the caller's thread. Raises ``InvalidRequestError``
        if the request can never run (or its grammar cannot be enforced).
        Reads only what is fixed at construction, so any thread may call it.
        """
        key = self._adapter_keys.get(adapter) if adapter is not None else None
        lora = self.runner.adapters.get(key) if key is not None else None
        if adapter is not None and lora is None:
            raise InvalidRequestError(f"no LoRA adapter named {adapter!r} is loaded", "adapter")
        max_tokens = check_request(prompt_token_ids, params, self.limits)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        if params.think is not None:
            self.grammars.blanks()  # worked out once, here rather than on the engine loop
        breakers = self._dry_breakers(tuple(params.dry_sequence_breakers)) if params.dry_active else {}
        return EngineRequest(request_id, list(prompt_token_ids), params, max_tokens,
                             time.monotonic() if arrival_time is None else arrival_time,
                             group or request_id, grammar, key, lora,
                             self._bad_words_token_ids(params.bad_words), breakers)

    def _dry_breakers(self, breakers: tuple[str, ...]) -> dict[int, tuple[tuple[int, ...], ...]]:
        """DRY's sequence breakers as tokens (``engine.sampler.dry_breakers``), found once
        per set of breakers (a scan of the vocabulary), the last 32 sets kept."""
        with self._dry_breakers_lock:
            found = self._dry_breakers_found.get(breakers)
            if found is None:
                vocab = [self.tokenizer.token_bytes(t) for t in range(self.vocab_size)]
                found = dry_breakers(vocab, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                                     breakers)
                if len(self._dry_breakers_found) >= 32:
                    self._dry_breakers_found.pop(next(iter(self._dry_breakers_found)))
                self._dry_breakers_found[breakers] = found
            return found

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token sequences: each word as it is and after a space
        (how it is tokenized mid-text), without special tokens."""
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, word if word.startswith(" ") else " " + word):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    found[ids] = None
        return tuple(found)

    @staticmethod
    def _sampling_defaults(config: EngineConfig, model: ModelConfig) -> dict[str, Any]:
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
        override = LLMEngine._sampling_overrides(config)
        if override:
            logger.info("default sampling from --override-generation-config (a request's own values win): %s",
                        override)
            defaults.update(override)
            try:  # each part was valid alone; together they may not be (top_k from one, ...)
                SamplingParams(**defaults)
            except ValueError as e:
                raise ValueError(f"--override-generation-config with the model's generation_config.json: {e}") from None
        return defaults

    @staticmethod
    def _sampling_overrides(config: EngineConfig) -> dict[str, Any]:
        """The operator's part of the default sampling (``override_generation_config``'s,
        checked with the rest by ``_sampling_defaults``): llama.cpp's /completion applies
        it too, as llama-server applies its own command line's sampling, and keeps
        llama.cpp's defaults over the model's."""
        return {k: v for k, v in config.override_generation_config.items() if k != "max_new_tokens"}

    @staticmethod
    def _default_max_tokens(config: EngineConfig, model: ModelConfig) -> int | None:
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

    # -- LoRA adapters ------------------------------------------------------

    def read_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter's weights for this model (``models.lora.load_adapter``:
        ``ValueError`` naming what is wrong, a rank above ``max_lora_rank`` too). Reads only
        what is fixed at construction, so any thread may call it; :meth:`install_adapter`
        then serves it."""
        loaded = self._loaded
        adapter = load_adapter(name, path, loaded.config, loaded.dtype, loaded.device, tp=loaded.tp)
        limit = self.config.max_lora_rank
        if limit is not None and adapter.rank > limit:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}, above --max-lora-rank {limit}")
        return adapter

    def install_adapter(self, adapter: LoRAAdapter, path: str, key: str | None = None) -> None:
        """Serve ``adapter`` under its name from the next request on (engine thread).
        ``ValueError`` if the name is taken."""
        if adapter.name == self.model_name:
            raise ValueError(f"a LoRA adapter cannot take the served model's name {self.model_name!r}")
        if adapter.name in self.lora_adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if key is None:
            self._adapter_loads += 1
            key = f"{adapter.name}@{self._adapter_loads}"
        self.runner.adapters[key] = adapter
        self._adapter_keys[adapter.name] = key
        self.lora_adapters[adapter.name] = path
        logger.info("LoRA adapter %r loaded from %s (rank %d)", adapter.name, path, adapter.rank)

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (engine thread): new requests for it are refused;
        the ones running finish on it, and its weights go with the last of them.
        ``ValueError`` if no adapter has that name."""
        key = self._adapter_keys.pop(name, None)
        if key is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.lora_adapters[name]
        self._retired_adapters.add(key)
        self._drop_retired_adapters()
        logger.info("LoRA adapter %r unloaded", name)

    def _drop_retired_adapters(self) -> None:
        in_use = {seq.adapter for api in self._requests.values() for seq in api.seqs}
        for key in self._retired_adapters - in_use:
            del self.runner.adapters[key]
        self._retired_adapters &= in_use

    def add(self, request: EngineRequest) -> None:
        """Queue a prepared request (its ``params.n`` samples); ``ValueError`` if its id is in use."""
        request_id, params = request.request_id, request.params
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request.adapter is not None and request.adapter not in self.runner.adapters:
            # Unloaded since its check, weights dropped: they serve it, then go again.
            assert request.lora is not None
            self.runner.adapters[request.adapter] = request.lora
            self._retired_adapters.add(request.adapter)
        seqs = [
            Request(request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                    prompt_token_ids=list(request.prompt_token_ids), sampling_params=params,
                    max_tokens=request.max_tokens, eos_token_ids=self.eos_token_ids,
                    group=request.group, sample_index=i, arrival_time=request.arrival_time,
                    adapter=request.adapter, bad_words_token_ids=request.bad_words_token_ids,
                    dry_breakers=request.dry_breakers,
                    grammar=(self.grammars.grammar(request.grammar, params.think)
                             if request.grammar is not None else None))
            for i in range(params.n)
        ]
        for seq in seqs:
            self.scheduler.add_request(seq)
        if request.grammar is not None:
            self._pending_structured.append(StructuredRequestStats(request.grammar.kind,
                                                                   request.grammar.compile_seconds))
        api = _ApiRequest(request_id, list(request.prompt_token_ids), params, seqs,
                          [IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
                           for _ in seqs])
        self._requests[request_id] = api
        for seq in seqs:
            self._seq_to_api[seq.request_id] = api

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, adapter: str | None = None) -> None:
        """:meth:`prepare` then :meth:`add`: ``ValueError`` if the request can never run."""
        self.add(self.prepare(request_id, prompt_token_ids, params, arrival_time, adapter=adapter))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its samples) and free its blocks now.

        Returns the request's last delta (``finish_reason="abort"`` for the
        unfinished samples), or None for an unknown or finished id.
        """
        api = self._requests.get(request_id)
        if api is None:
            return None
        for seq in api.seqs:
            self.scheduler.abort_request(seq.request_id)  # no-op for samples already finished
        self._pending_finished.extend(self._retire(api))
        outs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                for i in range(len(api.seqs)) if i not in api.done]
        return RequestOutput(request_id, outs, api.prompt_token_ids, finished=True,
                             num_cached_tokens=api.seqs[0].num_cached_tokens)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the step ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, detokenize; return this step's deltas."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        stats = StepStats(num_batched_tokens=sched.num_batched_tokens)
        outputs: list[RequestOutput] = []
        if sched.scheduled:
            items = [s for s in sched.scheduled if s.sample]
            sampling = [s.request for s in items]
            logits, hidden, masks, unmasked, proposal_masks = self._forward(sched, sampling)
            if any(s.num_prompt_logits for s in sched.scheduled):
                logits = self._record_prompt_logprobs(sched.scheduled, logits)
            tokens: dict[str, list[int]] = {}
            logprobs: dict[str, list[TokenLogprob | None]] = {}
            if sampling:
                main, extra = self._proposal_rows(items)
                sampled = self._sample(logits[main] if extra else logits, sampling, masks, unmasked)
                # After the rows of the last known tokens: each request's noise comes in order.
                proposals = self._sample_proposals(logits, items, extra, proposal_masks)
                mus = sampled.mirostat_mu or [None] * len(items)
                for item, token, lp, mu in zip(items, sampled.token_ids, sampled.logprobs, mus):
                    rid = item.request.request_id
                    if mu is not None:
                        # Mirostat requests get no proposals: the token sampled is the one kept.
                        assert not item.spec_token_ids
                        item.request.mirostat_mu = mu
                    tokens[rid], logprobs[rid] = self._verify(item, token, lp, proposals.get(rid), stats)
            prev_times = {r.request_id: r.last_token_time for r in sampling}
            updated = self.scheduler.update_from_output(sched, tokens)
            outputs = self._process(updated, logprobs, prev_times, stats)
            if hidden is not None:
                outputs += self._pool([s.request for s in sched.scheduled if s.pool], hidden, stats)
        self._fill_gauges(stats)
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        return outputs

    def _forward(self, sched: SchedulerOutput, sampling: list[Request]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[list[int], torch.Tensor] | None, list[int],
                            dict[str, torch.Tensor]]:
        """Run the model: its logits, and the pooled rows' hidden states (``ModelRunner.execute``).
        The constrained rows' token bitmasks are filled meanwhile, on
        another thread, except for rows that pick their logits' argmax (``picks_argmax``)
        where the grammar leaves a choice (not ``forced``) and have no proposals: those
        are checked after sampling (returned fourth) and masked only if need be. A
        constrained request with proposals also gets the mask after each proposal
        (returned fifth, by request id)."""
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None]
        unmasked = [i for i in rows if not sampling[i].spec_token_ids
                    and picks_argmax(sampling[i].sampling_params) and not sampling[i].grammar.forced]
        rows = [i for i in rows if i not in unmasked]  # a handful of rows: a list will do
        if not rows:
            return *self.runner.execute(sched), None, unmasked, {}
        specs = [sampling[i].spec_token_ids for i in rows]
        self._masks.start([sampling[i].grammar for i in rows], specs)
        try:
            logits, hidden = self.runner.execute(sched)
        finally:
            masks = self._masks.result()
        if not any(specs):
            return logits, hidden, (rows, masks), unmasked, {}
        # Each request's rows: the mask now, then one after each proposal.
        firsts, extra, row = [], {}, 0
        for i, spec in zip(rows, specs):
            firsts.append(row)
            if spec:
                extra[sampling[i].request_id] = masks[row + 1:row + 1 + len(spec)]
            row += 1 + len(spec)
        return logits, hidden, (rows, masks[firsts]), unmasked, extra

    def _record_prompt_logprobs(self, scheduled: list[ScheduledRequest], logits: torch.Tensor) -> torch.Tensor:
        """Fill in each request's prompt logprobs from its prompt positions' rows;
        return the sampled rows alone (what the rest of the step reads)."""
        keep: list[int] = []
        row = 0
        for s in scheduled:
            k = s.num_prompt_logits
            if k:
                lps = s.request.prompt_logprobs
                assert lps is not None
                # Position p's row gives the logprob of prompt token p + 1.
                first = len(lps)
                lps.extend(prompt_logprobs(logits[row:row + k], s.request.prompt_token_ids[first:first + k],
                                           s.request.sampling_params.prompt_logprobs or 0, self.vocab_size))
                row += k
            sampled = s.num_logits - k
            keep.extend(range(row, row + sampled))
            row += sampled
        assert row == logits.shape[0], (row, logits.shape)
        return logits[keep]

    def _sample(self, logits: torch.Tensor, sampling: list[Request],
                masks: tuple[list[int], torch.Tensor] | None, unmasked: list[int]) -> SamplerOutput:
        """Sample every row; an ``unmasked`` constrained row whose pick its grammar refuses
        is sampled again with its mask.

        Exact: for a greedy row the argmax of the masked logits is the unmasked
        argmax whenever the mask allows that token (the logits processors act
        token by token), so the mask is computed only where it changes the pick.
        Where the grammar leaves a choice its mask costs about 160 us of CPU (the
        forward's CPU, on a small machine), where it forces the next bytes about 20.
        """
        out = self.sampler(logits, sampling, masks)
        redo = [i for i in unmasked if not sampling[i].grammar.allows(out.token_ids[i])]
        if redo:
            self._masks.start([sampling[i].grammar for i in redo])
            again = self.sampler(logits[redo], [sampling[i] for i in redo],
                                 (list(range(len(redo))), self._masks.result()))
            for j, i in enumerate(redo):
                out.token_ids[i] = again.token_ids[j]
        return out

    @staticmethod
    def _proposal_rows(items: list[ScheduledRequest]) -> tuple[list[int], dict[str, list[int]]]:
        """The logits rows of each request's last known token, and of each request's proposals."""
        main: list[int] = []
        extra: dict[str, list[int]] = {}
        row = 0
        for item in items:
            main.append(row)
            k = len(item.spec_token_ids)
            if k:
                extra[item.request.request_id] = list(range(row + 1, row + 1 + k))
            row += 1 + k
        return main, extra

    def _sample_proposals(self, logits: torch.Tensor, items: list[ScheduledRequest],
                          extra: dict[str, list[int]], masks: dict[str, torch.Tensor]) -> dict[str, _Proposed]:
        """Sample the row after each proposal as the request's next steps would: its own
        sampling settings and logits processors with the proposals before it as output,
        its grammar's mask after them (``masks``),
        and for a seeded request the next draws of its generator (whose state is kept,
        to be wound back to what the kept tokens used)."""
        if not extra:
            return {}
        rows: list[int] = []
        requests: list[Request] = []
        states: dict[str, torch.Tensor | None] = {}
        masked_rows: list[int] = []
        for item in items:
            rid = item.request.request_id
            if rid in extra:
                if rid in masks:
                    masked_rows += range(len(rows), len(rows) + len(extra[rid]))
                rows += extra[rid]
                # The logits processors (penalties, min_tokens) see the proposals before
                # each position as output, as that position's own step would.
                spec = item.spec_token_ids
                requests += [dataclasses.replace(item.request, output_token_ids=item.request.output_token_ids + spec[:j])
                             for j in range(1, len(spec) + 1)]
                states[rid] = item.request.generator.get_state() if item.request.generator is not None else None
        grammar_masks = None
        if masked_rows:
            grammar_masks = (masked_rows, torch.cat([masks[rid] for rid in states if rid in masks]))
        out = self.sampler(logits[rows], requests, grammar_masks)
        proposed: dict[str, _Proposed] = {}
        start = 0
        for rid, state in states.items():
            k = len(extra[rid])
            proposed[rid] = _Proposed(out.token_ids[start:start + k], out.logprobs[start:start + k], state)
            start += k
        return proposed

    def _verify(self, item: ScheduledRequest, token: int, logprob: TokenLogprob | None,
                proposed: _Proposed | None, stats: StepStats) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens a request keeps and their logprobs: the sampled one and, while each
        proposal equals the model's own pick at its position, the pick after it.

        Exact in distribution (and token for token for a seeded request): each kept
        token is what sampling that position alone would give. For a proposal this
        accepts it with the model's probability of it and otherwise samples from the
        rest, as rejection sampling against a one-token draft does."""
        spec = item.spec_token_ids
        if not spec:
            return [token], [logprob]
        assert proposed is not None and len(proposed.token_ids) == len(spec)
        picks = [token] + proposed.token_ids
        accepted = 0
        while accepted < len(spec) and spec[accepted] == picks[accepted]:
            accepted += 1
        request = item.request
        if proposed.generator_state is not None and accepted < len(spec):
            # The rows past the last kept token drew noise that was never used.
            self.sampler.replay_noise(request, proposed.generator_state, accepted)
        stats.spec_drafts += 1
        stats.spec_draft_tokens += len(spec)
        stats.spec_accepted_tokens += accepted
        for position in range(accepted):
            stats.spec_accepted_per_position[position] = stats.spec_accepted_per_position.get(position, 0) + 1
        assert self.speculator is not None
        self.speculator.record(request, len(spec), accepted)
        return picks[:accepted + 1], ([logprob] + proposed.logprobs)[:accepted + 1]

    def _process(self, updated: list[tuple[Request, int]], logprobs: dict[str, list[TokenLogprob | None]],
                 prev_times: dict[str, float | None], stats: StepStats) -> list[RequestOutput]:
        by_api: dict[str, list[CompletionOutput]] = {}
        # A sample the engine failed (a grammar fault) fails its whole request, alone.
        failed = {self._seq_to_api[seq.request_id].request_id: seq.error for seq, _ in updated if seq.error}
        for seq, count in updated:
            api = self._seq_to_api[seq.request_id]
            if api.request_id in failed:
                continue
            prev = prev_times[seq.request_id]
            # A sample's first tokens come from its prompt's last position: its
            # prompt logprobs are complete and go out with them.
            assert prev is not None or not seq.needs_prompt_logits
            if prev is None:
                stats.time_to_first_token.append(seq.first_token_time - seq.arrival_time)
            else:
                stats.inter_token_latency.append(seq.last_token_time - prev)
            if not api.counted_prompt:
                api.counted_prompt = True
                stats.num_prompt_tokens += len(api.prompt_token_ids)
            detok = api.detoks[seq.sample_index]
            new = seq.output_token_ids[-count:]
            text = ""
            for i, token in enumerate(new):
                # A stop token (EOS or stop_token_ids) ends the text without being part of it.
                if i == len(new) - 1 and seq.status is RequestStatus.FINISHED_STOPPED and (
                        token in self.eos_token_ids or token in seq.sampling_params.stop_token_ids):
                    break
                text += detok.update([token])
                if detok.finished:
                    # Accepted proposals past the stop string were never generated.
                    del seq.output_token_ids[len(seq.output_token_ids) - len(new) + i + 1:]
                    new = new[:i + 1]
                    break
            lps = logprobs.get(seq.request_id, [])[:len(new)]
            stats.num_generation_tokens += len(new)
            if detok.finished:
                # A stop string ended it (even on the step that hit the length limit).
                seq.stop_reason = detok.stop_reason
                self.scheduler.stop_on_string(seq)
            elif seq.is_finished:
                text += detok.flush()
            by_api.setdefault(api.request_id, []).append(CompletionOutput(
                index=seq.sample_index, text=text, token_ids=new,
                logprobs=lps if lps and lps[0] is not None else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason,
                prompt_logprobs=seq.prompt_logprobs if prev is None else None))
        results = []
        for rid, outs in by_api.items():
            api = self._requests[rid]
            for o in outs:
                if o.finish_reason is not None:
                    api.done.add(o.index)
            finished = len(api.done) == len(api.seqs)
            if finished:
                stats.finished.extend(self._retire(api))
            results.append(RequestOutput(rid, outs, api.prompt_token_ids, finished=finished,
                                         num_cached_tokens=api.seqs[0].num_cached_tokens))
        for rid, error in failed.items():
            logger.error("request %s failed: %s", rid, error)
            aborted = self.abort_request(rid)
            assert aborted is not None
            results.append(dataclasses.replace(aborted, outputs=[], error=f"structured output failed: {error}"))
        return results

    def _pool(self, pooled: list[Request], hidden: torch.Tensor, stats: StepStats) -> list[RequestOutput]:
        """Finish each embedding request of the step with its answer: its prompt's last
        hidden state (row i of ``hidden``), cut to ``dimensions``, L2-normalised."""
        results = []
        for seq, row in zip(pooled, hidden):
            params = seq.sampling_params.pooling
            assert params is not None
            vector = row[:params.dimensions] if params.dimensions is not None else row
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED)
            api = self._seq_to_api[seq.request_id]
            stats.num_prompt_tokens += len(api.prompt_token_ids)
            stats.finished.extend(self._retire(api))
            results.append(RequestOutput(api.request_id, [CompletionOutput(
                index=0, text="", token_ids=[], finish_reason=RequestStatus.FINISHED_STOPPED.finish_reason,
                embedding=vector.tolist())], api.prompt_token_ids, finished=True,
                num_cached_tokens=seq.num_cached_tokens))
        return results

    def _retire(self, api: _ApiRequest) -> list[FinishedRequestStats]:
        """Forget a finished or aborted request; one stats record per sequence (sample)."""
        del self._requests[api.request_id]
        for seq in api.seqs:
            self._seq_to_api.pop(seq.request_id, None)
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
        if self._retired_adapters:
            self._drop_retired_adapters()
        return [self._finished_stats(seq) for seq in api.seqs]

    @staticmethod
    def _finished_stats(seq: Request) -> FinishedRequestStats:
        now = time.monotonic()
        scheduled, first, finished = seq.first_scheduled_time, seq.first_token_time, seq.finished_time or now
        return FinishedRequestStats(
            finish_reason=seq.status.finish_reason or "abort",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generation_tokens=seq.num_output_tokens,
            e2e_latency=finished - seq.arrival_time,
            queue_time=(scheduled - seq.arrival_time) if scheduled is not None else 0.0,
            inference_time=finished - scheduled if scheduled is not None else None,
            prefill_time=first - scheduled if scheduled is not None and first is not None else None,
            decode_time=(seq.last_token_time or first) - first if first is not None else None,
        )

    def _fill_gauges(self, stats: StepStats) -> None:
        kv = self.kv_cache.stats
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_blocks_total = kv.num_blocks_total
        stats.kv_blocks_used = kv.num_blocks_used
        stats.kv_usage = kv.usage
        if self.runner.adapters:
            # Every served adapter, from 0 (the metrics drop the series of one unloaded).
            stats.lora_running = dict.fromkeys(self.lora_adapters, 0)
            stats.lora_waiting = dict.fromkeys(self.lora_adapters, 0)
            for queue, counts in ((self.scheduler.running, stats.lora_running),
                                  (self.scheduler.waiting, stats.lora_waiting)):
                for seq in queue:
                    if seq.adapter is not None:
                        name = self.runner.adapters[seq.adapter].name
                        counts[name] = counts.get(name, 0) + 1
        stats.prefix_cache_queries = kv.prefix_cache_queries - self._last_kv_queries
        stats.prefix_cache_hits = kv.prefix_cache_hits - self._last_kv_hits
        self._last_kv_queries, self._last_kv_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        preemptions = self.scheduler.num_preemptions_total
        stats.num_preemptions = preemptions - self._last_preemptions
        self._last_preemptions = preemptions
        stats.finished.extend(self._pending_finished)
        self._pending_finished.clear()
        stats.structured.extend(self._pending_structured)
        self._pending_structured.clear()

    # -- offline ----------------------------------------------------------

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None,
                 use_tqdm: bool = True, adapter: str | None = None) -> list[list[GenerationResult]]:
        """Run a batch of prompts to completion (through the LoRA ``adapter``, if one);
        one list of ``n`` results per prompt, in order."""
        from tqdm import tqdm

        params = params or SamplingParams()
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        rids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(ids))]
        for rid, p in zip(rids, ids):
            self.add_request(rid, p, params, adapter=adapter)
        texts = {rid: [""] * params.n for rid in rids}
        tokens = {rid: [[] for _ in range(params.n)] for rid in rids}
        reasons: dict[str, list[str | None]] = {rid: [None] * params.n for rid in rids}
        prompt_lps: dict[str, list[list[TokenLogprob | None] | None]] = {rid: [None] * params.n for rid in rids}
        bar = tqdm(total=len(rids), disable=not use_tqdm, desc="generating", unit="req")
        while self.has_unfinished_requests():
            for out in self.step():
                for o in out.outputs:
                    texts[out.request_id][o.index] += o.text
                    tokens[out.request_id][o.index].extend(o.token_ids)
                    reasons[out.request_id][o.index] = o.finish_reason
                    if o.prompt_logprobs is not None:
                        prompt_lps[out.request_id][o.index] = o.prompt_logprobs
                if out.finished:
                    bar.update(1)
        bar.close()
        return [[GenerationResult(texts[r][i], tokens[r][i], reasons[r][i], p, prompt_lps[r][i])
                 for i in range(params.n)]
                for r, p in zip(rids, ids)]
