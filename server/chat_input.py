"""A chat request as the engine's input: its sampling parameters, how its answer is read
(``server.answers``) and its prompt tokens. The chat endpoint and the APIs that
translate into chat (Responses, Anthropic Messages) all prepare it here."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from server.answers import AnswerReader, plan_answer
from server.protocol import truncate_prompt
from server.protocol_chat import ChatCompletionRequest, render_prompt
from server.state import ServerState


def prepare_chat(state: ServerState, chat: ChatCompletionRequest
                 ) -> tuple[SamplingParams, AnswerReader, list[int]]:
    """A chat request's engine params, how its answer is read and its prompt. ``chat``
    comes with the model's defaults filled in already (``ServerState.with_model_defaults``,
    which each caller applies beside its model check). A 400 names chat's field; the
    params are checked before the template renders, so a request wrong in both hears
    of its params."""
    fmt = state.tool_format
    params = chat.sampling_params(fmt)
    calls = fmt if chat.tool_choice_name() != "none" else None
    ids = render_prompt(state.engine.tokenizer, chat, fmt)
    params, reader = plan_answer(state, params, calls)
    return params, reader, truncate_prompt(ids, chat.truncate_prompt_tokens, state.engine.max_model_len)
