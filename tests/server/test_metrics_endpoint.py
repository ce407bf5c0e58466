"""GET /metrics: names, labels, and counters that equal the responses' usage."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api_helpers import MODEL, sse_events
from engine.sampling_params import SamplingParams
from engine.stats import StepStats, StructuredRequestStats
from real_engine import ServedEngine
from server.metrics import PrometheusStatLogger

pytestmark = pytest.mark.anyio

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "kv_cache_blocks_total", "kv_cache_blocks_used"]
COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "num_preemptions_total", "request_success_total"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
              "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_time_per_output_token_seconds"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(f"kvserve_{name}", tuple(sorted({"model_name": MODEL, **labels}.items())))]


async def test_names_types_and_labels(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for g in GAUGES:
        assert families[f"kvserve_{g}"].type == "gauge"
    for c in COUNTERS:
        assert families[f"kvserve_{c.removesuffix('_total')}"].type == "counter"
    for h in HISTOGRAMS:
        assert families[f"kvserve_{h}"].type == "histogram"
    for family in families.values():
        for s in family.samples:
            assert s.labels["model_name"] == MODEL
    m = samples(r.text)
    for reason in ("stop", "length", "abort"):
        assert value(m, "request_success_total", finished_reason=reason) == 0
    # Before any step: the pool's size, not an empty pool.
    assert value(m, "kv_cache_blocks_total") == engine.num_kv_blocks > 0
    assert value(m, "kv_cache_blocks_used") == 0


async def test_counters_equal_summed_usage(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    usages = []
    for body in ({"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                 # EOS is held back for 5 tokens, then biased to come next.
                 {"prompt": ["a", "bb"], "max_tokens": 9, "n": 2, "min_tokens": 5, "logit_bias": {str(eos): 100}},
                 {"prompt": "hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
                  "stream_options": {"include_usage": True}}):
        r = await client.post("/v1/completions", json=body)
        usages.append(sse_events(r.text)[-2]["usage"] if body.get("stream") else r.json()["usage"])
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "yo"}], "max_tokens": 2, "ignore_eos": True})
    usages.append(r.json()["usage"])

    m = samples((await client.get("/metrics")).text)
    assert value(m, "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value(m, "generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert value(m, "prefix_cache_hits_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    # Each sample looks its prompt up (usage counts a prompt once): the n=2 prompts twice.
    assert value(m, "prefix_cache_queries_total") == value(m, "prompt_tokens_total") + usages[1]["prompt_tokens"]
    # Sequences: 1 + 2 * 2 + 1 + 1; the n=2 ones hit EOS after 5 tokens, others hit max_tokens.
    assert value(m, "request_success_total", finished_reason="length") == 3
    assert value(m, "request_success_total", finished_reason="stop") == 4
    # Per sequence: its tokens (7 sequences; their generated tokens are all of them) and times.
    assert value(m, "request_generation_tokens_sum") == value(m, "generation_tokens_total")
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert value(m, f"{name}_count") == 7, name
    assert value(m, "e2e_request_latency_seconds_count") == 7
    assert value(m, "time_to_first_token_seconds_count") == 7  # each sequence's first token
    assert value(m, "num_requests_running") == 0
    assert value(m, "kv_cache_blocks_total") == engine.num_kv_blocks


async def test_aborted_requests_are_counted(engine: ServedEngine) -> None:
    logger = PrometheusStatLogger(MODEL)
    engine.add_stat_logger(logger)
    await engine.start()
    try:
        gen = engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=10, n=2, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()

        def aborts() -> float:
            return value(samples(logger.render().decode()), "request_success_total", finished_reason="abort")

        for _ in range(500):  # the engine thread records the abort at its next step
            if aborts() == 2:
                break
            await asyncio.sleep(0.01)
        m = samples(logger.render().decode())
        assert value(m, "request_success_total", finished_reason="abort") == 2
        # Each sample's tokens until the abort, fewer than it asked for; counted per sequence too.
        assert value(m, "generation_tokens_total") in range(2, 20, 2)
        assert value(m, "request_generation_tokens_sum") == value(m, "generation_tokens_total")
    finally:
        await engine.shutdown()


def test_structured_requests_are_counted_by_kind_with_their_compile_time() -> None:
    logger = PrometheusStatLogger(MODEL)
    logger.record(StepStats(structured=[StructuredRequestStats("json", 0.002), StructuredRequestStats("json", 0.03),
                                        StructuredRequestStats("choice", 0.0004)]))
    m = samples(logger.render().decode())
    assert value(m, "structured_requests_total", kind="json") == 2
    assert value(m, "structured_requests_total", kind="choice") == 1
    assert value(m, "structured_requests_total", kind="regex") == 0  # every kind exported from the start
    assert value(m, "structured_compile_seconds_count") == 3
    assert value(m, "structured_compile_seconds_sum") == pytest.approx(0.0324)
    assert value(m, "structured_compile_seconds_bucket", le="0.0005") == 1


def test_lora_requests_running_and_waiting_per_adapter() -> None:
    logger = PrometheusStatLogger(MODEL, lora_adapters=("sql", "poet"))
    m = samples(logger.render().decode())
    assert [value(m, f"lora_requests_{s}", lora_name=n) for s in ("running", "waiting") for n in ("sql", "poet")] \
        == [0, 0, 0, 0]  # every adapter exported from the start
    logger.record(StepStats(lora_running={"sql": 3}, lora_waiting={"sql": 1, "poet": 2}))
    m = samples(logger.render().decode())
    assert value(m, "lora_requests_running", lora_name="sql") == 3
    assert value(m, "lora_requests_running", lora_name="poet") == 0
    assert value(m, "lora_requests_waiting", lora_name="poet") == 2
    logger.record(StepStats(lora_running={"sql": 0}, lora_waiting={"sql": 0}))  # poet unloaded
    m = samples(logger.render().decode())
    assert value(m, "lora_requests_running", lora_name="sql") == 0
    assert ("kvserve_lora_requests_running", (("lora_name", "poet"), ("model_name", MODEL))) not in m


def test_tokens_routed_per_layer_and_expert_add_up_over_steps() -> None:
    logger = PrometheusStatLogger(MODEL)
    m = samples(logger.render().decode())
    assert not any(name == "kvserve_moe_routed_tokens_total" for name, _ in m)  # none until routed
    logger.record(StepStats(routed_tokens={0: [3, 0, 1], 2: [0, 4, 0]}))
    logger.record(StepStats(routed_tokens={0: [1, 0, 0], 2: [0, 1, 5]}))
    m = samples(logger.render().decode())
    assert value(m, "moe_routed_tokens_total", layer="0", expert="0") == 4
    assert value(m, "moe_routed_tokens_total", layer="0", expert="2") == 1
    assert value(m, "moe_routed_tokens_total", layer="2", expert="1") == 5
    assert value(m, "moe_routed_tokens_total", layer="2", expert="2") == 5
    assert ("kvserve_moe_routed_tokens_total", (("expert", "1"), ("layer", "0"), ("model_name", MODEL))) not in m
