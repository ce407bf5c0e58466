"""``/v1/embeddings`` on the real server through the official ``openai`` client (which
asks for base64 by default and decodes it), the same vectors however they were asked for."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from e2e_helpers import ADAPTER, MODEL, KVServe, idle, metric, wait_until

pytestmark = pytest.mark.slow

TEXTS = ["A cat sat on the mat.", "The stock market fell sharply today.", "A kitten rested on a rug."]


def test_embeddings_through_the_openai_client(client: openai.OpenAI, server: KVServe) -> None:
    before = metric(server.metrics(), "prompt_tokens_total")
    batch = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
    assert batch.model == MODEL and [d.index for d in batch.data] == [0, 1, 2]
    vectors = [d.embedding for d in batch.data]
    assert all(len(v) == 576 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-5) for v in vectors)
    # The same vectors one by one, and as JSON floats (float32 values either way).
    for text, vector in zip(TEXTS, vectors):
        assert client.embeddings.create(model=MODEL, input=text).data[0].embedding == vector
        floats = client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
        assert floats == vector
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64).data[0].embedding
    assert len(short) == 64 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-5)
    # A LoRA adapter's embedding is its own.
    assert client.embeddings.create(model=ADAPTER, input=TEXTS[0]).data[0].embedding != vectors[0]

    samples = wait_until(server.metrics, idle, 10.0)
    assert idle(samples)
    # Usage counts the inputs' tokens, and so do the metrics (the five single requests above too).
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > len(TEXTS)
    assert metric(samples, "prompt_tokens_total") > before + batch.usage.prompt_tokens

    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="", encoding_format="float")


def test_score_and_rerank_are_the_embeddings_cosines(client: openai.OpenAI, server: KVServe) -> None:
    vectors = [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data]
    cosines = [math.fsum(x * y for x, y in zip(vectors[0], v)) for v in vectors]
    r = httpx.post(f"{server.url}/v1/score", json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS},
                   headers=server.headers, timeout=60.0)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == cosines
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:]},
                   headers=server.headers, timeout=60.0)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["relevance_score"] for x in results] == sorted(cosines[1:], reverse=True)
    assert [x["document"]["text"] for x in results] == [TEXTS[1 + i] for i in sorted(
        range(2), key=lambda i: -cosines[1 + i])]


def test_llama_cpps_embedding_route_gives_the_same_vectors(client: openai.OpenAI, server: KVServe) -> None:
    # llama.cpp's /embedding: its default (Euclidean) normalisation is /v1/embeddings' vector;
    # none (-1) is that vector's direction at the hidden state's own length.
    ours = [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS[:2],
                                                          encoding_format="float").data]
    r = httpx.post(f"{server.url}/embedding", json={"content": TEXTS[:2]}, headers=server.headers, timeout=60.0)
    assert r.status_code == 200, r.text
    assert [item["index"] for item in r.json()] == [0, 1]
    for item, vector in zip(r.json(), ours):
        [row] = item["embedding"]
        assert row == pytest.approx(vector, abs=1e-6)
    raw = httpx.post(f"{server.url}/embedding", json={"content": TEXTS[0], "embd_normalize": -1},
                     headers=server.headers, timeout=60.0).json()[0]["embedding"][0]
    norm = math.sqrt(sum(x * x for x in raw))
    assert norm > 1.5 and [x / norm for x in raw] == pytest.approx(ours[0], abs=1e-6)
