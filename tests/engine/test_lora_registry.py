"""engine.lora_registry: served names, the keys requests carry, and when weights go."""

from __future__ import annotations

import pytest

from engine.lora_registry import LoRARegistry
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.validation import InvalidRequestError
from models.lora import LoRAAdapter


def adapter(name: str, rank: int = 4) -> LoRAAdapter:
    return LoRAAdapter(name, f"/adapters/{name}", rank, [])


def registry(weights: dict[str, LoRAAdapter] | None = None) -> LoRARegistry:
    # Reading weights from disk needs a model (tests/engine/test_lora_engine.py); the rest does not.
    return LoRARegistry(None, "base-model", None, {} if weights is None else weights)


def running(*keys: str | None) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(max_tokens=1), 1, adapter=key) for i, key in enumerate(keys)]


def test_start_up_adapters_keep_their_names_as_keys_and_later_ones_are_numbered():
    weights: dict[str, LoRAAdapter] = {}
    loras = registry(weights)
    sql, chat, sql_again = adapter("sql"), adapter("chat"), adapter("sql")
    loras.install(sql, "/a/sql", key="sql")
    loras.install(chat, "/a/chat")
    assert loras.paths == {"sql": "/a/sql", "chat": "/a/chat"}
    assert weights == {"sql": sql, "chat@1": chat}
    assert loras.lookup("chat") == ("chat@1", chat)
    loras.remove("sql")
    loras.install(sql_again, "/a/sql2")
    # Loaded again, it is another key: its requests never share the old one's weights or blocks.
    assert loras.lookup("sql") == ("sql@2", sql_again)
    assert weights == {"chat@1": chat, "sql@2": sql_again}


def test_a_name_is_served_once_and_never_the_models():
    loras = registry()
    loras.install(adapter("sql"), "/a/sql")
    with pytest.raises(ValueError, match="already loaded"):
        loras.install(adapter("sql"), "/b/sql")
    with pytest.raises(ValueError, match="served model's name 'base-model'"):
        loras.install(adapter("base-model"), "/a/base")
    with pytest.raises(ValueError, match="no LoRA adapter named 'chat'"):
        loras.remove("chat")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'chat'") as err:
        loras.lookup("chat")
    assert err.value.param == "adapter"
    assert loras.paths == {"sql": "/a/sql"}


def serving_sql() -> tuple[LoRARegistry, str, LoRAAdapter]:
    """A registry serving adapter "sql", with the key and weights its requests run."""
    loras = registry()
    loras.install(adapter("sql"), "/a/sql")
    return loras, *loras.lookup("sql")


def test_an_unloaded_adapters_weights_stay_until_its_last_request_leaves():
    loras, key, sql = serving_sql()
    loras.acquire(key, sql)
    loras.acquire(key, sql)
    loras.remove("sql")
    assert loras.paths == {} and loras.weights == {key: sql}  # refused to new requests, still run
    loras.release(key)
    assert loras.weights == {key: sql}
    loras.release(key)
    assert loras.weights == {}


def test_weights_unloaded_between_the_check_and_the_start_serve_that_request_alone():
    loras, key, sql = serving_sql()
    loras.remove("sql")
    assert loras.weights == {}
    loras.acquire(key, sql)
    assert loras.weights == {key: sql} and loras.paths == {}
    loras.release(key)
    assert loras.weights == {}


def test_a_served_adapters_weights_stay_when_its_requests_leave():
    loras, key, sql = serving_sql()
    loras.acquire(key, sql)
    loras.release(key)
    assert loras.weights == {key: sql}


def test_counts_by_name_list_every_served_adapter_and_the_unloaded_ones_still_running():
    loras = registry()
    loras.install(adapter("sql"), "/a/sql")
    loras.install(adapter("chat"), "/a/chat")
    loras.install(adapter("old"), "/a/old")
    key, lora = loras.lookup("old")
    loras.acquire(key, lora)
    loras.remove("old")
    sql, _ = loras.lookup("sql")
    assert loras.count_by_name(running(sql, None, sql, key)) == {"sql": 2, "chat": 0, "old": 1}
    assert loras.count_by_name([]) == {"sql": 0, "chat": 0}
