"""Chat templates: render a list of chat messages into one prompt string.

Templates are Jinja2 programs shipped inside model files, so they are untrusted
input: they run in an immutable sandbox that refuses access to private
attributes and to methods that mutate state. The rendering context matches what
Hugging Face transformers passes (``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``raise_exception``, ``strftime_now``, a
``tojson`` filter that does not HTML-escape), so a template renders here exactly
as it does there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: plain ChatML, the format most
# instruction-tuned small models (SmolLM2, Qwen2) were trained on.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check chat messages and return copies whose ``content`` is a plain string.

    Each message needs a ``role`` from ``VALID_ROLES`` and a ``content`` that is
    a string or a list of ``{"type": "text", "text": ...}`` parts; the parts are
    joined with newlines (as vLLM does). An assistant message that only carries
    ``tool_calls`` may have ``content`` None. Other keys (``name``,
    ``tool_calls``, ``tool_call_id``) are passed through to the template, and
    ``reasoning_content`` also as ``thinking``.

    Raises:
        ValueError: a message is malformed; the message says which and how.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(f"{where}.role is {role!r}; expected one of {sorted(VALID_ROLES)}")
    normalized = dict(message)
    normalized["content"] = _content_text(where, role, message)
    if message.get("reasoning_content") is not None and "thinking" not in message:
        # gpt-oss's template reads an earlier turn's reasoning as `thinking` (llama.cpp's
        # server passes it so too); Qwen3's as `reasoning_content`.
        normalized["thinking"] = message["reasoning_content"]
    return normalized


def _content_text(where: str, role: str, message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return ""
        raise ValueError(f"{where}.content is missing; give a string or a list of text parts")
    if isinstance(content, Sequence):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(
                    f"{where}.content[{j}] must be {{'type': 'text', 'text': <string>}}; "
                    "only text parts are supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


class TemplateArgumentError(ValueError):
    """A render argument that cannot be used as given (not the messages' fault): its
    ``argument`` names it as a request does (``chat_template_kwargs``, ``continue_final_message``)."""

    def __init__(self, message: str, argument: str) -> None:
        super().__init__(message)
        self.argument = argument


# The names every render sets; extra context (a request's chat_template_kwargs) may not.
RESERVED_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    context: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """Render ``messages`` with a model's chat template (ChatML when ``template`` is None).

    ``tools`` (OpenAI's tool objects) are the template's ``tools`` where given;
    ``context`` holds more variables for it (a request's ``chat_template_kwargs``),
    which may not set a name the render sets. ``continue_final_message`` leaves
    the last message open, for the model to go on with it (a "prefill"): the
    render stops where that message's text ends. The
    result already contains whatever BOS text the template writes, so encode it
    without adding special tokens.

    Raises:
        ValueError: the messages are malformed, the template does not compile,
            it calls ``raise_exception``, or it breaks the sandbox rules.
    """
    context = dict(context or {})
    taken = sorted(set(context) & (RESERVED_NAMES | set(_environment().globals)))
    if taken:
        raise TemplateArgumentError(f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the "
                                    "server sets those names itself", "chat_template_kwargs")
    source = template if template is not None else DEFAULT_CHAT_TEMPLATE
    normalized = _developer_as_system(normalize_messages(messages), source)
    compiled = _compile(source)
    try:
        rendered = compiled.render(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **({"tools": tools} if tools else {}),
            **context,
        )
    # TypeError comes from templates doing e.g. str + list on an unexpected message shape.
    except (jinja2.TemplateError, TypeError) as exc:
        raise ValueError(f"chat template failed to render: {exc}") from exc
    return _open_final_message(rendered, normalized[-1]["content"]) if continue_final_message else rendered


def _open_final_message(rendered: str, final: str) -> str:
    """``rendered`` cut where the last message's text ends, dropping what closes its
    turn. Templates may trim a message's surrounding blanks: its text is found
    without them, and its trailing blanks are kept only where the template kept them."""
    core = final.strip()
    if not core:
        raise TemplateArgumentError("continue_final_message needs a final message with text to continue",
                                    "continue_final_message")
    at = rendered.rfind(core)
    if at < 0:
        raise TemplateArgumentError("continue_final_message: the chat template does not render the final "
                                    "message's text as it is, so it cannot be left open", "continue_final_message")
    end = at + len(core)
    tail = final[len(final.rstrip()):]  # the message's own trailing blanks
    if tail and rendered.startswith(tail, end):
        end += len(tail)
    return rendered[:end]


def _developer_as_system(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    # OpenAI's "developer" role is its newer name for "system". A template that never
    # names it would print an unknown turn, drop it, or add its own default system
    # prompt beside it (SmolLM2's does), so it gets "system", as vLLM and llama.cpp's
    # server do; a template that names it renders it itself.
    if "developer" in template:
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


@lru_cache(maxsize=16)
def template_tool_syntax(template: str | None) -> str | None:
    """How a chat template writes tool calls, when it renders ``tools`` itself:
    ``"hermes"`` (``<tool_call>`` JSON ``</tool_call>``, as Qwen2.5 and Hermes
    templates), ``"llama3_json"`` (one ``{"name", "parameters"}`` object, results in
    ``ipython`` turns: Llama 3.1/3.2), ``"mistral"`` (``[TOOL_CALLS]`` and a JSON array of
    calls), ``"mistral_v11"`` (``[TOOL_CALLS]name[ARGS]{...}`` per call: Mistral's
    templates from tokenizer version 11 on), ``"openai"`` (gpt-oss's harmony messages to
    ``functions.NAME``), ``"unknown"`` for a syntax kvserve does
    not read, None when the template knows nothing of tools.

    Raises:
        ValueError: the template is not valid Jinja2.
    """
    if template is None:
        return None
    try:
        names = meta.find_undeclared_variables(_environment().parse(template))
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template is not valid Jinja2: {exc}") from exc
    if "tools" not in names:
        return None
    if "<tool_call>" in template:
        return "hermes"
    # gpt-oss: harmony's channels, a call a message to functions.NAME on the commentary one.
    if "<|channel|>" in template:
        return "openai"
    # Mistral (7B v0.3, Nemo, Mixtral 8x22B): [TOOL_CALLS] [{"name", "arguments"}, ...];
    # from tokenizer version 11 (Small 3.1+, Devstral, Magistral) [TOOL_CALLS]name[ARGS]{...}.
    if "[TOOL_CALLS]" in template:
        return "mistral_v11" if "[ARGS]" in template else "mistral"
    # Llama 3.1/3.2: calls as {"name": ..., "parameters": ...}, results in ipython turns.
    if '"parameters"' in template and "ipython" in template:
        return "llama3_json"
    return "unknown"


def read_chat_template(path: str) -> str:
    """A chat template from a file (``--chat-template``), or given as it is (as vLLM
    takes it: a value that names no file and holds ``{``, ``}`` or a newline is the
    template itself), checked to compile.

    Raises:
        ValueError: the file cannot be read or is not valid Jinja2.
    """
    if not os.path.exists(path) and any(c in path for c in "{}\n"):
        _compile(path)
        return path
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc.strerror}") from None
    _compile(template)
    return template


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Cached: the server renders the same template for every chat request.
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template is not valid Jinja2: {exc}") from exc


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ', which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)
