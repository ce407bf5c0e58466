"""Load generator for any OpenAI-compatible server: streaming ``/v1/completions``.

For each concurrency level, ``--num-prompts`` requests go out with at most
``concurrency`` in flight (closed loop: a finished request makes room for the
next). Each prompt opens with a random tag drawn from the seed, a per-run
nonce and the prompt's index, so no server can answer it from a prompt cache
filled by an earlier run or level. Prompts are trimmed to ``--input-len``
tokens with the server's ``/tokenize`` + ``/detokenize`` (vLLM/kvserve or
llama-server shapes), else sized with a words-per-token ratio.

    kvserve bench serve --url http://127.0.0.1:8000 --concurrency 1 4 16 64 \\
        --input-len 128 --output-len 128 --ignore-eos --json out.json

Reported per level: requests completed and failed, duration, request/s,
output tokens/s, and mean/p50/p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, the gaps
between streamed chunks) and end-to-end latency, in ms. Output tokens are the
``usage`` the server reports at the end of the stream
(``stream_options.include_usage``), else the number of chunks with text.

``--structured json`` sends every request with ``response_format`` set to a
fixed JSON Schema (``BENCH_SCHEMA``: nested objects, enums, an array of at
least 12 objects), so each answer is constrained for all its tokens and runs
to ``--output-len`` like an unconstrained one with ``--ignore-eos``.

``--request-rate R [R ...]`` sends open-loop load instead, as vLLM's
benchmark does: each rate is a level whose requests arrive at ``R`` per
second on average, their gaps drawn from a gamma distribution of shape
``--burstiness`` (1: a Poisson process; below 1 burstier, above 1 steadier),
whether or not earlier answers have come back; ``inf`` sends them all at
once. ``--max-concurrency N`` caps the requests in flight (an arrival past
the cap waits for a place; its latencies count from when it is sent).

``--goodput ttft:MS tpot:MS e2el:MS`` (any of them) adds, per level, the
requests per second that completed within every one of those limits.

``--load quote`` (where prompt lookup pays): each prompt asks for a paragraph
to be rewritten with its typos fixed; the paragraph is a slice of
bench/data/quality_text.txt with a few letters swapped, so a good answer
quotes most of the prompt. ``--load code`` (the same, for code): each prompt
asks for a slice of bench/data/edit_source.py (an original file) to be given back
with one name renamed. ``--load random`` (the default) is the random-tag load
above.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import logging
import math
import os
import random
import secrets
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.stats import RequestResult, format_table, summarize

WORDS = tuple("""the of and to in is was for on with as by at from that this it be are
have has had not but or an they we you he she his her their our your its which who what
when where how all some any each many more most other such only own same so than too
very can will just should now time year people way day man thing woman life child world
school state family student group country problem hand part place case week company
system program question work government number night point home water room mother area
money story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment
air teacher force education river stone bridge garden window light music paper
""".split())


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
STRUCTURED = ("json",)
# --goodput's limits (ms): time to first token, time per output token, end-to-end latency.
SLO_KEYS = ("ttft", "tpot", "e2el")
LOADS = ("random", "quote", "code")
QUOTE_SOURCE = Path(__file__).parent / "data" / "quality_text.txt"
QUOTE_ASK = "Rewrite the following paragraph, fixing its typos. Change nothing else.\n\nParagraph: "
QUOTE_ANSWER = "\n\nRewritten paragraph: "
EDIT_SOURCE = Path(__file__).parent / "data" / "edit_source.py"
# (old, new) names the code load renames, one drawn per prompt.
EDIT_RENAMES = (("item", "entry"), ("amount", "count"), ("name", "label"), ("ledger", "book"),
                ("quantity", "stock"), ("price", "cost"))
EDIT_ASK = "Rename every `{old}` to `{new}` in the following Python code. Change nothing else.\n\n```python\n"
EDIT_ANSWER = "```\n\nThe code with `{old}` renamed to `{new}`:\n\n```python\n"


@dataclass
class BenchConfig:
    """What one benchmark run sends (everything but the concurrency levels)."""

    url: str = "http://127.0.0.1:8000"
    model: str | None = None          # None: the first model of GET /v1/models
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    request_timeout: float = 600.0    # seconds, per request
    max_duration: float = 3600.0      # seconds, per level; later requests are not sent
    warmup: int = 1                   # unmeasured requests before the first level
    words_per_token: float = 0.75     # prompt sizing when the server has no /tokenize
    progress: bool = True
    structured: str | None = None     # "json": every request constrained to BENCH_SCHEMA
    load: str = "random"              # LOADS: random-tag prompts, or paragraphs to quote
    burstiness: float = 1.0           # --request-rate arrivals: gamma shape (1: Poisson)
    goodput: dict[str, float] = field(default_factory=dict)  # SLO_KEYS -> limit in ms
    # Fields merged into every request's body last (a sampler's settings, say): they win.
    extra_body: dict[str, Any] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.structured not in (None, *STRUCTURED):
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED)}, got {self.structured!r}")
        if self.load not in LOADS:
            raise ValueError(f"load must be one of {', '.join(LOADS)}, got {self.load!r}")
        if self.request_timeout <= 0 or self.max_duration <= 0:
            raise ValueError("request_timeout and max_duration must be positive")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        for key, limit in self.goodput.items():
            if key not in SLO_KEYS or not limit > 0:
                raise ValueError(f"goodput limits are {', '.join(SLO_KEYS)} with a positive number of ms, "
                                 f"got {key}:{limit}")
        check_loopback(self.url)

    @property
    def base(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def check_loopback(url: str) -> None:
    """``ValueError`` unless ``url`` is http(s) to a host that resolves only to loopback."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url must be http(s)://HOST[:PORT], got {url!r}")
    try:
        infos = socket.getaddrinfo(parsed.host, parsed.port or 80, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {parsed.host!r}: {e}") from None
    addrs = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    if not addrs or not all(a.is_loopback for a in addrs):
        raise ValueError(f"{parsed.host!r} is not a loopback address: the load generator only "
                         "targets servers on this machine (127.0.0.0/8, ::1, localhost)")


def prompt_tag(seed: int, run_id: str, level: int, index: int) -> str:
    """A uuid-like tag, unique to the run, the level and the prompt."""
    rng = random.Random(f"tag:{seed}:{run_id}:{level}:{index}")
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def draft_prompt(seed: int, run_id: str, level: int, index: int, num_words: int) -> str:
    """The tag, then ``num_words`` words drawn from the seed (same words on every run)."""
    rng = random.Random(f"words:{seed}:{level}:{index}")
    return prompt_tag(seed, run_id, level, index) + " " + " ".join(
        rng.choice(WORDS) for _ in range(num_words))


def _typo(word: str, rng: random.Random) -> str:
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def quote_prompt(seed: int, run_id: str, level: int, index: int, num_words: int) -> str:
    """The tag, then the request to rewrite ``num_words`` words of the quote source
    (from a place drawn from the seed) in which one word in eight has two letters swapped."""
    rng = random.Random(f"quote:{seed}:{level}:{index}")
    words = QUOTE_SOURCE.read_text(encoding="utf-8").split()
    start = rng.randrange(0, len(words) - num_words)
    para = [_typo(w, rng) if len(w) > 4 and w.isalpha() and rng.random() < 0.125 else w
            for w in words[start:start + num_words]]
    return prompt_tag(seed, run_id, level, index) + "\n" + QUOTE_ASK + " ".join(para) + QUOTE_ANSWER


def edit_prompt(seed: int, run_id: str, level: int, index: int, num_lines: int) -> str:
    """The tag, then the request to rename one name in ``num_lines`` lines of the code
    source (from a place drawn from the seed)."""
    rng = random.Random(f"code:{seed}:{level}:{index}")
    lines = EDIT_SOURCE.read_text(encoding="utf-8").splitlines(keepends=True)
    start = rng.randrange(0, max(1, len(lines) - num_lines))
    old, new = rng.choice(EDIT_RENAMES)
    code = "".join(lines[start:start + num_lines])
    return (prompt_tag(seed, run_id, level, index) + "\n" + EDIT_ASK.format(old=old, new=new) + code
            + EDIT_ANSWER.format(old=old, new=new))


class PromptMaker:
    """Builds prompts of about ``input_len`` tokens, using the server's tokenizer when it
    has one: vLLM/kvserve ``{"prompt"} -> {"tokens"}`` or llama-server
    ``{"content"} -> {"tokens"}``, and ``/detokenize`` to cut at exactly ``input_len``."""

    def __init__(self, client: httpx.AsyncClient, cfg: BenchConfig, model: str) -> None:
        self.client, self.cfg, self.model = client, cfg, model
        self.dialect: str | None = None   # "vllm", "llama" or "none", found on first use

    async def _post(self, path: str, body: dict) -> dict | None:
        try:
            r = await self.client.post(self.cfg.base + path, json=body, headers=self.cfg.headers)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def _tokenize(self, text: str, dialect: str) -> list[int] | None:
        body = ({"model": self.model, "prompt": text, "add_special_tokens": False}
                if dialect == "vllm" else {"content": text, "add_special": False})
        out = await self._post("/tokenize", body)
        tokens = out.get("tokens") if isinstance(out, dict) else None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    async def detect(self) -> str:
        """Which ``/tokenize`` shape the server speaks ("none" if neither)."""
        if self.dialect is None:
            self.dialect = "none"
            for dialect in ("vllm", "llama"):
                if await self._tokenize("hello world", dialect):
                    self.dialect = dialect
                    break
        return self.dialect

    async def make(self, level: int, index: int) -> tuple[str, int]:
        """``(prompt, token count)``; the count is estimated without a tokenizer."""
        cfg = self.cfg
        if cfg.load in ("quote", "code"):
            return await self._quote(level, index)
        if await self.detect() != "none":
            text = draft_prompt(cfg.seed, cfg.run_id, level, index, 2 * cfg.input_len)
            tokens = await self._tokenize(text, self.dialect)
            if tokens is not None:
                if len(tokens) <= cfg.input_len:
                    return text, len(tokens)
                out = await self._post("/detokenize",
                                       {"model": self.model, "tokens": tokens[:cfg.input_len]})
                cut = out and (out.get("prompt") or out.get("content"))
                if isinstance(cut, str) and cut:
                    return cut, cfg.input_len
        tag_tokens = len(prompt_tag(cfg.seed, cfg.run_id, level, index)) // 2
        words = max(1, round((cfg.input_len - tag_tokens) * cfg.words_per_token))
        return draft_prompt(cfg.seed, cfg.run_id, level, index, words), cfg.input_len


    async def _quote(self, level: int, index: int) -> tuple[str, int]:
        # The paragraph (the code's lines) is sized to fill --input-len (the question and
        # the answer's lead-in are kept whole): one measured guess, then a proportional fit.
        cfg = self.cfg
        code = cfg.load == "code"
        words = max(8, round(cfg.input_len * (0.08 if code else 0.6)))
        for _ in range(3):
            text = (edit_prompt if code else quote_prompt)(cfg.seed, cfg.run_id, level, index, words)
            tokens = (await self._tokenize(text, self.dialect)
                      if await self.detect() != "none" else None)
            count = len(tokens) if tokens is not None else round(len(text.split()) / cfg.words_per_token)
            if count <= cfg.input_len:
                return text, count
            words = max(8, int(words * cfg.input_len / count) - 1)
        return text, count


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
    if not result.ok:
        result.error = "no text streamed"


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


def report_text(report: dict) -> str:
    """The header line and the table that ``main`` prints."""
    c = report["config"]
    head = (f"{report['url']}  model {report['model']}  {c['input_len']} input tokens "
            f"(tokenizer: {report['tokenizer']}) -> {c['output_len']} output tokens"
            f"{' (ignore_eos)' if c['ignore_eos'] else ''}, temperature {c['temperature']}"
            f"{', structured: ' + c['structured'] if c.get('structured') else ''}"
            f"{', load: ' + c['load'] if c.get('load', 'random') != 'random' else ''}")
    text = head + "\n\n" + format_table(report["levels"])
    if c.get("goodput"):
        limits = ", ".join(f"{k} <= {v:g} ms" for k, v in c["goodput"].items())
        text += "\n\ngoodput (" + limits + "): " + ", ".join(
            f"{s['request_goodput']:.2f} req/s" for s in report["levels"])
    return text


def build_parser(prog: str = "python -m bench.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchConfig.__dataclass_fields__
    p.add_argument("--url", default=d["url"].default, help="server base URL (loopback only)")
    p.add_argument("--model", default=None, help="model name (default: ask /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="N",
                   help="one or several levels of requests in flight, e.g. 1 4 16 64 (default 1)")
    p.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="R",
                   help="open-loop levels instead: requests arrive at R per second (inf: all at once), "
                        "see --burstiness")
    p.add_argument("--burstiness", type=float, default=d["burstiness"].default,
                   help="with --request-rate: the gamma shape of the gaps between arrivals "
                        "(1: Poisson; lower: burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="with --request-rate: at most N requests in flight")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="also report the requests per second that met every limit: ttft:MS, tpot:MS, e2el:MS")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default max(16, 4 x concurrency))")
    p.add_argument("--input-len", type=int, default=d["input_len"].default)
    p.add_argument("--output-len", type=int, default=d["output_len"].default,
                   help="max_tokens of each request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true so every answer has --output-len tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=d["request_timeout"].default)
    p.add_argument("--max-duration", type=float, default=d["max_duration"].default,
                   help="seconds per level; requests not sent by then count as failed")
    p.add_argument("--warmup", type=int, default=d["warmup"].default)
    p.add_argument("--structured", choices=STRUCTURED, default=None,
                   help="constrain every answer: json = response_format with a fixed JSON Schema")
    p.add_argument("--load", choices=LOADS, default="random",
                   help="random: random-tag prompts; quote: paragraphs the answer must rewrite; code: "
                        "code the answer must give back with a name renamed (both where speculation pays)")
    p.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="fields merged into every request's body, e.g. '{\"dry_multiplier\": 0.8}' "
                        "(they win over the bench's own)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def main(argv: list[str] | None = None, prog: str = "python -m bench.serve") -> int:
    # httpx logs every request at INFO (``kvserve bench`` logs at INFO): the table is the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.request_rate is not None:
        if args.concurrency is not None:
            parser.error("--request-rate levels take --max-concurrency, not --concurrency")
        if min(args.request_rate) <= 0 or any(math.isnan(r) for r in args.request_rate):
            parser.error("--request-rate must be positive (inf: all at once)")
        levels = [args.max_concurrency] if args.max_concurrency is not None else []
    elif args.max_concurrency is not None:
        parser.error("--max-concurrency goes with --request-rate (closed-loop levels are --concurrency)")
    else:
        levels = args.concurrency or [1]
    if levels and min(levels) < 1:
        parser.error("--concurrency levels must be at least 1")
    goodput: dict[str, float] = {}
    for item in args.goodput:
        key, _, value = item.partition(":")
        try:
            goodput[key] = float(value)
        except ValueError:
            parser.error(f"--goodput takes KEY:MS ({', '.join(SLO_KEYS)}), got {item!r}")
    try:
        cfg = BenchConfig(url=args.url, model=args.model, input_len=args.input_len,
                          output_len=args.output_len, seed=args.seed, ignore_eos=args.ignore_eos,
                          temperature=args.temperature, api_key=args.api_key,
                          request_timeout=args.request_timeout, max_duration=args.max_duration,
                          warmup=args.warmup, progress=not args.no_progress, structured=args.structured,
                          load=args.load, burstiness=args.burstiness, goodput=goodput,
                          extra_body=args.extra_body)
    except ValueError as e:
        parser.error(str(e))
    try:
        report = run(cfg, levels, args.num_prompts, request_rates=args.request_rate)
    except httpx.HTTPError as e:
        print(f"{prog}: error: cannot reach {cfg.url}: {e!r}", file=sys.stderr)
        return 1
    print(report_text(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(s["completed"] for s in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
