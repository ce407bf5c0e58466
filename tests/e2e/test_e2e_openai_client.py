"""The real server driven by the official ``openai`` client: completions and chat,
streaming and not, usage chunks, n, stop, seeds and greedy determinism."""

from __future__ import annotations

import httpx
import openai
import pytest

from e2e_helpers import MODEL, KVServe

pytestmark = pytest.mark.slow

# The anthropic SDK (2.x) takes no temperature argument; kvserve reads the field from the body.
GREEDY = {"temperature": 0}

PROMPT = "List of fruits: apple, banana,"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 8


def prompt_len(server: KVServe, **body: object) -> int:
    """The server's own token count for a prompt (or chat messages) via /tokenize."""
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body},
                   headers=server.headers, timeout=30.0)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def same_counts(a: object, b: object) -> bool:
    """Equal token counts (cached_tokens may differ: a repeated prompt hits the prefix cache)."""
    fields = ("prompt_tokens", "completion_tokens", "total_tokens")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def stream_completion(client: openai.OpenAI, **kwargs: object) -> tuple[list, str]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    return chunks, "".join(c.choices[0].text for c in chunks if c.choices)


def stream_chat(client: openai.OpenAI, **kwargs: object) -> tuple[list, str]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    return chunks, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_list_shows_the_served_model(client: openai.OpenAI) -> None:
    # The base model, then the LoRA adapter the shared server loads (conftest.ADAPTER).
    assert [m.id for m in client.models.list()] == [MODEL, "sql"]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion(client: openai.OpenAI, server: KVServe) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id
    [choice] = r.choices
    assert choice.index == 0 and choice.text
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == prompt_len(server, prompt=PROMPT)
    assert 0 < r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == MAX_TOKENS


def test_chat_completion(client: openai.OpenAI, server: KVServe) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == prompt_len(server, messages=MESSAGES)
    assert 0 < r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream_at_temperature_0(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0)
    chunks, text = stream_completion(client, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     stream_options={"include_usage": True})
    assert text == full.choices[0].text
    # The usage chunk comes last, alone, with no choices; no other chunk carries usage.
    *deltas, last = chunks
    assert last.choices == [] and same_counts(last.usage, full.usage)
    assert all(c.usage is None and len(c.choices) == 1 for c in deltas)
    assert {c.id for c in chunks} == {last.id}
    finishes = [c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert deltas[-1].choices[0].finish_reason is not None


def test_chat_stream_equals_non_stream_at_temperature_0(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                          temperature=0)
    chunks, text = stream_chat(client, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                               stream_options={"include_usage": True})
    assert text == full.choices[0].message.content
    *deltas, last = chunks
    assert last.choices == [] and same_counts(last.usage, full.usage)
    assert all(c.usage is None and len(c.choices) == 1 for c in deltas)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks, text = stream_chat(client, messages=MESSAGES, max_tokens=4, temperature=0)
    assert text
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_n_2_returns_two_choices(client: openai.OpenAI, server: KVServe) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                  seed=7, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    # The prompt is counted once, the samples' tokens together.
    assert r.usage.prompt_tokens == prompt_len(server, prompt=PROMPT)
    assert 2 <= r.usage.completion_tokens <= 12

    chunks, _ = stream_chat(client, messages=MESSAGES, max_tokens=4, temperature=1.0, n=2,
                            stream_options={"include_usage": True})
    # Both samples stream on their own index and each finishes exactly once.
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks[:-1]:
        [choice] = c.choices
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values()), finishes
    assert chunks[-1].choices == [] and 2 <= chunks[-1].usage.completion_tokens <= 8


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                       temperature=0).choices[0].text
    assert len(greedy) >= 6, f"the greedy text {greedy!r} is too short to pick a stop string from"
    middle = len(greedy) // 2
    stop = greedy[middle:middle + 3]
    expected = greedy[:greedy.find(stop)]

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"

    # Streamed, the stop text is held back and never sent.
    chunks, text = stream_completion(client, prompt=PROMPT, max_tokens=12, temperature=0,
                                     stop=[stop])
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_same_seed_same_text_at_temperature_1(client: openai.OpenAI) -> None:
    def sample() -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=1.0, seed=1234).choices[0].text

    first = sample()
    assert first
    assert sample() == first


def tokenize(server: KVServe, text: str, add_special_tokens: bool) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text,
                                                   "add_special_tokens": add_special_tokens},
                   headers=server.headers, timeout=30.0)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_tokenizer_info_names_special_tokens_the_server_tokenizes_whole(server: KVServe) -> None:
    """lm-evaluation-harness's remote tokenizer: the EOS text from /tokenizer_info must
    come back from /tokenize as the one EOS id (it stops generations with it)."""
    r = httpx.get(f"{server.url}/tokenizer_info", headers=server.headers, timeout=30.0)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["chat_template"] and info["model_max_length"] > 0
    for special in (info["eos_token"], info["bos_token"]):
        [token_id] = tokenize(server, special, add_special_tokens=False)
        r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [token_id]},
                       headers=server.headers, timeout=30.0)
        assert r.status_code == 200


def test_scoring_a_continuation_as_lm_evaluation_harness_does(client: openai.OpenAI, server: KVServe) -> None:
    """Its loglikelihood requests (``local-completions``): token ids, ``echo``, ``logprobs=1``,
    ``max_tokens=1``; it reads ``token_logprobs[ctxlen:-1]`` (the last is the generated
    token's) and whether each is the top one. Each must be what generating from that
    point reports."""
    context = tokenize(server, PROMPT, add_special_tokens=True)
    continuation = tokenize(server, " cherry, grape and", add_special_tokens=False)
    ctxlen = len(context)
    scored = client.completions.create(model=MODEL, prompt=context + continuation, echo=True, max_tokens=1,
                                       logprobs=1, temperature=0, seed=1234)
    lp = scored.choices[0].logprobs
    # The prompt's tokens (the first without a logprob), then the one generated.
    assert len(lp.tokens) == ctxlen + len(continuation) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    logprobs, tops = lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]
    greedy = 0
    for i, (logprob, top) in enumerate(zip(logprobs, tops, strict=True)):
        step = client.completions.create(model=MODEL, prompt=context + continuation[:i], max_tokens=1,
                                         logprobs=1, temperature=0).choices[0].logprobs
        # Generating from the same prefix finds the same best token at the same logprob, bit for bit.
        assert max(top.values()) == step.token_logprobs[0], (i, top, step.token_logprobs[0])
        assert top[step.tokens[0]] == step.token_logprobs[0]
        assert top[lp.tokens[ctxlen + i]] == logprob
        greedy += logprob == max(top.values())  # lm-eval's is_greedy
    print(f"{greedy} of {len(continuation)} continuation tokens are the greedy pick")
    # Where the generated token is EOS, there is still exactly one entry after the prompt.
    eos = tokenize(server, "<|im_end|>", add_special_tokens=False)
    ended = client.completions.create(model=MODEL, prompt=context + continuation, echo=True, max_tokens=1,
                                      logprobs=1, temperature=0, logit_bias={str(eos[0]): 100}).choices[0]
    assert ended.finish_reason == "stop" and len(ended.logprobs.tokens) == len(lp.tokens)
    assert ended.logprobs.token_logprobs[:-1] == lp.token_logprobs[:-1]
    # max_tokens=0: the prompt's entries alone, streamed or not.
    alone = client.completions.create(model=MODEL, prompt=context + continuation, echo=True, max_tokens=0,
                                      logprobs=1, temperature=0)
    assert alone.choices[0].finish_reason == "length" and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    chunks = list(client.completions.create(model=MODEL, prompt=context + continuation, echo=True,
                                            max_tokens=0, logprobs=1, temperature=0, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs[:-1]


def test_chat_prompt_logprobs_equal_the_completions_echo_of_the_same_tokens(client: openai.OpenAI,
                                                                            server: KVServe) -> None:
    """vLLM's ``prompt_logprobs`` extension on a chat, through the SDK's ``extra_body``."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    entries = chat.model_extra["prompt_logprobs"]
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": MESSAGES},
                   headers=server.headers, timeout=30.0)
    ids = r.json()["tokens"]
    echoed = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=0).choices[0]
    assert len(entries) == len(ids) and entries[0] is None
    for i, token_id in enumerate(ids[1:], start=1):
        mine = entries[i][str(token_id)]
        assert mine["logprob"] == echoed.logprobs.token_logprobs[i]
        assert mine["rank"] >= 1 and len(entries[i]) <= 3
        best = min(entries[i].values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and best["logprob"] >= mine["logprob"]


def test_responses_answer_as_chat_does(client: openai.OpenAI) -> None:
    """The Responses API is chat in other words: the same turns give the same greedy
    text, streamed or not, and ``previous_response_id`` continues the conversation."""
    instructions, ask = "Answer in one short sentence.", MESSAGES[0]["content"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": instructions},
                                                                 *MESSAGES],
                                          max_tokens=MAX_TOKENS, temperature=0)
    first = client.responses.create(model=MODEL, instructions=instructions, input=ask,
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens
    assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(model=MODEL, instructions=instructions, input=ask,
                                 max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == first.output_text

    # A second turn on the stored first one equals chat given the whole history
    # (an earlier response's instructions are not carried over, as in OpenAI's API).
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And three more?",
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    history = [*MESSAGES, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And three more?"}]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=MAX_TOKENS, temperature=0)
    assert second.output_text == again.choices[0].message.content
    assert second.usage.input_tokens == again.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_anthropic_messages_answer_as_chat_does(client: openai.OpenAI, server: KVServe) -> None:
    """Anthropic's Messages API through the official ``anthropic`` SDK (its key as
    ``x-api-key``): the same turns give chat's greedy text, streamed or not."""
    import anthropic

    claude = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120.0)
    system = "Answer in one short sentence."
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system}, *MESSAGES],
                                          max_tokens=MAX_TOKENS, temperature=0)
    message = claude.messages.create(model=MODEL, system=system, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                     extra_body=GREEDY)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                        chat.usage.completion_tokens)
    with claude.messages.stream(model=MODEL, system=system, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == message.content[0].text
    assert claude.messages.count_tokens(model=MODEL, system=system, messages=MESSAGES).input_tokens == \
        message.usage.input_tokens


def test_a_prefilled_answer_continues_the_last_message(client: openai.OpenAI, server: KVServe) -> None:
    """vLLM's continue_final_message (and Anthropic's prefill): the answer goes on from the
    last assistant message, as a completion of the prompt /tokenize renders for it."""
    import anthropic

    prefill = [*MESSAGES, {"role": "assistant", "content": "The three colors are"}]
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": prefill, "continue_final_message": True},
                   headers=server.headers, timeout=30.0)
    ids = r.json()["tokens"]
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120.0)
    message = claude.messages.create(model=MODEL, messages=prefill, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    assert message.content[0].text == completion.choices[0].text
    with pytest.raises(anthropic.BadRequestError, match="continue"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[*MESSAGES, {"role": "assistant", "content": " "}])


def test_return_token_ids_are_the_prompt_and_the_answer(client: openai.OpenAI, server: KVServe) -> None:
    # vLLM's return_token_ids through the SDK (extra_body, read back from model_extra), as an
    # RL rollout reads them: the chat prompt's ids are what /tokenize gives its messages, and
    # the answer's ids decode to its text.
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=server.headers,
                           timeout=30).json()["tokens"]
    assert r.model_extra["prompt_token_ids"] == tokenized
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=server.headers,
                      timeout=30).json()["prompt"]
    assert text.startswith(r.choices[0].message.content)
    streamed = [t for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"return_token_ids": True}) for c in chunk.choices for t in c.model_extra["token_ids"]]
    assert streamed == ids
