"""Prometheus metrics fed from the engine's per-step stats.

Names follow vLLM's (``vllm:x`` becomes ``kvserve_x``) so existing dashboards
translate directly. Every number comes from ``engine.stats.StepStats``; the
HTTP layer never re-derives engine state; it counts only what it alone sees
(clients that disconnect). Each logger has its own registry,
so several apps (tests) in one process do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.sampling_params import STRUCTURED_KINDS
from engine.stats import StepStats

__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger"]

FINISH_REASONS = ("stop", "length", "abort")

# Buckets sized for a CPU, where a step takes milliseconds to seconds and a
# long request minutes.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class PrometheusStatLogger:
    """A ``engine.stats.StatLogger`` that updates Prometheus series.

    ``record`` runs on the engine thread; prometheus_client's metric updates
    are thread-safe, and rendering happens on the event loop.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 kv_blocks_total: int | None = None, lora_adapters: tuple[str, ...] = ()) -> None:
        """``kv_blocks_total``: the pool's size, exported before the first step reports it;
        ``lora_adapters``: the served LoRA adapters' names (a series each, from 0)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, model_name

        # Each helper registers one family and returns its child for this model.
        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"kvserve_{name}", doc, ["model_name"], registry=r).labels(m)

        def counter(name: str, doc: str) -> Any:
            # prometheus_client appends "_total" to counter names itself.
            return Counter(f"kvserve_{name}", doc, ["model_name"], registry=r).labels(m)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"kvserve_{name}", doc, ["model_name"], buckets=buckets,
                             registry=r).labels(m)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache blocks in use (0-1).")
        self.kv_cache_blocks_total = gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        if kv_blocks_total is not None:  # a fresh server (or replica) is not an empty pool
            self.kv_cache_blocks_total.set(kv_blocks_total)
        self.kv_cache_blocks_used = gauge("kv_cache_blocks_used", "KV cache blocks in use.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        # Counted by the HTTP layer: the one series that is not an engine stat.
        self.client_disconnected = counter(
            "http_requests_client_disconnected",
            "Requests whose client hung up before the response was complete.")
        self._success = Counter("kvserve_request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = m
        # Pre-created so every reason is exported (as 0) before it first happens.
        self.request_success = {reason: self._success.labels(m, reason)
                                for reason in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.",
            _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Request latency from arrival to finish.",
            _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduling.",
            _REQUEST_BUCKETS)
        # Per finished sequence, as vLLM's: its tokens and where its time went.
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished sequence.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of each finished sequence.", _TOKEN_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Time from first scheduling to finish.", _REQUEST_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first scheduling to the first token.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", _REQUEST_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Each sequence's mean time per output token after its first.", _LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens run through the model per engine step.",
            _TOKEN_BUCKETS)
        self._structured = Counter("kvserve_structured_requests", "Requests with a structured output, by kind.",
                                   ["model_name", "kind"], registry=r)
        self.structured_requests = {kind: self._structured.labels(m, kind) for kind in STRUCTURED_KINDS}
        self.structured_compile_time = histogram(
            "structured_compile_seconds", "Time to check and compile a structured output's grammar.",
            _COMPILE_BUCKETS)
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: requests' steps that ran proposals.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.")
        self._accepted_per_pos = Counter(
            "kvserve_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted tokens by position in the proposal (0 = first).",
            ["model_name", "position"], registry=r)
        self._routed = Counter(
            "kvserve_moe_routed_tokens",
            "A mixture of experts (with --expert-routing-metrics): tokens each layer routed to each expert.",
            ["model_name", "layer", "expert"], registry=r)
        self._routed_children: dict[tuple[int, int], Any] = {}  # (label lookups are slow: once each)
        self._lora = {
            state: Gauge(f"kvserve_lora_requests_{state}", f"Sequences {state} per LoRA adapter.",
                         ["model_name", "lora_name"], registry=r) for state in ("running", "waiting")}
        self._lora_names = set(lora_adapters)
        for gauge_ in self._lora.values():
            for name in lora_adapters:
                gauge_.labels(m, name).set(0)

    def record(self, stats: StepStats) -> None:
        """Apply one engine step's stats."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_blocks_total.set(stats.kv_blocks_total)
        self.kv_cache_blocks_used.set(stats.kv_blocks_used)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        if stats.num_batched_tokens:
            self.iteration_tokens.observe(stats.num_batched_tokens)
        for t in stats.time_to_first_token:
            self.time_to_first_token.observe(t)
        for t in stats.inter_token_latency:
            self.inter_token_latency.observe(t)
        for fin in stats.finished:
            child = self.request_success.get(fin.finish_reason)
            if child is None:  # a reason this module does not know yet still counts
                child = self._success.labels(self._model_name, fin.finish_reason)
            child.inc()
            self.e2e_request_latency.observe(fin.e2e_latency)
            self.request_queue_time.observe(fin.queue_time)
            self.request_prompt_tokens.observe(fin.num_prompt_tokens)
            self.request_generation_tokens.observe(fin.num_generation_tokens)
            if fin.inference_time is not None:
                self.request_inference_time.observe(fin.inference_time)
            if fin.prefill_time is not None:
                self.request_prefill_time.observe(fin.prefill_time)
            if fin.decode_time is not None:
                self.request_decode_time.observe(fin.decode_time)
                if fin.num_generation_tokens > 1:
                    self.request_time_per_output_token.observe(
                        fin.decode_time / (fin.num_generation_tokens - 1))

        # The engine reports every adapter it serves: one unloaded loses its series.
        served = set(stats.lora_running) | set(stats.lora_waiting)
        for name in served | self._lora_names:
            for state, counts in (("running", stats.lora_running), ("waiting", stats.lora_waiting)):
                if name in served:
                    self._lora[state].labels(self._model_name, name).set(counts.get(name, 0))
                else:
                    self._lora[state].remove(self._model_name, name)
        self._lora_names = served
        if stats.spec_drafts:
            self.spec_decode_num_drafts.inc(stats.spec_drafts)
            self.spec_decode_num_draft_tokens.inc(stats.spec_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.spec_accepted_tokens)
            for position, count in stats.spec_accepted_per_position.items():
                self._accepted_per_pos.labels(self._model_name, str(position)).inc(count)
        for st in stats.structured:
            self.structured_requests[st.kind].inc()
            self.structured_compile_time.observe(st.compile_seconds)
        for layer, counts in stats.routed_tokens.items():
            for expert, n in enumerate(counts):
                if n:
                    child = self._routed_children.get((layer, expert))
                    if child is None:
                        child = self._routed_children[layer, expert] = self._routed.labels(
                            self._model_name, str(layer), str(expert))
                    child.inc(n)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
