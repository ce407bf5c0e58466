"""POST /completion (llama.cpp server's own API) against the real engine on the tiny checkpoint:
its fields reach the engine as /v1/completions' do, and the answer comes back in llama.cpp's
shape."""

from __future__ import annotations

import json

import httpx
import pytest

from api_helpers import MODEL, assert_error
from models.tokenizer import FimTokens
from real_engine import MAX_MODEL_LEN, PLAIN_TEMPLATE, ServedEngine, a_stop_string, greedy, name

pytestmark = pytest.mark.anyio

VOCAB = 49152  # the tiny model's (SmolLM2's) vocabulary: the first id past it


async def complete(client: httpx.AsyncClient, path: str = "/completion", **body) -> httpx.Response:
    return await client.post(path, json=body)


@pytest.fixture
def engine(make_engine) -> ServedEngine:
    return make_engine(chat_template=PLAIN_TEMPLATE)


def events(body: str) -> list[dict]:
    """A llama.cpp stream: ``data: {...}`` events and no ``[DONE]``."""
    blocks = body.strip().split("\n\n")
    assert all(b.startswith("data: {") for b in blocks), blocks
    return [json.loads(b[len("data: "):]) for b in blocks]


async def test_an_answer_in_llama_cpps_shape(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", n_predict=12, return_tokens=True, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    # Sampled (llama.cpp's temperature): the text is its tokens'.
    assert len(body["tokens"]) == 12 and body["content"] == engine.tokenizer.decode(body["tokens"])
    n = len(engine.tokenizer.encode("hi"))
    assert (body["stop"], body["stop_type"], body["stopping_word"]) == (True, "limit", "")
    assert (body["tokens_predicted"], body["tokens_evaluated"], body["tokens_cached"]) == (12, n, 0)
    prompt = engine.tokenizer.decode(engine.tokenizer.encode("hi"), skip_special_tokens=False)
    assert body["model"] == MODEL and body["prompt"] == prompt and body["truncated"] is False
    assert body["has_new_line"] is False and "completion_probabilities" not in body
    settings = body["generation_settings"]
    assert (settings["n_ctx"], settings["n_predict"], settings["temperature"], settings["top_k"]) == (
        MAX_MODEL_LEN, 12, 0.8, 40)
    timings = body["timings"]
    assert timings["predicted_n"] == 12 and timings["prompt_n"] == n and timings["predicted_ms"] >= 0
    # llama.cpp's defaults where the request says nothing: not OpenAI's.
    p = engine.requests[-1].params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (12, 0.8, 40, 0.95, 0.05, None)
    # Without return_tokens the ids stay out, as in llama.cpp; /completions is the same route.
    body = (await complete(client, "/completions", prompt="hi", n_predict=2, temperature=0, ignore_eos=True)).json()
    assert body["content"] == (await greedy(engine, "hi", 2)).text and body["tokens"] == []


async def test_fields_reach_the_engine_under_llama_cpps_names(client: httpx.AsyncClient,
                                                              engine: ServedEngine) -> None:
    r = await complete(client, prompt="hi", n_predict=4, temperature=0.5, top_k=0, top_p=0.9, min_p=0,
                       repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25, seed=7,
                       ignore_eos=True, logit_bias=[[65, 2.5], ["ab", -1], [66, False]], n_cmpl=1,
                       cache_prompt=True, samplers=["top_k", "temperature"], typical_p=1.0, mirostat=2,
                       mirostat_tau=3.0, mirostat_eta=0.2)
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (4, 0.5, 0, 0.9, 0.0, 7)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.ignore_eos) == (1.1, 0.5, 0.25, True)
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta) == (2, 3.0, 0.2)
    # llama.cpp's samplers: its names (a name it does not know skipped, DRY and the
    # penalties always first) or its letters; reported back in generation_settings.
    assert p.samplers == ("top_k", "temperature")
    assert r.json()["generation_settings"]["samplers"] == ["penalties", "dry", "top_k", "temperature"]
    for samplers, order in [(["dry", "top-p", "tfs_z", "min_p", "temp"], ("top_p", "min_p", "temperature")),
                            ("dkypmxts", ("top_k", "typ_p", "top_p", "min_p", "xtc", "temperature", "top_n_sigma")),
                            ([], ())]:
        assert (await complete(client, prompt="hi", n_predict=1, samplers=samplers)).status_code == 200
        assert engine.requests[-1].params.samplers == order, samplers
    await complete(client, prompt="hi", n_predict=1)
    assert engine.requests[-1].params.samplers is None
    # A text's every token gets its bias; false is the least bias there is.
    assert p.logit_bias == {65: 2.5, **{t: -1.0 for t in engine.tokenizer.encode("ab", add_special_tokens=False)},
                            66: -100.0}
    # llama.cpp's defaults for its own samplers: each off but its settings as llama.cpp's.
    assert (p.typical_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold) == (1.0, -1.0, 0.0, 0.1)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, -1)
    assert p.dry_sequence_breakers == ["\n", ":", '"', "*"]
    assert p.repeat_last_n == 64  # llama.cpp's penalties count the last 64 tokens, prompt included
    assert p.temperature_last and (p.dynatemp_range, p.dynatemp_exponent) == (0.0, 1.0)  # llama.cpp's chain
    r = await complete(client, prompt="hi", n_predict=2, typical_p=0.9, top_n_sigma=1.5, xtc_probability=0.5,
                       xtc_threshold=0.2, dry_multiplier=0.8, dry_base=2, dry_allowed_length=3,
                       dry_penalty_last_n=64, dry_sequence_breakers=["\n\n"], repeat_last_n=-1,
                       dynatemp_range=0.3, dynatemp_exponent=1.5)
    p = engine.requests[-1].params
    assert (p.typical_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold) == (0.9, 1.5, 0.5, 0.2)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.8, 2.0, 3, 64)
    assert p.dry_sequence_breakers == ["\n\n"] and p.repeat_last_n == -1
    assert (p.dynatemp_range, p.dynatemp_exponent) == (0.3, 1.5)
    settings = r.json()["generation_settings"]
    assert (settings["typical_p"], settings["dry_multiplier"], settings["dry_sequence_breakers"]) == (0.9, 0.8, ["\n\n"])
    await complete(client, prompt="hi", n_predict=-1, temperature=-1, seed=-1)
    p = engine.requests[-1].params
    assert (p.max_tokens, p.temperature, p.seed) == (None, 0.0, None)  # the rest of the context; greedy
    await complete(client, prompt="hi", n_predict=3, logit_bias={"65": 1.5})
    assert engine.requests[-1].params.logit_bias == {65: 1.5}


async def test_prompts_of_ids_and_texts(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    # Ids and texts in one list are one prompt (a text after the first gets no BOS).
    def enc(text: str, special: bool = False) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=special)

    await complete(client, prompt=[104, "ey", 33], n_predict=1)
    assert engine.requests[-1].prompt_token_ids == [104, *enc("ey"), 33]
    await complete(client, prompt=["ab", 33], n_predict=1)
    assert engine.requests[-1].prompt_token_ids == [*enc("ab", special=True), 33]
    # A list of texts (or of lists) is several prompts: an array of results.
    r = await complete(client, prompt=["a", [98, "c"]], n_predict=2, temperature=0, ignore_eos=True)
    results = r.json()
    prompts = [enc("a", special=True), [98, *enc("c")]]
    assert [x["index"] for x in results] == [0, 1]
    assert [x["tokens_evaluated"] for x in results] == [len(p) for p in prompts]
    assert [x["content"] for x in results] == [(await greedy(engine, p, 2)).text for p in prompts]


async def test_stops_eos_and_probabilities(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    g = await greedy(engine, "hi", 40, logprobs=2)
    stop = a_stop_string(g.text)
    body = (await complete(client, prompt="hi", n_predict=40, stop=[stop], temperature=0, ignore_eos=True)).json()
    assert (body["content"], body["stop_type"], body["stopping_word"]) == (g.text[:g.text.find(stop)], "word", stop)
    # EOS held back for 5 tokens (the operator's --override-generation-config), then biased to come next.
    engine.sampling_overrides = {"min_tokens": 5}
    engine.sampling_defaults = {**engine.inner.sampling_defaults, "min_tokens": 5}
    eos = engine.tokenizer.eos_token_ids[0]
    body = (await complete(client, prompt="hi", n_predict=40, n_probs=2, temperature=0,
                           logit_bias=[[eos, 100]])).json()
    assert (body["content"], body["stop_type"], body["tokens_predicted"]) == ((await greedy(engine, "hi", 5)).text,
                                                                              "eos", 6)
    probs = body["completion_probabilities"]
    first = g.logprobs[0]
    assert len(probs) == 6 and probs[0]["id"] == first.token_id and probs[0]["token"] == name(engine, first.token_id)
    assert probs[0]["bytes"] == list(engine.tokenizer.token_bytes(first.token_id))
    assert probs[0]["logprob"] == first.logprob
    assert len(probs[0]["top_logprobs"]) == 2 and set(probs[0]["top_logprobs"][0]) == {"id", "token", "bytes",
                                                                                        "logprob"}


async def test_n_predict_0_evaluates_the_prompt_only(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    body = (await complete(client, prompt="hello there", n_predict=0)).json()
    assert (body["content"], body["tokens_predicted"], body["stop_type"]) == ("", 0, "limit")
    assert body["tokens_evaluated"] == len(engine.tokenizer.encode("hello there"))


async def test_the_stream_is_llama_cpps(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    whole = (await complete(client, prompt="hi", n_predict=9, n_probs=1, temperature=0, ignore_eos=True)).json()
    r = await complete(client, prompt="hi", n_predict=9, n_probs=1, stream=True, temperature=0, ignore_eos=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    deltas, last = got[:-1], got[-1]
    assert all(e["stop"] is False for e in deltas) and last["stop"] is True
    assert "".join(e["content"] for e in deltas) == whole["content"]
    assert [t for e in deltas for t in e["tokens"]] == (await greedy(engine, "hi", 9)).token_ids
    assert [p for e in deltas for p in e["completion_probabilities"]] == whole["completion_probabilities"]
    assert (last["content"], last["stop_type"], last["tokens_predicted"]) == ("", "limit", 9)
    assert "[DONE]" not in r.text


async def test_bad_requests_are_400s_naming_llama_cpps_field(client: httpx.AsyncClient) -> None:
    for body, param in [({"prompt": "hi", "mirostat": 3}, "mirostat"),
                        ({"prompt": "hi", "mirostat": 2, "mirostat_tau": -1}, "mirostat_tau"),
                        ({"prompt": "hi", "mirostat": 1, "mirostat_eta": "nan"}, "mirostat_eta"),
                        ({"prompt": "hi", "dynatemp_range": -0.5}, "dynatemp_range"),
                        ({"prompt": "hi", "typical_p": 0}, "typical_p"),
                        ({"prompt": "hi", "dry_multiplier": -1}, "dry_multiplier"),
                        ({"prompt": "hi", "dry_base": 0.5}, "dry_base"),
                        ({"prompt": "hi", "dry_allowed_length": 0}, "dry_allowed_length"),
                        ({"prompt": "hi", "dry_penalty_last_n": -2}, "dry_penalty_last_n"),
                        ({"prompt": "hi", "dry_sequence_breakers": ["\n", ""]}, "dry_sequence_breakers"),
                        ({"prompt": "hi", "xtc_probability": 1.5}, "xtc_probability"),
                        ({"prompt": "hi", "repeat_last_n": -3}, "repeat_last_n"),
                        ({"prompt": "hi", "lora": [{"id": 0, "scale": 0.5}]}, "lora"),
                        ({"prompt": "hi", "n_predict": -2}, "n_predict"),
                        ({"prompt": "hi", "n_predict": 10_000}, "prompt"),  # past the context
                        ({"prompt": "hi", "n_probs": 50}, "n_probs"),
                        ({"prompt": "hi", "repeat_penalty": 0}, "repeat_penalty"),
                        ({"prompt": "hi", "logit_bias": [[65]]}, "logit_bias"),
                        ({"prompt": "hi", "logit_bias": [[65, "up"]]}, "logit_bias"),
                        ({"prompt": [[]]}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": [1.5]}, "prompt"), ({"prompt": [VOCAB]}, "prompt"),
                        ({"prompt": "hi", "grammar": "root ::= a", "json_schema": {}}, "json_schema")]:
        assert_error(await client.post("/completion", json=body), 400, param)
    # As llama.cpp's server, a model name it does not serve is no error: the base model answers.
    r = await client.post("/completion", json={"prompt": "hi", "model": "gpt-4o", "n_predict": 1, "stop": "x"})
    assert r.status_code == 200 and r.json()["model"] == MODEL


async def test_tokenize_detokenize_props_and_apply_template_as_llama_cpp_has_them(
        client: httpx.AsyncClient, engine: ServedEngine) -> None:
    # /tokenize with llama.cpp's content: no BOS unless add_special; pieces on request.
    tok = engine.tokenizer
    hi = tok.encode("hi", add_special_tokens=False)
    assert (await client.post("/tokenize", json={"content": "hi"})).json()["tokens"] == hi
    r = await client.post("/tokenize", json={"content": "hé🙂!", "add_special": True, "with_pieces": True})

    def piece(token_id: int) -> str | list[int]:  # a text, or the bytes of part of a character
        raw = tok.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)

    assert r.json()["tokens"] == [{"id": t, "piece": piece(t)} for t in tok.encode("hé🙂!", add_special_tokens=True)]
    assert any(isinstance(p["piece"], list) for p in r.json()["tokens"])  # the emoji is split
    assert (await client.post("/detokenize", json={"tokens": hi})).json()["content"] == "hi"
    props = (await client.get("/props")).json()
    assert props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN and props["model_alias"] == MODEL
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["chat_template"] == tok.chat_template
    assert props["bos_token"] == name(engine, tok.bos_token_id)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = (await client.post("/apply-template", json={"messages": messages})).json()["prompt"]
    assert prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    # The rendered prompt through /completion is the chat request's prompt (after the BOS
    # a text prompt gets where the tokenizer adds one, as llama.cpp adds it).
    await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    chat_prompt = engine.requests[-1].prompt_token_ids
    await complete(client, prompt=prompt, n_predict=1)
    bos = [tok.bos_token_id] if tok.encode("a")[:1] == [tok.bos_token_id] else []  # SmolLM2's adds none
    assert engine.requests[-1].prompt_token_ids == bos + chat_prompt
    assert_error(await client.post("/apply-template", json={"messages": []}), 400, "messages")


def fim(engine: ServedEngine, monkeypatch: pytest.MonkeyPatch, **separators: int) -> FimTokens:
    """Three of SmolLM2's special tokens stand in for a code model's markers (as ``separators``' too)."""
    markers = FimTokens(prefix=3, suffix=4, middle=5, **separators)
    monkeypatch.setattr(engine.tokenizer, "fim_tokens", markers)
    return markers


def enc(engine: ServedEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def test_infill_lays_out_llama_cpps_prompt(client: httpx.AsyncClient, engine: ServedEngine,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert_error(await complete(client, "/infill", input_prefix="def f(", input_suffix="):"), 400, "input_prefix")
    bos = engine.tokenizer.encode("", add_special_tokens=True)  # where the model adds one (SmolLM2: none)
    m = fim(engine, monkeypatch)  # no repository or file separator tokens
    r = await complete(client, "/infill", input_prefix="def f(", input_suffix="):", prompt="x",
                       input_extra=[{"filename": "a.py", "text": "y = 1"}], n_predict=-1, temperature=0)
    assert r.status_code == 200, r.text
    # Without a file separator token the chunks are joined by a snippet line.
    assert engine.requests[-1].prompt_token_ids == [
        *enc(engine, "\n\n--- snippet ---\n\n"), *enc(engine, "y = 1"), *bos, m.prefix, *enc(engine, "def f("),
        *enc(engine, "x"), m.suffix, *enc(engine, "):"), m.middle]
    assert r.json()["content"] and r.json()["stop_type"] == "limit"  # /completion's answer
    # With them: the repository's name, each file's name, then the file being edited.
    m = fim(engine, monkeypatch, repo=6, file_sep=7)
    r = await complete(client, "/infill", input_prefix="a", input_suffix="b",
                       input_extra=[{"filename": "a.py", "text": "y = 1"}, {"text": "z"}], n_predict=4)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == [
        6, *enc(engine, "myproject\n"), 7, *enc(engine, "a.py\n"), *enc(engine, "y = 1"), 7, *enc(engine, "tmp\n"),
        *enc(engine, "z"), 7, *enc(engine, "filename\n"), *bos, m.prefix, *enc(engine, "a"), m.suffix,
        *enc(engine, "b"), m.middle]
    assert engine.requests[-1].params.max_tokens == 4
    assert_error(await complete(client, "/infill", input_prefix="a", input_extra=[{"text": 5}]), 400)


async def test_infill_trims_the_prefix_suffix_and_context_as_llama_cpp(client: httpx.AsyncClient, engine: ServedEngine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m = fim(engine, monkeypatch)

    def one(text: str) -> int:
        [token] = enc(engine, text)
        assert enc(engine, text * 5) == [token] * 5  # a repeat is that many tokens
        return token

    p, q, s, t, c, d = map(one, (" p", " q", " s", " t", " c", " d"))
    # n_ctx 256: the batch is half of it, 128 tokens.
    prefix, suffix = " p" * 150 + " q" * 250, " s" * 20 + " t" * 100
    context = " c" * 100 + " d" * 200
    r = await complete(client, "/infill", input_prefix=prefix, input_suffix=suffix, prompt="xy",
                       input_extra=[{"text": context}], n_predict=10)
    assert r.status_code == 200, r.text
    # The prefix's last 3/4 of the batch (96), the suffix's first quarter less the prompt and
    # two markers (32 - 2 - the prompt's tokens), the context's last n_ctx - batch - 2 x n_predict (108).
    xy = enc(engine, "xy")
    bos = engine.tokenizer.encode("", add_special_tokens=True)
    assert engine.requests[-1].prompt_token_ids == [
        *[d] * 108, *bos, m.prefix, *[q] * 96, *xy, m.suffix, *[s] * 20, *[t] * (10 - len(xy)), m.middle]


async def test_completions_suffix_is_a_fill_in_the_middle_prompt(client: httpx.AsyncClient, engine: ServedEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"prompt": "def f(", "suffix": "):\n    pass", "max_tokens": 3}
    assert_error(await client.post("/v1/completions", json=body), 400, "suffix")
    m = fim(engine, monkeypatch)
    bos = engine.tokenizer.encode("", add_special_tokens=True)
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == [
        *bos, m.prefix, *enc(engine, "def f("), m.suffix, *enc(engine, "):\n    pass"), m.middle]
    assert r.json()["usage"]["prompt_tokens"] == len(engine.requests[-1].prompt_token_ids)
    r = await client.post("/v1/completions", json={"prompt": [[104, 105], [106]], "suffix": "!", "max_tokens": 1})
    bang = enc(engine, "!")
    assert r.status_code == 200 and sorted(q.prompt_token_ids for q in engine.requests[-2:]) == sorted([
        [*bos, m.prefix, 104, 105, m.suffix, *bang, m.middle], [*bos, m.prefix, 106, m.suffix, *bang, m.middle]])
    assert_error(await client.post("/v1/completions", json={**body, "echo": True}), 400)
