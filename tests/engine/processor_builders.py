"""Builders shared by the input and output processor tests: a word tokenizer and a
scheduler without a model (imported by module name, as pytest puts this folder on sys.path)."""

from __future__ import annotations

import re

from engine.input_processor import InputProcessor
from engine.kv_cache_manager import KVCacheManager
from engine.lora_registry import LoRARegistry
from engine.scheduler import Scheduler, SchedulerConfig
from engine.validation import RequestLimits

# Token i's text; a word and the same word after a space are two tokens, as in BPE.
WORDS = ["<eos>", "Hello", " world", "!", " Paris", "Paris", " is", " nice", "\n", " END", "é", "x\ny", " x"]
EOS = 0


class WordTokenizer:
    """Each word of ``WORDS`` is one token (the words' order decides a tie)."""

    vocab_size = len(WORDS)
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The tokens of ``text``; ``ValueError`` on a piece no token spells."""
        pieces = re.findall(r"<eos>|x\ny| ?[A-Za-zé]+|\n|!", text)
        unknown = [p for p in pieces if p not in WORDS] or ([text] if "".join(pieces) != text else [])
        if unknown:
            raise ValueError(f"no token spells {unknown[0]!r}")
        return [WORDS.index(p) for p in pieces]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[i] for i in ids if not (skip_special_tokens and i == EOS))

    def token_bytes(self, token_id: int) -> bytes:
        return WORDS[token_id].encode()


def tokens(text: str) -> list[int]:
    """``text`` as the word tokenizer's ids."""
    return WordTokenizer().encode(text)


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_model_len: int = 64) -> Scheduler:
    """A scheduler over its own KV cache manager (no model: tests hand it the tokens)."""
    return Scheduler(SchedulerConfig(max_model_len=max_model_len), KVCacheManager(num_blocks, block_size))


class NoGrammars:
    """A grammar compiler for requests without a structured output: never called."""

    def compile(self, *args, **kwargs):
        raise AssertionError("no request here has a grammar")

    grammar = blanks = compile


def make_inputs(max_model_len: int = 32, default_length: int | None = None,
                adapters: LoRARegistry | None = None) -> InputProcessor:
    """An input processor on the word tokenizer (no adapter served unless ``adapters``)."""
    limits = RequestLimits(vocab_size=len(WORDS), max_model_len=max_model_len, default_max_tokens=default_length)
    adapters = adapters or LoRARegistry(None, "base", None, {})
    return InputProcessor(WordTokenizer(), limits, NoGrammars(), adapters, frozenset({EOS}))
