"""The load generator's requests and levels (``bench.serve``): one streamed completion
timed chunk by chunk (``send_request``), closed-loop levels of a fixed concurrency
(``run_level``), open-loop levels of random arrivals (``run_rate_level``), and a whole
run of levels with its warm-up (``run_async``)."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import random
import sys
import time
from dataclasses import asdict

import httpx
from tqdm import tqdm

from bench.serve_config import BenchConfig
from bench.serve_prompts import PromptMaker
from bench.stats import RequestResult, summarize

# --structured json: a record long enough that no answer ends before 128 tokens.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "status": {"enum": ["draft", "review", "done"]},
        "owner": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 20}, "team": {"enum": ["core", "infra", "ml"]}},
                  "required": ["name", "team"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 12, "maxItems": 24,
                  "items": {"type": "object",
                            "properties": {"id": {"type": "integer", "minimum": 0},
                                           "label": {"type": "string", "maxLength": 16},
                                           "priority": {"enum": ["low", "medium", "high"]},
                                           "done": {"type": "boolean"}},
                            "required": ["id", "label", "priority", "done"], "additionalProperties": False}},
    },
    "required": ["title", "status", "owner", "items"],
    "additionalProperties": False,
}


async def _stream(client: httpx.AsyncClient, cfg: BenchConfig, body: dict,
                  result: RequestResult) -> None:
    start = time.perf_counter()
    last = None
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", cfg.base + "/v1/completions", json=body,
                             headers=cfg.headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            result.error = f"HTTP {resp.status_code}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.error = "error event"
                return
            now = time.perf_counter()
            text = "".join(c.get("text") or "" for c in event.get("choices") or ())
            if text:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
            usage = event.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                usage_tokens = usage["completion_tokens"]
                result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
    result.e2e = time.perf_counter() - start
    result.usage_reported = usage_tokens is not None
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:  # (the tokens a server reports, where it does: an empty text's cause)
        result.error = "no text streamed" + (f" ({usage_tokens} tokens)" if usage_tokens is not None else "")


async def send_request(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: str,
                       prompt_tokens: int, timeout: float, max_tokens: int | None = None
                       ) -> RequestResult:
    """One streamed completion, bounded by ``timeout`` seconds; never raises."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens or cfg.output_len,
            "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.structured == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench_record", "schema": BENCH_SCHEMA}}
    body.update(cfg.extra_body)
    result = RequestResult(ok=False, prompt_tokens=prompt_tokens)
    try:
        await asyncio.wait_for(_stream(client, cfg, body, result), timeout)
    except asyncio.TimeoutError:
        result.ok, result.error = False, "timeout"
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a malformed event
        result.ok, result.error = False, type(e).__name__
    return result


async def run_level(client: httpx.AsyncClient, cfg: BenchConfig, model: str,
                    prompts: list[tuple[str, int]], concurrency: int) -> dict:
    """Send ``prompts`` with ``concurrency`` in flight; the level's summary."""
    pending = iter(prompts)
    results: list[RequestResult] = []
    not_sent = 0
    start = time.perf_counter()
    deadline = start + cfg.max_duration
    bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", unit="req",
               disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True)

    async def worker() -> None:
        nonlocal not_sent
        for prompt, n_tokens in pending:  # one shared iterator: each prompt goes once
            left = deadline - time.perf_counter()
            if left <= 0:
                not_sent += 1
                continue
            timeout = min(cfg.request_timeout, left)
            results.append(await send_request(client, cfg, model, prompt, n_tokens, timeout))
            bar.update(1)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        bar.close()
    return summarize(results, time.perf_counter() - start, concurrency, not_sent, slos=cfg.goodput)


def arrival_gaps(rate: float, burstiness: float, count: int, rng: random.Random) -> list[float]:
    """Seconds between ``count`` arrivals at ``rate`` per second on average: gamma-distributed
    gaps of shape ``burstiness`` and mean ``1 / rate`` (exponential, a Poisson process, at 1);
    all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


async def run_rate_level(client: httpx.AsyncClient, cfg: BenchConfig, model: str,
                         prompts: list[tuple[str, int]], rate: float, max_concurrency: int | None,
                         level: int) -> dict:
    """Open loop: ``prompts`` arrive at ``rate`` per second (``arrival_gaps``, drawn from the
    seed) whatever the answers do, at most ``max_concurrency`` in flight; the level's summary."""
    gaps = arrival_gaps(rate, cfg.burstiness, len(prompts), random.Random(f"arrivals:{cfg.seed}:{level}"))
    places = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(prompts), desc=f"{rate:g} req/s", unit="req", disable=not cfg.progress,
               file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    deadline = start + cfg.max_duration

    async def one(prompt: str, n_tokens: int) -> RequestResult | None:
        if places is not None:
            await places.acquire()
        try:
            left = deadline - time.perf_counter()
            if left <= 0:
                return None  # waited for a place past the level's time
            return await send_request(client, cfg, model, prompt, n_tokens, min(cfg.request_timeout, left))
        finally:
            if places is not None:
                places.release()
            bar.update(1)

    tasks: list[asyncio.Task] = []
    not_sent = 0
    arrival = start
    try:
        for (prompt, n_tokens), gap in zip(prompts, gaps):
            arrival += gap
            if arrival >= deadline:
                not_sent += 1
                continue
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one(prompt, n_tokens)))
        sent = await asyncio.gather(*tasks)
    finally:
        bar.close()
    results = [r for r in sent if r is not None]
    summary = summarize(results, time.perf_counter() - start, max_concurrency,
                        not_sent + len(sent) - len(results), slos=cfg.goodput)
    summary["request_rate"] = rate if math.isfinite(rate) else "inf"
    summary["burstiness"] = cfg.burstiness
    return summary


async def served_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    """``cfg.model``, else the first id of ``GET /v1/models``."""
    if cfg.model:
        return cfg.model
    r = await client.get(cfg.base + "/v1/models", headers=cfg.headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def default_num_prompts(concurrency: int) -> int:
    return max(16, 4 * concurrency)


def default_rate_prompts(rate: float, max_concurrency: int | None) -> int:
    """About eight seconds of arrivals (at least 16); at an infinite rate, as a closed level."""
    if math.isinf(rate):
        return default_num_prompts(max_concurrency or 4)
    return max(16, math.ceil(8 * rate))


async def run_async(cfg: BenchConfig, levels: list[int], num_prompts: int | None = None,
                    transport: httpx.AsyncBaseTransport | None = None,
                    request_rates: list[float] | None = None) -> dict:
    """Run every level in turn against ``cfg.url``; the JSON-ready report.

    ``levels`` are the closed-loop concurrency levels; with ``request_rates`` each rate is
    an open-loop level instead (``run_rate_level``) and ``levels`` is ``[]`` or
    ``[max_concurrency]``."""
    if request_rates is not None:
        if not request_rates or not all(r > 0 for r in request_rates) or len(levels) > 1:
            raise ValueError(f"request rates must be positive (inf: all at once) with at most one "
                             f"concurrency cap, got {request_rates} and {levels}")
    elif not levels:
        raise ValueError("give concurrency levels or request rates")
    if levels and min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive integers, got {levels}")
    cap = levels[0] if request_rates is not None and levels else None
    most = max(levels) if levels else 256  # open loop without a cap: many in flight
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    # trust_env=False: a proxy from the environment must never see these requests.
    async with httpx.AsyncClient(transport=transport, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        model = await served_model(client, cfg)
        maker = PromptMaker(client, cfg, model)
        dialect = await maker.detect()
        for i in range(cfg.warmup):
            prompt, n = await maker.make(-1, i)
            await send_request(client, cfg, model, prompt, n, cfg.request_timeout,
                               max_tokens=min(cfg.output_len, 16))
        summaries = []
        plan = ([(rate, default_rate_prompts(rate, cap)) for rate in request_rates] if request_rates is not None
                else [(c, default_num_prompts(c)) for c in levels])
        for level, (load, default_n) in enumerate(plan):
            n = num_prompts or default_n
            sem = asyncio.Semaphore(8)

            async def make(index: int, level: int = level) -> tuple[str, int]:
                async with sem:
                    return await maker.make(level, index)

            prompts = list(await asyncio.gather(*(make(i) for i in range(n))))
            if request_rates is not None:
                summaries.append(await run_rate_level(client, cfg, model, prompts, load, cap, level))
            else:
                summaries.append(await run_level(client, cfg, model, prompts, int(load)))
    config = {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "progress")}
    return {"url": cfg.url, "model": model, "tokenizer": dialect, "config": config,
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "levels": summaries}


def run(cfg: BenchConfig, levels: list[int], num_prompts: int | None = None,
        request_rates: list[float] | None = None) -> dict:
    """Blocking ``run_async``."""
    return asyncio.run(run_async(cfg, levels, num_prompts, request_rates=request_rates))
