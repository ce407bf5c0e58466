"""Structured outputs through the real server and the official ``openai`` SDK, unmodified."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from e2e_helpers import MODEL, KVServe, metric

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    # Bounded strings: unbounded, the 135M model sometimes writes one until max_tokens.
    hobbies: list[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=3)
    home: City


SUBJECTS = ["a baker", "a pilot", "a retired teacher", "a chess player", "a nurse", "a student",
            "a farmer", "a poet", "a carpenter", "a diver", "a judge", "a gardener", "a drummer",
            "a chemist", "a sailor", "a painter", "a librarian", "a runner", "a chef", "a miner"]


def test_parse_returns_a_parsed_object_for_twenty_prompts(client: openai.OpenAI, server: KVServe) -> None:
    before = server.metrics()

    def parse(subject: str):
        return client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": f"Describe {subject} as a person record."}],
            response_format=Person, max_tokens=200, temperature=0)

    # All twenty at once, as a client with a thread pool sends them: the server batches
    # twenty grammars' masks in its steps.
    with ThreadPoolExecutor(len(SUBJECTS)) as pool:
        completions = list(pool.map(parse, SUBJECTS))
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        person = choice.message.parsed
        assert isinstance(person, Person), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())
    after = server.metrics()
    assert metric(after, "structured_requests_total", kind="json") - \
        metric(before, "structured_requests_total", kind="json") == len(SUBJECTS)


def test_streamed_structured_text_equals_the_whole_one(client: openai.OpenAI) -> None:
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Give a code like AB-123."}], max_tokens=20,
                temperature=0, extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    whole = client.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **body)
                       if c.choices)
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", whole) and streamed == whole


def test_completions_choice_and_a_refused_schema(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"choice": [" blue", " green"]}}
                                     ).choices[0].text
    assert text in (" blue", " green")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "string", "not": {"const": "a"}}}})
    assert err.value.body["param"] == "response_format" and "not" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                  extra_body={"structured_outputs": {"json": {"type": "string", "not": {"const": "a"}}}})
    assert err.value.body["param"] == "structured_outputs" and "not" in err.value.body["message"]


def test_logprobs_of_a_constrained_answer_are_json_numbers(client: openai.OpenAI, server: KVServe) -> None:
    # Only the few tokens that spell the next part of "Hello world" are allowed at each step,
    # so most of the top 20 alternatives have probability 0 (-inf, which JSON cannot carry):
    # they come back at vLLM's floor, -9999, not as a 500.
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                temperature=0, logprobs=True, top_logprobs=20,
                extra_body={"structured_outputs": {"choice": ["Hello world"]}})
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.message.content == "Hello world"
    values = [t.logprob for e in whole.logprobs.content for t in [e, *e.top_logprobs]]
    assert all(isinstance(v, float) and -9999.0 <= v <= 0.0 for v in values), values
    assert -9999.0 in values  # an alternative the grammar ruled out
    streamed = [e for c in client.chat.completions.create(stream=True, **body)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in whole.logprobs.content]
    completion = client.completions.create(model=MODEL, prompt="Greeting:", max_tokens=8, temperature=0,
                                           logprobs=20, extra_body={"structured_outputs": {"choice": ["Hello world"]}})
    lps = completion.choices[0].logprobs
    assert -9999.0 in [v for top in lps.top_logprobs for v in top.values()], lps
