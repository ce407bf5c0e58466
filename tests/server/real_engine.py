"""The server tests' engine: the real ``AsyncEngine`` over a tiny random checkpoint.

``write_tiny_checkpoint`` makes a 2-layer random Llama with SmolLM2's tokenizer and chat
template (once per session, in conftest.py); ``build_engine`` starts an ``AsyncEngine`` on
those shared weights. ``ServedEngine`` wraps it thinly: it records what each request asked
(for assertions on the translated ``SamplingParams``) and can inject faults, but every
answer, stop string, logprob and cache hit is the real engine's.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import PoolingParams, SamplingParams, StructuredOutput

MODEL_NAME = "fake-model"  # the served name the tests ask for (api_helpers.MODEL)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 64
HIDDEN_SIZE = 64  # the tiny model's: an embedding's length


def write_tiny_checkpoint(path: Path, tokenizer, added: tuple[str, ...] = ()) -> Path:
    """A random 2-layer Llama (hidden 64, GQA 4/2) with ``tokenizer``'s vocabulary, its
    ``tokenizer.json`` and chat template, as ``save_pretrained`` writes a checkpoint;
    ``added``: texts the tokenizer gains as single (added, not special) tokens, as Qwen3's
    ``<think>`` is, with an embedding row each."""
    import tokenizers
    import transformers

    backend = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=backend.get_vocab_size(with_added_tokens=True),
                                      hidden_size=HIDDEN_SIZE, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        # NOTE: weights far larger than an initialiser's make the logits peaked, so
        # greedy answers vary from token to token instead of repeating one.
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(backend.to_str())
    name = backend.id_to_token
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": name(tokenizer.bos_token_id), "eos_token": name(tokenizer.eos_token_ids[0]),
        "chat_template": tokenizer.chat_template, "add_bos_token": False}))
    return path


def build_engine(loaded, checkpoint: Path, **overrides) -> AsyncEngine:
    """An ``AsyncEngine`` on the shared weights ``loaded``, with its own KV cache of
    ``NUM_KV_BLOCKS`` blocks; ``overrides`` are ``EngineConfig`` fields."""
    budget = NUM_KV_BLOCKS * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    settings = dict(model=str(checkpoint), served_model_name=MODEL_NAME, dtype="float32", device="cpu",
                    kv_cache_memory=budget, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                    kv_cache_dtype="float32", quantization="none")
    return AsyncEngine(LLMEngine(EngineConfig(**{**settings, **overrides}), loaded=loaded))


@dataclass
class SeenRequest:
    """What the engine was asked for one request that entered it, and what it answered."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str | None = None
    adapter: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list)
    aborted: bool = False  # the stream was closed before its last delta


class ServedEngine:
    """The real ``AsyncEngine`` with a record of its requests and faults on cue.

    ``fail_after_steps``: each stream, after that many deltas, ends with
    ``RequestOutput.error`` (``fault="error"``) or raises ``EngineDeadError`` and
    the engine reports itself dead (``fault="raise"``, as a dead loop does).
    ``step_delay`` makes each engine step take that long (seconds), so a test can act
    mid-stream; a shutdown cuts the wait short. ``script``: the text every generation
    answers, which the engine itself writes under a structured-output constraint (a
    ``choice`` of that one text), then ends with EOS; the recorded params are the server's.
    ``script_over_constraints``: the script even where the request has a constraint of its
    own (the engine then gets the script's choice in its place, and no ``think``).
    ``script_grammar``: a Lark grammar of the script that the engine writes in place of
    the ``choice`` (to write ``<think>`` as its single token, ``<think>`` in Lark: under a
    choice's forced text, llguidance's mask allows the added token, which its matcher then
    refuses).
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.inner = engine
        self.requests: list[SeenRequest] = []
        self.fail_after_steps: int | None = None
        self.fault = "error"
        self.step_delay = 0.0
        self.script: str | None = None
        self.script_over_constraints = False
        self.script_grammar: str | None = None
        self.started = False
        self.shut_down = False
        self._killed = False
        self._stopping = threading.Event()
        step = engine.engine.step

        def paced_step():  # on the engine thread
            if self.step_delay:
                self._stopping.wait(self.step_delay)
            return step()

        engine.engine.step = paced_step

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def is_alive(self) -> bool:
        return self.inner.is_alive and not self._killed

    @property
    def groups(self) -> dict[str, str]:
        """Request id -> the admission group generate() was given (default: the id)."""
        return {r.request_id: r.group or r.request_id for r in self.requests}

    @property
    def adapters(self) -> dict[str, str | None]:
        return {r.request_id: r.adapter for r in self.requests}

    @property
    def aborted(self) -> list[str]:
        return [r.request_id for r in self.requests if r.aborted]

    async def start(self) -> None:
        self.started = True
        await self.inner.start()

    async def shutdown(self) -> None:
        self.shut_down = True
        self._stopping.set()
        await self.inner.shutdown()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 group: str | None = None, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        asked = params
        if (self.script is not None and params.pooling is None
                and (params.structured is None or self.script_over_constraints)):
            script = (StructuredOutput("grammar", self.script_grammar) if self.script_grammar is not None
                      else StructuredOutput("choice", (self.script,)))
            params = dataclasses.replace(params, structured=script, think=None)
        stream = self.inner.generate(request_id, prompt_token_ids, params, group=group, adapter=adapter)
        params = asked
        return self._watch(SeenRequest(request_id, list(prompt_token_ids), params, group, adapter), stream)

    async def _watch(self, seen: SeenRequest, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        # Recorded once iterated: that is when the request enters the engine.
        self.requests.append(seen)
        finished = False
        try:
            if self._killed:
                raise EngineDeadError("the engine is not running")
            async for out in stream:
                if self.fail_after_steps is not None and len(seen.outputs) >= self.fail_after_steps:
                    finished = True
                    if self.fault == "raise":
                        self._killed = True
                        raise EngineDeadError("engine loop died")
                    yield RequestOutput(seen.request_id, [], seen.prompt_token_ids, finished=True,
                                        error="simulated engine fault")
                    return
                seen.outputs.append(out)
                finished = out.finished
                yield out
        finally:
            seen.aborted = not finished
            await stream.aclose()


async def direct(engine: ServedEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every delta of the engine's own answer to ``prompt``, run directly (not recorded)."""
    return [out async for out in engine.inner.generate(f"direct-{id(params)}", prompt, params)]


async def answer(engine: ServedEngine, prompt: list[int], params: SamplingParams) -> list[tuple[str, str | None]]:
    """The engine's own answer to ``prompt``, run directly: per sample, (text, finish_reason)."""
    texts: dict[int, list] = {}
    for out in await direct(engine, prompt, params):
        for o in out.outputs:
            t = texts.setdefault(o.index, ["", None])
            t[0] += o.text
            t[1] = o.finish_reason or t[1]
    return [tuple(texts[i]) for i in sorted(texts)]


GREEDY = {"temperature": 0, "ignore_eos": True}  # a request whose answer the engine repeats


@dataclass
class Greedy:
    """The engine's own greedy answer to a prompt (one sample)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None


async def greedy(engine: ServedEngine, prompt: str | list[int], max_tokens: int, **params) -> Greedy:
    """The engine's own answer to ``prompt`` with ``GREEDY`` params, run directly."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    outs = await direct(engine, ids, SamplingParams(max_tokens=max_tokens, **GREEDY, **params))
    samples = [o.outputs[0] for o in outs if o.outputs]
    return Greedy("".join(o.text for o in samples), [t for o in samples for t in o.token_ids],
                  [lp for o in samples for lp in o.logprobs or []],
                  next((o.prompt_logprobs for o in samples if o.prompt_logprobs), None))


def name(engine: ServedEngine, token_id: int) -> str:
    """A token's text, as logprobs name it."""
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def top(engine: ServedEngine, lp: TokenLogprob) -> dict[str, float]:
    """A logprobs entry's alternatives, and its own token (OpenAI's "up to logprobs + 1")."""
    return {name(engine, t): v for t, v in lp.top} | {name(engine, lp.token_id): lp.logprob}


def offsets(names: list[str]) -> list[int]:
    """Where each token's text starts, counted in the tokens' texts."""
    return [0, *accumulate(len(n) for n in names)][:-1]


def a_stop_string(text: str) -> str:
    """A piece of ``text`` from its middle, to stop the same answer at."""
    stop = text[len(text) // 2:][:4]
    assert stop.strip(), text
    return stop


def tokens_until(engine: ServedEngine, token_ids: list[int], stop: str) -> int:
    """How many of ``token_ids`` the engine generates before its text holds ``stop``."""
    return next(k for k in range(1, len(token_ids) + 1) if stop in engine.tokenizer.decode(token_ids[:k]))


def generated_tokens(engine: ServedEngine) -> int:
    """The tokens the engine generated for the last request (its EOS included)."""
    return sum(len(o.token_ids) for out in engine.requests[-1].outputs for o in out.outputs)


def logprob_entry(engine: ServedEngine, token_id: int, logprob: float, as_id: bool = False) -> dict:
    """A token's logprobs entry as the chat and Responses APIs send it."""
    token = f"token_id:{token_id}" if as_id else name(engine, token_id)
    return {"token": token, "logprob": logprob, "bytes": list(engine.tokenizer.token_bytes(token_id))}


async def embed(engine: ServedEngine, prompt: list[int], normalize: bool = True) -> list[float]:
    """The engine's own embedding of ``prompt``, run directly."""
    outs = await direct(engine, prompt, SamplingParams.embedding(PoolingParams(normalize=normalize)))
    return outs[-1].outputs[0].embedding


# Each message as <|role|>content (its reasoning as <think>...</think> first), then the
# template's keyword arguments as [name=value]: rendered prompts that read easily.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% if not (continue_final_message and loop.last) %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking is defined %}[enable_thinking={{ enable_thinking }}]{% endif %}"
    "{% if x is defined %}[x={{ x }}]{% endif %}")


def start_loop(engine: AsyncEngine) -> tuple[threading.Thread, threading.Event]:
    """Run the engine loop on a daemon thread; set the event to stop a loop never started."""
    give_up = threading.Event()
    thread = threading.Thread(target=engine.run_loop, args=(give_up,), name="server-test-engine", daemon=True)
    thread.start()
    return thread, give_up
