"""Tensor parallel over HTTP: the same answers as one rank, and a lost rank reported.

``kvserve serve --tensor-parallel-size N`` starts N-1 more processes; each holds
1/N of every layer's heads. In the exact float path (float32, no quantization)
its greedy tokens must be one rank's and its logprobs (the prompt's too) within
1e-4 (row-parallel sums are added in another order). The default model splits 3 ways (9 query
heads, 3 KV heads), a tiny random checkpoint 2 ways. A rank that dies or
freezes must turn ``/health`` to 503 within seconds, end the streams in flight
with an error, refuse new requests and leave no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from e2e_helpers import SMOLLM2_SHAPE, KVServe, Process, free_port, kvserve_argv, wait_until

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 180.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three things to do in the rain:"]
EXACT = ["--quantization", "none", "--kv-cache-dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB"]
# The watchdog's heartbeat timeout (engine.workers) plus slack for a busy machine.
FAULT_SECONDS = 15.0


def start(tmp_path_factory: pytest.TempPathFactory, name: str, extra: list[str]) -> KVServe:
    log = tmp_path_factory.mktemp(name) / "server.log"
    srv = KVServe(free_port(), log, api_key=None, shutdown_timeout=5.0, extra=extra)
    srv.wait_http_ok(f"{srv.url}/health", STARTUP_TIMEOUT)
    return srv


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its tensor-parallel ranks)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def completions(srv: KVServe, model: str = "smollm2", prompts: list[str] = PROMPTS
                ) -> list[tuple[list[str], list[float | None], str]]:
    """The prompt's and the greedy tokens, their logprobs (``echo``: the prompt's too, the
    first None) and the streamed text for each prompt."""
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300.0)
    out = []
    for prompt in prompts:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=5, echo=True)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert prompt + streamed == r.choices[0].text
        out.append((r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, streamed))
    return out


def assert_same_answers(split: KVServe, whole: KVServe, model: str = "smollm2",
                        prompts: list[str] = PROMPTS) -> list:
    """The split server's answers are the whole one's (returned)."""
    reference = completions(whole, model, prompts)
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(completions(split, model, prompts), reference):
        assert tokens == ref_tokens
        assert logprobs[0] is None and ref_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(logprobs[1:], ref_logprobs[1:])) < 1e-4, (logprobs, ref_logprobs)
    return reference


def stream_tokens(srv: KVServe) -> Iterator[str]:
    """Lines of a long streaming completion."""
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120.0) as r:
        assert r.status_code == 200
        yield from (line for line in r.iter_lines() if line)


def assert_lost_rank_reported(srv: KVServe, hurt) -> None:
    """Hurt one rank mid-stream: the stream ends with an error, /health turns 503, new
    requests get 503, every rank is gone, and SIGTERM still stops the server cleanly."""
    ranks = children(srv.proc.pid)
    assert ranks, "no rank processes"
    lines = stream_tokens(srv)
    events = [next(lines) for _ in range(3)]
    hurt(ranks[0])
    t0 = time.monotonic()
    events += list(lines)
    errors = [json.loads(e[6:])["error"] for e in events if e.startswith("data: {") and '"error"' in e]
    assert errors and "tensor parallel rank" in errors[0]["message"], events[-3:]
    assert events[-1] == "data: [DONE]"
    status = wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code,
                        lambda code: code == 503, FAULT_SECONDS)
    assert status == 503, srv.describe()
    assert time.monotonic() - t0 < FAULT_SECONDS
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2},
                   timeout=10)
    assert r.status_code == 503 and "error" in r.json()
    assert wait_until(lambda: [p for p in ranks if alive(p)], lambda left: not left, 10) == []
    assert srv.stop(30) == 0, srv.describe()


# -- the default model, 3 ranks ---------------------------------------------


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, make_lora) -> list[str]:
    """A LoRA adapter both servers serve as ``sql`` (each rank keeps its part of it)."""
    path = make_lora(tmp_path_factory.mktemp("lora") / "sql", SMOLLM2_SHAPE, rank=8, seed=3)
    return ["--lora-modules", f"sql={path}"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory, adapter) -> Iterator[KVServe]:
    srv = start(tmp_path_factory, "tp1", [*EXACT, *adapter])
    yield srv
    srv.stop(30)


@pytest.fixture(scope="module")
def split3(tmp_path_factory, adapter) -> Iterator[KVServe]:
    srv = start(tmp_path_factory, "tp3", [*EXACT, *adapter, "--tensor-parallel-size", "3", "--allow-runtime-lora"])
    yield srv
    srv.kill()


def test_three_ranks_give_one_ranks_answers(split3, whole, adapter):
    assert len(children(split3.proc.pid)) == 2
    # (two prompts, an adapter's one: three ranks sharing two cores answer slowly)
    base = assert_same_answers(split3, whole, prompts=PROMPTS[:2])
    # A LoRA adapter, each rank holding its part of it, as its projections are split.
    assert assert_same_answers(split3, whole, model="sql", prompts=PROMPTS[:1]) != base[:1]
    # Loading one while serving would reach rank 0 alone: refused.
    r = httpx.post(f"{split3.url}/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": adapter[1][4:]},
                   timeout=30)
    assert r.status_code == 400 and "tensor parallelism" in r.json()["error"]["message"]


def test_a_killed_rank_turns_health_503_and_stops_every_rank(split3):
    assert_lost_rank_reported(split3, lambda pid: os.kill(pid, signal.SIGKILL))


# -- a tiny random checkpoint, 2 ranks ----------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2, tmp_path_factory) -> Path:
    """A 2-layer random Llama (4 query heads, 4 KV heads) with SmolLM2's tokenizer."""
    import transformers

    path = tmp_path_factory.mktemp("tiny_tp")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=smollm2.config.vocab_size, hidden_size=128,
                                      intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=1024,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(smollm2.tokenizer.to_json())
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return path


def tiny_args(path: Path) -> list[str]:
    return ["--model", str(path), "--served-model-name", "smollm2", *EXACT]


def test_two_ranks_of_a_tiny_checkpoint_give_one_ranks_answers(tiny_checkpoint, tmp_path_factory):
    whole = start(tmp_path_factory, "tiny1", tiny_args(tiny_checkpoint))
    try:
        split = start(tmp_path_factory, "tiny2", [*tiny_args(tiny_checkpoint), "--tensor-parallel-size", "2"])
        try:
            assert_same_answers(split, whole)
            two_hosts(tiny_checkpoint, tmp_path_factory, whole)
        finally:
            whole.stop(30)
        # A frozen rank (SIGSTOP: its process is alive, its heartbeats stop) is lost too.
        assert_lost_rank_reported(split, lambda pid: os.kill(pid, signal.SIGSTOP))
    finally:
        whole.kill()


def two_hosts(path: Path, tmp_path_factory, whole: KVServe) -> None:
    """``-tp 4 --nnodes 2``: a second "host" (here, another process) runs ranks 2 and 3 and
    no HTTP; SIGTERM on rank 0 stops every rank of both."""
    port = free_port()
    multi = ["-tp", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    log = tmp_path_factory.mktemp("node1") / "node1.log"
    node1 = Process(kvserve_argv("serve", *tiny_args(path), "--dtype", "float32", *multi, "--node-rank", "1"),
                    log, "kvserve serve --node-rank 1")
    try:
        node0 = start(tmp_path_factory, "node0", [*tiny_args(path), *multi, "--node-rank", "0"])
        local = children(node0.proc.pid)
        assert len(local) == 1 and len(children(node1.proc.pid)) == 1, "each host starts its second rank"
        assert_same_answers(node0, whole)
        assert node0.stop(30) == 0, node0.describe()
        assert node1.proc.wait(30) == 0, node1.describe()  # rank 0 stopped it
        assert not [p for p in local if alive(p)]
    finally:
        node1.kill()


def test_a_split_that_does_not_divide_the_heads_is_refused_at_start_up(tmp_path_factory):
    log = tmp_path_factory.mktemp("tp2") / "server.log"
    srv = KVServe(free_port(), log, api_key=None, shutdown_timeout=5.0,
                  extra=[*EXACT, "--tensor-parallel-size", "2"])
    assert srv.proc.wait(60) != 0
    assert "tensor parallel size 2 does not divide the model's 9 query heads and 3 KV heads" in srv.log()
    assert "Traceback" not in srv.log()
