"""llama.cpp server's own /completion API on the real server: the same answer as
/v1/completions, streamed or not, a GBNF grammar followed, and llama.cpp's shape."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from e2e_helpers import KVServe

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def post(server: KVServe, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120.0)


def test_the_answer_is_v1_completions_streamed_or_not(server: KVServe) -> None:
    ours = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                            "logprobs": 2}).json()["choices"][0]
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "n_probs": 2,
                                         "return_tokens": True})
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["content"] == ours["text"] and body["stop_type"] == "limit"
    assert [p["logprob"] for p in body["completion_probabilities"]] == ours["logprobs"]["token_logprobs"]
    assert len(body["tokens"]) == body["tokens_predicted"] == 12
    assert body["timings"]["predicted_n"] == 12 and body["timings"]["predicted_per_second"] > 0
    with httpx.stream("POST", f"{server.url}/completion", headers=server.headers, timeout=120.0,
                      json={"prompt": PROMPT, "n_predict": 12, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line]
    assert "".join(e["content"] for e in events) == body["content"]
    assert [t for e in events for t in e["tokens"]] == body["tokens"]
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    # A long prompt's blocks come from the prefix cache the second time (tokens_cached).
    long = {"prompt": " ".join([PROMPT] * 8), "n_predict": 1, "temperature": 0}
    first, again = post(server, "/completion", long).json(), post(server, "/completion", long).json()
    assert again["tokens_cached"] > 0 and again["timings"]["cache_n"] == again["tokens_cached"]
    assert again["content"] == first["content"] and again["tokens_evaluated"] == first["tokens_evaluated"]


def test_a_gbnf_grammar_is_followed_and_a_broken_one_is_a_400(server: KVServe) -> None:
    grammar = 'root ::= ("yes" | "no") ", " [a-z ]{1,12} "."'
    for seed in range(3):
        body = post(server, "/completion", {"prompt": "Is the sky blue? Answer:", "n_predict": 24,
                                            "grammar": grammar, "seed": seed}).json()
        assert re.fullmatch(r"(yes|no), [a-z ]{1,12}\.", body["content"]), body["content"]
        assert body["stop_type"] == "eos"
    r = post(server, "/completion", {"prompt": "hi", "grammar": "root ::= ("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text


def test_llama_cpps_samplers_run_as_the_same_request_to_v1_completions(server: KVServe) -> None:
    # A looping prompt, greedy: DRY changes the answer, and /completion's DRY is /v1/completions'.
    loop = "one two three, one two three, one two three, one two three,"
    samplers = {"dry_multiplier": 1.0, "dry_allowed_length": 2, "dry_sequence_breakers": ["\n"]}
    plain = post(server, "/completion", {"prompt": loop, "n_predict": 16, "temperature": 0}).json()["content"]
    dry = post(server, "/completion", {"prompt": loop, "n_predict": 16, "temperature": 0, **samplers})
    assert dry.status_code == 200, dry.text
    assert dry.json()["content"] != plain
    ours = post(server, "/v1/completions", {"prompt": loop, "max_tokens": 16, "temperature": 0, **samplers}).json()
    assert ours["choices"][0]["text"] == dry.json()["content"]
    # Seeded sampling with XTC, typical-p and top-n-sigma: the same answer twice.
    seeded = {"prompt": "Once upon a time", "n_predict": 16, "seed": 5, "xtc_probability": 0.5,
              "typical_p": 0.9, "top_n_sigma": 2.0}
    assert post(server, "/completion", seeded).json()["content"] == post(server, "/completion", seeded).json()["content"]
    # Mirostat 2, seeded: /completion's answer is /v1/completions' with the same fields (its
    # top_k/top_p/min_p defaults unused, as in llama.cpp), and not the answer without it.
    miro = {"seed": 5, "temperature": 1.5, "mirostat": 2, "mirostat_tau": 1.0, "mirostat_eta": 0.2}
    answer = post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 24, **miro})
    assert answer.status_code == 200, answer.text
    ours = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, **miro}).json()
    assert ours["choices"][0]["text"] == answer.json()["content"]
    assert answer.json()["generation_settings"]["mirostat"] == 2
    without = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24,
                                               **{**miro, "mirostat": 0}}).json()
    assert without["choices"][0]["text"] != answer.json()["content"]
    # A chain of its own: /completion's min_p and top_p defaults go unused, as in llama.cpp,
    # so it answers as /v1/completions with the same chain.
    chain = {"seed": 9, "temperature": 1.2, "top_k": 5, "samplers": "kt"}
    answer = post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 24, **chain}).json()
    ours = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, **chain,
                                            "samplers": ["top_k", "temperature"]}).json()
    assert ours["choices"][0]["text"] == answer["content"]
    assert answer["generation_settings"]["samplers"] == ["penalties", "dry", "top_k", "temperature"]


def test_fill_in_the_middle_needs_a_code_models_markers(server: KVServe) -> None:
    # SmolLM2 has no fill-in-the-middle tokens: /infill and a completions suffix say so.
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": "def f(", "suffix": "):", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
