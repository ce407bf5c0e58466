"""Every field of every request body, each set to values a hostile client sends, on the
real server: a 4xx or an answer, never a 5xx or an error inside a 200; and afterwards no
request left running and no KV block held.

The fields come from the routes' own pydantic models, so a field added later is covered
without touching this test. The values are the ones that reach past schema checks into
the engine: a negative number, an integer past 64 bits, NaN, an object for
anything (each a 400 or an accepted value; none may fault)."""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_helpers import KVServe, metric, parse_metrics

from server.anthropic_api import MessagesRequest
from server.protocol import CompletionRequest
from server.protocol_chat import ApplyTemplateRequest, ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from server.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from server.responses_api import ResponsesRequest
from server.serving_embeddings import LlamaCppEmbeddingRequest
from server.serving_llamacpp import LlamaCppCompletionRequest, LlamaCppInfillRequest

pytestmark = pytest.mark.slow

_CHAT = [{"role": "user", "content": "Hi"}]
# path, the body's model (its fields are fuzzed), a valid body to start from.
ROUTES = [
    ("/v1/completions", CompletionRequest, {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": _CHAT, "max_tokens": 2}),
    ("/v1/embeddings", EmbeddingRequest, {"input": "Hello"}),
    ("/v1/score", ScoreRequest, {"text_1": "a", "text_2": ["b"]}),
    ("/v1/rerank", RerankRequest, {"query": "a", "documents": ["b", "c"]}),
    ("/tokenize", TokenizeRequest, {"prompt": "Hello"}),
    ("/detokenize", DetokenizeRequest, {"tokens": [1, 2]}),
    ("/apply-template", ApplyTemplateRequest, {"messages": _CHAT}),
    ("/v1/messages", MessagesRequest, {"messages": _CHAT, "max_tokens": 2, "model": "smollm2"}),
    ("/completion", LlamaCppCompletionRequest, {"prompt": "Hello", "n_predict": 2}),
    ("/infill", LlamaCppInfillRequest, {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2}),
    ("/embedding", LlamaCppEmbeddingRequest, {"content": "Hello"}),
    ("/v1/responses", ResponsesRequest, {"input": "Hi", "max_output_tokens": 16, "store": False}),
]
VALUES = [-5, 2**63, float("nan"), {"x": [None]}]


def test_no_field_of_any_route_makes_the_server_fail(server: KVServe) -> None:
    failures = []
    sent = 0
    headers = {"authorization": f"Bearer {server.api_key}", "content-type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60.0) as c:
        for path, model, base in ROUTES:
            for field in model.model_fields:
                for value in VALUES:
                    # json.dumps writes NaN as the bare literal Python's json (and so the server) reads.
                    r = c.post(path, content=json.dumps({**base, field: value}))
                    sent += 1
                    if r.status_code >= 500 or "server_error" in r.text:
                        failures.append((path, field, value, r.status_code, r.text[:200]))
        text = c.get("/metrics").text
    assert sent > 400, "the routes' models list their fields"
    assert not failures, failures
    metrics = parse_metrics(text)
    assert metric(metrics, "num_requests_running") == 0
    assert metric(metrics, "num_requests_waiting") == 0
    assert metric(metrics, "kv_cache_usage_perc") == 0
