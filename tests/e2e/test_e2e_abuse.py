"""A hostile client against a real ``kvserve serve``, as the probe did: a burst past
``--max-queue``, one body of many prompts beside a small request, ``min_tokens`` past
the context, a client that hangs up mid-body, ``/metrics`` behind the key, and a
drain that runs out of time. Real processes and sockets on 127.0.0.1 only; every loop
is bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import MODEL, KVServe, free_port, metric, parse_metrics, wait_until

pytestmark = pytest.mark.slow

MAX_QUEUE = 8
MAX_NUM_SEQS = 4
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVServe]:
    log_dir = tmp_path_factory.mktemp("kvserve-hostile")
    srv = KVServe(free_port(), log_dir / "server.log", api_key="h-" + secrets.token_hex(8),
                  shutdown_timeout=5.0,
                  extra=["--max-queue", str(MAX_QUEUE), "--max-num-seqs", str(MAX_NUM_SEQS),
                         "--metrics-require-key"])
    try:
        srv.wait_http_ok(f"{srv.url}/health", 120.0)
        yield srv
    finally:
        rc = srv.stop(40.0)
    assert rc == 0, srv.describe()
    assert "Traceback" not in srv.log(tail=10**7), srv.describe()


def scrape(srv: KVServe) -> dict:
    r = httpx.get(f"{srv.url}/metrics", headers=srv.headers, timeout=10.0)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)


def idle(srv: KVServe) -> bool:
    m = scrape(srv)
    return (metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0
            and metric(m, "kv_cache_blocks_used") == 0)


def test_metrics_needs_the_key_when_asked(hostile: KVServe) -> None:
    r = httpx.get(f"{hostile.url}/metrics", timeout=10.0)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert scrape(hostile)  # with the key


def test_a_burst_of_100_gets_exactly_the_split_max_queue_implies(hostile: KVServe) -> None:
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 128, "ignore_eos": True}
    peak = 0

    async def burst() -> list[tuple[int, float, dict]]:
        nonlocal peak
        limits = httpx.Limits(max_connections=110, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=hostile.url, headers=hostile.headers,
                                     timeout=TIMEOUT, limits=limits) as c:
            async def one() -> tuple[int, float, dict]:
                r = await c.post("/v1/completions", json=body)
                return r.status_code, time.monotonic(), dict(r.headers)

            async def watch(tasks: list[asyncio.Future]) -> None:
                nonlocal peak
                while not all(t.done() for t in tasks):
                    m = parse_metrics((await c.get("/metrics")).text)
                    peak = max(peak, metric(m, "num_requests_running") + metric(m, "num_requests_waiting"))
                    await asyncio.sleep(0.1)

            tasks = [asyncio.ensure_future(one()) for _ in range(100)]
            await asyncio.wait_for(asyncio.gather(watch(tasks), *tasks), TIMEOUT * 2)
            return [t.result() for t in tasks]

    results = asyncio.run(burst())
    ok = [t for code, t, _ in results if code == 200]
    refused = [(t, h) for code, t, h in results if code == 503]
    assert len(ok) + len(refused) == 100, sorted({code for code, _, _ in results})
    assert all(int(h["retry-after"]) >= 1 for _, h in refused)
    # Every place taken is given back only when its request is answered: the 200s are the
    # first 8 places plus one per request that finished before the last refusal.
    last_refusal = max(t for t, _ in refused)
    finished_meanwhile = sum(t < last_refusal for t in ok)
    assert MAX_QUEUE <= len(ok) <= MAX_QUEUE + finished_meanwhile, (len(ok), finished_meanwhile)
    assert peak <= MAX_QUEUE, peak
    assert wait_until(lambda: idle(hostile), lambda ok: ok, timeout=30.0, interval=0.25)


def test_a_request_of_many_prompts_takes_turns_with_a_small_one(hostile: KVServe) -> None:
    prompts = [f"Item {i} of the list:" for i in range(64)]
    big = {"model": MODEL, "prompt": prompts, "max_tokens": 16, "ignore_eos": True, "stream": True}
    small = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    seen: dict[str, float] = {}

    async def run() -> tuple[int, int]:
        big_done: list[int] = []
        small_first_after = -1
        small_sent_after = -1
        async with httpx.AsyncClient(base_url=hostile.url, headers=hostile.headers,
                                     timeout=TIMEOUT) as c:
            big_started = asyncio.Event()

            async def read_big() -> None:
                async with c.stream("POST", "/v1/completions", json=big) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            big_started.set()
                            for ch in json.loads(line[6:])["choices"]:
                                if ch["finish_reason"] is not None:
                                    big_done.append(ch["index"])
                seen["big_end"] = time.monotonic()

            async def read_small() -> None:
                nonlocal small_first_after, small_sent_after
                await big_started.wait()
                seen["small_sent"] = time.monotonic()
                small_sent_after = len(big_done)
                async with c.stream("POST", "/v1/completions", json=small) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and small_first_after < 0:
                            seen["small_first"] = time.monotonic()
                            small_first_after = len(big_done)

            seen["big_sent"] = time.monotonic()
            await asyncio.wait_for(asyncio.gather(read_big(), read_small()), TIMEOUT * 2)
        return small_sent_after, small_first_after, len(big_done)

    small_sent_after, small_first_after, big_total = asyncio.run(run())
    assert big_total == len(prompts)
    # FIFO would put the small request behind all 64 prompts; taking turns, it waits for
    # at most the prompts already admitted and the current round (a few waves of 4). Counted
    # from when it was sent: a client slow to send it must not count against the server.
    assert 0 <= small_sent_after <= small_first_after <= small_sent_after + 3 * MAX_NUM_SEQS, (
        small_sent_after, small_first_after, seen)
    print(f"small TTFT {seen['small_first'] - seen['small_sent']:.2f} s after "
          f"{small_first_after} of {big_total} big choices finished; the big request took "
          f"{seen['big_end'] - seen['big_sent']:.2f} s")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 4000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2**63}),
    ("/v1/completions", {"prompt": ["x"] * 129, "max_tokens": 1}),
])
def test_requests_that_could_never_be_honoured_are_400(hostile: KVServe, path: str,
                                                       body: dict) -> None:
    r = httpx.post(f"{hostile.url}{path}", json={"model": MODEL, **body}, headers=hostile.headers,
                   timeout=30.0)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == ("prompt" if "prompt" in body and "min_tokens" not in body
                                          else "min_tokens")


def test_a_client_that_hangs_up_mid_body_is_counted_and_logged_at_info(hostile: KVServe) -> None:
    before = metric(scrape(hostile), "http_requests_client_disconnected_total")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {hostile.api_key}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=10) as s:
        s.sendall(head.encode() + b'{"prompt": "never fini')
        time.sleep(0.3)
    count = wait_until(lambda: metric(scrape(hostile), "http_requests_client_disconnected_total"),
                       lambda n: n == before + 1, timeout=10.0, interval=0.1)
    assert count == before + 1
    log = hostile.log(tail=10**7)
    assert "client disconnected" in log
    assert "unhandled error" not in log and "Traceback" not in log and " ERROR " not in log


def test_a_drain_past_the_timeout_ends_every_request_with_an_error(tmp_path: Path) -> None:
    srv = KVServe(free_port(), tmp_path / "server.log", api_key=None, shutdown_timeout=2.0,
                  extra=["--max-num-seqs", "2"])
    long = {"model": MODEL, "prompt": "Tell me a very long story:", "max_tokens": 1500,
            "ignore_eos": True}

    async def run() -> tuple[list[list[str]], list[int]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as c:
            started = [asyncio.Event() for _ in range(2)]

            async def stream(i: int) -> list[str] | int:
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if i < 2:
                                started[i].set()
                    return lines

            running = [asyncio.ensure_future(stream(i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), TIMEOUT)
            # Two more that wait in the engine (max-num-seqs 2): not started when the drain ends.
            waiting = [asyncio.ensure_future(stream(2)),
                       asyncio.ensure_future(c.post("/v1/completions", json=long))]
            # Both must be admitted before the drain starts (one arriving after it gets a 503
            # and no abort): wait until the engine holds them, however slow the machine.
            deadline = time.monotonic() + TIMEOUT
            while metric(parse_metrics((await c.get("/metrics")).text), "num_requests_waiting") < 2:
                assert time.monotonic() < deadline, "the two waiting requests never reached the engine"
                await asyncio.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            done = await asyncio.wait_for(asyncio.gather(*running, *waiting), TIMEOUT)
        return done[:2], [done[2], done[3].status_code]

    try:
        srv.wait_http_ok(f"{srv.url}/health", 120.0)
        streams, not_started = asyncio.run(run())
    finally:
        rc = srv.stop(60.0)
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    assert not_started == [503, 503]
    assert rc == 0, srv.describe()
    log = srv.log(tail=10**7)
    assert log.count("aborting request") == 4, log
    assert "Traceback" not in log and "CancelledError" not in log, log
