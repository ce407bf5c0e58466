"""``POST /completion``: llama.cpp server's own completion API, for its clients.

A request is run as the ``/v1/completions`` request it means (the same engine
parameters, so the same answer), and answered in llama.cpp's shape: the text
as ``content`` with ``stop``, ``stop_type`` and ``stopping_word``, token counts,
``timings``, and per token ``completion_probabilities`` when ``n_probs`` asks.
Streamed, each event is ``data: {"content": <new text>, "stop": false, ...}``,
the last one the whole result's fields with ``"stop": true``, and no ``[DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import create_model
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from engine.sampler_settings import LLAMACPP_SETTINGS
from engine.sampling_params import SamplingParams
from server.body import read_model, validate
from server.engine_client import TokenizerLike
from server.errors import bad_request, renamed_params
from server.fim import infill_prompt
from server.protocol import CompletionRequest, _Strict
from server.protocol_responses import json_logprob, sse_json
from server.driver import Job, Renderer, respond
from server.serving_common import Choices, token_name
from server.state import ServerState, new_request_id

# The /v1/completions field a 400 names -> the llama.cpp field it came from.
_TO_LLAMACPP = {"max_tokens": "n_predict", "logprobs": "n_probs", "n": "n_cmpl",
                **{s.name: name for name, s in LLAMACPP_SETTINGS.items() if name != s.name}}
# llama.cpp's "random seed" (LLAMA_DEFAULT_SEED, 0xFFFFFFFF) and -1.
_RANDOM_SEEDS = (-1, 0xFFFFFFFF)
# llama.cpp's defaults for what a request leaves out (GET /props shows them): its
# sampler settings' (engine.sampler_settings) and these.
LLAMACPP_DEFAULTS: dict[str, Any] = {
    "n_predict": -1, "seed": -1, "n_probs": 0, "ignore_eos": False,
    **{name: s.llamacpp_value for name, s in LLAMACPP_SETTINGS.items()}}


def llamacpp_defaults(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """What ``/completion`` fills a request's left-out fields with, in llama.cpp's names
    (``GET /props`` shows it): llama.cpp's defaults under ``--override-generation-config``'s."""
    out = dict(LLAMACPP_DEFAULTS)
    for name, value in overrides.items():
        field = _TO_LLAMACPP.get(name, name)
        if field in LlamaCppCompletionRequest.model_fields:
            out[field] = value
    return out


# Samplers and options kvserve does not have, each with its value that turns it off: a
# request that turns one on is a 400, not answered by other sampling than it asked for.
_OFF = {"post_sampling_probs": False, "n_indent": 0, "t_max_predict_ms": 0}
# The chain /completion runs unless a request sends its own ``samplers`` (llama.cpp's names).
_DEFAULT_CHAIN = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


# llama.cpp's sampler settings (engine.sampler_settings), by its names, with its defaults.
_LlamaCppSamplerFields = create_model("_LlamaCppSamplerFields", __base__=_Strict,
                                      **{name: (s.annotation, s.llamacpp_value) for name, s in LLAMACPP_SETTINGS.items()})


class LlamaCppCompletionRequest(_LlamaCppSamplerFields):
    """``POST /completion``: llama.cpp's fields and defaults (``temperature`` 0.8,
    ``top_k`` 40, ``top_p`` 0.95, ``min_p`` 0.05, ``n_predict`` -1: up to the context)."""

    model: str | None = None
    prompt: str | list[Any]
    n_predict: int = LLAMACPP_DEFAULTS["n_predict"]
    stop: str | list[str] = []
    seed: int = LLAMACPP_DEFAULTS["seed"]
    ignore_eos: bool = LLAMACPP_DEFAULTS["ignore_eos"]
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    n_probs: int = LLAMACPP_DEFAULTS["n_probs"]
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    stream: bool = False
    n_cmpl: int = 1
    return_tokens: bool = False
    lora: list[Any] | None = None
    # Accepted and without effect here: the prefix cache always reuses what it can and
    # gives the same logits as computing anew (cache_prompt); a request never outgrows
    # the context (n_keep).
    cache_prompt: bool = True
    n_keep: int = 0
    samplers: list[str] | str | None = None  # its chain: only these, in this order
    # Samplers kvserve does not have (_OFF): only their "off" values.
    post_sampling_probs: bool = _OFF["post_sampling_probs"]
    n_indent: int = _OFF["n_indent"]
    t_max_predict_ms: int = _OFF["t_max_predict_ms"]

    def prompts(self, tok: TokenizerLike, n_ctx: int) -> list[list[int]]:
        """The prompts as token ids (a 400 names ``prompt``). A string, or a list of ids
        and strings (one prompt, its texts tokenized in place); several prompts as a
        list of strings or of such lists. A BOS, where the model adds one, goes before
        a prompt that starts with a text, as llama.cpp does. (``n_ctx``, the context
        length, shapes ``/infill``'s prompt.)"""
        p = self.prompt
        if isinstance(p, str) or any(isinstance(x, int) and not isinstance(x, bool) for x in p):
            many = [p]
        else:
            many = p
        if not many:
            raise bad_request("prompt must not be empty", "prompt")
        return [_tokens(tok, one) for one in many]

    def as_completion(self, prompts: list[list[int]], tok: TokenizerLike,
                      overrides: Mapping[str, Any] | None = None) -> CompletionRequest:
        """The ``/v1/completions`` request this one means (a 400 names this API's field).
        ``overrides`` (``--override-generation-config``'s sampling, by the engine's names)
        fill what the request left out, as llama-server's command line does; the rest
        keeps llama.cpp's defaults."""
        for name, off in _OFF.items():
            if getattr(self, name) != off:
                raise bad_request(f"{name} is not supported (only {off!r}, which turns it off)", name)
        if self.lora:
            raise bad_request("per-request LoRA scales are not supported; serve each adapter with "
                              "--lora-modules and name it as the model", "lora")
        if self.n_predict < -1:
            raise bad_request(f"n_predict must be -1 (up to the context) or more, got {self.n_predict}",
                              "n_predict")
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompts, "n": self.n_cmpl,
            # -1: the rest of the context; 0: the prompt evaluated, nothing generated.
            "max_tokens": None if self.n_predict == -1 else self.n_predict, "echo": self.n_predict == 0,
            **{s.name: getattr(self, name) for name, s in LLAMACPP_SETTINGS.items()},
            # (llama.cpp's off values below the engine's)
            "temperature": max(self.temperature, 0.0), "top_k": max(self.top_k, 0),
            # llama.cpp's chain divides by the temperature after its truncations.
            "temperature_last": True, "samplers": self.samplers,
            "stop": self.stop, "seed": None if self.seed in _RANDOM_SEEDS else self.seed,
            "ignore_eos": self.ignore_eos, "logit_bias": _logit_bias(self.logit_bias, tok),
            "logprobs": self.n_probs or None, "grammar": self.grammar, "json_schema": self.json_schema,
        }
        for name, value in (overrides or {}).items():
            if name in CompletionRequest.model_fields and _TO_LLAMACPP.get(name, name) not in self.model_fields_set:
                body[name] = value
        with renamed_params(_TO_LLAMACPP):
            # (max_tokens None is meant: the rest of the context, not the API's default of 16)
            return validate(CompletionRequest, {k: v for k, v in body.items()
                                                if v is not None or k == "max_tokens"})

    def generation_settings(self, params: SamplingParams, n_ctx: int, model: str) -> dict[str, Any]:
        """What ran, in llama.cpp's names (its ``generation_settings``)."""
        return {"n_ctx": n_ctx, "model": model, "n_predict": self.n_predict, "seed": self.seed,
                **{name: getattr(params, s.name) for name, s in LLAMACPP_SETTINGS.items()},
                "samplers": ["penalties", "dry", *(params.samplers if params.samplers is not None
                                                   else _DEFAULT_CHAIN)],
                "stop": list(params.stop), "ignore_eos": params.ignore_eos, "n_probs": self.n_probs,
                "grammar": self.grammar or "", "stream": self.stream}


class InfillChunk(_Strict):
    """A file of context for ``/infill`` (llama.cpp's ``input_extra`` entries)."""

    text: str = ""
    filename: str = "tmp"


class LlamaCppInfillRequest(LlamaCppCompletionRequest):
    """``POST /infill``: ``/completion``'s fields, and the code around the gap:
    ``input_prefix``, ``input_suffix``, ``input_extra`` (files of context) and an
    optional ``prompt`` (text that goes right after the prefix)."""

    prompt: str = ""  # type: ignore[assignment]
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []

    def prompts(self, tok: TokenizerLike, n_ctx: int) -> list[list[int]]:
        """One prompt, laid out as llama.cpp's (``server.fim.infill_prompt``)."""
        extra = [(chunk.filename, chunk.text) for chunk in self.input_extra]
        return [infill_prompt(tok, self.input_prefix, self.input_suffix, self.prompt, extra, n_ctx,
                              self.n_predict)]


def _tokens(tok: TokenizerLike, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("each prompt must be a string or a non-empty list of token ids and strings", "prompt")
    ids: list[int] = []
    for i, piece in enumerate(prompt):
        if isinstance(piece, str):
            ids += tok.encode(piece, add_special_tokens=i == 0)
        elif isinstance(piece, int) and not isinstance(piece, bool):
            ids.append(piece)
        else:
            raise bad_request(f"a prompt's pieces must be token ids or strings, got {piece!r}", "prompt")
    return ids


def _logit_bias(bias: list[list[Any]] | dict[str, Any] | None, tok: TokenizerLike) -> dict[str, float] | None:
    """llama.cpp's ``logit_bias`` (``[[token, bias], ...]`` or ``{token: bias}``; a token is
    an id or a text, whose every token gets the bias; ``false``: never) as OpenAI's."""
    if bias is None:
        return None
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    out: dict[str, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise bad_request(f"logit_bias entries must be [token, bias] pairs, got {pair!r}", "logit_bias")
        token, value = pair
        if value is False:
            value = -100.0  # the least a bias may be: the token is as good as never picked
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"a logit_bias must be a number or false, got {value!r}", "logit_bias")
        if isinstance(token, str) and not token.lstrip("-").isdigit():
            ids = tok.encode(token, add_special_tokens=False)
        else:
            ids = [int(token)]
        out.update({str(i): float(value) for i in ids})
    return out


class _TimedChoices(Choices):
    """``Choices`` that also note when each prompt's first and last tokens came back
    (llama.cpp's ``timings``)."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        super().__init__(prompt_lens, n)
        self.start = time.perf_counter()
        self.first: list[float | None] = [None] * len(prompt_lens)
        self.last = [self.start] * len(prompt_lens)

    def update(self, prompt_index: int, ro: RequestOutput) -> list:
        changed = super().update(prompt_index, ro)
        moment = time.perf_counter()
        if any(out.token_ids for _, out, _ in changed):
            if self.first[prompt_index] is None:
                self.first[prompt_index] = moment
            self.last[prompt_index] = moment
        return changed

    def timings(self, idx: int, predicted: int) -> dict[str, float]:
        """llama.cpp's ``timings`` for choice ``idx``, as this server saw them: the prompt
        from the request's start to its first token, the rest after it."""
        p = idx // self.n
        first = self.first[p] if self.first[p] is not None else self.last[p]
        prompt_n = self.prompt_lens[p] - self.cached[p]
        prompt_ms, predicted_ms = (first - self.start) * 1e3, (self.last[p] - first) * 1e3
        return {"cache_n": self.cached[p], "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
                "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(predicted, 1),
                "predicted_per_second": predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0}


def _probabilities(tok: TokenizerLike, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """``completion_probabilities``: per token its id, text, bytes and logprob, and its
    ``n_probs`` most likely alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"id": token_id, "token": token_name(tok, token_id, False),
                "bytes": list(tok.token_bytes(token_id)), "logprob": json_logprob(logprob)}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


async def create_llamacpp_completion(state: ServerState, request: Request) -> Response:
    """Validate, run and render one llama.cpp ``/completion`` request."""
    return await _complete(state, request, await read_model(request, LlamaCppCompletionRequest))


async def create_llamacpp_infill(state: ServerState, request: Request) -> Response:
    """llama.cpp's ``/infill``: a fill-in-the-middle prompt (``server.fim``), then as
    ``/completion``."""
    return await _complete(state, request, await read_model(request, LlamaCppInfillRequest))


async def _complete(state: ServerState, request: Request, body: LlamaCppCompletionRequest) -> Response:
    # llama.cpp's server (one model) reads no model name: any name but a served adapter's
    # is the base model here too.
    model = state.check_model(body.model if body.model in state.engine.lora_adapters else None)
    tok = state.engine.tokenizer
    prompts = body.prompts(tok, state.engine.max_model_len)
    completion = body.as_completion(prompts, tok, state.engine.sampling_overrides)
    with renamed_params(_TO_LLAMACPP):
        params = completion.sampling_params()
    job = Job(new_request_id("cmpl"), model, prompts, params,
              {"prompt": "prompt", **_TO_LLAMACPP,
               "structured": "grammar" if body.grammar is not None else "json_schema"}, bool(body.stream))
    settings = body.generation_settings(params, state.engine.max_model_len, model)
    return await respond(state, request, job, LlamaCppRenderer(tok, body, job, settings))


class LlamaCppRenderer(Renderer):
    """llama.cpp's completion result per choice (a list of them for several), or its
    stream: ``content`` events, then the result's fields with ``"stop": true``."""

    done = None  # llama.cpp's stream has no [DONE]
    choices: _TimedChoices

    def __init__(self, tok: TokenizerLike, body: LlamaCppCompletionRequest, job: Job,
                 settings: dict[str, Any]) -> None:
        super().__init__(_TimedChoices([len(p) for p in job.prompts], job.params.n))
        self.tok, self.body, self.job, self.settings = tok, body, job, settings
        self.evaluate_only = body.n_predict == 0

    def _final(self, idx: int, streamed: bool) -> dict[str, Any]:
        choices, body, n = self.choices, self.body, self.job.params.n
        st = choices.states[idx]
        tokens = [] if self.evaluate_only else st.token_ids
        content = "" if self.evaluate_only or streamed else "".join(st.text)
        if st.finish_reason == "length" or self.evaluate_only:
            stop_type, word = "limit", ""
        elif isinstance(st.stop_reason, str):
            stop_type, word = "word", st.stop_reason
        else:  # an end-of-sequence or stop token, or a grammar that accepts no more
            stop_type, word = "eos", ""
        out: dict[str, Any] = {
            "index": idx, "content": content, "tokens": tokens if body.return_tokens and not streamed else [],
            "id_slot": -1, "stop": True, "model": self.job.model, "tokens_predicted": len(tokens),
            "tokens_evaluated": choices.prompt_lens[idx // n], "generation_settings": self.settings,
            "prompt": self.tok.decode(self.job.prompts[idx // n], skip_special_tokens=False),
            "has_new_line": "\n" in "".join(st.text) and not self.evaluate_only, "truncated": False,
            "stop_type": stop_type, "stopping_word": word, "tokens_cached": choices.cached[idx // n],
            "timings": choices.timings(idx, len(tokens))}
        if body.n_probs and not streamed and not self.evaluate_only:
            out["completion_probabilities"] = _probabilities(self.tok, st.logprobs)
        return out

    def whole(self) -> Response:
        results = [self._final(idx, streamed=False) for idx in range(len(self.choices.states))]
        return JSONResponse(results if len(results) > 1 else results[0])

    def delta(self, prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        choices = self.choices
        for idx, out, finished in choices.update(prompt_index, ro):
            if not self.evaluate_only and (out.text or out.token_ids):
                event: dict[str, Any] = {"index": idx, "content": out.text, "tokens": out.token_ids,
                                         "stop": False, "id_slot": -1,
                                         "tokens_predicted": choices.states[idx].num_tokens,
                                         "tokens_evaluated": choices.prompt_lens[prompt_index]}
                if self.body.n_probs:
                    event["completion_probabilities"] = _probabilities(self.tok, out.logprobs or [])
                yield sse_json(_json(event))
            if finished:
                yield sse_json(_json(self._final(idx, streamed=True)))


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
