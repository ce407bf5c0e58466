"""A LoRA adapter served beside the base model (``--lora-modules sql=DIR``), through the
official ``openai`` client: its own answers, the same streamed or not, alone or batched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from e2e_helpers import ADAPTER, MODEL, SMOLLM2_SHAPE, KVServe, idle, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List of fruits: apple, banana,", "def add(a, b):",
           "Once upon a time, in a small village,"]


def completion(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, list[float]]:
    choice = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                       logprobs=0).choices[0]
    return choice.text, choice.logprobs.token_logprobs


def test_the_adapter_is_listed_with_the_base_model_as_parent(client: openai.OpenAI) -> None:
    card = client.models.retrieve(ADAPTER)
    assert card.id == ADAPTER and card.model_extra["parent"] == MODEL
    assert card.model_extra["root"].endswith(ADAPTER)


def test_the_adapter_answers_the_same_streamed_alone_or_batched(client: openai.OpenAI, server: KVServe) -> None:
    alone = {(model, p): completion(client, model, p) for model in (MODEL, ADAPTER) for p in PROMPTS}
    # The adapter changes what the model says.
    assert all(alone[(ADAPTER, p)][1] != alone[(MODEL, p)][1] for p in PROMPTS)

    # The same requests at once: base and adapter rows in the same steps.
    with ThreadPoolExecutor(8) as pool:
        batched = dict(zip(alone, pool.map(lambda key: completion(client, *key), alone)))
    assert batched == alone

    for p in PROMPTS[:2]:
        text, logprobs = "", []
        for chunk in client.completions.create(model=ADAPTER, prompt=p, max_tokens=10, temperature=0,
                                               logprobs=0, stream=True):
            for choice in chunk.choices:
                text += choice.text
                logprobs += choice.logprobs.token_logprobs if choice.logprobs else []
        assert (text, logprobs) == alone[(ADAPTER, p)]
    assert idle(wait_until(server.metrics, idle, 10.0))  # no request left, no block held


def test_chat_with_the_adapter(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    r, base = (client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True) for model in (ADAPTER, MODEL))
    assert r.model == ADAPTER and base.model == MODEL
    assert r.choices[0].message.content
    assert [t.logprob for t in r.choices[0].logprobs.content] != [t.logprob for t in base.choices[0].logprobs.content]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="chess", messages=messages, max_tokens=2)


def test_an_adapter_loaded_and_unloaded_while_serving(client: openai.OpenAI, server: KVServe, make_lora,
                                                      tmp_path) -> None:
    path = make_lora(tmp_path / "poet", SMOLLM2_SHAPE, rank=4, seed=7, targets=("q_proj", "v_proj"))
    url, headers = server.url, server.headers
    # The server's --max-lora-rank 8 refuses a rank-16 adapter.
    wide = make_lora(tmp_path / "wide", SMOLLM2_SHAPE, rank=16, seed=8, targets=("q_proj",))
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(wide)},
                   headers=headers, timeout=60.0)
    assert r.status_code == 400 and "has rank 16, above --max-lora-rank 8" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(path)},
                   headers=headers, timeout=60.0)
    assert r.status_code == 200, r.text
    assert "poet" in [m.id for m in client.models.list()]
    poet = completion(client, "poet", PROMPTS[0])
    assert poet != completion(client, MODEL, PROMPTS[0]) and poet != completion(client, ADAPTER, PROMPTS[0])
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=headers, timeout=60.0)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        completion(client, "poet", PROMPTS[0])
    assert [m.id for m in client.models.list()] == [MODEL, ADAPTER]
    assert idle(wait_until(server.metrics, idle, 10.0))
