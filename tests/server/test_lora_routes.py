"""LoRA adapters over HTTP: each is a model of its own in /v1/models and in every
generation API, run by the engine as that adapter (vLLM's ``--lora-modules``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from api_helpers import MODEL, assert_error, client_for, sse_events
from engine.config import LoRAModule
from real_engine import MAX_MODEL_LEN, ServedEngine
from server.app import build_app

pytestmark = pytest.mark.anyio

NAMES = ("sql", "poet")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_loaded, make_lora) -> dict[str, str]:
    """Served name -> directory of a random LoRA adapter of the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_lora(root / name, tiny_loaded.config, seed=seed)) for seed, name in enumerate(NAMES)}


@pytest.fixture
def engine(make_engine, adapters: dict[str, str]) -> ServedEngine:
    return make_engine(lora_modules=tuple(LoRAModule(n, p) for n, p in adapters.items()))


@pytest.fixture
async def client(engine: ServedEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        async with client_for(app) as c:
            yield c


async def test_models_lists_each_adapter_with_the_base_as_parent(client: httpx.AsyncClient,
                                                                  adapters: dict[str, str]) -> None:
    cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
    assert list(cards) == [MODEL, "sql", "poet"]
    assert (cards[MODEL]["root"], cards[MODEL]["parent"]) == (MODEL, None)
    for name, path in adapters.items():
        assert (cards[name]["root"], cards[name]["parent"]) == (path, MODEL)
        assert cards[name]["max_model_len"] == MAX_MODEL_LEN
    card = (await client.get("/v1/models/sql")).json()
    assert (card["id"], card["parent"]) == ("sql", MODEL)
    assert_error(await client.get("/v1/models/chess"), 404)


GENERATIONS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", GENERATIONS, ids=[p for p, _ in GENERATIONS])
async def test_every_api_runs_the_adapter_its_model_names(client: httpx.AsyncClient, engine: ServedEngine,
                                                          path: str, body: dict, stream: bool) -> None:
    for model, adapter in [("sql", "sql"), ("poet", "poet"), (MODEL, None), (None, None)]:
        sent = {**body, "stream": stream} | ({"model": model} if model else {})
        r = await client.post(path, json=sent)
        assert r.status_code == 200, r.text
        assert engine.adapters[engine.requests[-1].request_id] == adapter
        answered = model or MODEL
        if not stream:
            assert r.json()["model"] == answered
        elif path in ("/v1/completions", "/v1/chat/completions"):
            events = sse_events(r.text)
            assert {e["model"] for e in events[:-1]} == {answered}
        else:  # typed events: the model is in the opening one
            assert f'"model":"{answered}"' in r.text.replace(" ", "")


@pytest.mark.parametrize("path,body", GENERATIONS, ids=[p for p, _ in GENERATIONS])
async def test_an_unknown_model_is_a_404_and_runs_nothing(client: httpx.AsyncClient, engine: ServedEngine,
                                                          path: str, body: dict) -> None:
    r = await client.post(path, json={**body, "model": "chess"})
    assert r.status_code == 404
    assert "chess" in r.text
    assert engine.requests == []


async def test_adapters_load_and_unload_while_serving_when_allowed(engine: ServedEngine, tmp_path,
                                                                   adapters: dict[str, str]) -> None:
    # vLLM's routes, only with --allow-runtime-lora (off by default: they read server paths).
    closed = build_app(engine)
    async with client_for(closed) as c:
        assert (await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})).status_code == 404
    app = build_app(engine, runtime_lora=True)
    async with app.router.lifespan_context(app):
        async with client_for(app) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "chess", "lora_path": adapters["sql"]})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chess' added successfully."
            assert "chess" in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            r = await c.post("/v1/completions", json={"model": "chess", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and engine.adapters[engine.requests[-1].request_id] == "chess"
            # The name in use, a path that is no adapter, a missing field: 400s naming the field.
            for body, param in [({"lora_name": "sql", "lora_path": adapters["poet"]}, "lora_name"),
                                ({"lora_name": MODEL, "lora_path": adapters["poet"]}, "lora_name"),
                                ({"lora_name": "new", "lora_path": str(tmp_path / "none")}, "lora_path"),
                                ({"lora_name": "new"}, "lora_path")]:
                assert_error(await c.post("/v1/load_lora_adapter", json=body), 400, param)
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "chess"})
            assert r.status_code == 200 and "removed" in r.text
            assert_error(await c.post("/v1/completions", json={"model": "chess", "prompt": "hi"}), 404)
            assert_error(await c.post("/v1/unload_lora_adapter", json={"lora_name": "chess"}), 404, "lora_name")
