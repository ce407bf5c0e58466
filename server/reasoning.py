"""Reasoning parsers: a thinking model's ``<think>...</think>`` apart from its answer.

``--reasoning-parser qwen3`` reads an answer that opens with ``<think>`` as
reasoning up to ``</think>`` and the rest as content (Qwen3 thinks unless the
request's ``chat_template_kwargs`` turn it off, and then writes no tags);
``deepseek_r1`` reads everything up to ``</think>`` as reasoning, since its
template opens the block in the prompt (a leading ``<think>`` the model writes
anyway is dropped), and an answer cut before ``</think>`` as all reasoning;
``openai_gptoss`` reads gpt-oss's harmony channels (``server.harmony``: analysis
is reasoning), and ``auto``, the default, takes it where the chat template writes
harmony's channels and reads no reasoning elsewhere.
The text between the tags goes out as it was generated (no whitespace is
trimmed), so a streamed answer's pieces join into the whole answer's.

A constrained answer (tools, a structured output) thinks first too where the
tokenizer has ``<think>`` and ``</think>`` as single tokens (Qwen3's and
DeepSeek-R1's do): the engine's grammar then waits out the block
(``ThinkTokens``), and holds for the answer after it. A harmony answer's grammar
waits for the final channel (``<|channel|>final`` ... ``<|message|>``) and holds
for its body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling_params import ThinkTokens
from server.harmony import CHANNEL, MESSAGE, HarmonyStream, partial_tag

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models marks its reasoning."""

    name: str
    # The answer starts inside the reasoning block (the template opened it).
    opens_in_prompt: bool
    # The answer is read with the tokenizer's special tokens in its text (harmony's tags are).
    keeps_special_tokens = False

    def stream(self, trim: bool = False) -> "ReasoningStream | HarmonyStream":
        """A reader of one answer arriving in pieces (``trim``: see ``ReasoningStream``)."""
        return ReasoningStream(self, trim)

    def split(self, text: str, trim: bool = False) -> tuple[str | None, str]:
        """A whole answer as ``(reasoning, content)``; reasoning None where there is none
        (``trim``: see ``ReasoningStream``)."""
        stream = self.stream(trim)
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        reasoning += rest_reasoning
        content += rest_content
        return (reasoning if stream.reasoned else None), content


    def tokens(self, tokenizer: Any) -> ThinkTokens | None:
        """``<think>`` and ``</think>`` as the engine's ``ThinkTokens`` (so that a
        constrained answer's grammar waits out the block), or None where ``tokenizer``
        has no single token for each."""
        start, end = single_token(tokenizer, START), single_token(tokenizer, END)
        if start is None or end is None:
            return None
        return ThinkTokens(start, end, self.opens_in_prompt)


def single_token(tokenizer: Any, tag: str) -> int | None:
    """``tag``'s one token in ``tokenizer``, or None where it is not one token."""
    encoded = tokenizer.encode(tag, add_special_tokens=False)
    # (a tokenizer may map an unknown word to one "unknown" token: not the tag)
    if len(encoded) != 1 or tokenizer.decode(encoded, skip_special_tokens=False) != tag:
        return None
    return encoded[0]


@dataclass(frozen=True)
class HarmonyFormat(ReasoningFormat):
    """gpt-oss's harmony channels (``server.harmony``), read with the special tokens kept."""

    keeps_special_tokens = True

    def stream(self, trim: bool = False) -> HarmonyStream:
        return HarmonyStream()

    def tokens(self, tokenizer: Any) -> ThinkTokens | None:
        """The final channel's ``<|channel|>final`` ... ``<|message|>`` as the block's close:
        a constrained answer's grammar holds for the final message's body (vLLM's gate too),
        the analysis and commentary messages before it free. None where the two tags are not
        single tokens."""
        channel, message = single_token(tokenizer, CHANNEL), single_token(tokenizer, MESSAGE)
        if channel is None or message is None:
            return None
        final = tokenizer.encode("final", add_special_tokens=False)
        return ThinkTokens(channel, message, opens_in_prompt=True, end_after=(channel, *final))


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", opens_in_prompt=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", opens_in_prompt=True),
    "openai_gptoss": HarmonyFormat("openai_gptoss", opens_in_prompt=False),
}
REASONING_PARSERS = ("auto", "none", *REASONING_FORMATS)


def reasoning_format(name: str, chat_template: str | None = None) -> ReasoningFormat | None:
    """The format ``--reasoning-parser`` names; None for ``none``, and for ``auto`` unless
    ``chat_template`` writes harmony's channels (gpt-oss's)."""
    if name == "auto":
        return REASONING_FORMATS["openai_gptoss"] if chat_template and CHANNEL in chat_template else None
    if name == "none":
        return None
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}") from None


class ReasoningStream:
    """One answer's text, fed piece by piece, split into reasoning and content pieces.

    Text that could still be part of a tag is held back until the next piece
    shows what it is, so a tag is never sent, in whole or in part. With ``trim``
    the blanks right after ``</think>`` are dropped: a constrained answer's grammar
    lets them through before the answer it holds for (``engine.structured``).
    """

    def __init__(self, fmt: ReasoningFormat, trim: bool = False) -> None:
        self.format = fmt
        self.trim = trim
        self._trimming = False  # dropping the blanks after </think>
        # "start": before the answer shows whether it opens with <think> (the
        # leading tag is optional where the prompt opened the block);
        # "reasoning" inside the block; "content" after it, or with no block.
        self.state = "start"
        self.reasoned = fmt.opens_in_prompt
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` to send for ``text``."""
        buf, self._held = self._held + text, ""
        reasoning = ""
        if self.state == "start":
            if START.startswith(buf) and len(buf) < len(START):
                self._held = buf
                return "", ""
            if buf.startswith(START):
                buf, self.state, self.reasoned = buf[len(START):], "reasoning", True
            else:
                self.state = "reasoning" if self.format.opens_in_prompt else "content"
        if self.state == "reasoning":
            end = buf.find(END)
            if end < 0:
                keep = partial_tag(buf, (END,))
                self._held = buf[len(buf) - keep:] if keep else ""
                return buf[:len(buf) - keep], ""
            reasoning, buf, self.state = buf[:end], buf[end + len(END):], "content"
            self._trimming = self.trim
        if self._trimming:
            buf = buf.lstrip(" \t\r\n")
            self._trimming = not buf
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the answer."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "start" and self.format.opens_in_prompt:
            self.state = "reasoning"
            return held, ""
        return "", held
