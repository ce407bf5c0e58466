"""llama.cpp's DRY ("don't repeat yourself") penalty: which tokens break a repeat, and
what each next token's logit loses for lengthening one.

``dry_breakers`` runs once per request (the engine keeps its result on the request);
``dry_penalties`` runs per row and step, from ``engine.logits_processors``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from engine.sampling_params import MAX_DRY_BREAKER_CHARS, SamplingParams


# A breaker's head token -> the tokens that must follow it to complete the breaker (none:
# the head holds a whole breaker). Built by ``dry_breakers``.
DryBreakers = Mapping[int, tuple[tuple[int, ...], ...]]
# As llama.cpp: a breaker's tail is cut to this many tokens, which keeps the scan linear.
_MAX_DRY_TAIL_TOKENS = 20
# log(float32 max): base ** exponent stays finite below this exponent of e.
_FLOAT_MAX_LOG = 88.7228391


def dry_breakers(vocab_bytes: Sequence[bytes], encode: Callable[[str], list[int]],
                 breakers: Sequence[str]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Which tokens end a repeat for DRY, as llama.cpp finds them: a token whose text
    holds a breaker is a breaker alone; a token whose text ends with the start of one
    is a breaker's head, followed by the rest of the breaker as ``encode`` tokenizes it.

    ``vocab_bytes[t]`` is token t's text as bytes (special tokens included)."""
    found: dict[int, dict[tuple[int, ...], None]] = {}
    for breaker in breakers:
        text = breaker[:MAX_DRY_BREAKER_CHARS].encode("utf-8")
        first = text[:1]
        for token, word in enumerate(vocab_bytes):
            if text in word:
                found.setdefault(token, {})[()] = None
                continue
            # Where the token's text ends with a proper prefix of the breaker.
            pos = word.find(first, max(0, len(word) - len(text) + 1))
            while pos != -1:
                if text.startswith(word[pos:]):
                    rest = text[len(word) - pos:].decode("utf-8", errors="ignore")
                    tail = tuple(encode(rest)[:_MAX_DRY_TAIL_TOKENS]) if rest else ()
                    if tail:
                        found.setdefault(token, {})[tail] = None
                pos = word.find(first, pos + 1)
    return {token: tuple(tails) for token, tails in found.items()}


def dry_penalties(tokens: Sequence[int], params: SamplingParams, breakers: DryBreakers) -> dict[int, float]:
    """llama.cpp's DRY ("don't repeat yourself") for one row: token -> what its logit loses.

    Over the last ``dry_penalty_last_n`` of ``tokens`` (-1: all), for each earlier place
    where the context's end repeats (the longest run of tokens ending there that equals
    the run ending the context, cut at the last breaker), the token that followed that
    place would lengthen the repeat: if the run is at least ``dry_allowed_length`` long,
    that token loses ``dry_multiplier * dry_base ** (run - dry_allowed_length)`` (the
    longest run it would lengthen counts). A token that is a breaker alone never loses.
    """
    if not params.dry_active:
        return {}
    allowed = params.dry_allowed_length
    window = len(tokens) if params.dry_penalty_last_n == -1 else min(len(tokens), params.dry_penalty_last_n)
    if window <= allowed:
        return {}
    ctx = list(tokens[len(tokens) - window:])
    # A repeat reaches back no further than the end of the last breaker in the context.
    limit = window
    for back in range(window):
        tails = breakers.get(ctx[window - 1 - back])
        if tails is None:
            continue
        fits = [len(t) for t in tails if len(t) <= back and tuple(ctx[window - back:window - back + len(t)]) == t]
        if fits:
            limit = back - max(fits)
            break
    if limit < allowed:
        return {}
    # The Z-function of the context read backwards: z[k], how many tokens ending k places
    # before the end equal the tokens ending the context. Linear, however long the repeats.
    rev = ctx[::-1]
    z = [0] * window
    left = right = 0
    for k in range(1, window):
        n = min(right - k, z[k - left]) if k < right else 0
        while k + n < window and rev[n] == rev[k + n]:
            n += 1
        z[k] = n
        if k + n > right:
            left, right = k, k + n
    # The token after each such run would lengthen it (rev[k - 1] follows the run at k).
    longest: dict[int, int] = {}
    for k in range(1, window):
        run = min(z[k], limit)
        if run >= allowed:
            follower = rev[k - 1]
            if run > longest.get(follower, 0):
                longest[follower] = run
    max_exponent = int(_FLOAT_MAX_LOG / math.log(params.dry_base)) if params.dry_base > 1.000001 else 0
    out: dict[int, float] = {}
    for token, length in longest.items():
        if () in breakers.get(token, ()):
            continue
        exponent = length - allowed
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        out[token] = params.dry_multiplier * params.dry_base ** exponent
    return out
