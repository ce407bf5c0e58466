"""Tool calling for chat completions: the prompt's tools, the call grammar, and the answer's calls.

A ``ToolFormat`` is one way of writing calls; the server picks one per model
(``tool_format_for``):

* ``hermes`` where the model's chat template renders ``tools`` itself and
  writes calls as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``
  (Qwen2.5, Qwen3, Hermes and the templates that copy them). The template gets
  ``tools`` and the messages' own ``tool_calls`` and ``tool_call_id``.
* ``llama3_json`` where the template writes calls as Llama 3.1/3.2's do:
  one JSON object ``{"name": ..., "parameters": {...}}`` per answer, results in
  ``ipython`` turns (the template renders both).
* ``mistral`` where the template writes calls as Mistral's (7B v0.3, Nemo,
  Mixtral 8x22B): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``,
  results in ``[TOOL_RESULTS]``; call ids are 9 letters and digits, as those
  templates require. ``[TOOL_CALLS]`` is a control token of Mistral's
  vocabulary: the grammar names it as that token, and the answer keeps it.
  Mistral's newer templates and tokenizers (version 11 on: Mistral Small 3.1+,
  Devstral, Magistral) write each call as ``[TOOL_CALLS]name[ARGS]{...}``.
* ``openai`` where the template writes gpt-oss's harmony channels: calls are messages to
  ``functions.NAME`` on the commentary channel, read by the harmony reasoning reader
  (``server.harmony``, which hands them on in the hermes syntax); ``auto`` is the model's
  own choice, and ``required`` or a named tool a grammar of the whole harmony answer
  (free analysis messages, then the call), harmony's tags as their tokens.
* ``generic``, kvserve's own, for every other template (the default model's
  knows nothing of tools): the tools are listed in the system message
  (``tools_block``), and a call is the answer's whole text, one JSON object
  ``{"name": ..., "arguments": {...}}`` or, with ``parallel_tool_calls`` (the
  default), a JSON array of them. Earlier turns are rendered the same way: an
  assistant message's ``tool_calls`` become its content in that JSON, and a
  ``tool`` message's result is a message of role ``tool``.

Either way the answer is generated under a grammar (``ToolFormat.grammar``), so
a call always names a given tool, its arguments validate against the tool's
``parameters``, and there are at most as many calls as tools:

* ``tool_choice: "required"``: calls, nothing else;
* a named function: a call of that function;
* ``"auto"`` (the default with tools): either a text answer that does not
  start the way calls do, or calls;
* ``"none"``: a text answer (the tools stay in the prompt, as OpenAI's do).

The package has a module per format (``generic``, ``hermes``, ``llama3_json``,
``mistral``) on the interface of ``base`` (``ToolFormat``, ``FunctionSpec``,
``ParsedCall`` and the helpers the formats share), ``history`` for earlier
turns' calls and ``stream`` for ``CallStream``. This module holds the registry
(``FORMATS``, ``TOOL_PARSERS``, ``tool_format_for``) and re-exports the names
the server imports from ``server.tools``; the imports run one way, from here to
the formats to ``base``, never back.
"""

from __future__ import annotations

from collections.abc import Callable

from server.tools.base import MAX_PARALLEL_CALLS, FunctionSpec, ParsedCall, ToolFormat, max_calls, new_call_id
from server.tools.generic import PARALLEL_NOTE, TOOLS_PREAMBLE, GenericFormat, calls_schema, tools_block
from server.tools.hermes import HERMES_CLOSE, HERMES_OPEN, HermesFormat, OpenAIHarmonyFormat
from server.tools.history import history_content, template_tool_calls
from server.tools.llama3_json import Llama3JsonFormat
from server.tools.mistral import MISTRAL_ARGS, MISTRAL_CALLS, MistralArgsFormat, MistralFormat
from server.tools.stream import CallStream

__all__ = [
    "FORMATS", "HERMES_CLOSE", "HERMES_OPEN", "MAX_PARALLEL_CALLS", "MISTRAL_ARGS", "MISTRAL_CALLS", "PARALLEL_NOTE",
    "TOOLS_PREAMBLE", "TOOL_PARSERS", "CallStream", "FunctionSpec", "GenericFormat", "HermesFormat",
    "Llama3JsonFormat", "MistralArgsFormat", "MistralFormat", "OpenAIHarmonyFormat", "ParsedCall", "ToolFormat",
    "calls_schema",
    "history_content", "max_calls", "new_call_id", "template_tool_calls", "tool_format_for", "tools_block",
]

# One instance per format, by the name --tool-call-parser takes: the formats keep no per-request
# state, so every request shares them (the Mistral ones tool_format_for makes aside).
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (GenericFormat(), HermesFormat(), Llama3JsonFormat(),
                                                      MistralFormat(), OpenAIHarmonyFormat())}
TOOL_PARSERS = ("auto", *FORMATS)


def tool_format_for(parser: str, template_syntax: str | None,
                    encode: Callable[[str], list[int]] | None = None) -> ToolFormat:
    """The format for ``--tool-call-parser`` ``parser``: ``auto`` takes the chat
    template's own syntax (``template_syntax``, e.g. "hermes"; "mistral_v11" is
    Mistral's ``[ARGS]`` syntax) where kvserve reads it, else the generic format.
    ``encode`` (the tokenizer's, without special tokens added) tells whether
    Mistral's markers are single tokens."""
    if parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {parser!r}")
    syntax = "mistral" if template_syntax == "mistral_v11" else template_syntax
    name = parser if parser != "auto" else syntax if syntax in FORMATS else "generic"
    def one_token(text: str) -> int | None:
        ids = encode(text) if encode is not None else []
        return ids[0] if len(ids) == 1 else None

    if name == "openai":
        tags = {tag: one_token(tag) for tag in OpenAIHarmonyFormat.TAGS}
        return OpenAIHarmonyFormat({tag: token for tag, token in tags.items() if token is not None})
    if name != "mistral":
        return FORMATS[name]
    marker_token, args_token = one_token(MISTRAL_CALLS), one_token(MISTRAL_ARGS)
    # The newer syntax where the template writes it, or the vocabulary has [ARGS] as one
    # token (Mistral's tokenizers from version 11 on, which vLLM reads it by).
    if template_syntax == "mistral_v11" or args_token is not None:
        return MistralArgsFormat(marker_token, args_token)
    return MistralFormat(marker_token)
