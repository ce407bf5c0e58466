"""POST /v1/completions: the wire format, streaming and not, against the real engine on the
tiny checkpoint. Texts, token counts and logprobs are the engine's own for the same prompt and
params, run directly (``greedy``)."""

from __future__ import annotations

import json

import httpx
import pytest

from api_helpers import MODEL, assert_error, client_for, sse_events
from real_engine import GREEDY, ServedEngine, a_stop_string, greedy, name, offsets, tokens_until, top
from server.app import build_app

pytestmark = pytest.mark.anyio

async def complete(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": MODEL, **body})


async def test_non_streaming_shape(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", **GREEDY)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    # Default max_tokens is 16.
    n = len(engine.tokenizer.encode("hi"))
    assert body["choices"] == [{"text": (await greedy(engine, "hi", 16)).text, "index": 0, "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 16, "total_tokens": n + 16,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_params_reach_the_engine(client: httpx.AsyncClient, engine: ServedEngine) -> None:
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


async def test_token_id_prompt(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt=[104, 105], max_tokens=2, **GREEDY)
    assert r.json()["choices"][0]["text"] == (await greedy(engine, [104, 105], 2)).text
    assert engine.requests[-1].prompt_token_ids == [104, 105]


async def test_multiple_prompts_and_n(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt=["a", "bc"], n=2, max_tokens=3, **GREEDY)
    body = r.json()
    # Choice i * n + k is sample k of prompt i (greedy: both samples are the prompt's answer).
    a, bc = (await greedy(engine, "a", 3)).text, (await greedy(engine, "bc", 3)).text
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, a), (1, a), (2, bc), (3, bc)]
    assert body["usage"]["prompt_tokens"] == len(engine.tokenizer.encode("a")) + len(engine.tokenizer.encode("bc"))
    assert body["usage"]["completion_tokens"] == 12


async def test_stop_string_is_not_returned(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    g = await greedy(engine, "hi", 30)
    stop = a_stop_string(g.text)
    r = await complete(client, prompt="hi", stop=stop, max_tokens=30, **GREEDY)
    choice = r.json()["choices"][0]
    assert choice["text"] == g.text[:g.text.find(stop)]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == tokens_until(engine, g.token_ids, stop)


async def test_eos_finishes_with_stop(engine: ServedEngine, client: httpx.AsyncClient) -> None:
    # EOS held back for 4 tokens, then biased to come next.
    eos = engine.tokenizer.eos_token_ids[0]
    r = await complete(client, prompt="hi", max_tokens=10, temperature=0, min_tokens=4, logit_bias={str(eos): 100})
    assert r.json()["choices"][0] == {"text": (await greedy(engine, "hi", 4)).text, "index": 0, "logprobs": None,
                                      "finish_reason": "stop"}
    assert r.json()["usage"]["completion_tokens"] == 5  # EOS counts as a generated token


async def test_max_tokens_null_means_rest_of_context(client: httpx.AsyncClient,
                                                     engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=None, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == engine.max_model_len - len(engine.tokenizer.encode("hi"))


async def test_echo(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi ", max_tokens=2, echo=True, **GREEDY)
    assert r.json()["choices"][0]["text"] == "hi " + (await greedy(engine, "hi ", 2)).text


async def test_echo_with_logprobs_lists_the_prompt_tokens_first(client: httpx.AsyncClient,
                                                                  engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi there", max_tokens=2, echo=True, logprobs=1, **GREEDY)
    choice = r.json()["choices"][0]
    g = await greedy(engine, "hi there", 2, logprobs=1, prompt_logprobs=1)
    assert choice["text"] == "hi there" + g.text
    lp = choice["logprobs"]
    # The first token has no logprob, as OpenAI sends it.
    prompt = engine.tokenizer.encode("hi there")
    names = [name(engine, t) for t in prompt + g.token_ids]
    scored = g.prompt_logprobs[1:] + g.logprobs
    assert lp["tokens"] == names
    assert lp["token_logprobs"] == [None] + [e.logprob for e in scored]
    assert lp["top_logprobs"] == [None] + [top(engine, e) for e in scored]
    assert lp["text_offset"] == offsets(names)
    assert engine.requests[-1].params.prompt_logprobs == 1


async def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: httpx.AsyncClient,
                                                              engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi there", max_tokens=0, echo=True, logprobs=0)
    body = r.json()
    assert body["choices"][0]["text"] == "hi there"
    assert body["choices"][0]["finish_reason"] == "length"
    lp = body["choices"][0]["logprobs"]
    prompt = engine.tokenizer.encode("hi there")
    scored = (await greedy(engine, prompt, 1, prompt_logprobs=0)).prompt_logprobs[1:]
    assert lp["tokens"] == [name(engine, t) for t in prompt]
    assert lp["token_logprobs"] == [None] + [e.logprob for e in scored]
    assert lp["top_logprobs"] == [None] + [{name(engine, e.token_id): e.logprob} for e in scored]
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(prompt)

    plain = (await complete(client, prompt="hi there", max_tokens=0, echo=True)).json()
    assert plain["choices"][0]["text"] == "hi there" and plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 4])
async def test_streamed_echo_logprobs_equal_the_non_streamed(client: httpx.AsyncClient, max_tokens: int) -> None:
    body = dict(prompt=["hi", "abc"], n=2, max_tokens=max_tokens, echo=True, logprobs=1, **GREEDY)
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


async def test_tokens_as_token_ids_keep_the_text_offsets(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    body = dict(prompt="hi there", max_tokens=2, echo=True, logprobs=1, **GREEDY)
    named = (await complete(client, **body)).json()["choices"][0]["logprobs"]
    ids = (await complete(client, **body, return_tokens_as_token_ids=True)).json()["choices"][0]["logprobs"]
    g = await greedy(engine, "hi there", 2, logprobs=1, prompt_logprobs=1)
    tokens = engine.tokenizer.encode("hi there") + g.token_ids
    assert ids["tokens"] == [f"token_id:{t}" for t in tokens]
    scored = g.prompt_logprobs[1:] + g.logprobs
    assert ids["top_logprobs"][1:] == [{f"token_id:{t}": v for t, v in e.top} | {f"token_id:{e.token_id}": e.logprob}
                                       for e in scored]
    # Offsets still count the tokens' texts.
    assert ids["text_offset"] == named["text_offset"] == offsets([name(engine, t) for t in tokens])
    assert ids["token_logprobs"] == named["token_logprobs"]


async def test_prompt_logprobs_in_vllm_s_shape(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi there", max_tokens=1, prompt_logprobs=2)
    choice = r.json()["choices"][0]
    scored = (await greedy(engine, "hi there", 1, prompt_logprobs=2)).prompt_logprobs

    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": name(engine, token_id)}

    # Token id -> its entry: the prompt token first (with its rank), then the alternatives.
    assert choice["prompt_logprobs"] == [None] + [
        {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        | {str(t): entry(t, v, rank) for rank, (t, v) in enumerate(e.top, start=1) if t != e.token_id}
        for e in scored[1:]]
    assert list(choice["prompt_logprobs"][1])[0] == str(scored[1].token_id)
    assert list(choice)[-1] == "prompt_logprobs" and choice["logprobs"] is None
    assert engine.requests[-1].params.prompt_logprobs == 2
    # Only there when asked for; echo's logprobs take prompt_logprobs' alternatives.
    assert "prompt_logprobs" not in (await complete(client, prompt="hi", max_tokens=1)).json()["choices"][0]
    echoed = (await complete(client, prompt="hi there", max_tokens=1, echo=True, logprobs=0, prompt_logprobs=2)).json()
    assert echoed["choices"][0]["logprobs"]["top_logprobs"][1] == top(engine, scored[1])


async def test_prompt_logprobs_are_not_streamed(client: httpx.AsyncClient) -> None:
    assert_error(await complete(client, prompt="hi", prompt_logprobs=1, stream=True), 400)


async def test_logprobs(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=3, logprobs=2, **GREEDY)
    lp = r.json()["choices"][0]["logprobs"]
    g = await greedy(engine, "hi", 3, logprobs=2)
    names = [name(engine, t) for t in g.token_ids]
    assert lp["tokens"] == names
    assert lp["token_logprobs"] == [e.logprob for e in g.logprobs]
    assert lp["top_logprobs"][0] == top(engine, g.logprobs[0]) and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"] == offsets(names)


async def test_logprobs_0_gives_the_sampled_tokens_entry_and_never_null(client: httpx.AsyncClient,
                                                                        engine: ServedEngine) -> None:
    # OpenAI: "up to logprobs + 1" entries, the sampled token's always among them (vLLM too).
    g = await greedy(engine, "hi", 3, logprobs=0)
    for stream in (False, True):
        r = await complete(client, prompt="hi", max_tokens=3, logprobs=0, stream=stream, **GREEDY)
        events = ([json.loads(line[6:]) for line in r.text.splitlines()
                   if line.startswith("data: {")] if stream else [r.json()])
        tops = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
        assert tops == [{name(engine, e.token_id): e.logprob} for e in g.logprobs], (stream, tops)


async def test_cached_tokens_reported(client: httpx.AsyncClient) -> None:
    prompt = "a long shared prefix that spans blocks " * 5
    await complete(client, prompt=prompt, max_tokens=1)
    r = await complete(client, prompt=prompt, max_tokens=1)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0


async def test_streaming_wire_format(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=4, stream=True, **GREEDY)
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
    assert "".join(c["choices"][0]["text"] for c in chunks) == (await greedy(engine, "hi", 4)).text
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert all(r is None for r in reasons[:-1])


async def test_streaming_include_usage(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", max_tokens=4, n=2, stream=True,
                       stream_options={"include_usage": True}, **GREEDY)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == []
    n = len(engine.tokenizer.encode("hi"))
    assert last["usage"] == {"prompt_tokens": n, "completion_tokens": 8, "total_tokens": n + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    text = (await greedy(engine, "hi", 4)).text
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert "".join(ch["text"] for ch in mine) == text
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]


async def test_streaming_stop_and_echo(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    g = await greedy(engine, "hi ", 30)
    stop = a_stop_string(g.text)
    r = await complete(client, prompt="hi ", stop=[stop], max_tokens=30, stream=True, echo=True, **GREEDY)
    chunks = sse_events(r.text)[:-1]
    assert chunks[0]["choices"][0]["text"] == "hi "
    # Held back while it could become the stop string, then cut before it.
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hi " + g.text[:g.text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client: httpx.AsyncClient) -> None:
    plain = (await complete(client, prompt="hey", max_tokens=5, n=2, **GREEDY)).json()
    events = sse_events((await complete(client, prompt="hey", max_tokens=5, n=2, stream=True, **GREEDY, stream_options={
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
    plain = (await complete(client, prompt="hey", max_tokens=9, n=2, **GREEDY)).json()
    streamed = sse_events((await complete(client, prompt="hey", max_tokens=9, n=2,
                                          stream=True, **GREEDY)).text)[:-1]
    for choice in plain["choices"]:
        parts = [c["choices"][0]["text"] for c in streamed
                 if c["choices"][0]["index"] == choice["index"]]
        assert "".join(parts) == choice["text"]


async def test_batch_of_token_id_prompts(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt=[[104], [105, 106]], max_tokens=1)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert sorted(req.prompt_token_ids for req in engine.requests) == [[104], [105, 106]]
    assert r.json()["usage"]["prompt_tokens"] == 3


async def test_truncate_prompt_tokens_and_allowed_token_ids(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    # vLLM's: the prompt's last N tokens (-1: the context length), and the only tokens allowed.
    text = "hello world, how are you doing today?"
    ids = engine.tokenizer.encode(text)
    r = await complete(client, prompt=text, max_tokens=2, truncate_prompt_tokens=5, echo=True,
                       allowed_token_ids=[104, 101])
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == ids[-5:]
    # The echo is the prompt that ran.
    assert r.json()["choices"][0]["text"].startswith(engine.tokenizer.decode(ids[-5:]))
    assert r.json()["usage"]["prompt_tokens"] == 5
    assert engine.requests[-1].params.allowed_token_ids == [104, 101]
    await complete(client, prompt="hi", max_tokens=1, truncate_prompt_tokens=-1)
    assert engine.requests[-1].prompt_token_ids == engine.tokenizer.encode("hi")
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                     "max_tokens": 1, "truncate_prompt_tokens": 4})
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    # The rendered prompt's end.
    assert engine.requests[-1].prompt_token_ids == engine.tokenizer.encode(rendered, add_special_tokens=False)[-4:]
    r = await client.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    await complete(client, prompt="hi", max_tokens=1, bad_words=["zz", " y"])
    assert engine.requests[-1].params.bad_words == ["zz", " y"]
    for body, param in [({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"bad_words": [""]}, "bad_words"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"allowed_token_ids": [engine.vocab_size]}, "allowed_token_ids")]:
        assert_error(await complete(client, prompt="hi", max_tokens=1, **body), 400, param)


async def test_priority_reaches_the_engine_from_every_api(client: httpx.AsyncClient, engine: ServedEngine,
                                                          make_engine) -> None:
    # vLLM's priority: refused (naming it) unless the engine's policy is priority, then passed on.
    assert_error(await complete(client, prompt="hi", max_tokens=1, priority=3), 400, "priority")
    assert_error(await client.post("/v1/embeddings", json={"input": "hi", "priority": 3}), 400, "priority")
    await complete(client, prompt="hi", max_tokens=1, priority=0)
    assert engine.requests[-1].params.priority == 0
    engine = make_engine(scheduling_policy="priority")
    app = build_app(engine)
    async with app.router.lifespan_context(app), client_for(app) as client:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for url, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", chat),
                          ("/v1/embeddings", {"input": "hi"}),
                          ("/v1/responses", {"input": "hi", "max_output_tokens": 1})]:
            r = await client.post(url, json={**body, "priority": -7})
            assert r.status_code == 200, (url, r.text)
            assert engine.requests[-1].params.priority == -7, url
        assert_error(await complete(client, prompt="hi", max_tokens=1, priority="high"), 400, "priority")
        await complete(client, prompt="hi", max_tokens=1)
        assert engine.requests[-1].params.priority == 0


async def test_cache_salt_reaches_the_engine_from_every_api(client: httpx.AsyncClient, engine: ServedEngine) -> None:
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
                                                                              engine: ServedEngine) -> None:
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


async def test_return_token_ids(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    # vLLM's return_token_ids: the prompt's ids and the answer's, streamed or not; a token
    # whose text a stop string holds back still has its id sent (with the next chunk).
    answers = [await greedy(engine, p, 12) for p in ("hi", "a")]
    stop = a_stop_string(answers[0].text)
    body = {"prompt": ["hi", "a"], "n": 2, "max_tokens": 12, "stop": [stop], "return_token_ids": True, **GREEDY}
    whole = (await complete(client, **body)).json()
    for i, choice in enumerate(whole["choices"]):
        assert choice["prompt_token_ids"] == engine.tokenizer.encode(["hi", "a"][i // 2])
        # Its text stops before the stop string, its tokens after it.
        g = answers[i // 2]
        cut = g.text.find(stop)
        assert choice["text"] == (g.text[:cut] if cut >= 0 else g.text)
        assert choice["token_ids"] == g.token_ids[:tokens_until(engine, g.token_ids, stop) if cut >= 0 else None]
    events = [e for e in sse_events((await complete(client, **body, stream=True)).text) if e != "[DONE]"]
    for i, choice in enumerate(whole["choices"]):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    plain = (await complete(client, prompt="hi", max_tokens=2)).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
