"""``kvserve serve --speculative ngram`` and ``--speculative draft --draft-model`` over
HTTP: the same answers as the plain server, streamed or not, with the proposals counted
on ``/metrics``."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from e2e_helpers import MODEL, KVServe, free_port, idle, metric, wait_until
from mixed_requests import CHAT, SCHEMA, check_answer, mixed_request

pytestmark = pytest.mark.slow

PARAGRAPH = ("The lighthouse stood above him on the crest of the island, white and plain, with a red "
             "band painted around its middle like a ribbon on a parcel. He had imagined it would be taller.")
PROMPTS = [f"Repeat this paragraph word for word.\n\nParagraph: {PARAGRAPH}\n\nRepeated: The lighthouse",
           "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]


# The draft is the default model itself: every greedy proposal is then accepted.
@pytest.fixture(scope="module", params=[["ngram"], ["draft", "--draft-model", MODEL]], ids=["ngram", "draft"])
def speculating(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVServe]:
    srv = KVServe(free_port(), tmp_path_factory.mktemp("spec") / "server.log", api_key=None,
                  shutdown_timeout=10.0, extra=["--speculative", *request.param, "--num-speculative-tokens", "5"])
    try:
        srv.wait_http_ok(f"{srv.url}/health", 120.0)
        yield srv
    finally:
        rc = srv.stop(30.0)
    assert rc == 0, srv.describe()


def test_answers_equal_the_plain_servers_streamed_or_not(client: openai.OpenAI, speculating: KVServe) -> None:
    spec = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="none", max_retries=0, timeout=120.0)
    body = dict(model=MODEL, max_tokens=60, temperature=0)
    for prompt in PROMPTS:
        plain = client.completions.create(prompt=prompt, **body).choices[0]
        whole = spec.completions.create(prompt=prompt, **body).choices[0]
        streamed = "".join(c.choices[0].text for c in spec.completions.create(prompt=prompt, stream=True, **body)
                           if c.choices)
        assert whole.text == plain.text == streamed and whole.finish_reason == plain.finish_reason
    # Seeded sampling with logprobs gives the same tokens and logprobs.
    sampled = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0.8, seed=4, logprobs=2)
    a = client.completions.create(**sampled).choices[0]
    b = spec.completions.create(**sampled).choices[0]
    assert b.text == a.text and b.logprobs.token_logprobs == a.logprobs.token_logprobs
    # A chat with a stop string and n=2.
    messages = [{"role": "user", "content": f"Quote this: {PARAGRAPH}"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0,
                                           stop=["ribbon"], n=2)
    same = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0,
                                        stop=["ribbon"], n=2)
    assert [c.message.content for c in same.choices] == [c.message.content for c in plain.choices]
    assert same.usage.completion_tokens == plain.usage.completion_tokens
    m = speculating.metrics()
    drafts = metric(m, "spec_decode_num_draft_tokens_total")
    kept = metric(m, "spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < kept <= drafts
    assert metric(m, "spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric(m, "spec_decode_num_drafts_total") > 0
    assert metric(m, "generation_tokens_total") >= kept
    r = httpx.get(f"{speculating.url}/metrics", timeout=10.0)
    assert "kvserve_spec_decode_num_accepted_tokens_per_pos_total" in r.text


def test_mixed_requests_at_once_with_hang_ups_leave_nothing_behind(speculating: KVServe) -> None:
    # Speculation meets every other feature: grammars, tools, logprobs, n, penalties, stop
    # strings; four clients at once, and some streams dropped after a few events.
    def client(k: int) -> list[str]:
        rng, problems = random.Random(k), []
        with httpx.Client(base_url=speculating.url, timeout=120.0) as http:
            for _ in range(12):
                path, body = mixed_request(rng)
                if body.get("stream") and rng.random() < 0.3:
                    with http.stream("POST", path, json=body) as r:
                        for _, _line in zip(range(rng.randint(0, 3)), r.iter_lines()):
                            pass
                    continue
                problem = check_answer(path, body, http.post(path, json=body))
                if problem:
                    problems.append(problem)
        return problems

    # First, one that a draft once broke: sampled JSON whose end and end of text get proposed.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say a word."}], "n": 8, "seed": 0,
            "temperature": 1.0, "presence_penalty": 2.0, "frequency_penalty": 0.5, "min_tokens": 10,
            "max_tokens": 20, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    problem = check_answer(CHAT, body, httpx.post(f"{speculating.url}{CHAT}", json=body, timeout=120.0))
    with ThreadPoolExecutor(4) as pool:
        problems = [p for found in pool.map(client, range(4)) for p in found] + [problem] * bool(problem)
    assert not problems, problems
    samples = wait_until(speculating.metrics, idle, timeout=60.0)
    assert idle(samples), samples
    assert "Traceback" not in speculating.log(tail=10**7)
