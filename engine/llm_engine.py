"""The synchronous engine: add requests, step, collect deltas.

A step reads schedule -> execute -> sample (verifying proposals) -> update ->
process, as vLLM's ``EngineCore.step`` does, with the pieces beside it:
``engine.input_processor`` checks and prepares requests before they enter,
``engine.output_processor`` owns them from then on (deltas, stop strings,
``n``, pooling, stats), ``engine.speculative`` proposes and verifies, and
``engine.lora_registry`` keeps the served adapters. This module builds them
(sizing the KV cache from the memory budget) and runs the step's middle: the
forward with its grammar masks and prompt logprobs, and the sampling.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, SpeculativeConfig, step_budget
from engine.draft import DraftProposer
from engine.input_processor import InputProcessor, default_max_tokens, sampling_defaults, sampling_overrides
from engine.kv_cache_manager import KVCacheManager
from engine.lora_registry import LoRARegistry
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.output_processor import OutputProcessor, StepResult
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import EngineRequest, Request
from engine.sampler import Sampler, SamplerOutput, picks_argmax, prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from engine.speculative import NgramProposals, Proposer, Speculator, proposal_rows, sample_proposals, verify
from engine.stats import StatLogger, StepStats
from engine.structured import BitmaskFiller, GrammarCompiler
from engine.validation import RequestLimits
from engine.workers import WorkerGroup
from models.chat_template import read_chat_template
from models.kv_cache import cdiv, model_layout, resolve_dtype
from models.loader import LoadedModel, load_model
from models.lora import LoRAAdapter
from models.memory import available_memory

logger = logging.getLogger(__name__)

GrammarMasks = tuple[list[int], torch.Tensor]  # (rows, their token bitmasks), as the Sampler takes them


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
class _Executed:
    """One step after the forward: what sampling reads, and the result it fills in."""

    sched: SchedulerOutput
    result: StepResult
    items: list[ScheduledRequest]  # the requests that sample, in their logits rows' order
    logits: torch.Tensor | None = None  # the sampled rows (prompt logprobs' rows taken out)
    masks: GrammarMasks | None = None  # the constrained rows masked before sampling
    unmasked: list[int] = field(default_factory=list)  # constrained rows checked after it (see _sample_rows)
    proposal_masks: dict[str, torch.Tensor] = field(default_factory=dict)  # by request id, one per proposal


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
        self.sampling_defaults = sampling_defaults(config, loaded.config)
        self.sampling_overrides = sampling_overrides(config)
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        if config.max_model_len and config.max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length "
                             f"({loaded.config.max_position_embeddings})")
        kv_dtype = resolve_dtype(config.kv_cache_dtype, loaded.dtype)
        tp_size = config.parallel.tensor_parallel_size
        cfg = loaded.config
        layout_len = self.max_model_len  # (the ranks build the same layout from it)
        self.kv_layout = model_layout(cfg, layout_len, config.hybrid_kv_cache)
        block_bytes = kv_bytes_per_block(cfg, kv_dtype, config.block_size, tp_size, self.kv_layout)
        free = torch.cuda.mem_get_info(loaded.device)[0] if loaded.device.type == "cuda" else available_memory()
        if free is not None and loaded.device.type != "cuda":
            free = max(0, free - loaded.mapped_bytes)  # (mapped weights: counted available until read)
        # Bytes a token takes in every layer (what a short sequence holds in a hybrid cache too).
        token_bytes = cdiv(kv_bytes_per_block(cfg, kv_dtype, config.block_size, tp_size), config.block_size)
        self.budget = step_budget(config, loaded.device.type, self.max_model_len, token_bytes, free)
        # NOTE: the budget is per rank (as vLLM's per GPU): N ranks cache N times the tokens.
        num_blocks = self.budget.kv_cache_memory // block_bytes
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        needed = self._blocks_per_sequence(self.max_model_len)
        if num_blocks < needed and config.max_model_len is None and num_blocks > 0:
            # The model's own context does not fit: serve what does, as llama-server picks
            # its context (a length the user asked for stays an error below).
            shrunk = self._longest_fitting()
            logger.warning("the model's context (%d tokens) does not fit the KV cache budget (%.0f MiB); "
                           "serving max_model_len=%d (raise --kv-cache-memory for more)",
                           self.max_model_len, self.budget.kv_cache_memory / 2**20, shrunk)
            self.max_model_len, needed = shrunk, self._blocks_per_sequence(shrunk)
        if num_blocks < needed or self.max_model_len < 1:
            raise ValueError(
                f"the KV cache budget ({self.budget.kv_cache_memory / 2**20:.0f} MiB = {num_blocks} blocks of "
                f"{config.block_size} tokens) cannot hold one sequence of max_model_len={self.max_model_len} "
                f"({needed} blocks); raise --kv-cache-memory or lower --max-model-len")
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                       self.kv_layout.group_windows)
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=self.max_model_len, max_num_seqs=self.budget.max_num_seqs,
                            max_num_batched_tokens=self.budget.max_num_batched_tokens,
                            max_loras=config.max_loras),
            self.kv_cache)
        if self.workers is not None:
            self.workers.set_num_blocks(num_blocks, layout_len, config.hybrid_kv_cache)
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, kv_dtype,
                                  peers=self.workers, layout=self.kv_layout)
        self._routing = config.expert_routing_metrics
        if self._routing:
            if not hasattr(loaded.model, "count_routed_tokens"):
                raise ValueError(f"--expert-routing-metrics counts a mixture of experts' routed tokens; "
                                 f"{config.model} ({loaded.config.architecture}) has no experts")
            loaded.model.count_routed_tokens()
        self.adapters = LoRARegistry(loaded, self.model_name, config.max_lora_rank, self.runner.adapters)
        self.lora_adapters = self.adapters.paths  # served adapter name -> its directory (/v1/models lists them)
        for module in config.lora_modules:
            # Keyed by their names: the tensor-parallel ranks know them so.
            self.adapters.install(self.adapters.read(module.name, module.path), module.path, key=module.name)
        # Ids both the tokenizer and the model's rows know (see RequestLimits).
        self.vocab_size = min(self.tokenizer.vocab_size, loaded.config.vocab_size)
        limits = RequestLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                               hidden_size=loaded.config.hidden_size,
                               priority_scheduling=config.scheduling_policy == "priority",
                               default_max_tokens=default_max_tokens(config, loaded.config))
        self.sampler = Sampler(self.vocab_size)
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer.to_json, self.vocab_size, sorted(self.eos_token_ids))
        self._masks = BitmaskFiller(self.vocab_size)
        self.speculator = (Speculator(config.speculative, self.max_model_len, self._proposer(config.speculative, draft))
                           if config.speculative else None)
        self.inputs = InputProcessor(self.tokenizer, limits, self.grammars, self.adapters, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler, self.adapters,
                                       self.speculator)
        self.stat_loggers: list[StatLogger] = self.outputs.stat_loggers  # the same list: callers append to it
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s; steps of up to %d sequences and %d tokens",
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    str(kv_dtype).removeprefix("torch."), self.budget.max_num_seqs,
                    self.budget.max_num_batched_tokens)
        if self.kv_layout.hybrid:
            lay = self.kv_layout
            logger.info("KV cache layout: %d groups of %d layers (windows %s); a block id holds %d layers, "
                        "a sequence of %d tokens at most %d block ids (%d with every layer kept)",
                        lay.num_groups, lay.num_slots, ",".join(str(w) for w in lay.group_windows), lay.num_slots,
                        self.max_model_len, needed, cdiv(self.max_model_len, self.block_size) * lay.num_groups)

    def _blocks_per_sequence(self, num_tokens: int) -> int:
        """Block ids one sequence of ``num_tokens`` holds at most (the layout's groups)."""
        return self.kv_layout.blocks_for(num_tokens, self.block_size, self.budget.max_num_batched_tokens)

    def _longest_fitting(self) -> int:
        """The longest context (whole blocks) one sequence can hold in the cache (0: none)."""
        lo, hi = 0, cdiv(self.max_model_len, self.block_size)
        while lo < hi:  # the most blocks of tokens that fit: blocks_for grows with the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._blocks_per_sequence(mid * self.block_size) <= self.num_blocks else (lo, mid - 1)
        return lo * self.block_size

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
        # As many tokens as the target holds in every layer (a hybrid cache's block ids hold fewer layers).
        cfg = self.model_config
        holding = len(set(cfg.kv_sources)) if cfg.kv_sources else cfg.num_hidden_layers  # layers with a cache
        blocks = self.num_blocks * self.kv_layout.num_slots // holding
        logger.info("speculative: draft model %s, %d KV blocks of its own", spec.draft_model, blocks)
        return DraftProposer(draft, blocks, self.block_size, kv_dtype, spec.num_speculative_tokens,
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
        return self.inputs.prepare(request_id, prompt_token_ids, params, arrival_time, group, adapter)

    def add(self, request: EngineRequest) -> None:
        """Queue a prepared request (its ``params.n`` samples); ``ValueError`` if its id is in use."""
        seqs = self.inputs.sequences(request)
        self.outputs.add(request, seqs)  # first: an id in use fails before the scheduler has its samples
        for seq in seqs:
            self.scheduler.add_request(seq)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, adapter: str | None = None) -> None:
        """:meth:`prepare` then :meth:`add`: ``ValueError`` if the request can never run."""
        self.add(self.prepare(request_id, prompt_token_ids, params, arrival_time, adapter=adapter))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its samples) and free its blocks now.

        Returns the request's last delta (``finish_reason="abort"`` for the
        unfinished samples), or None for an unknown or finished id.
        """
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs)

    # -- LoRA adapters ------------------------------------------------------

    def read_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter's weights for this model (``ValueError`` naming what is
        wrong, a rank above ``max_lora_rank`` too). Reads only what is fixed at construction,
        so any thread may call it; :meth:`install_adapter` then serves it."""
        return self.adapters.read(name, path)

    def install_adapter(self, adapter: LoRAAdapter, path: str, key: str | None = None) -> None:
        """Serve ``adapter`` under its name from the next request on (engine thread), its
        requests keyed by ``key`` (``engine.lora_registry``). ``ValueError`` if the name is taken."""
        self.adapters.install(adapter, path, key)

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (engine thread): new requests for it are refused;
        the ones running finish on it, and its weights go with the last of them.
        ``ValueError`` if no adapter has that name."""
        self.adapters.remove(name)

    # -- the step ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample (verifying proposals), update the requests and
        turn what they got into deltas; return this step's deltas."""
        sched = self._schedule()
        executed = self._execute(sched)
        result = self._sample(executed)
        updated = self.scheduler.update_from_output(sched, result.token_ids)
        return self.outputs.process(result, updated)

    def _schedule(self) -> SchedulerOutput:
        """This step's work. Proposals come first: they run as extra positions of their requests."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def _execute(self, sched: SchedulerOutput) -> _Executed:
        """Run the model on the step's tokens (nothing when none is scheduled): the sampled
        rows' logits with their grammar masks, prompt logprobs recorded from their rows, and
        the pooled requests' hidden states."""
        executed = _Executed(sched, StepResult(StepStats(num_batched_tokens=sched.num_batched_tokens)),
                             [s for s in sched.scheduled if s.sample])
        if not sched.scheduled:
            return executed
        logits, hidden = self._forward(executed)
        if self._routing:
            executed.result.stats.routed_tokens = self.runner.model.take_routed_tokens()
        if any(s.num_prompt_logits for s in sched.scheduled):
            logits = self._record_prompt_logprobs(sched.scheduled, logits)
        executed.logits = logits
        if hidden is not None:
            executed.result.pooled = [s.request for s in sched.scheduled if s.pool]
            executed.result.hidden = hidden
        return executed

    def _sample(self, executed: _Executed) -> StepResult:
        """Sample each request's next token and keep what it confirms of its proposals
        (``engine.speculative.verify``)."""
        result, items, logits = executed.result, executed.items, executed.logits
        result.last_token_times = {s.request.request_id: s.request.last_token_time for s in items}
        if not items:
            return result
        sampling = [s.request for s in items]
        main, extra = proposal_rows(items)
        sampled = self._sample_rows(logits[main] if extra else logits, sampling, executed.masks, executed.unmasked)
        # After the rows of the last known tokens: each request's noise comes in order.
        proposals = sample_proposals(self.sampler, logits, items, extra, executed.proposal_masks)
        mus = sampled.mirostat_mu or [None] * len(items)
        for item, token, lp, mu in zip(items, sampled.token_ids, sampled.logprobs, mus):
            rid = item.request.request_id
            if mu is not None:
                # Mirostat requests get no proposals: the token sampled is the one kept.
                assert not item.spec_token_ids
                item.request.mirostat_mu = mu
            result.token_ids[rid], result.logprobs[rid] = verify(
                item, token, lp, proposals.get(rid), self.sampler, self.speculator, result.stats)
        return result

    def _forward(self, executed: _Executed) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model: its logits, and the pooled rows' hidden states (``ModelRunner.execute``).

        The constrained rows' token bitmasks are filled meanwhile, on another thread
        (``executed.masks``), except for rows that pick their logits' argmax
        (``picks_argmax``) where the grammar leaves a choice (not ``forced``) and have no
        proposals: those are checked after sampling (``executed.unmasked``) and masked
        only if need be. A constrained request with proposals also gets the mask after
        each proposal (``executed.proposal_masks``)."""
        sched, sampling = executed.sched, [s.request for s in executed.items]
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None]
        executed.unmasked = [i for i in rows if not sampling[i].spec_token_ids
                             and picks_argmax(sampling[i].sampling_params) and not sampling[i].grammar.forced]
        rows = [i for i in rows if i not in executed.unmasked]  # a handful of rows: a list will do
        if not rows:
            return self.runner.execute(sched)
        specs = [sampling[i].spec_token_ids for i in rows]
        self._masks.start([sampling[i].grammar for i in rows], specs)
        try:
            logits, hidden = self.runner.execute(sched)
        finally:
            masks = self._masks.result()
        if not any(specs):
            executed.masks = (rows, masks)
            return logits, hidden
        # Each request's rows: the mask now, then one after each proposal.
        firsts, row = [], 0
        for i, spec in zip(rows, specs):
            firsts.append(row)
            if spec:
                executed.proposal_masks[sampling[i].request_id] = masks[row + 1:row + 1 + len(spec)]
            row += 1 + len(spec)
        executed.masks = (rows, masks[firsts])
        return logits, hidden

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

    def _sample_rows(self, logits: torch.Tensor, sampling: list[Request], masks: GrammarMasks | None,
                     unmasked: list[int]) -> SamplerOutput:
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
