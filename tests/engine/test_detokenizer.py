"""IncrementalDetokenizer on the default model's real tokenizer: UTF-8 safety, stop strings, flush."""

from __future__ import annotations


import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

PROMPT = "<|im_start|>assistant\n"
ENGLISH = "Hello world, how are you?"
CHINESE = "你好，世界！我们"
EMOJI = "🎉👍🏽 ok 😀"


@pytest.fixture(scope="module")
def tokenizer(reference_tokenizer):
    return reference_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_detokenizer(tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), SamplingParams(**params))


def feed_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.update([token_id]) for token_id in ids]


# ----------------------------------------------------------------- UTF-8 and spaces

@pytest.mark.parametrize("text", [ENGLISH, CHINESE, EMOJI])
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detok = make_detokenizer(tokenizer)
    deltas = feed_one_by_one(detok, ids) + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text


@pytest.mark.parametrize("text", [CHINESE, EMOJI])
def test_no_delta_holds_half_a_character(tokenizer, text):
    detok = make_detokenizer(tokenizer)
    deltas = feed_one_by_one(detok, encode(tokenizer, text))
    assert all("\ufffd" not in delta for delta in deltas)


def test_english_streams_one_token_at_a_time(tokenizer):
    detok = make_detokenizer(tokenizer)
    assert feed_one_by_one(detok, encode(tokenizer, ENGLISH)) == [
        "Hello", " world", ",", " how", " are", " you", "?"]


def test_several_tokens_per_update(tokenizer):
    ids = encode(tokenizer, EMOJI)
    detok = make_detokenizer(tokenizer)
    deltas = [detok.update(ids[:4]), detok.update(ids[4:]), detok.flush()]
    assert "".join(deltas) == EMOJI
    assert all("\ufffd" not in delta for delta in deltas)


def test_decodes_a_bounded_window_per_token(tokenizer):
    class CountingTokenizer:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            CountingTokenizer.longest = max(CountingTokenizer.longest, len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(CountingTokenizer(), encode(tokenizer, PROMPT), SamplingParams())
    feed_one_by_one(detok, encode(tokenizer, ENGLISH * 20))
    assert CountingTokenizer.longest <= 8


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    skipping = make_detokenizer(tokenizer)
    keeping = make_detokenizer(tokenizer, skip_special_tokens=False)
    assert skipping.update([eos]) == ""
    assert keeping.update([eos]) == tokenizer.decode([eos], skip_special_tokens=False)


# ----------------------------------------------------------------- stop strings

def test_stop_string_spanning_tokens_never_streams(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["how are"])
    deltas = feed_one_by_one(detok, encode(tokenizer, ENGLISH))
    assert "".join(deltas) == detok.output_text == "Hello world, "
    assert not any("how" in delta for delta in deltas)
    assert (detok.stop_reason, detok.finished) == ("how are", True)


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["world!"])
    deltas = feed_one_by_one(detok, encode(tokenizer, "Hello world, how"))
    assert deltas == ["Hello", " ", "world,", " ho"]  # "w" could start "world!"
    assert (detok.stop_reason, detok.finished) == (None, False)


def test_stop_string_inside_a_token(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["wor"])
    assert "".join(feed_one_by_one(detok, encode(tokenizer, ENGLISH))) == "Hello "
    assert detok.stop_reason == "wor"


def test_earliest_stop_string_wins(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["you", "world"])
    detok.update(encode(tokenizer, ENGLISH))
    assert (detok.output_text, detok.stop_reason) == ("Hello ", "world")


def test_include_stop_str_in_output(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["how are"], include_stop_str_in_output=True)
    deltas = feed_one_by_one(detok, encode(tokenizer, ENGLISH))
    assert deltas == ["Hello", " world", ",", " how", " are", "", ""]
    assert (detok.output_text, detok.stop_reason, detok.finished) == ("Hello world, how are", "how are", True)


def test_include_stop_str_cuts_inside_a_token(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["ld, h"], include_stop_str_in_output=True)
    feed_one_by_one(detok, encode(tokenizer, ENGLISH))
    assert detok.output_text == "Hello world, h"


def test_nothing_after_a_stop_string(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["world"])
    detok.update(encode(tokenizer, ENGLISH))
    assert detok.update(encode(tokenizer, " more")) == ""
    assert detok.flush() == ""
    assert detok.output_text == "Hello "


# ----------------------------------------------------------------- flush

def test_flush_emits_held_back_text(tokenizer):
    detok = make_detokenizer(tokenizer, stop=["you?!"])
    deltas = feed_one_by_one(detok, encode(tokenizer, ENGLISH))
    assert deltas[-2:] == [" ", ""]  # " you" and "?" could start the stop string
    assert detok.flush() == "you?"
    assert detok.output_text == ENGLISH
    assert (detok.stop_reason, detok.finished) == (None, False)


def test_flush_drops_a_dangling_partial_character(tokenizer):
    ids = encode(tokenizer, " ok 😀")
    detok = make_detokenizer(tokenizer)
    deltas = feed_one_by_one(detok, ids[:-1]) + [detok.flush()]
    assert "".join(deltas) == " ok "
    assert all("\ufffd" not in delta for delta in deltas)
