"""``kvserve run-batch`` with the real model: a batch file's answers equal the server's
(the batch with ``--scheduling-policy priority`` and a priority on every line)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from e2e_helpers import MODEL, REPO, KVServe, kvserve_argv

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
              "logprobs": 2}
SEEDED = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7}
EMBEDDING = {"model": MODEL, "input": "a sentence to embed"}
BAD = {"model": MODEL, "prompt": "x", "max_tokens": 1, "temperature": -1}


def test_run_batch_answers_a_file_as_the_server_answers_each_line(server: KVServe, tmp_path: Path) -> None:
    requests = [("chat", "/v1/chat/completions", CHAT), ("completion", "/v1/completions", COMPLETION),
                ("seeded", "/v1/completions", SEEDED), ("embedding", "/v1/embeddings", EMBEDDING),
                ("bad", "/v1/completions", BAD)]
    # This run takes priorities (the shared server, fcfs, refuses them): each line has one.
    source = "\n".join(json.dumps({"custom_id": c, "method": "POST", "url": u, "body": {**b, "priority": i % 3 - 1}})
                       for i, (c, u, b) in enumerate(requests))
    out = tmp_path / "out.jsonl"
    # The shared server runs float32 + w4a8; so does this process (the input comes on stdin).
    # (With auto, a CPU with AMX-BF16 would pick w4a16 here: other bits.)
    argv = kvserve_argv("run-batch", "-i", "-", "-o", str(out), "--model", MODEL, "--dtype", "float32",
                        "--quantization", "w4a8", "--no-progress", "--scheduling-policy", "priority")
    r = subprocess.run(argv, input=source, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 succeeded, 1 failed" in r.stderr, r.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [c for c, _, _ in requests]
    headers = {"Authorization": f"Bearer {server.api_key}"}
    for g, (custom_id, url, body) in zip(got, requests):
        direct = httpx.post(f"{server.url}{url}", json=body, headers=headers, timeout=120)
        assert g["response"]["status_code"] == direct.status_code, custom_id
        if custom_id == "bad":
            assert direct.status_code == 400
            assert g["response"]["body"] == direct.json()
            assert g["error"]["message"] == direct.json()["error"]["message"]
            continue
        assert g["error"] is None, g
        mine, theirs = g["response"]["body"], direct.json()
        if custom_id == "embedding":
            assert mine["data"] == theirs["data"]
        else:
            # Greedy, logprobs and a seeded sample: the same bits in a batch file as on the server.
            assert mine["choices"] == theirs["choices"], custom_id
            assert mine["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    refused = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "priority": 1}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
