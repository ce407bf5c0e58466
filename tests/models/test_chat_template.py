"""Chat templates render as transformers renders them, inside a sandbox."""

from __future__ import annotations


import jinja2
import pytest

from models.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat_template
from models.tokenizer import Tokenizer

CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is 2+2?"}],
    "with system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ],
    "multi turn": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 中文?"},
    ],
}


@pytest.fixture(scope="module")
def ours(gguf_tokenizer) -> Tokenizer:
    return gguf_tokenizer


@pytest.fixture(scope="module")
def reference(reference_tokenizer):
    return reference_tokenizer


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_template_renders_like_transformers(ours, reference, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_text_parts_are_joined_with_newlines(ours, reference):
    # SmolLM2's template concatenates content as a string, so the reference gets the joined text.
    parts = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second line"}]
    expected = reference.apply_chat_template(
        [{"role": "user", "content": "first line\nsecond line"}], tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template([{"role": "user", "content": parts}]) == expected


def test_model_without_template_falls_back_to_chatml():
    rendered = render_chat_template(None, [{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat_template(DEFAULT_CHAT_TEMPLATE, [{"role": "user", "content": "hi"}]) == rendered


def test_template_sees_bos_eos_and_helpers():
    template = "{{ bos_token }}{{ messages[0] | tojson }}{{ eos_token }}{{ strftime_now('%Y') | length }}"
    rendered = render_chat_template(template, [{"role": "user", "content": "<b>&"}], bos_token="<s>", eos_token="</s>")
    # Unlike Jinja's own tojson, nothing is HTML-escaped: the prompt must keep the user's text.
    assert rendered == '<s>{"role": "user", "content": "<b>&"}</s>4'


def test_template_kwargs_are_variables_but_not_the_renders_own():
    # Qwen3's switch: a request's chat_template_kwargs reach the template as variables.
    template = ("{{ messages[0].content }}{% if enable_thinking is defined and enable_thinking is false %}"
                "<think></think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat_template(template, messages) == "hi"
    assert render_chat_template(template, messages, context={"enable_thinking": False}) == "hi<think></think>"
    for name in ("messages", "tools", "add_generation_prompt", "bos_token", "raise_exception"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs may not set '{name}'"):
            render_chat_template(template, messages, context={name: 1})


def test_block_tags_leave_no_whitespace():
    # trim_blocks drops the newline after a tag, lstrip_blocks the indentation before one.
    template = "{% for m in messages %}\n  {% if m.content %}\n{{ m.content }}|\n  {% endif %}\n{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat_template(template, messages) == "a|\nb|\n"


@pytest.mark.parametrize(
    "template",
    ["{{ ''.__class__.__mro__ }}", "{{ messages.__class__.__base__.__subclasses__() }}", "{{ messages.append(1) }}"],
)
def test_unsafe_template_is_refused_by_the_sandbox(template):
    with pytest.raises(ValueError, match="unsafe") as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)


def test_raise_exception_becomes_value_error():
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('system message required') }}{% endif %}"
    with pytest.raises(ValueError, match="system message required"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_invalid_template_syntax_is_value_error():
    with pytest.raises(ValueError, match="not valid Jinja2"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        ("hello", "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role is 'robot'"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 3}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\] must be"),
    ],
)
def test_malformed_messages_are_rejected(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(None, messages)


def test_assistant_tool_call_without_content_is_accepted():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "weather"}}]},
    ]
    template = "{{ messages[1].content | length }}:{{ messages[1].tool_calls[0].function.name }}"
    assert render_chat_template(template, messages) == "0:weather"


def test_developer_messages_are_system_messages_to_a_template_that_does_not_know_the_role(ours, reference):
    # SmolLM2's template adds its own system prompt unless the first message is "system".
    developer = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    expected = reference.apply_chat_template(CONVERSATIONS["with system"], tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(developer) == expected
    assert render_chat_template(None, developer).startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    knows = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{# developer #}"
    assert render_chat_template(knows, developer) == "developer:You are terse.;user:Hi there;"


def test_the_tokenizer_hands_template_kwargs_over_and_refuses_its_own_names(ours):
    messages = [{"role": "user", "content": "hi"}]
    plain = ours.apply_chat_template(messages)
    assert ours.apply_chat_template(messages, template_kwargs={"enable_thinking": False}) == plain
    for name in ("messages", "tools", "add_generation_prompt", "eos_token"):
        with pytest.raises(ValueError, match=f"may not set '{name}'"):
            ours.apply_chat_template(messages, template_kwargs={name: []})


@pytest.mark.parametrize("final", ["The three colors are", "Red, green and ", "  {\"a\": "])
def test_a_final_message_left_open_renders_like_transformers(ours, reference, final):
    # vLLM's continue_final_message (and Anthropic's prefill): the model goes on with
    # the last message instead of starting a new turn.
    messages = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": final}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.rstrip().endswith(final.strip())  # nothing closes the turn


def test_a_final_message_that_cannot_be_left_open_is_refused():
    with pytest.raises(ValueError, match="final message with text"):
        render_chat_template(None, [{"role": "assistant", "content": "  "}], continue_final_message=True)
    with pytest.raises(ValueError, match="cannot be left open"):
        render_chat_template("{% for m in messages %}{{ m.content | upper }}{% endfor %}",
                             [{"role": "assistant", "content": "abc"}], continue_final_message=True)
