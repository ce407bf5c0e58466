"""server.tools: the generic, hermes, llama3_json and mistral tool-call formats, their grammars, and the
streamed calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server.protocol_chat import ChatMessage, template_messages
from models.chat_template import read_chat_template, render_chat_template, template_tool_syntax
from server.tools import FORMATS, CallStream, FunctionSpec, calls_schema, tool_format_for

GENERIC, HERMES, LLAMA3, MISTRAL = FORMATS["generic"], FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]
parse_calls, scan_calls = GENERIC.parse, GENERIC.scan
HERMES_TEMPLATE = Path(__file__).parents[1] / "data" / "hermes_chat_template.jinja"
LLAMA3_TEMPLATE = Path(__file__).parents[1] / "data" / "llama3_json_chat_template.jinja"
MISTRAL_TEMPLATE = Path(__file__).parents[1] / "data" / "mistral_chat_template.jinja"

WEATHER = FunctionSpec("get_weather", "Weather in a city.",
                       {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = FunctionSpec("get_time", None, {"type": "object"})
ONE = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, 2]}}'
TWO = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'


def test_a_finished_answer_parses_into_its_calls():
    [call] = parse_calls(ONE)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": 'Pa"ris}', "days": [1, 2]}
    assert [(c.name, c.arguments) for c in parse_calls(TWO)] == [("get_weather", '{"city": "Rome"}'),
                                                                  ("get_time", "{}")]
    assert parse_calls("It is sunny.") is None
    assert parse_calls(ONE[:-5]) is None  # cut off by max_tokens: not a call


def test_scanning_a_growing_answer_never_goes_back():
    seen: list = []
    for end in range(1, len(TWO) + 1):
        calls = scan_calls(TWO[:end])
        assert calls is not None
        for i, c in enumerate(calls):
            if i < len(seen):
                assert c.arguments.startswith(seen[i])
        seen = [c.arguments for c in calls]
    assert [c.complete for c in scan_calls(TWO)] == [True, True]


def test_the_stream_sends_name_first_then_arguments_in_pieces():
    stream = CallStream(GENERIC)
    deltas = []
    for i in range(0, len(ONE), 4):
        text, calls = stream.feed(ONE[i:i + 4])
        assert text == ""
        deltas += calls
    rest, were_calls = stream.finish()
    assert rest == "" and were_calls
    head = deltas[0]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == parse_calls(ONE)[0].arguments and len(deltas) > 3


def test_a_text_answer_streams_as_content():
    stream = CallStream(GENERIC)
    assert stream.feed("  ") == ("  ", [])  # blanks first: text, as the grammar has it
    assert stream.feed("Hi") == ("Hi", [])
    assert stream.feed(" there") == (" there", [])
    assert stream.finish() == ("", False)


def test_grammars_for_each_tool_choice():
    assert GENERIC.grammar([WEATHER, TIME], "none", True) is None
    required = GENERIC.grammar([WEATHER, TIME], "required", False)
    assert required.kind == "json" and len(required.value["anyOf"]) == 2
    named = GENERIC.grammar([WEATHER, TIME], "get_time", True)
    assert named.value["items"]["properties"]["name"] == {"const": "get_time"}
    assert named.value["maxItems"] == 1
    auto = GENERIC.grammar([WEATHER], "auto", False)
    assert auto.kind == "grammar" and "%json" in auto.value and "TEXT" in auto.value
    assert calls_schema([WEATHER, TIME], True)["maxItems"] == 2


def history() -> list[ChatMessage]:
    """A question, the assistant's call, and the tool's result."""
    return [
        ChatMessage(role="user", content="Weather in Rome?"),
        ChatMessage(role="assistant", tool_calls=[{"id": "call_1", "type": "function",
                                                   "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Rome"}'}}]),
        ChatMessage(role="tool", tool_call_id="call_1", content='{"temp": 20}'),
    ]


def test_the_prompt_lists_the_tools_and_earlier_calls():
    messages = history()
    out = template_messages(messages, [WEATHER], parallel=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert out[3] == {"role": "tool", "content": '{"temp": 20}'}
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatMessage(role="tool", content="x")


HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris</tool_call>"}}\n</tool_call>'
HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_answers_parse_into_their_calls():
    [call] = HERMES.parse(HERMES_ONE)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": 'Pa"ris</tool_call>'}
    assert [(c.name, c.arguments) for c in HERMES.parse(HERMES_TWO)] == [
        ("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert HERMES.parse("It is sunny.") is None
    assert HERMES.parse(HERMES_TWO[:-3]) is None  # cut off by max_tokens
    assert HERMES.parse(ONE) is None  # the generic format's JSON is not a hermes call


def stream_two_calls(stream: CallStream, text: str) -> tuple[list, list]:
    """Feed ``text`` (calls of get_weather, then get_time) 3 characters at a time: every
    delta, and the calls' first deltas (id and name) in order."""
    deltas = []
    for i in range(0, len(text), 3):
        content, calls = stream.feed(text[i:i + 3])
        assert content == ""
        deltas += calls
    assert stream.finish() == ("", True)
    heads = [d for d in deltas if d.id]
    assert [(d.index, d.function.name) for d in heads] == [(0, "get_weather"), (1, "get_time")]
    return deltas, heads


def test_a_hermes_stream_holds_back_until_the_tag_decides():
    stream = CallStream(HERMES)
    assert stream.feed("<tool") == ("", [])
    deltas, heads = stream_two_calls(stream, HERMES_TWO[5:])
    for index, call in enumerate(HERMES.parse(HERMES_TWO)):
        assert "".join(d.function.arguments or "" for d in deltas if d.index == index) == call.arguments
    text_stream = CallStream(HERMES)
    assert text_stream.feed("<b>") == ("<b>", [])  # not a call's tag: content from then on
    assert text_stream.finish() == ("", False)


def test_hermes_grammars_bound_the_calls_and_wrap_them_in_tags():
    auto = HERMES.grammar([WEATHER, TIME], "auto", True)
    assert auto.kind == "grammar" and "TEXT" in auto.value and "{0,1}" in auto.value
    assert "<tool_call>" in auto.value and '"whitespace_flexible": false' in auto.value
    named = HERMES.grammar([WEATHER, TIME], "get_time", True)
    assert "TEXT" not in named.value and "get_weather" not in named.value and "{0," not in named.value
    assert HERMES.grammar([WEATHER], "none", True) is None


def test_the_hermes_grammar_accepts_its_calls_and_nothing_else():
    from llguidance import LLMatcher, LLTokenizer  # noqa: F401 (the engine's grammar library)

    from engine.structured import llguidance_grammar

    grammar = llguidance_grammar(HERMES.grammar([WEATHER, TIME], "required", True))
    assert LLMatcher.validate_grammar(grammar) == ""


def test_the_template_decides_the_format():
    template = read_chat_template(str(HERMES_TEMPLATE))
    assert template_tool_syntax(template) == "hermes"
    assert template_tool_syntax("{{ messages[0].content }}") is None
    assert template_tool_syntax("{% for t in tools %}[{{ t | tojson }}]{% endfor %}") == "unknown"
    assert tool_format_for("auto", "hermes") is HERMES
    assert tool_format_for("auto", "unknown") is GENERIC and tool_format_for("auto", None) is GENERIC
    assert tool_format_for("generic", "hermes") is GENERIC and tool_format_for("hermes", None) is HERMES
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_format_for("pythonic", None)
    with pytest.raises(ValueError, match="cannot read"):
        read_chat_template(str(HERMES_TEMPLATE) + ".missing")
    # A template given as it is (vLLM's --chat-template takes either), checked all the same.
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert read_chat_template(inline) == inline
    with pytest.raises(ValueError, match="not valid Jinja2"):
        read_chat_template("{% for m in messages %}")


def test_hermes_history_goes_to_the_template_as_objects():
    messages = history()
    out = template_messages(messages, [WEATHER], parallel=True, tool_format=HERMES)
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]  # no tools block: the template has them
    assert out[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
    assert out[2]["tool_call_id"] == "call_1"
    text = render_chat_template(read_chat_template(str(HERMES_TEMPLATE)), out,
                                tools=[WEATHER.openai()])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert '"name": "get_weather", "description": "Weather in a city."' in text
    assert "<tool_response>\n{\"temp\": 20}\n</tool_response>" in text


def test_an_answer_that_starts_with_blanks_is_text_as_the_grammar_has_it():
    # The "auto" grammars open calls at the first character; after blanks the answer took the
    # text branch, so nothing held it to the tools: it must not come back as tool_calls.
    for fmt, calls in ((GENERIC, ONE), (HERMES, HERMES_ONE)):
        assert fmt.parse(calls) is not None
        for lead in (" ", "\n"):
            assert fmt.parse(lead + calls) is None and fmt.scan(lead + calls) is None
            stream = CallStream(fmt)
            assert stream.feed(lead + calls[:5]) == (lead + calls[:5], [])
            assert stream.feed(calls[5:]) == (calls[5:], [])
            assert stream.finish() == ("", False)


LLAMA3_ONE = '{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, 2]}}'


def test_llama3_json_answers_parse_and_stream_into_one_call():
    [call] = LLAMA3.parse(LLAMA3_ONE)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": 'Pa"ris}', "days": [1, 2]}
    assert LLAMA3.parse(ONE) is None  # "arguments" is the generic format's key
    assert LLAMA3.parse(LLAMA3_ONE[:-2]) is None and LLAMA3.parse("It is sunny.") is None
    stream, deltas = CallStream(LLAMA3), []
    for i in range(0, len(LLAMA3_ONE), 4):
        text, calls = stream.feed(LLAMA3_ONE[i:i + 4])
        assert text == ""
        deltas += calls
    assert stream.finish() == ("", True)
    assert [(d.index, d.function.name) for d in deltas if d.id] == [(0, "get_weather")]
    assert "".join(d.function.arguments or "" for d in deltas) == call.arguments
    for lead in (" ", "Sure"):  # text, as the grammar's text branch has it
        assert LLAMA3.scan(lead + LLAMA3_ONE) is None


def test_llama3_json_grammars_make_one_call_of_the_chosen_tools():
    from llguidance import LLMatcher

    from engine.structured import llguidance_grammar

    required = LLAMA3.grammar([WEATHER, TIME], "required", True)
    assert required.kind == "json" and len(required.value["anyOf"]) == 2  # one object, never an array
    assert required.value["anyOf"][0]["required"] == ["name", "parameters"]
    named = LLAMA3.grammar([WEATHER, TIME], "get_time", True)
    assert named.value["properties"]["name"] == {"const": "get_time"}
    auto = LLAMA3.grammar([WEATHER], "auto", True)
    assert auto.kind == "grammar" and "TEXT" in auto.value and '"parameters"' in auto.value
    assert LLAMA3.grammar([WEATHER], "none", True) is None
    for grammar in (required, auto):
        assert LLMatcher.validate_grammar(llguidance_grammar(grammar)) == ""


def test_the_llama3_template_is_read_and_renders_calls_and_results():
    template = read_chat_template(str(LLAMA3_TEMPLATE))
    assert template_tool_syntax(template) == "llama3_json"
    assert tool_format_for("auto", "llama3_json") is LLAMA3 and tool_format_for("llama3_json", None) is LLAMA3
    out = template_messages(history(), [WEATHER], parallel=True, tool_format=LLAMA3)
    text = render_chat_template(template, out, tools=[WEATHER.openai()])
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}<|im_end|>' in text
    assert '<|im_start|>ipython\n{"output": "{\\"temp\\": 20}"}<|im_end|>' in text
    assert '"name": "get_weather", "description": "Weather in a city."' in text


MISTRAL_TWO = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'


def test_mistral_answers_parse_and_stream_into_their_calls():
    calls = MISTRAL.parse(MISTRAL_TWO)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert MISTRAL.parse(TWO) is None  # no marker: not Mistral's calls
    assert MISTRAL.parse(MISTRAL_TWO[:-3]) is None and MISTRAL.parse("It is sunny.") is None
    assert MISTRAL.parse('[TOOL_CALLS] {"name": "get_time", "arguments": {}}') is None  # always an array
    deltas, heads = stream_two_calls(CallStream(MISTRAL), MISTRAL_TWO)
    # Mistral's templates take only ids of 9 letters and digits.
    assert all(len(d.id) == 9 and d.id.isalnum() for d in heads) and len({d.id for d in heads}) == 2
    for index, call in enumerate(calls):
        assert "".join(d.function.arguments or "" for d in deltas if d.index == index) == call.arguments
    text_stream = CallStream(MISTRAL)
    assert text_stream.feed("[TOOL") == ("", [])  # could still be the marker
    assert text_stream.feed("S]") == ("[TOOLS]", [])  # it is not: content from then on
    assert text_stream.finish() == ("", False)


def test_mistral_grammars_open_with_the_marker_and_make_an_array_of_calls():
    from llguidance import LLMatcher

    from engine.structured import llguidance_grammar

    required = MISTRAL.grammar([WEATHER, TIME], "required", True)
    assert required.kind == "grammar" and required.value.startswith('start: calls\ncalls: "[TOOL_CALLS]" " " body')
    assert '"type": "array"' in required.value and '"maxItems": 2' in required.value
    assert '"maxItems": 1' in MISTRAL.grammar([WEATHER, TIME], "required", False).value
    named = MISTRAL.grammar([WEATHER, TIME], "get_time", True)
    assert "get_weather" not in named.value
    auto = MISTRAL.grammar([WEATHER], "auto", True)
    assert "start: TEXT | calls" in auto.value
    assert MISTRAL.grammar([WEATHER], "none", True) is None
    # Where the vocabulary has the marker as one token, the grammar asks for that token.
    token = tool_format_for("mistral", None, lambda text: [5] if text == "[TOOL_CALLS]" else [1, 2])
    assert token.grammar([WEATHER], "required", True).value.startswith("start: calls\ncalls: <[5]> \" \" body")
    spelt = tool_format_for("auto", "mistral", lambda text: [1, 2, 3])
    assert spelt.marker_token is None and '"[TOOL_CALLS]"' in spelt.grammar([WEATHER], "auto", True).value
    for grammar in (required, auto, token.grammar([WEATHER], "auto", True)):
        assert LLMatcher.validate_grammar(llguidance_grammar(grammar)) == ""


def test_the_mistral_template_is_read_and_renders_calls_results_and_their_ids():
    template = read_chat_template(str(MISTRAL_TEMPLATE))
    assert template_tool_syntax(template) == "mistral"
    assert tool_format_for("auto", "mistral").name == "mistral"
    # Ids of another API (call_..., toolu_...) reach the template by their last 9 characters.
    out = template_messages(history(), [WEATHER], parallel=True, tool_format=MISTRAL)
    assert out[1]["tool_calls"][0]["id"] == "call_1" and out[2]["tool_call_id"] == "call_1"
    long = [ChatMessage(role="user", content="Weather in Rome?"),
            ChatMessage(role="assistant", content=None, tool_calls=[
                {"id": "call_0123456789abcdef", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
            ChatMessage(role="tool", content='{"temp": 20}', tool_call_id="call_0123456789abcdef")]
    out = template_messages(long, [WEATHER], parallel=True, tool_format=MISTRAL)
    assert out[1]["tool_calls"][0]["id"] == out[2]["tool_call_id"] == "789abcdef"
    text = render_chat_template(template, out, tools=[WEATHER.openai()])
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "789abcdef"}]' in text
    assert '[TOOL_RESULTS] {"content": "{\\"temp\\": 20}", "call_id": "789abcdef"}[/TOOL_RESULTS]' in text
    assert text.count("[AVAILABLE_TOOLS]") == 1
    with pytest.raises(ValueError, match="length 9"):
        render_chat_template(template, template_messages(history(), [WEATHER], tool_format=HERMES),
                             tools=[WEATHER.openai()])


def test_mistrals_control_token_is_the_grammars_and_stays_in_the_text(smollm2_loaded):
    # SmolLM2's tokenizer with [TOOL_CALLS] added as a special token, as Mistral's has it.
    from tokenizers import Tokenizer

    from engine.structured import GrammarCompiler, bitmask_words

    tok = Tokenizer.from_str(smollm2_loaded.tokenizer.to_json())
    tok.add_special_tokens(["[TOOL_CALLS]"])
    marker = tok.token_to_id("[TOOL_CALLS]")
    fmt = tool_format_for("auto", "mistral", lambda text: tok.encode(text, add_special_tokens=False).ids)
    assert fmt.marker_token == marker
    compiler = GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [0])

    def allowed(grammar) -> torch.Tensor:  # the mask the engine computes, as booleans
        words = torch.zeros(bitmask_words(tok.get_vocab_size()), dtype=torch.int32)
        grammar.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[:tok.get_vocab_size()].bool()

    grammar = compiler.grammar(compiler.compile(fmt.grammar([WEATHER], "required", True)))
    bracket = tok.encode("[", add_special_tokens=False).ids[0]
    first = allowed(grammar)
    assert first[marker] and not first[bracket]  # the token, not the text spelt out
    grammar.advance(marker)
    body = tok.encode(' [{"name": "get_weather", "arguments": {"city": "Rome"}}]', add_special_tokens=False).ids
    for t in body:
        assert allowed(grammar)[t], tok.decode([t])
        grammar.advance(t)
    assert grammar.finished
    text = tok.decode([marker, *body], skip_special_tokens=False)
    assert [(c.name, c.arguments) for c in fmt.parse(text)] == [("get_weather", '{"city": "Rome"}')]
    auto = allowed(compiler.grammar(compiler.compile(fmt.grammar([WEATHER], "auto", True))))
    assert auto[marker] and not auto[bracket] and auto[tok.encode("It", add_special_tokens=False).ids[0]]


MISTRAL_V11_TEMPLATE = Path(__file__).parents[1] / "data" / "mistral_v11_chat_template.jinja"
MISTRAL_V11 = tool_format_for("mistral", "mistral_v11")
MISTRAL_V11_TWO = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'


def test_mistrals_args_syntax_parses_and_streams_into_its_calls():
    calls = MISTRAL_V11.parse(MISTRAL_V11_TWO)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert MISTRAL_V11.parse(MISTRAL_V11_TWO + "\n") is not None  # blanks after the last call
    for cut in (MISTRAL_V11_TWO[:-1], MISTRAL_V11_TWO[:-5], '[TOOL_CALLS]get_time', '[TOOL_CALLS]get_time[ARGS]{} and',
                '[TOOL_CALLS]get_time[ARGS]{"a": tru}', MISTRAL_TWO, TWO, "It is sunny."):
        assert MISTRAL_V11.parse(cut) is None, cut
    # Growing, a call shows once its name has all arrived ([ARGS] says where it ends).
    assert MISTRAL_V11.scan("[TOOL_CALLS]get_wea") == [] and MISTRAL_V11.scan("It") is None
    [call] = MISTRAL_V11.scan('[TOOL_CALLS]get_weather[ARGS]{"ci')
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"ci', False)
    deltas, heads = stream_two_calls(CallStream(MISTRAL_V11), MISTRAL_V11_TWO)
    assert all(len(d.id) == 9 and d.id.isalnum() for d in heads)
    for index, call in enumerate(calls):
        assert "".join(d.function.arguments or "" for d in deltas if d.index == index) == call.arguments


def test_mistrals_args_grammar_names_each_tool_before_its_arguments():
    from llguidance import LLMatcher

    from engine.structured import llguidance_grammar

    required = MISTRAL_V11.grammar([WEATHER, TIME], "required", True)
    assert required.value.startswith("start: calls\ncalls: call call{0,1}\n")
    assert 'fn0: "get_weather" "[ARGS]" body0' in required.value and '"city"' in required.value
    assert "call{0" not in MISTRAL_V11.grammar([WEATHER, TIME], "required", False).value  # one call
    named = MISTRAL_V11.grammar([WEATHER, TIME], "get_time", True)
    assert "get_weather" not in named.value and "get_time" in named.value
    auto = MISTRAL_V11.grammar([WEATHER], "auto", True)
    assert auto.value.startswith("start: TEXT | calls\n")
    assert MISTRAL_V11.grammar([WEATHER], "none", True) is None
    # Both markers as their tokens where the vocabulary has them as one (version 11's does).
    ids = {"[TOOL_CALLS]": [5], "[ARGS]": [32]}
    tokens = tool_format_for("mistral", None, lambda text: ids.get(text, [1, 2]))
    assert (tokens.marker_token, tokens.args_token) == (5, 32)  # found by the vocabulary alone
    assert 'call: <[5]> (fn0)\nfn0: "get_weather" <[32]> body0' in tokens.grammar([WEATHER], "required", True).value
    for grammar in (required, named, auto, tokens.grammar([WEATHER, TIME], "auto", True)):
        assert LLMatcher.validate_grammar(llguidance_grammar(grammar)) == ""


def test_mistrals_newer_template_is_read_and_renders_calls_and_results():
    template = read_chat_template(str(MISTRAL_V11_TEMPLATE))
    assert template_tool_syntax(template) == "mistral_v11"
    fmt = tool_format_for("auto", "mistral_v11")
    assert fmt.name == "mistral" and fmt.args_token is None
    assert type(tool_format_for("auto", "mistral")) is type(MISTRAL)  # the older syntax stays
    out = template_messages(history(), [WEATHER], parallel=True, tool_format=fmt)
    text = render_chat_template(template, out, tools=[WEATHER.openai()])
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}<|im_end|>' in text
    assert '[TOOL_RESULTS]{"temp": 20}[/TOOL_RESULTS]' in text and text.count("[AVAILABLE_TOOLS]") == 1


def test_mistrals_args_syntax_runs_on_its_control_tokens(smollm2_loaded):
    # SmolLM2's tokenizer with [TOOL_CALLS] and [ARGS] added as special tokens, as
    # Mistral's version-11 tokenizers have them.
    from tokenizers import Tokenizer

    from engine.structured import GrammarCompiler

    tok = Tokenizer.from_str(smollm2_loaded.tokenizer.to_json())
    tok.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    fmt = tool_format_for("auto", "mistral_v11", lambda text: tok.encode(text, add_special_tokens=False).ids)
    assert (fmt.marker_token, fmt.args_token) == (tok.token_to_id("[TOOL_CALLS]"), tok.token_to_id("[ARGS]"))
    compiler = GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [0])
    grammar = compiler.grammar(compiler.compile(fmt.grammar([WEATHER, TIME], "required", True)))
    answer = tok.encode(MISTRAL_V11_TWO, add_special_tokens=False).ids
    assert answer.count(fmt.marker_token) == 2 and answer.count(fmt.args_token) == 2
    for t in answer:
        assert grammar.matcher.consume_token(t), tok.decode([t], skip_special_tokens=False)
    assert grammar.finished
    text = tok.decode(answer, skip_special_tokens=False)
    assert [(c.name, c.arguments) for c in fmt.parse(text)] == [("get_weather", '{"city": "Rome"}'),
                                                                  ("get_time", "{}")]
    # The spelt-out marker is not a way into the calls.
    spelt = compiler.grammar(compiler.compile(fmt.grammar([WEATHER], "required", True)))
    assert not spelt.matcher.consume_token(tok.encode("[", add_special_tokens=False).ids[0])
