"""Rebuilding a GGUF file's tokenizer (its ``tokenizer.ggml.*`` vocabulary, merges or scores
and token types) as a ``tokenizers`` pipeline that splits text the way llama.cpp does:
byte-level BPE ("gpt2", by ``tokenizer.ggml.pre``) and SentencePiece-style BPE ("llama",
"gemma4"). ``models.tokenizer.Tokenizer.from_gguf_fields`` is the entry point."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

logger = logging.getLogger(__name__)


# --- GGUF: byte-level BPE ("gpt2") -------------------------------------------

# Split regexes, as llama.cpp applies them per tokenizer.ggml.pre (llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _PreType(NamedTuple):
    """How llama.cpp treats one tokenizer.ggml.pre value."""

    splitter: str  # "gpt2" | "digits" | "llama3" | "qwen2"
    ignore_merges: bool = False  # a word that is itself in the vocabulary is taken whole
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


# "gpt2" is the GPT-2 regex built into ByteLevel; "digits" first isolates every \p{N}
# character (SmolLM, StarCoder); "default" (or no key at all) gets the GPT-2 regex.
BPE_PRE_TYPES: dict[str, _PreType] = {
    **dict.fromkeys(("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), _PreType("gpt2")),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _PreType("digits")
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _PreType("llama3", ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _PreType("llama3")),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _PreType("qwen2")),
}


def _byte_level_pre_tokenizer(splitter: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if splitter == "gpt2":
        return gpt2
    if splitter == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    pattern = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[splitter]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_char().items()}


@lru_cache(maxsize=1)
def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


# llama.cpp matches these token types whole in the raw text before any splitting; the first two
# are special (skipped when decoding with skip_special_tokens), USER_DEFINED ones are plain text.
_SPECIAL_TYPES = {TokenType.CONTROL, TokenType.UNKNOWN}
_ADDED_TYPES = _SPECIAL_TYPES | {TokenType.USER_DEFINED}


def byte_level_backend(tokens: list[str], types: list[int], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    if pre not in BPE_PRE_TYPES:
        raise ValueError(f"GGUF pre-tokenizer type {pre!r} is not supported; supported: {sorted(BPE_PRE_TYPES)}")
    pre_type = BPE_PRE_TYPES[pre]
    byte_to_char = _byte_to_char()
    outside = _outside_alphabet(tuple(sorted(byte_to_char.values())))
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, types)):
        # Added tokens stay as raw text (that is how they are matched); a normal token outside
        # the byte alphabet is a converter slip, respelled so BPE can still reach it.
        if token_type not in _ADDED_TYPES and outside.search(token):
            token = "".join(byte_to_char[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(BPE(vocab, pairs, ignore_merges=pre_type.ignore_merges))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre_type.splitter)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, types)
    return backend


@lru_cache(maxsize=1)
def _outside_alphabet(alphabet: tuple[str, ...]) -> re.Pattern[str]:
    """A character not in ``alphabet`` (one search a token: half the time of a set's)."""
    return re.compile("[^" + re.escape("".join(alphabet)) + "]")


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Their text is already a vocabulary key, so tokenizers reuses the GGUF id instead of appending one.
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k in _SPECIAL_TYPES]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED]
    )


# --- GGUF: SentencePiece-style BPE ("llama") ---------------------------------


def sentencepiece_backend(
    tokens: list[str], types: list[int], scores: list[float] | None, unk_id: int | None, *, add_space_prefix: bool,
    merges: list[str] | None = None,
) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE: its merges implied by the scores, or (``merges``: Gemma 4's
    files) listed, then run, as llama.cpp does, within runs of newlines and of other text."""
    if scores is None and merges is None:
        raise ValueError("GGUF 'llama' tokenizer has no tokenizer.ggml.scores; the file is incomplete")
    vocab = {token: index for index, token in reversed(list(enumerate(tokens)))}
    unk = tokens[unk_id] if unk_id is not None else None
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges is not None
             else _merges_from_scores(tokens, types, scores or [], vocab))
    backend = tokenizers.Tokenizer(BPE(vocab, pairs, unk_token=unk, byte_fallback=True, fuse_unk=True))
    if merges is not None:
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    # llama.cpp escapes spaces as U+2581 and, with add_space_prefix, prefixes one to every text
    # fragment (also after a special token), which is what a per-segment normalizer does.
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    _add_gguf_added_tokens(backend, tokens, types)
    return backend


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Merges implied by a scored vocabulary: SentencePiece joins the pair whose result scores highest
    (ties: by the parts' ids). Every cut of every token is looked up: 1.1 s for Gemma's 262k
    tokens (513k merges), so a large vocabulary's merges are kept on disk (``_merges_file``)."""
    path = _merges_file(tokens, types, scores)
    ids = _read_merge_ids(path, len(tokens)) if path is not None else None
    if ids is None:
        normal, get = int(TokenType.NORMAL), vocab.get
        ranked: list[tuple[float, int, int]] = []
        for token, token_type, score in zip(tokens, types, scores):
            if token_type != normal:
                continue
            for cut in range(1, len(token)):
                left = get(token[:cut])
                if left is not None and (right := get(token[cut:])) is not None:
                    ranked.append((-score, left, right))
        ranked.sort()
        ids = np.array([(left, right) for _, left, right in ranked], dtype=np.int32).reshape(-1, 2)
        if path is not None:
            _write_merge_ids(path, ids)
    at = tokens.__getitem__
    return list(zip(map(at, ids[:, 0].tolist()), map(at, ids[:, 1].tolist())))


# --- The merges of a large scored vocabulary, kept on disk ---------------------

# Vocabularies from this size keep their derived merges: Gemma's 262k tokens took 1.1 s of a
# 1.8 s tokenizer build (4.5 s from start to ready for Gemma 3 270M), Llama 2's 32k 0.1 s.
MIN_CACHED_TOKENS = 65536
# NOTE: a change to what _merges_from_scores derives must change this: it names the files.
_MERGES_FORMAT = b"kvserve merges from scores 1"


def _merges_file(tokens: list[str], types: list[int], scores: list[float]) -> Path | None:
    """Where the merges of this vocabulary are kept (``$KVSERVE_TOKENIZER_CACHE``, default
    ``~/.cache/kvserve/tokenizers``; ``off``: nowhere), named by a digest of the tokens, their
    types and scores; None below ``MIN_CACHED_TOKENS``."""
    setting = os.environ.get("KVSERVE_TOKENIZER_CACHE", str(Path.home() / ".cache" / "kvserve" / "tokenizers"))
    if len(tokens) < MIN_CACHED_TOKENS or setting.lower() in ("off", "0", ""):
        return None
    digest = hashlib.sha256(_MERGES_FORMAT)
    digest.update("\0".join(tokens).encode())
    digest.update(np.asarray(types, dtype=np.int64).tobytes())
    digest.update(np.asarray(scores, dtype=np.float64).tobytes())
    return Path(setting) / f"merges-{len(tokens)}-{digest.hexdigest()[:24]}.i32"


def _read_merge_ids(path: Path, vocab_size: int) -> np.ndarray | None:
    """The kept merges, ``[n, 2]`` int32 token ids, or None (no file, or one that is not a
    whole list of ids in range: it is built again and replaced)."""
    try:
        ids = np.fromfile(path, dtype="<i4")
    except OSError:
        return None
    if ids.size % 2 or (ids.size and not (0 <= ids.min() and ids.max() < vocab_size)):
        logger.warning("ignoring the damaged merges file %s", path)
        return None
    return ids.astype(np.int32).reshape(-1, 2)


def _write_merge_ids(path: Path, ids: np.ndarray) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ids.astype("<i4").tofile(tmp)
        os.replace(tmp, path)
    except OSError as exc:  # (a read-only or full disk: the next start derives them again)
        tmp.unlink(missing_ok=True)
        logger.warning("could not keep the tokenizer's merges in %s (%s)", path, exc)
