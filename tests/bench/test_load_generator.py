"""bench.serve against a fake streaming server: counting, timing order, tags, output."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from bench.serve import main
from bench.serve_config import BenchConfig, check_loopback
from bench.serve_load import run_async, send_request
from fake_openai_server import MODEL, FakeSettings, serving

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def config(url: str, **kw) -> BenchConfig:
    kw = {"input_len": 16, "output_len": 8, "warmup": 0, "progress": False, **kw}
    return BenchConfig(url=url, **kw)


def bench(settings: FakeSettings, levels: list[int], num_prompts: int | None = None,
          **kw) -> dict:
    with serving(settings) as url:
        return asyncio.run(run_async(config(url, **kw), levels, num_prompts))


def test_counts_requests_and_usage_tokens_per_level() -> None:
    s = FakeSettings(tokens_per_chunk=3)  # 8 tokens in 3 chunks: usage must win
    report = bench(s, [1, 3], num_prompts=5, ignore_eos=True)
    assert report["model"] == MODEL and report["tokenizer"] == "vllm"
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert (lv["num_prompts"], lv["completed"], lv["failed"], lv["not_sent"]) == (5, 5, 0, 0)
        assert lv["output_tokens"] == 5 * 8 and lv["usage_reported"]
        assert lv["input_tokens"] == 5 * 16
        assert lv["output_throughput"] == pytest.approx(40 / lv["duration_s"])
        assert lv["request_throughput"] == pytest.approx(5 / lv["duration_s"])
    assert len(s.bodies) == 10
    for body in s.bodies:
        assert body["max_tokens"] == 8 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == MODEL


def test_without_usage_counts_chunks_and_speaks_llama_tokenize() -> None:
    report = bench(FakeSettings(dialect="llama", usage=False), [2], num_prompts=4)
    [lv] = report["levels"]
    assert report["tokenizer"] == "llama"
    assert lv["completed"] == 4 and lv["output_tokens"] == 4 * 8 and not lv["usage_reported"]
    assert lv["input_tokens"] == 4 * 16  # trimmed with /tokenize + /detokenize


def test_default_num_prompts_and_warmup_not_counted() -> None:
    s = FakeSettings(delay=0.0)
    report = bench(s, [1, 5], warmup=2)
    assert [lv["completed"] for lv in report["levels"]] == [16, 20]
    assert len(s.bodies) == 2 + 16 + 20
    assert [b["max_tokens"] for b in s.bodies[:2]] == [8, 8]


def test_timing_order_of_one_request() -> None:
    s = FakeSettings(delay=0.01)
    with serving(s) as url:
        async def one():
            async with httpx.AsyncClient(trust_env=False) as client:
                return await send_request(client, config(url), MODEL, "a b c", 3, timeout=30)
        r = asyncio.run(one())
    assert r.ok and r.output_tokens == 8 and r.prompt_tokens == 3
    assert len(r.itl) == 7 and all(gap > 0 for gap in r.itl)
    assert 0 < r.ttft < r.ttft + sum(r.itl) <= r.e2e
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 7)


def test_level_latencies_are_ordered() -> None:
    [lv] = bench(FakeSettings(delay=0.005), [2], num_prompts=6)["levels"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < lv[key]["p50"] <= lv[key]["p99"], key
    assert lv["ttft_ms"]["mean"] < lv["e2e_ms"]["mean"]
    # The fake sleeps 5 ms before each of its 8 chunks, so a request takes 40 ms or more however
    # late the client reads; gaps the client measures can bunch up when it lags (same process),
    # so only their mean is held near the fake's.
    assert lv["e2e_ms"]["p50"] >= 8 * 5
    assert lv["itl_ms"]["mean"] >= 2.5


def test_failed_requests_are_counted_with_their_error() -> None:
    [lv] = bench(FakeSettings(fail_every=3), [2], num_prompts=9)["levels"]
    assert (lv["completed"], lv["failed"]) == (6, 3)
    assert lv["errors"] == {"HTTP 503": 3}
    assert lv["output_tokens"] == 6 * 8


def test_request_timeout_and_level_time_limit() -> None:
    [lv] = bench(FakeSettings(delay=0.3), [1], num_prompts=5, request_timeout=0.2)["levels"]
    assert (lv["completed"], lv["failed"]) == (0, 5) and lv["errors"] == {"timeout": 5}
    [lv] = bench(FakeSettings(delay=0.05), [1], num_prompts=50, max_duration=0.3)["levels"]
    assert lv["completed"] + lv["failed"] + lv["not_sent"] == 50
    assert lv["not_sent"] > 0 and lv["duration_s"] < 5


def test_prompts_open_with_distinct_random_tags() -> None:
    s = FakeSettings(delay=0.0)
    with serving(s) as url:
        for _ in range(2):  # two runs with the same seed
            asyncio.run(run_async(config(url, warmup=1), [1, 2], num_prompts=4))
    tags = [b["prompt"].split()[0] for b in s.bodies]
    assert len(tags) == 2 * (1 + 4 + 4)
    assert all(UUID.match(t) for t in tags), tags
    assert len(set(tags)) == len(tags)
    assert all(len(b["prompt"].split()) == 16 for b in s.bodies)  # exactly --input-len
    # The same seed draws the same words after the tag: only the tag changes per run.
    first, second = s.bodies[1:9], s.bodies[10:18]
    assert [b["prompt"].split()[1:] for b in first] == [b["prompt"].split()[1:] for b in second]


def test_without_tokenize_prompts_are_sized_by_words() -> None:
    s = FakeSettings(dialect="none")
    report = bench(s, [1], num_prompts=3, input_len=100)
    assert report["tokenizer"] == "none" and report["levels"][0]["completed"] == 3
    for body in s.bodies:
        words = body["prompt"].split()
        assert UUID.match(words[0]) and 50 <= len(words) <= 100


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://8.8.8.8", "ftp://127.0.0.1/",
                                 "http://"])
def test_only_loopback_urls(url: str) -> None:
    with pytest.raises(ValueError):
        check_loopback(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80",
                                 "http://127.0.0.2:9/v1"])
def test_loopback_urls_pass(url: str) -> None:
    check_loopback(url)


def test_main_prints_the_table_and_writes_json(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    with serving(FakeSettings()) as url:
        rc = main(["--url", url, "--concurrency", "1", "2", "--num-prompts", "3",
                   "--input-len", "16", "--output-len", "4", "--warmup", "0",
                   "--no-progress", "--json", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert table[0].startswith("| concurrency | ok | failed |") and len(table) == 2 + 2
    assert table[2].startswith("| 1 | 3 | 0 |") and table[3].startswith("| 2 | 3 | 0 |")
    report = json.loads(out.read_text())
    assert [lv["completed"] for lv in report["levels"]] == [3, 3]
    assert report["config"]["output_len"] == 4 and "api_key" not in report["config"]


def test_extra_body_goes_into_every_request_and_wins(capsys: pytest.CaptureFixture[str]) -> None:
    s = FakeSettings()
    with serving(s) as url:
        rc = main(["--url", url, "--num-prompts", "3", "--output-len", "2", "--warmup", "1", "--no-progress",
                   "--extra-body", '{"dry_multiplier": 0.8, "temperature": 0.5}'])
    assert rc == 0 and len(s.bodies) == 4
    assert all(b["dry_multiplier"] == 0.8 and b["temperature"] == 0.5 for b in s.bodies)
    with pytest.raises(SystemExit):
        main(["--url", url, "--extra-body", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_kvserve_bench_serve_dispatches(capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main as kvserve

    with serving(FakeSettings()) as url:
        rc = kvserve(["bench", "serve", "--url", url, "--num-prompts", "2", "--output-len", "2",
                      "--warmup", "0", "--no-progress"])
    assert rc == 0
    assert "| 1 | 2 | 0 |" in capsys.readouterr().out


def test_cli_rejects_a_remote_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--url", "http://192.0.2.1:8000"])
    assert "loopback" in capsys.readouterr().err


def test_structured_json_sends_the_fixed_schema_which_forces_long_answers() -> None:
    import jsonschema

    from bench.serve_load import BENCH_SCHEMA

    s = FakeSettings()
    report = bench(s, [2], num_prompts=3, structured="json")
    assert report["levels"][0]["completed"] == 3 and report["config"]["structured"] == "json"
    for body in s.bodies:
        assert body["response_format"] == {"type": "json_schema",
                                           "json_schema": {"name": "bench_record", "schema": BENCH_SCHEMA}}
    jsonschema.Draft202012Validator.check_schema(BENCH_SCHEMA)
    assert BENCH_SCHEMA["properties"]["items"]["minItems"] >= 12  # answers run to --output-len
    with pytest.raises(ValueError, match="structured"):
        BenchConfig(structured="xml")


def test_arrival_gaps_have_the_rates_mean_and_the_burstiness_spread() -> None:
    import random
    import statistics

    from bench.serve_load import arrival_gaps

    poisson = arrival_gaps(4.0, 1.0, 20000, random.Random(1))
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(poisson) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    bursty = arrival_gaps(4.0, 0.25, 20000, random.Random(1))
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(bursty) == pytest.approx(0.5, rel=0.1)  # gamma: sd = mean / sqrt(shape)
    assert arrival_gaps(float("inf"), 1.0, 5, random.Random(1)) == [0.0] * 5
    # The same seed, the same arrivals.
    assert arrival_gaps(2.0, 1.0, 10, random.Random("x")) == arrival_gaps(2.0, 1.0, 10, random.Random("x"))


def test_request_rate_levels_send_open_loop_and_cap_what_is_in_flight() -> None:
    s = FakeSettings(delay=0.02)  # each request takes 8 x 20 ms
    with serving(s) as url:
        report = asyncio.run(run_async(config(url), [], 12, request_rates=[50.0, float("inf")]))
        capped = asyncio.run(run_async(config(url), [2], 8, request_rates=[float("inf")]))
    fast, burst = report["levels"]
    assert (fast["request_rate"], burst["request_rate"], fast["concurrency"]) == (50.0, "inf", None)
    for lv in (fast, burst):
        assert (lv["completed"], lv["failed"], lv["not_sent"]) == (12, 0, 0)
    # Open loop: 12 arrivals 20 ms apart on average overlap the 160 ms answers; all at once,
    # the level takes about one answer's time, not twelve.
    assert burst["duration_s"] < 12 * 0.16 / 2
    [lv] = capped["levels"]
    assert lv["concurrency"] == 2 and lv["completed"] == 8
    assert lv["duration_s"] >= 4 * 0.16  # 8 requests, 2 at a time
    # A capped arrival's latencies count from when it was sent: no queueing time in its TTFT.
    assert lv["ttft_ms"]["p99"] < 160


def test_goodput_counts_the_requests_within_every_limit() -> None:
    from bench.stats import RequestResult, summarize

    fast = RequestResult(ok=True, output_tokens=5, ttft=0.1, e2e=0.5)    # tpot 100 ms
    slow = RequestResult(ok=True, output_tokens=5, ttft=0.1, e2e=2.1)    # tpot 500 ms
    late = RequestResult(ok=True, output_tokens=1, ttft=0.9, e2e=0.9)    # no tpot
    failed = RequestResult(ok=False, error="timeout")
    s = summarize([fast, slow, late, failed], 2.0, 4, slos={"ttft": 200.0, "tpot": 150.0})
    assert s["request_goodput"] == pytest.approx(1 / 2.0)  # only fast: late misses ttft
    s = summarize([fast, slow, late], 2.0, 4, slos={"e2el": 1000.0})
    assert s["request_goodput"] == pytest.approx(2 / 2.0)
    assert "request_goodput" not in summarize([fast], 1.0, 1)


def test_main_takes_request_rates_and_goodput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rate.json"
    with serving(FakeSettings(delay=0.0)) as url:
        rc = main(["--url", url, "--request-rate", "100", "inf", "--max-concurrency", "3", "--num-prompts", "6",
                   "--input-len", "8", "--output-len", "4", "--warmup", "0", "--no-progress",
                   "--goodput", "ttft:10000", "e2el:10000", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| request rate |" in text and "| 100/s (max 3) |" in text and "| inf/s (max 3) |" in text
    assert "goodput (ttft <= 10000 ms, e2el <= 10000 ms):" in text
    report = json.loads(out.read_text())
    assert [lv["request_rate"] for lv in report["levels"]] == [100.0, "inf"]
    assert all(lv["request_goodput"] > 0 for lv in report["levels"])
    for bad in (["--request-rate", "0"], ["--request-rate", "5", "--concurrency", "2"], ["--max-concurrency", "2"],
                ["--request-rate", "5", "--goodput", "ttft"], ["--request-rate", "5", "--goodput", "itl:5"],
                ["--request-rate", "5", "--burstiness", "0"]):
        with pytest.raises(SystemExit):
            main(["--url", "http://127.0.0.1:9", *bad])


def test_the_priority_bench_sends_urgent_requests_into_a_busy_server(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.priority import main as priority_main

    s = FakeSettings(delay=0.005)
    with serving(s) as url:
        assert priority_main(["--url", url, "--background", "6", "--background-tokens", "4", "--urgent", "2",
                              "--delay", "0.01", "--priority"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["priority"] is True and len(report["urgent_ttft_ms"]) == 2
    assert report["background_ttft_mean_ms"] >= 0
    urgent = [b for b in s.bodies if b["prompt"].startswith("Urgent")]
    assert len(urgent) == 2 and all(b["priority"] == -1 and b["max_tokens"] == 8 for b in urgent)
    assert all("priority" not in b for b in s.bodies if b["prompt"].startswith("Background"))


def test_the_code_load_asks_for_code_back_with_a_name_renamed() -> None:
    s = FakeSettings(delay=0.0)
    report = bench(s, [1], num_prompts=3, input_len=200, load="code")
    assert report["levels"][0]["completed"] == 3
    source = Path("bench/data/edit_source.py").read_text(encoding="utf-8")
    for body in s.bodies:
        prompt = body["prompt"]
        assert UUID.match(prompt.split()[0])
        ask = re.search(r"Rename every `(\w+)` to `(\w+)`", prompt)
        assert ask and prompt.endswith(f"The code with `{ask[1]}` renamed to `{ask[2]}`:\n\n```python\n")
        code = prompt.split("```python\n")[1].split("```")[0]
        assert len(code.splitlines()) >= 5 and code in source  # a slice of the source, unchanged
        assert len(prompt.split()) <= 200  # sized by the fake tokenizer's words to --input-len
