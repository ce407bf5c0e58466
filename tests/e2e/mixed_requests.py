"""Seeded random request bodies that mix the API's features (sampling settings, penalties,
stop strings, n, logprobs, echo, prompt logprobs, streaming with usage, structured outputs, tools,
the Responses API, Anthropic's Messages API, embeddings, llama.cpp's /completion), and a check of each answer: never a 5xx, a 4xx in OpenAI's error shape, a
stream that ends in ``[DONE]`` (a Responses stream: in ``response.completed`` or
``response.incomplete``) without an error event, and a body the ``openai`` SDK's types accept. Bugs hide in the
combinations: logprobs under a grammar (-inf in JSON), a draft's proposals under a grammar
(a broken matcher took the engine loop down) were both found this way."""

from __future__ import annotations

import base64
import json
import random
import struct
from typing import Any

import httpx
import pydantic
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from e2e_helpers import MODEL

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"
LLAMACPP = "/completion"


def _sampling(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    options = {"temperature": [0, 0.7, 1.0, 1.5], "top_p": [0.1, 0.9], "top_k": [1, 5, -1], "min_p": [0.0, 0.1],
               "seed": list(range(100)), "n": [1, 2, 3], "stop": ["\n", ["."], [",", "!"]],
               "presence_penalty": [-1.0, 2.0], "frequency_penalty": [-2.0, 0.5], "repetition_penalty": [1.3],
               "min_tokens": [0, 3, 10], "ignore_eos": [True], "include_stop_str_in_output": [True],
               "allowed_token_ids": [list(range(200, 2000)), [2, 28, 30]], "truncate_prompt_tokens": [2, -1]}
    for key, values in options.items():
        if rng.random() < 0.25:
            body[key] = rng.choice(values)
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.randrange(49152)): rng.choice([-100, 5, 100])}
    body["max_tokens"] = rng.choice([1, 5, 20, 40])
    if rng.random() < 0.4:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.3}
    return body


def _structured(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    pick = rng.random()
    if pick < 0.1:
        body["response_format"] = {"type": "json_object"}
    elif pick < 0.25:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    elif pick < 0.3:
        body["structured_outputs"] = {"choice": ["yes", "no"]}
    elif pick < 0.35:
        body["structured_outputs"] = {"regex": "[a-z]{1,8}"}
    elif pick < 0.4:
        body["grammar"] = 'root ::= ("yes" | "no") ", " [a-z ]{1,12} "."'  # llama.cpp's GBNF
    return body


def mixed_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One random (route, body)."""
    if rng.random() < 0.08:
        body: dict[str, Any] = {"model": MODEL, "input": rng.choice(
            ["Once upon a time", ["a", "b c", "Ünïcödé 🙂"], [1, 2, 3], [[1, 2], [3]], ""])}
        if rng.random() < 0.3:
            body["dimensions"] = rng.choice([1, 64, 576, 577])
        if rng.random() < 0.5:
            body["encoding_format"] = rng.choice(["float", "base64"])
        return EMBEDDINGS, body
    if rng.random() < 0.4:
        prompt = rng.choice(["Once upon a time", ["a", "b c"], [1, 2, 3], "Ünïcödé 🙂"])
        body = _sampling(rng, {"model": MODEL, "prompt": prompt})
        if rng.random() < 0.3:
            body["logprobs"] = rng.choice([0, 1, 5, 20])
        if rng.random() < 0.2:
            body["echo"] = True  # with logprobs: the prompt's too
            if rng.random() < 0.5:
                body["max_tokens"] = 0  # scoring: the prompt alone
        body = _structured(rng, body)
        if rng.random() < 0.2 and not {"echo", "response_format", "structured_outputs"} & body.keys():
            return LLAMACPP, as_llamacpp(body)
        if rng.random() < 0.1:
            body["prompt_logprobs"] = rng.choice([0, 2])  # vLLM's (a 400 with stream)
        return COMPLETIONS, body
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": rng.choice(["system", "developer"]), "content": "Be brief."})
    messages.append({"role": "user", "content": rng.choice(
        ["Hi", "What's the weather in Paris?", "Count to five.", [{"type": "text", "text": "Say a word."}]])})
    if rng.random() < 0.2:
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = _sampling(rng, {"model": MODEL, "messages": messages})
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = rng.choice([0, 1, 5, 20])
    if rng.random() < 0.3:
        body["tools"] = TOOLS
        if rng.random() < 0.6:
            body["tool_choice"] = rng.choice(["auto", "required", "none",
                                              {"type": "function", "function": {"name": "get_time"}}])
    else:
        body = _structured(rng, body)
    if rng.random() < 0.25 and "prompt_logprobs" not in body and "structured_outputs" not in body \
            and "grammar" not in body:
        return RESPONSES, as_responses(body)
    if rng.random() < 0.2 and not {"prompt_logprobs", "structured_outputs", "grammar", "response_format",
                                   "logprobs"} & body.keys():
        return MESSAGES, as_messages(body)
    return CHAT, body


def as_llamacpp(completion: dict[str, Any]) -> dict[str, Any]:
    """The same completions request in llama.cpp's /completion words."""
    names = {"max_tokens": "n_predict", "logprobs": "n_probs", "n": "n_cmpl", "repetition_penalty": "repeat_penalty"}
    body = {names.get(k, k): v for k, v in completion.items()
            if k not in ("model", "stream_options", "min_tokens", "include_stop_str_in_output", "allowed_token_ids",
                         "truncate_prompt_tokens")}
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    if "logit_bias" in body:
        body["logit_bias"] = [[int(k), v] for k, v in body["logit_bias"].items()]
    return body


def _check_llamacpp(body: dict[str, Any], r: httpx.Response, where: str) -> str | None:
    if not body.get("stream"):
        raw = r.json()
        results = raw if isinstance(raw, list) else [raw]
        ok = all(isinstance(x["content"], str) and x["stop"] is True and x["stop_type"] in ("eos", "limit", "word")
                 for x in results)
        return None if ok else where
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    if any("error" in e for e in events) or not events or not events[-1]["stop"]:
        return where
    return None


def as_messages(chat: dict[str, Any]) -> dict[str, Any]:
    """The same request in Anthropic's Messages API's words."""
    system = [m["content"] for m in chat["messages"] if m["role"] in ("system", "developer")]
    turns: list[dict[str, Any]] = []
    for m in chat["messages"]:
        if m.get("tool_calls"):
            turns.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            turns.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                       "content": m["content"]}]})
        elif m["role"] == "user":
            content = m["content"]
            turns.append({"role": "user", "content": content if isinstance(content, str) else
                          [{"type": "text", "text": p["text"]} for p in content]})
    body: dict[str, Any] = {k: v for k, v in chat.items() if k in ("model", "max_tokens", "temperature", "top_p",
                                                                  "top_k", "stream")}
    body["messages"] = turns
    if system:
        body["system"] = system[0]
    if chat.get("stop"):
        body["stop_sequences"] = [chat["stop"]] if isinstance(chat["stop"], str) else chat["stop"]
    if "tools" in chat:
        body["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description"),
                          "input_schema": t["function"]["parameters"]} for t in chat["tools"]]
        body["tools"] = [{k: v for k, v in t.items() if v is not None} for t in body["tools"]]
    choice = chat.get("tool_choice")
    if choice is not None:
        body["tool_choice"] = ({"type": "tool", "name": choice["function"]["name"]} if isinstance(choice, dict)
                               else {"type": {"required": "any"}.get(choice, choice)})
    return body


def _check_messages(body: dict[str, Any], r: httpx.Response, where: str) -> str | None:
    if not body.get("stream"):
        AnthropicMessage.model_validate(r.json())
        return None
    events = [_ANTHROPIC_EVENT.validate_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    return None if events[-1].type == "message_stop" else where


def as_responses(chat: dict[str, Any]) -> dict[str, Any]:
    """The same request in the Responses API's words."""
    items: list[dict[str, Any]] = []
    for m in chat["messages"]:
        if m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], **c["function"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            content = m["content"]
            if isinstance(content, list):
                content = [{"type": "input_text", "text": p["text"]} for p in content]
            items.append({"role": m["role"], "content": content})
    body = {k: v for k, v in chat.items() if k not in ("messages", "max_tokens", "n", "stream_options", "logprobs",
                                                      "tools", "tool_choice", "response_format")}
    body["input"], body["max_output_tokens"] = items, chat["max_tokens"]
    if chat.get("logprobs"):
        body["include"] = ["message.output_text.logprobs"]
    if "tools" in chat:
        body["tools"] = [{"type": "function", **t["function"]} for t in chat["tools"]]
    choice = chat.get("tool_choice")
    if choice is not None:
        body["tool_choice"] = {"type": "function", **choice["function"]} if isinstance(choice, dict) else choice
    fmt = chat.get("response_format")
    if fmt is not None:
        body["text"] = {"format": {"type": "json_schema", **fmt["json_schema"]} if "json_schema" in fmt else fmt}
    return body


_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
_ANTHROPIC_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


def _check_responses(body: dict[str, Any], r: httpx.Response, where: str) -> str | None:
    if not body.get("stream"):
        answer = Response.model_validate(r.json())
        return None if answer.status in ("completed", "incomplete") else where
    events = [_EVENT.validate_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    if events[-1].type not in ("response.completed", "response.incomplete"):
        return where
    if [e.sequence_number for e in events] != list(range(len(events))):
        return where
    return None


def check_answer(path: str, body: dict[str, Any], r: httpx.Response) -> str | None:
    """What is wrong with ``r`` as the answer to ``body`` (None: nothing)."""
    where = f"{path} {json.dumps(body)} -> {r.status_code}: {r.text[-400:]}"
    if r.status_code >= 500:
        return where
    if r.status_code != 200:
        error = r.json().get("error", {})
        if path == MESSAGES:  # Anthropic's shape
            return None if r.json().get("type") == "error" and {"type", "message"} <= error.keys() else where
        return None if {"message", "type", "param", "code"} <= error.keys() else where
    chat = path == CHAT
    try:
        if path == EMBEDDINGS:
            raw = r.json()
            if body.get("encoding_format") == "base64":  # the SDK decodes it before validating
                for item in raw["data"]:
                    packed = base64.b64decode(item["embedding"])
                    item["embedding"] = list(struct.unpack(f"<{len(packed) // 4}f", packed))
            answer = CreateEmbeddingResponse.model_validate(raw)
            inputs = body["input"]
            many = isinstance(inputs, list) and isinstance(inputs[0], (str, list))
            return None if len(answer.data) == (len(inputs) if many else 1) else where
        if path == RESPONSES:
            return _check_responses(body, r, where)
        if path == MESSAGES:
            return _check_messages(body, r, where)
        if path == LLAMACPP:
            return _check_llamacpp(body, r, where)
        if not body.get("stream"):
            answer = r.json()
            if not chat:
                for choice in answer["choices"]:
                    _prompt_start(body, choice)
            (ChatCompletion if chat else Completion).model_validate(answer)
            return None
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        if events[-1] != "[DONE]":
            return where
        with_logprobs: set[int] = set()
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:
                return where
            if not chat:  # null until the last chunk, as OpenAI streams it (the SDK does not validate it)
                for choice in chunk["choices"]:
                    choice["finish_reason"] = choice["finish_reason"] or "stop"
                    if choice["logprobs"] and choice["index"] not in with_logprobs:
                        with_logprobs.add(choice["index"])
                        _prompt_start(body, choice)
            (ChatCompletionChunk if chat else Completion).model_validate(chunk)
    except ValueError as exc:  # pydantic's ValidationError and JSON errors
        return f"{where} ({exc})"
    return None


def _prompt_start(body: dict[str, Any], choice: dict[str, Any]) -> None:
    """An echoed prompt's first token has no logprob: ``null``, as OpenAI sends it (the
    SDK's types say float, and do not validate). Only there: any other null still fails."""
    lps = choice["logprobs"]
    if body.get("echo") and lps and lps["tokens"] and lps["token_logprobs"][0] is None:
        assert lps["top_logprobs"][0] is None
        lps["token_logprobs"][0], lps["top_logprobs"][0] = 0.0, {}
