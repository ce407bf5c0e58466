"""``POST /v1/embeddings`` over the real engine on the tiny checkpoint: OpenAI's shape, each input one engine
request, float and base64 encodings, and the errors."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest

from api_helpers import MODEL, assert_error
from real_engine import HIDDEN_SIZE, ServedEngine, embed

pytestmark = pytest.mark.anyio

FLOAT32_EPS = 1e-6  # the engine normalises in float32


async def test_one_text_gets_one_normalised_embedding(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["object"], body["model"]) == ("list", MODEL)
    [item] = body["data"]
    assert (item["object"], item["index"]) == ("embedding", 0)
    assert len(item["embedding"]) == HIDDEN_SIZE
    assert abs(sum(v * v for v in item["embedding"]) - 1) < FLOAT32_EPS
    prompt = engine.requests[-1].prompt_token_ids
    assert prompt == engine.tokenizer.encode("hi")
    assert body["usage"] == {"prompt_tokens": len(prompt), "total_tokens": len(prompt)}
    params = engine.requests[-1].params
    assert params.pooling is not None and (params.n, params.max_tokens) == (1, 1)


async def test_a_list_of_inputs_keeps_its_order(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    for inputs in (["a", "bb", "ccc", "dddd"], [[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]]):
        body = (await client.post("/v1/embeddings", json={"input": inputs})).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert len({tuple(r.prompt_token_ids) for r in engine.requests[-4:]}) == 4
        # One group: the inputs take turns with other requests together.
        assert len({engine.groups[r.request_id] for r in engine.requests[-4:]}) == 1
        # The data follow the inputs: each is the engine's own embedding of its input.
        prompts = [engine.tokenizer.encode(t) if isinstance(t, str) else t for t in inputs]
        lengths = [len(p) for p in prompts]
        raw = (await client.post("/v1/embeddings", json={"input": inputs, "normalize": False})).json()
        assert [d["embedding"] for d in raw["data"]] == [await embed(engine, p, normalize=False) for p in prompts]
        assert body["usage"]["prompt_tokens"] == sum(lengths)
    assert_error(await client.post("/v1/embeddings", json={"input": ["a", [5]]}), 400)


async def test_base64_is_the_float32_bytes(client: httpx.AsyncClient) -> None:
    floats = (await client.post("/v1/embeddings", json={"input": "hi"})).json()["data"][0]["embedding"]
    b64 = (await client.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64"})).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == [struct.unpack("<f", struct.pack("<f", v))[0] for v in floats]


async def test_dimensions_cut_then_normalise(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/embeddings", json={"input": "hi", "dimensions": 3})).json()
    vector = body["data"][0]["embedding"]
    assert len(vector) == 3 and abs(sum(v * v for v in vector) - 1) < FLOAT32_EPS


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, None),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": HIDDEN_SIZE + 1}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, None),
    ({"input": [1, 10**9]}, "input"),
    ({"input": "x " * 300}, "input"),
    ({"input": ["a"] * 2049}, None),
    ({"input": 3}, None),
])
async def test_bad_input_is_a_400_and_runs_nothing(client: httpx.AsyncClient, engine: ServedEngine,
                                                  body: dict, param: str | None) -> None:
    r = await client.post("/v1/embeddings", json=body)
    err = assert_error(r, 400)
    if param is not None:
        assert err["param"] == param, err
    assert engine.requests == []


async def test_an_unknown_model_is_a_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/v1/embeddings", json={"input": "hi", "model": "chess"}), 404)


async def test_score_is_the_cosine_of_the_embeddings(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    tok = engine.tokenizer
    r = await client.post("/v1/score", json={"text_1": "ab", "text_2": ["ab", "abcd", "z"]})
    assert r.status_code == 200, r.text
    body = r.json()
    query = await embed(engine, tok.encode("ab"))
    expected = [sum(x * y for x, y in zip(query, await embed(engine, tok.encode(t)))) for t in ["ab", "abcd", "z"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "score"
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-12)
    assert body["data"][0]["score"] == pytest.approx(1.0)
    # Each distinct text embedded once, in one group.
    assert sorted(tuple(r.prompt_token_ids) for r in engine.requests[:3]) == sorted(
        tuple(tok.encode(t)) for t in ["ab", "abcd", "z"])
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in ["ab", "abcd", "z"])
    pairwise = (await client.post("/score", json={"text_1": ["ab", "z"], "text_2": ["abcd", "z"]})).json()
    z = await embed(engine, tok.encode("z"))
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([expected[1], sum(v * v for v in z)], abs=1e-12)
    assert_error(await client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), 400, "text_2")
    assert_error(await client.post("/v1/score", json={"text_1": "", "text_2": "a"}), 400, "text_1")


async def test_rerank_orders_the_documents_by_score(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    docs = ["z", "abcd", {"text": "abc"}, "ab"]
    r = await client.post("/v1/rerank", json={"query": "ab", "documents": docs, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    scores = (await client.post("/v1/score", json={"text_1": "ab", "text_2": ["z", "abcd", "abc", "ab"]})).json()
    by_index = {d["index"]: d["score"] for d in scores["data"]}
    assert [x["index"] for x in results] == sorted(by_index, key=lambda i: -by_index[i])[:3]
    assert [x["relevance_score"] for x in results] == [by_index[x["index"]] for x in results]
    assert results[0] == {"index": 3, "relevance_score": pytest.approx(1.0), "document": {"text": "ab"}}
    bare = (await client.post("/v2/rerank", json={"query": "ab", "documents": ["z"], "return_documents": False}))
    assert "document" not in bare.json()["results"][0]
    for body, param in [({"query": "ab", "documents": []}, "documents"), ({"query": "ab", "documents": ["a", ""]},
                                                                          "documents"),
                        ({"query": "", "documents": ["a"]}, "query")]:
        assert_error(await client.post("/rerank", json=body), 400, param)


async def test_llama_cpps_embedding_route_normalises_as_llama_cpp(client: httpx.AsyncClient,
                                                                  engine: ServedEngine) -> None:
    # llama.cpp's /embedding: [{"index", "embedding": [[...]]}], the raw vector normalised by
    # embd_normalize (default 2); `content` or `input`, one text or several; /embeddings too.
    r = await client.post("/embedding", json={"content": "hi", "embd_normalize": -1})
    assert r.status_code == 200, r.text
    [item] = r.json()
    prompt = engine.requests[-1].prompt_token_ids
    assert engine.requests[-1].params.pooling.normalize is False
    raw = await embed(engine, prompt, normalize=False)
    assert item == {"index": 0, "embedding": [raw]}
    for how, expect in [(2, [v / sum(x * x for x in raw) ** 0.5 for v in raw]),
                        (1, [v / sum(abs(x) for x in raw) for v in raw]),
                        (0, [v * 32760 / max(abs(x) for x in raw) for v in raw]),
                        (3, [v / sum(abs(x) ** 3 for x in raw) ** (1 / 3) for v in raw])]:
        [item] = (await client.post("/embeddings", json={"input": "hi", "embd_normalize": how})).json()
        assert item["embedding"][0] == pytest.approx(expect, rel=1e-12), how
    # A p this large is the largest magnitude's norm, without overflowing on the way.
    [item] = (await client.post("/embedding", json={"content": "hi", "embd_normalize": 10**6})).json()
    assert max(abs(v) for v in item["embedding"][0]) == pytest.approx(1.0, rel=1e-4)
    assert [len(x["embedding"][0]) for x in (await client.post("/embedding", json={"content": "hi"})).json()] == [
        HIDDEN_SIZE]
    several = (await client.post("/embedding", json={"content": ["a", "bb", "ccc"]})).json()
    assert [x["index"] for x in several] == [0, 1, 2]
    ids = (await client.post("/embedding", json={"content": [[5, 6], [7]]})).json()
    assert len(ids) == 2 and [r.prompt_token_ids for r in engine.requests[-2:]] == [[5, 6], [7]]
    for body, param in [({}, "content"), ({"content": ""}, "content"), ({"input": []}, "input"),
                        ({"content": "hi", "embd_normalize": -2}, "embd_normalize"),
                        ({"content": "hi", "model": "nope"}, "model")]:
        assert_error(await client.post("/embedding", json=body), 400 if param != "model" else 404, param)
