"""Incremental detokenization: output token ids -> UTF-8 safe text deltas.

Decoding one token at a time is wrong for byte-level BPE (a character can span
several tokens) and for SentencePiece (a token's leading space depends on what
precedes it). As in TGI and vLLM, each step decodes a short window: the
tokens already emitted since the last step (``prefix_offset:read_offset``)
with and without the new tokens, and emits the difference. The window is reset
after every emission, so the cost per token stays constant.
"""

from __future__ import annotations

from typing import Protocol

from engine.sampling_params import SamplingParams

# Prompt tokens used as the first window's context, as in vLLM: enough for a
# tokenizer to decide the leading space of the first output token.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    """The one tokenizer call the detokenizer needs (a Hugging Face tokenizer fits)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, UTF-8 safe, with stop strings.

    ``output_text`` is all text emitted so far. When a stop string matches,
    ``stop_reason`` is that string and ``finished`` is True. For byte-level BPE
    tokenizers the deltas plus ``flush()`` concatenate to
    ``tokenizer.decode(output_ids)`` (cut at a stop string); SentencePiece
    tokenizers keep the first token's leading space, which a standalone decode
    strips, because the window starts inside the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            # A prompt cut inside a character: output bytes that complete it
            # would shift the window diff, so start without context.
            context = []
        self._ids = context  # the prompt context, then every output token
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pending = ""  # decoded text held back because it may start a stop string
        self._stops = sorted(set(params.stop), key=len)
        self._max_stop_len = len(self._stops[-1]) if self._stops else 0

    def update(self, new_token_ids: list[int]) -> str:
        """Returns the new text that is safe to emit now (possibly "").

        Never emits half a UTF-8 character (a decode ending in U+FFFD is held
        until completed). Text that could be the beginning of a stop string is
        held back, so stop text never streams. When a stop string matches,
        sets ``stop_reason``, cuts the text before it (after it with
        ``include_stop_str_in_output``) and sets ``finished``; later calls
        return "".
        """
        if self.finished:
            return ""
        self._ids.extend(new_token_ids)
        return self._push(self._decode_new(at_end=False), at_end=False)

    def flush(self) -> str:
        """At the end of generation (not by stop string): emit held-back text.

        Tokens that end inside a UTF-8 character are dropped rather than
        emitted as U+FFFD. A stop string completed by them still cuts the text.
        """
        if self.finished:
            return ""
        return self._push(self._decode_new(at_end=True), at_end=True)

    def _decode_new(self, at_end: bool) -> str:
        """Complete text added by the tokens after ``read_offset`` ("" while incomplete)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if at_end:
            full_text = full_text.rstrip(_REPLACEMENT_CHAR)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _push(self, new_text: str, at_end: bool) -> str:
        """Add decoded text; emit what no stop string can claim, hold back the rest."""
        text = self._pending + new_text
        self._pending = ""
        if not self._stops:
            return self._emit(text)
        # A stop string may begin in text already emitted (only with
        # include_stop_str_in_output, which holds nothing back), so the search
        # looks back as far as the longest stop string could reach.
        lookback = self.output_text[max(0, len(self.output_text) - self._max_stop_len + 1):]
        match = self._find_stop(lookback + text)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.params.include_stop_str_in_output else start
            end -= len(lookback)
            assert end >= 0, "held-back text let a stop string stream"
            self.stop_reason = stop
            self.finished = True
            return self._emit(text[:end])
        # When the stop text is part of the output anyway there is no need to
        # hold back what might start it.
        hold = 0 if at_end or self.params.include_stop_str_in_output else self._stop_prefix_len(text)
        self._pending = text[len(text) - hold:]
        return self._emit(text[: len(text) - hold])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` (shortest on a tie), as (index, stop)."""
        found = [(i, stop) for stop in self._stops if (i := text.find(stop)) >= 0]
        return min(found, key=lambda m: (m[0], len(m[1]))) if found else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, text: str) -> str:
        self.output_text += text
        return text
