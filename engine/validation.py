"""The one check a request passes before the engine accepts it.

``SamplingParams`` validates each parameter on its own at construction; what
depends on the model (the vocabulary, the context length) is checked here,
once, when a request enters the engine (``LLMEngine.prepare``). The server
maps ``InvalidRequestError`` to OpenAI's 400 with its ``param``; the scheduler
below only asserts what this module guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine can never run; ``param`` names the field at fault
    (``"prompt"`` for the prompt itself, else a ``SamplingParams`` field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What bounds a request on the loaded model.

    ``vocab_size`` is the number of token ids that both the tokenizer and the
    model's embedding rows know: the bound for prompt ids, ``stop_token_ids``
    and ``logit_bias`` keys, and the width the sampler draws from, so that every
    id that goes in or comes out can be both embedded and decoded.
    """

    vocab_size: int
    max_model_len: int
    hidden_size: int = 0  # an embedding's length (0: not checked)
    # The engine orders requests by their priority (--scheduling-policy priority);
    # otherwise a priority other than 0 is refused rather than ignored.
    priority_scheduling: bool = False
    # The longest answer of a request that sets no max_tokens (the model's generation_config
    # max_new_tokens); None: the rest of the context.
    default_max_tokens: int | None = None


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> int:
    """Check that a request can run; return its resolved ``max_tokens``.

    Raises ``InvalidRequestError`` with a message a user can act on.
    """
    n, limit = len(prompt_token_ids), limits.max_model_len
    if n == 0:
        raise InvalidRequestError("The prompt is empty.", "prompt")
    check_token_ids(prompt_token_ids, limits.vocab_size, "prompt")
    check_token_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias), limits.vocab_size, "logit_bias")
    check_token_ids(params.allowed_token_ids or [], limits.vocab_size, "allowed_token_ids")
    if params.priority != 0 and not limits.priority_scheduling:
        raise InvalidRequestError("priority is only honoured by a server started with --scheduling-policy "
                                  "priority; leave it out or send 0.", "priority")
    if params.think is not None:
        check_token_ids(params.think.token_ids, limits.vocab_size, "think")
    if params.pooling is not None:
        # An embedding generates nothing: its prompt may fill the whole context.
        dims = params.pooling.dimensions
        if limits.hidden_size and dims is not None and dims > limits.hidden_size:
            raise InvalidRequestError(f"dimensions must be at most {limits.hidden_size} (the model's "
                                      f"embedding length), got {dims}.", "dimensions")
        if n > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your input has "
                f"{n} tokens. Please shorten it.", "prompt")
        return 1
    if n >= limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{n} tokens, which leaves no room for the completion. Please shorten the prompt.",
            "prompt")
    room = limit - n
    if params.max_tokens is not None:
        max_tokens = params.max_tokens
    else:
        max_tokens = min(room, limits.default_max_tokens or room)
    if n + max_tokens > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.", "prompt")
    if params.min_tokens > max_tokens:
        # Only reachable without max_tokens (SamplingParams checks the pair): the
        # completion can hold the rest of the context, or the model's default length.
        if max_tokens < room:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds this model's default answer length "
                f"({max_tokens}, its generation_config's max_new_tokens); set max_tokens too.", "min_tokens")
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you asked for "
            f"at least {params.min_tokens} completion tokens after a prompt of {n} tokens, "
            f"which leaves room for {limit - n}. Please reduce min_tokens.", "min_tokens")
    return max_tokens


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """``InvalidRequestError`` naming ``param`` unless every id is in ``[0, vocab_size)``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{param} contains token id {bad}, outside the vocabulary "
                                  f"[0, {vocab_size}).", param)
