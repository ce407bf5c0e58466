"""The real server's /metrics: counters equal the responses' usage, and a client that
goes away mid-stream leaves nothing running and no KV block held."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from e2e_helpers import MODEL, KVServe, idle, metric, wait_until

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def wait_idle(server: KVServe, timeout: float = 10.0) -> dict:
    samples = wait_until(server.metrics, idle, timeout)
    assert idle(samples), "the server still has work in flight"
    return samples


def test_token_counters_equal_summed_usage(client: openai.OpenAI, server: KVServe) -> None:
    before = wait_idle(server)
    usages = []
    usages.append(client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0).usage)
    usages.append(client.completions.create(
        model=MODEL, prompt=["Roses are red,", "One, two,"], max_tokens=5, temperature=1.0,
        seed=3, n=2).usage)
    *_, last = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True})
    usages.append(last.usage)
    # The same chat twice: the second run's prompt is partly served by the prefix cache.
    for _ in range(2):
        usages.append(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0).usage)
    *_, last = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.7, seed=11, stream=True,
        stream_options={"include_usage": True})
    usages.append(last.usage)
    after = wait_idle(server)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert all(u is not None for u in usages)
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 0, "a repeated chat prompt should hit the prefix cache"
    assert delta("prefix_cache_hits_total") == cached
    # Six API requests, one of them with two prompts and n=2 (4 sequences): 9 sequences.
    by_reason = {r: metric(after, "request_success_total", finished_reason=r)
                 - metric(before, "request_success_total", finished_reason=r)
                 for r in ("stop", "length", "abort")}
    finished = sum(by_reason.values())
    assert finished == 9, by_reason
    assert delta("e2e_request_latency_seconds_count") == finished
    # Per sequence, as vLLM's: every sequence got a token here, so each has every time.
    assert delta("request_generation_tokens_sum") == delta("generation_tokens_total")
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(f"{name}_count") == finished, name
    assert 0 < delta("request_time_per_output_token_seconds_count") <= finished
    assert delta("request_prefill_time_seconds_sum") <= delta("request_inference_time_seconds_sum")


def test_closed_stream_frees_everything(server: KVServe) -> None:
    wait_idle(server)
    before = server.metrics()
    # Plenty of tokens to go (EOS ignored), so the request is still running when the client
    # leaves; when the abort works it costs only the few tokens already made.
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 256,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60.0) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Keep the line iterator alive: dropping it mid-stream would close the connection.
            events = (json.loads(line.removeprefix("data: "))
                      for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                assert next(events)["choices"][0]["finish_reason"] is None
            running = server.metrics()
            assert metric(running, "num_requests_running") == 1
            assert metric(running, "kv_cache_blocks_used") > 0
            r.close()

    after = wait_until(server.metrics, idle, timeout=30.0)  # a poll: no slower when the abort is prompt
    assert metric(after, "num_requests_running") == 0
    assert metric(after, "num_requests_waiting") == 0
    assert metric(after, "kv_cache_blocks_used") == 0
    assert metric(after, "kv_cache_usage_perc") == 0
    aborted = (metric(after, "request_success_total", finished_reason="abort")
               - metric(before, "request_success_total", finished_reason="abort"))
    assert aborted == 1
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") < 256
