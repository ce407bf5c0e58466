"""Auth, unknown routes and models, body limits, overload and draining."""

from __future__ import annotations

import httpx
import pytest
from starlette.routing import Route

from api_helpers import MODEL, assert_error, client_for
from models.tokenizer import FimTokens
from real_engine import ServedEngine
from server.app import build_app
from server.middleware import OPEN_PATHS

pytestmark = pytest.mark.anyio

KEY = "s3cret-key"


# A response id no response has: with the key, its routes answer 404 (auth passed).
NO_SUCH_RESPONSE = "resp_none"


def _concrete(path: str) -> str:
    return path.replace("{model:path}", MODEL).replace("{response_id}", NO_SUCH_RESPONSE)


def _all_endpoints(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        assert isinstance(route, Route)
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                out.append((method, _concrete(route.path)))
    return out


async def test_every_route_requires_the_key_except_probes(engine: ServedEngine,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # /infill needs a code model's markers: three of the tokenizer's special tokens stand in.
    monkeypatch.setattr(engine.tokenizer, "fim_tokens", FimTokens(prefix=3, suffix=4, middle=5))
    app = build_app(engine, api_key=KEY)
    endpoints = _all_endpoints(app)
    assert {p for _, p in endpoints} >= {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                         "/tokenize", "/detokenize", "/tokenizer_info", "/health", "/ready",
                                         "/metrics", "/version", "/v1/responses", "/v1/messages",
                                         "/v1/messages/count_tokens", "/v1/embeddings",
                                         f"/v1/responses/{NO_SUCH_RESPONSE}", "/completion"}
    bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1},
              "/v1/responses": {"input": "hi", "max_output_tokens": 1},
              "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
              "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
              "/v1/embeddings": {"input": "hi"},
              "/v1/score": {"text_1": "a", "text_2": "b"}, "/score": {"text_1": "a", "text_2": "b"},
              "/v1/rerank": {"query": "a", "documents": ["b"]}, "/rerank": {"query": "a", "documents": ["b"]},
              "/v2/rerank": {"query": "a", "documents": ["b"]},
              "/completion": {"prompt": "hi", "n_predict": 1},
              "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 1},
              "/embedding": {"content": "hi"}, "/embeddings": {"content": "hi"},
              "/invocations": {"prompt": "hi", "max_tokens": 1},
              "/apply-template": {"messages": [{"role": "user", "content": "hi"}]}, "/completions": {"prompt": "hi", "n_predict": 1},
              "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [104]}}
    async with app.router.lifespan_context(app):
        for method, path in endpoints:
            json = bodies.get(path) if method == "POST" else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                async with client_for(app, **headers) as c:
                    r = await c.request(method, path, json=json)
                if path in OPEN_PATHS:
                    assert r.status_code == 200, (method, path, r.text)
                else:
                    err = assert_error(r, 401)
                    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            async with client_for(app, Authorization=f"Bearer {KEY}") as c:
                r = await c.request(method, path, json=json)
            assert r.status_code == (404 if NO_SUCH_RESPONSE in path else 200), (method, path, r.text)


async def test_unknown_route_needs_key_then_404(engine: ServedEngine) -> None:
    app = build_app(engine, api_key=KEY)
    async with client_for(app) as c:
        assert_error(await c.get("/v1/nope"), 401)
    async with client_for(app, Authorization=f"bearer {KEY}") as c:
        assert_error(await c.get("/v1/nope"), 404)


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    err = assert_error(await client.post("/v1/engines/foo/completions", json={}), 404)
    assert "/v1/engines/foo/completions" in err["message"]
    assert_error(await client.get("/v1/completions"), 405)


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/completions", {"prompt": "hi"}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/v1/models/other-model", None),
])
async def test_unknown_model_is_404(client: httpx.AsyncClient, method, path, body) -> None:
    if body is not None:
        body["model"] = "other-model"
    err = assert_error(await client.request(method, path, json=body), 404, param="model")
    assert err["code"] == "model_not_found" and "other-model" in err["message"]


async def test_served_model_name(engine: ServedEngine) -> None:
    app = build_app(engine, served_model_name="alias")
    async with app.router.lifespan_context(app), client_for(app) as c:
        r = await c.post("/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 1})
        assert r.json()["model"] == "alias"
        assert_error(await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 404)



async def test_several_served_model_names(engine: ServedEngine) -> None:
    # vLLM's --served-model-name A B: a request may name either; the first answers.
    app = build_app(engine, served_model_name=["first", "second"], runtime_lora=True)
    async with app.router.lifespan_context(app), client_for(app) as c:
        for name in ("first", "second", None):
            body = {"prompt": "hi", "max_tokens": 1} | ({"model": name} if name else {})
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == "first"
            assert engine.adapters[engine.requests[-1].request_id] is None  # the base model
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["first", "second"]
        card = (await c.get("/v1/models/second")).json()
        assert (card["id"], card["root"], card["parent"]) == ("second", "first", None)
        assert_error(await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 404)
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": "/"})
        assert_error(r, 400, "lora_name")


async def test_declared_body_over_limit_is_413(engine: ServedEngine) -> None:
    app = build_app(engine, max_body_size=1024)
    async with client_for(app) as c:
        r = await c.post("/v1/completions", content=b'{"prompt": "' + b"x" * 2000 + b'"}')
        err = assert_error(r, 413)
        assert "1024" in err["message"]
        at_limit = b'{"prompt": "' + b"x " * 504 + b'x"}'
        r = await c.post("/v1/completions", content=at_limit + b" " * (1024 - len(at_limit)))
        assert_error(r, 400, contains="context length")  # past the body limit, refused later


async def test_streamed_body_over_limit_is_413_before_the_end(engine: ServedEngine) -> None:
    app = build_app(engine, max_body_size=1024)
    pulled = []

    async def chunks():
        for i in range(10):
            pulled.append(i)
            yield b"x" * 512

    async with client_for(app) as c:
        r = await c.post("/v1/completions", content=chunks())  # chunked: no Content-Length
    assert_error(r, 413)
    assert len(pulled) < 10


async def test_queue_full_is_503_with_retry_after(engine: ServedEngine) -> None:
    app = build_app(engine, max_queue=2)
    body = {"prompt": "hi", "max_tokens": 1}
    in_flight = app.state.kvserve.in_flight  # what admission counts: requests not yet answered
    async with app.router.lifespan_context(app), client_for(app) as c:
        in_flight["other-1"] = 0.0
        assert (await c.post("/v1/completions", json=body)).status_code == 200
        assert list(in_flight) == ["other-1"], "an answered request gives its place back"
        in_flight["other-2"] = 0.0
        for path, b in (("/v1/completions", body),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = await c.post(path, json=b)
            err = assert_error(r, 503)
            assert int(r.headers["retry-after"]) >= 1
            assert err["type"] == "server_error"


async def test_draining_refuses_new_requests(engine: ServedEngine) -> None:
    app = build_app(engine)
    async with app.router.lifespan_context(app), client_for(app) as c:
        assert (await c.get("/ready")).status_code == 200
        app.state.kvserve.draining = True
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert_error(r, 503)
        assert "retry-after" in r.headers
        assert_error(await c.get("/v1/models"), 503)
        assert (await c.get("/health")).status_code == 200
        assert_error(await c.get("/ready"), 503)
        assert (await c.get("/metrics")).status_code == 200
    assert engine.shut_down


async def test_dead_engine(engine: ServedEngine, client: httpx.AsyncClient) -> None:
    await engine.inner.shutdown()  # the engine loop is gone
    assert_error(await client.get("/health"), 503)
    assert_error(await client.get("/ready"), 503)
    assert_error(await client.post("/v1/completions", json={"prompt": "hi"}), 503)


async def test_unexpected_bug_is_a_json_500(engine: ServedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(engine.tokenizer, "encode", boom)
    app = build_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://test") as c:
        r = await c.post("/v1/completions", json={"prompt": "hi"})
    err = assert_error(r, 500)
    assert err["type"] == "server_error" and "tokenizer bug" not in err["message"]


async def test_framework_validation_errors_are_400_not_422(engine: ServedEngine) -> None:
    app = build_app(engine)

    @app.get("/v1/_probe")
    async def probe(count: int) -> dict:  # FastAPI validates the query parameter
        return {"count": count}

    async with client_for(app) as c:
        assert (await c.get("/v1/_probe", params={"count": 2})).json() == {"count": 2}
        assert_error(await c.get("/v1/_probe", params={"count": "many"}), 400, param="count")


async def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(engine: ServedEngine) -> None:
    # vLLM's --generation-config auto: generation_config.json's values (engine.sampling_defaults).
    # --override-generation-config adds its own (llama.cpp's samplers among them).
    engine.sampling_defaults = {"temperature": 0.6, "top_k": 20, "dry_multiplier": 0.8,
                                "dry_sequence_breakers": ["\n"], "samplers": ["top_k", "temperature"]}
    app = build_app(engine)
    async with app.router.lifespan_context(app), client_for(app) as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                           ("/v1/messages", {"max_tokens": 1, "messages": chat["messages"]})]:
            assert (await c.post(path, json=body)).status_code == 200, path
            p = engine.requests[-1].params
            assert (p.temperature, p.top_k, p.dry_multiplier, p.dry_sequence_breakers) == (0.6, 20, 0.8, ["\n"]), path
            assert p.samplers == ("top_k", "temperature"), path
            await c.post(path, json={**body, "temperature": 1.0, "top_k": 5})
            p = engine.requests[-1].params
            assert (p.temperature, p.top_k) == (1.0, 5), path  # the request's own values win
        # llama.cpp's /completion has llama.cpp's own defaults, not the model's.
        await c.post("/completion", json={"prompt": "hi", "n_predict": 1})
        assert (engine.requests[-1].params.temperature, engine.requests[-1].params.top_k) == (0.8, 40)


async def test_completion_fills_left_out_fields_from_the_operators_overrides(engine: ServedEngine) -> None:
    # --override-generation-config is the operator's, as llama-server's own --temp, --top-k:
    # llama.cpp's /completion applies it too, under a request's own values, over llama.cpp's
    # defaults (and not the model's generation_config.json, which only the OpenAI routes apply).
    engine.sampling_overrides = {"temperature": 0.2, "repetition_penalty": 1.1, "dry_multiplier": 0.8,
                                 "min_tokens": 2}
    engine.sampling_defaults = {**engine.sampling_overrides, "top_k": 20}
    app = build_app(engine)
    async with app.router.lifespan_context(app), client_for(app) as c:
        assert (await c.post("/completion", json={"prompt": "hi", "n_predict": 3})).status_code == 200
        p = engine.requests[-1].params
        assert (p.temperature, p.repetition_penalty, p.dry_multiplier, p.min_tokens) == (0.2, 1.1, 0.8, 2)
        assert (p.top_k, p.top_p, p.min_p) == (40, 0.95, 0.05)  # llama.cpp's own
        await c.post("/completion", json={"prompt": "hi", "n_predict": 3, "temperature": 0.9, "repeat_penalty": 1.0})
        p = engine.requests[-1].params
        assert (p.temperature, p.repetition_penalty, p.dry_multiplier) == (0.9, 1.0, 0.8)  # the request's win
        params = (await c.get("/props")).json()["default_generation_settings"]["params"]
        assert (params["temperature"], params["repeat_penalty"], params["dry_multiplier"], params["top_k"]) == (
            0.2, 1.1, 0.8, 40)
