"""POST /v1/completions: the wire format, streaming and not, against the fake engine."""

from __future__ import annotations

import json

import httpx
import pytest

from api_helpers import MODEL, assert_error, sse_events
from fake_engine import SCRIPT, FakeEngine

pytestmark = pytest.mark.anyio


async def complete(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": MODEL, **body})


async def test_non_streaming_shape(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi")
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    # Default max_tokens is 16; "hi" is BOS + 2 bytes.
    assert body["choices"] == [{"text": SCRIPT[:16], "index": 0, "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_params_reach_the_engine(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=5, temperature=0.5, top_p=0.9, seed=7,
                       presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"65": 2.5},
                       top_k=40, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=1,
                       stop_token_ids=[33], stop=["zz"], user="someone")
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed) == (5, 0.5, 0.9, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, {65: 2.5})
    assert (p.top_k, p.min_p, p.repetition_penalty) == (40, 0.1, 1.2)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids, p.stop) == (True, 1, [33], ["zz"])
    assert engine.requests[-1].request_id.startswith("cmpl-")


async def test_token_id_prompt(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await complete(client, prompt=[104, 105], max_tokens=2)
    assert r.json()["choices"][0]["text"] == "he"
    assert engine.requests[-1].prompt_token_ids == [104, 105]


async def test_multiple_prompts_and_n(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt=["a", "bc"], n=2, max_tokens=3)
    body = r.json()
    # Choice i * n + k is sample k of prompt i.
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "hel"), (1, "ell"), (2, "hel"), (3, "ell")]
    assert body["usage"]["prompt_tokens"] == 2 + 3
    assert body["usage"]["completion_tokens"] == 12


async def test_stop_string_is_not_returned(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi", stop="world", max_tokens=30)
    choice = r.json()["choices"][0]
    assert choice["text"] == "hello "
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == len("hello world")


async def test_eos_finishes_with_stop(engine: FakeEngine, client: httpx.AsyncClient) -> None:
    engine.eos_at = 4
    r = await complete(client, prompt="hi", max_tokens=10)
    assert r.json()["choices"][0] == {"text": "hell", "index": 0, "logprobs": None,
                                      "finish_reason": "stop"}
    assert r.json()["usage"]["completion_tokens"] == 5  # EOS counts as a generated token


async def test_max_tokens_null_means_rest_of_context(client: httpx.AsyncClient,
                                                     engine: FakeEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=None)
    assert r.json()["usage"]["completion_tokens"] == engine.max_model_len - 3


async def test_echo(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi ", max_tokens=2, echo=True)
    assert r.json()["choices"][0]["text"] == "hi he"


async def test_echo_with_logprobs_lists_the_prompt_tokens_first(client: httpx.AsyncClient,
                                                                  engine: FakeEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=2, echo=True, logprobs=1)
    choice = r.json()["choices"][0]
    assert choice["text"] == "hihe"
    lp = choice["logprobs"]
    # "hi" is BOS, "h", "i": the first token has no logprob, as OpenAI sends it.
    assert lp["tokens"] == ["<s>", "h", "i", "h", "e"]
    assert lp["token_logprobs"] == [None, -0.5, -1.0, -0.25, -0.25]
    assert lp["top_logprobs"] == [None, {"h": -0.5}, {"i": -1.0}, {"h": -0.25}, {"e": -0.25}]
    assert lp["text_offset"] == [0, 3, 4, 5, 6]
    assert engine.requests[-1].params.prompt_logprobs == 1


async def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi", max_tokens=0, echo=True, logprobs=0)
    body = r.json()
    assert body["choices"][0]["text"] == "hi"
    assert body["choices"][0]["finish_reason"] == "length"
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<s>", "h", "i"]
    assert lp["token_logprobs"] == [None, -0.5, -1.0]
    assert lp["top_logprobs"] == [None, {"h": -0.5}, {"i": -1.0}]
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == 3

    plain = (await complete(client, prompt="hi", max_tokens=0, echo=True)).json()
    assert plain["choices"][0]["text"] == "hi" and plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 4])
async def test_streamed_echo_logprobs_equal_the_non_streamed(client: httpx.AsyncClient, max_tokens: int) -> None:
    body = dict(prompt=["hi", "abc"], n=2, max_tokens=max_tokens, echo=True, logprobs=1)
    plain = (await complete(client, **body)).json()
    events = sse_events((await complete(client, stream=True, stream_options={"include_usage": True},
                                        **body)).text)[:-1]
    assert events[-1]["usage"] == plain["usage"]
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in events if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert {k: sum((m["logprobs"][k] for m in mine if m["logprobs"]), []) for k in keys} == choice["logprobs"]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == [choice["finish_reason"]]


async def test_tokens_as_token_ids_keep_the_text_offsets(client: httpx.AsyncClient) -> None:
    body = dict(prompt="hi", max_tokens=2, echo=True, logprobs=1)
    named = (await complete(client, **body)).json()["choices"][0]["logprobs"]
    ids = (await complete(client, **body, return_tokens_as_token_ids=True)).json()["choices"][0]["logprobs"]
    assert ids["tokens"] == ["token_id:256", "token_id:104", "token_id:105", "token_id:104", "token_id:101"]
    assert ids["top_logprobs"][1] == {"token_id:104": -0.5} and ids["top_logprobs"][3] == {"token_id:104": -0.25}
    # Offsets still count the tokens' texts ("<s>" is 3 characters).
    assert ids["text_offset"] == named["text_offset"] == [0, 3, 4, 5, 6]
    assert ids["token_logprobs"] == named["token_logprobs"]


async def test_prompt_logprobs_in_vllm_s_shape(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=1, prompt_logprobs=2)
    choice = r.json()["choices"][0]
    # Token id -> its entry: the prompt token first (with its rank), then the alternatives.
    assert choice["prompt_logprobs"] == [
        None,
        {"104": {"logprob": -0.5, "rank": 1, "decoded_token": "h"},
         "120": {"logprob": -10.0, "rank": 2, "decoded_token": "x"}},
        {"105": {"logprob": -1.0, "rank": 1, "decoded_token": "i"},
         "120": {"logprob": -10.0, "rank": 2, "decoded_token": "x"}}]
    assert list(choice)[-1] == "prompt_logprobs" and choice["logprobs"] is None
    assert engine.requests[-1].params.prompt_logprobs == 2
    # Only there when asked for; echo's logprobs take prompt_logprobs' alternatives.
    assert "prompt_logprobs" not in (await complete(client, prompt="hi", max_tokens=1)).json()["choices"][0]
    echoed = (await complete(client, prompt="hi", max_tokens=1, echo=True, logprobs=0, prompt_logprobs=2)).json()
    assert echoed["choices"][0]["logprobs"]["top_logprobs"][1] == {"h": -0.5, "x": -10.0}


async def test_prompt_logprobs_are_not_streamed(client: httpx.AsyncClient) -> None:
    assert_error(await complete(client, prompt="hi", prompt_logprobs=1, stream=True), 400)


async def test_logprobs(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi", max_tokens=3, logprobs=2)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "l"]
    assert lp["token_logprobs"] == [-0.25, -0.25, -0.25]
    assert lp["top_logprobs"][0] == {"h": -0.25, "x": -2.0}
    assert lp["text_offset"] == [0, 1, 2]


async def test_logprobs_0_gives_the_sampled_tokens_entry_and_never_null(client: httpx.AsyncClient) -> None:
    # OpenAI: "up to logprobs + 1" entries, the sampled token's always among them (vLLM too).
    for stream in (False, True):
        r = await complete(client, prompt="hi", max_tokens=3, logprobs=0, stream=stream)
        events = ([json.loads(line[6:]) for line in r.text.splitlines()
                   if line.startswith("data: {")] if stream else [r.json()])
        tops = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
        assert tops == [{"h": -0.25}, {"e": -0.25}, {"l": -0.25}], (stream, tops)


async def test_cached_tokens_reported(client: httpx.AsyncClient) -> None:
    prompt = "a long shared prefix that spans blocks " * 2
    await complete(client, prompt=prompt, max_tokens=1)
    r = await complete(client, prompt=prompt, max_tokens=1)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0


async def test_streaming_wire_format(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi", max_tokens=4, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[0]["id"].startswith("cmpl-")
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices"}  # no usage key
        assert c["object"] == "text_completion" and c["model"] == MODEL
        assert len(c["choices"]) == 1
        assert set(c["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hell"
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert all(r is None for r in reasons[:-1])


async def test_streaming_include_usage(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi", max_tokens=4, n=2, stream=True,
                       stream_options={"include_usage": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    for idx, text in ((0, "hell"), (1, "ello")):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert "".join(ch["text"] for ch in mine) == text
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]


async def test_streaming_stop_and_echo(client: httpx.AsyncClient) -> None:
    r = await complete(client, prompt="hi ", stop=["world"], max_tokens=30, stream=True, echo=True)
    chunks = sse_events(r.text)[:-1]
    assert chunks[0]["choices"][0]["text"] == "hi "
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hi hello "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client: httpx.AsyncClient) -> None:
    plain = (await complete(client, prompt="hey", max_tokens=5, n=2)).json()
    events = sse_events((await complete(client, prompt="hey", max_tokens=5, n=2, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})).text)[:-1]
    generated = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] for e in events)
    assert generated == sorted(generated) and generated[0] > 0
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the second request may hit the cache
    assert [events[-1]["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    assert events[-1]["choices"] == []
    # Without it, only the last chunk's usage is set.
    events = sse_events((await complete(client, prompt="hey", max_tokens=5, stream=True,
                                        stream_options={"include_usage": True})).text)[:-1]
    assert [e["usage"] is None for e in events] == [True] * (len(events) - 1) + [False]


async def test_stream_equals_non_stream(client: httpx.AsyncClient) -> None:
    plain = (await complete(client, prompt="hey", max_tokens=9, n=2)).json()
    streamed = sse_events((await complete(client, prompt="hey", max_tokens=9, n=2,
                                          stream=True)).text)[:-1]
    for choice in plain["choices"]:
        parts = [c["choices"][0]["text"] for c in streamed
                 if c["choices"][0]["index"] == choice["index"]]
        assert "".join(parts) == choice["text"]


async def test_batch_of_token_id_prompts(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await complete(client, prompt=[[104], [105, 106]], max_tokens=1)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert sorted(req.prompt_token_ids for req in engine.requests) == [[104], [105, 106]]
    assert r.json()["usage"]["prompt_tokens"] == 3


async def test_truncate_prompt_tokens_and_allowed_token_ids(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    # vLLM's: the prompt's last N tokens (-1: the context length), and the only tokens allowed.
    r = await complete(client, prompt="hello world", max_tokens=2, truncate_prompt_tokens=5, echo=True,
                       allowed_token_ids=[104, 101])
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == list(b"world")
    assert r.json()["choices"][0]["text"].startswith("world")  # the echo is the prompt that ran
    assert r.json()["usage"]["prompt_tokens"] == 5
    assert engine.requests[-1].params.allowed_token_ids == [104, 101]
    await complete(client, prompt="hi", max_tokens=1, truncate_prompt_tokens=-1)
    assert engine.requests[-1].prompt_token_ids == [256, 104, 105]
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                     "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert engine.requests[-1].prompt_token_ids == list(b"ant|>")[-4:]  # the rendered prompt's end
    r = await client.post("/v1/embeddings", json={"input": "hello world", "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    await complete(client, prompt="hi", max_tokens=1, bad_words=["zz", " y"])
    assert engine.requests[-1].params.bad_words == ["zz", " y"]
    for body, param in [({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"bad_words": [""]}, "bad_words"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"allowed_token_ids": [99999]}, "allowed_token_ids")]:
        assert_error(await complete(client, prompt="hi", max_tokens=1, **body), 400, param)


async def test_priority_reaches_the_engine_from_every_api(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    # vLLM's priority: refused (naming it) unless the engine's policy is priority, then passed on.
    assert_error(await complete(client, prompt="hi", max_tokens=1, priority=3), 400, "priority")
    assert_error(await client.post("/v1/embeddings", json={"input": "hi", "priority": 3}), 400, "priority")
    await complete(client, prompt="hi", max_tokens=1, priority=0)
    assert engine.requests[-1].params.priority == 0
    engine.priority_scheduling = True
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for url, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", chat),
                      ("/v1/embeddings", {"input": "hi"}), ("/v1/responses", {"input": "hi", "max_output_tokens": 1})]:
        r = await client.post(url, json={**body, "priority": -7})
        assert r.status_code == 200, (url, r.text)
        assert engine.requests[-1].params.priority == -7, url
    assert_error(await complete(client, prompt="hi", max_tokens=1, priority="high"), 400, "priority")
    await complete(client, prompt="hi", max_tokens=1)
    assert engine.requests[-1].params.priority == 0


async def test_cache_salt_reaches_the_engine_from_every_api(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for url, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", chat),
                      ("/v1/embeddings", {"input": "hi"}), ("/v1/responses", {"input": "hi", "max_output_tokens": 1})]:
        r = await client.post(url, json={**body, "cache_salt": "tenant-7"})
        assert r.status_code == 200, (url, r.text)
        assert engine.requests[-1].params.cache_salt == "tenant-7", url
        assert_error(await client.post(url, json={**body, "cache_salt": ""}), 400, "cache_salt")
    await complete(client, prompt="hi", max_tokens=1)
    assert engine.requests[-1].params.cache_salt is None


async def test_llama_cpps_samplers_reach_the_engine_from_completions_and_chat(client: httpx.AsyncClient,
                                                                              engine: FakeEngine) -> None:
    # llama.cpp's own sampler fields, as its OpenAI-compatible endpoints take them.
    fields = {"typical_p": 0.8, "top_n_sigma": 1.0, "xtc_probability": 0.3, "xtc_threshold": 0.15,
              "dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3, "dry_penalty_last_n": 128,
              "dry_sequence_breakers": ["\n", "###"], "repeat_last_n": 32, "dynatemp_range": 0.5,
              "dynatemp_exponent": 2.0, "temperature_last": True, "mirostat": 1, "mirostat_tau": 4.0,
              "mirostat_eta": 0.05, "samplers": ("top_k", "typ_p", "temperature")}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for url, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", chat)]:
        r = await client.post(url, json={**body, **fields})
        assert r.status_code == 200, (url, r.text)
        p = engine.requests[-1].params
        assert {name: getattr(p, name) for name in fields} == fields, url
        for name, bad in [("mirostat", 3), ("mirostat", True), ("mirostat_tau", -0.5), ("typical_p", 1.5), ("xtc_threshold", -0.1), ("dry_base", 0.9),
                          ("dry_allowed_length", 0), ("dry_sequence_breakers", [""]), ("top_n_sigma", "inf"),
                          ("repeat_last_n", -2), ("dynatemp_range", -1), ("dynatemp_exponent", 0)]:
            assert_error(await client.post(url, json={**body, name: bad}), 400, name)
    await complete(client, prompt="hi", max_tokens=1)
    p = engine.requests[-1].params
    assert (p.typical_p, p.top_n_sigma, p.xtc_probability, p.dry_multiplier) == (1.0, -1.0, 0.0, 0.0)
    assert p.repeat_last_n is None and p.temperature_last is False  # vLLM's way unless asked for
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.samplers) == (0, 5.0, 0.1, None)


async def test_return_token_ids(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    # vLLM's return_token_ids: the prompt's ids and the answer's, streamed or not; a token
    # whose text a stop string holds back still has its id sent (with the next chunk).
    body = {"prompt": ["hi", "a"], "n": 2, "max_tokens": 12, "stop": ["world"], "return_token_ids": True}
    whole = (await complete(client, **body)).json()
    for i, choice in enumerate(whole["choices"]):
        assert choice["prompt_token_ids"] == engine.tokenizer.encode(["hi", "a"][i // 2])
        # Sample k types SCRIPT from k on; its text stops before "world", its tokens after it.
        assert choice["text"] + "world" == SCRIPT[i % 2:][:len(choice["text"]) + 5]
        assert choice["token_ids"] == [ord(c) for c in choice["text"] + "world"]
    events = [e for e in sse_events((await complete(client, **body, stream=True)).text) if e != "[DONE]"]
    for i, choice in enumerate(whole["choices"]):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    plain = (await complete(client, prompt="hi", max_tokens=2)).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


@pytest.fixture
def engine():
    """NOTE: this file's tests still run on the fake engine (issue 41 item 5 converts them)."""
    from fake_engine import FakeEngine

    return FakeEngine()
