"""Same request, same answer over HTTP, with ``kvserve serve``'s defaults.

The second of two identical chats finds its prompt in the prefix cache; at
temperature 0 it must still get the first one's text and logprobs, bit for
bit, streamed or not (issue 14: it used to get another answer).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from e2e_helpers import MODEL, KVServe, free_port, idle, metric, wait_until

pytestmark = pytest.mark.slow

CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0,
            logprobs=True)


def whole(client: openai.OpenAI) -> tuple[str, list[float]]:
    choice = client.chat.completions.create(**CHAT).choices[0]
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


def streamed(client: openai.OpenAI) -> tuple[str, list[float]]:
    text, logprobs = "", []
    for chunk in client.chat.completions.create(stream=True, **CHAT):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []]
    return text, logprobs


def test_the_same_chat_twice_gets_the_same_answer_with_default_settings(tmp_path: Path) -> None:
    srv = KVServe(free_port(), tmp_path / "server.log", api_key=None, shutdown_timeout=5.0, dtype=None)
    try:
        srv.wait_http_ok(f"{srv.url}/health", 300.0)  # a first start on this CPU also chooses the path
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120.0)

        first = whole(client)
        answers = [whole(client), streamed(client), streamed(client)]

        assert first[0].strip() and len(first[1]) == 16
        for answer in answers:
            assert answer == first
        samples = wait_until(srv.metrics, idle, 10.0)
        # The repeats did hit the prefix cache (so the check means something).
        assert metric(samples, "prefix_cache_hits_total") > 0
    finally:
        rc = srv.stop(30.0)
    assert rc == 0, srv.describe()
