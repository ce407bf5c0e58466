"""Turns one step's logits into next tokens, vectorised over the batch.

Per step, in vLLM's order:

0. structured outputs: tokens a request's grammar does not allow next are
   set to -inf (``ops.apply_token_bitmask``, in place: the engine computed
   the masks while the forward ran);
1. logits processors (``apply_logits_processors``): logit bias, min_tokens
   masking of EOS and stop token ids, repetition penalty, presence and
   frequency penalties, llama.cpp's DRY penalty;
2. logprobs, when a request asks for them, from the processed logits;
3. greedy rows take the argmax; random rows are divided by their temperature,
   masked by llama.cpp's top-n-sigma, then top-k, llama.cpp's locally typical
   sampling, top-p (``apply_top_k_top_p``), min-p (``apply_min_p``) and
   llama.cpp's XTC (``apply_xtc``), and sampled with the exponential race
   ``argmax(probs / q)``, q ~ Exp(1). (llama.cpp divides by the temperature
   last, after the truncations: a request with ``temperature_last`` or a dynamic
   temperature, ``dynatemp_range``, gets that order; here, as in vLLM, it comes
   first otherwise, which moves what typical-p, top-p, min-p and XTC keep at
   temperatures other than 1.)
   A request with its own ``samplers`` order runs those steps alone, in that
   order (llama.cpp's chain). A mirostat row skips the truncations: after its temperature,
   ``apply_mirostat`` cuts it at the request's surprise bound
   (``Request.mirostat_mu``), and the output carries the bound after the token
   sampled, which the engine keeps.

A seeded request draws its XTC coin (when XTC is on) and its ``q`` from its own
generator (on the CPU, in that order, a full vocabulary row of ``q`` per sampled
token), so its tokens do not depend on which other requests share the batch, on
its row position, or on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampling_params import MAX_DRY_BREAKER_CHARS, SamplingParams
from models import ops

# NOTE: as in vLLM, temperatures this small are treated as greedy: dividing by
# them would overflow float32 logits to inf.
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    """The sampled token of each row and, where requested, its logprobs."""

    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none
    # Per row: the request's mirostat mu after this token (None: no mirostat, or greedy).
    mirostat_mu: list[float | None] | None = None


class Sampler:
    """Samples one token per row from logits ``[S, vocab]``.

    ``vocab_size`` is the number of real tokens (the tokenizer's size). Models
    often pad their output layer beyond it; those columns are never sampled.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size

    def replay_noise(self, request: Request, state: torch.Tensor, num_rows: int) -> None:
        """Set ``request``'s generator back to ``state``, then draw what sampling
        ``num_rows`` of its rows draws (nothing for a greedy request)."""
        assert request.generator is not None
        request.generator.set_state(state)
        params = request.sampling_params
        if not _is_greedy(params):
            for _ in range(num_rows):
                _seeded_draws(request.generator, self.vocab_size, params.xtc_active)

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 grammar_masks: tuple[list[int], torch.Tensor] | None = None) -> SamplerOutput:
        """Sample the next token of every row; ``logits`` is not modified, except that
        the constrained rows' forbidden tokens are set to -inf in place.

        logits: float32 ``[S, vocab]`` (row i belongs to ``requests[i]``; vocab
        may be >= ``vocab_size``). ``grammar_masks``: the constrained rows and
        their allowed-token bitmasks (``engine.structured``). Logprobs are the
        log-softmax of the logits after the grammar's mask, logit bias,
        min_tokens masking and penalties, but before temperature, top-k,
        top-p and min-p.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (logits.shape, len(requests))
        assert logits.shape[1] >= self.vocab_size, (logits.shape, self.vocab_size)
        logits = logits[:, : self.vocab_size].float()
        if grammar_masks is not None:
            # First, so that every later fallback (a row all -inf) stays inside the grammar.
            ops.apply_token_bitmask(logits, *grammar_masks)
        params = [r.sampling_params for r in requests]
        greedy = [_is_greedy(p) for p in params]
        needs_processing = any(_needs_processing(r) for r in requests)
        wants_logprobs = any(p.logprobs is not None for p in params)
        if all(greedy) and not needs_processing and not wants_logprobs:
            return SamplerOutput(ops.argmax(logits).tolist(), [None] * len(requests))
        mirostat_mu: list[float | None] = [None] * len(requests)

        raw_argmax = ops.argmax(logits)
        if needs_processing:
            logits = apply_logits_processors(logits, requests)
        tokens = ops.argmax(logits)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows], mus = _sample(logits[rows], [requests[i] for i in random_rows])
            for i, mu in zip(random_rows, mus):
                mirostat_mu[i] = mu
        # A row whose every token is masked (-inf) has no distribution to sample
        # from: fall back to the model's own choice rather than fail the batch.
        tokens = torch.where(torch.isfinite(logits).any(dim=-1), tokens, raw_argmax)
        token_ids = tokens.tolist()
        logprobs = _logprobs(logits, token_ids, params) if wants_logprobs else [None] * len(requests)
        return SamplerOutput(token_ids, logprobs, mirostat_mu)


# --------------------------------------------------------------------------- processors


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Return a copy of ``logits [S, V]`` with every request's processors applied.

    In order: every token but ``allowed_token_ids`` (where given) set to -inf;
    each bad word's last token set to -inf where it would complete the word;
    ``logit_bias`` added; while a request has fewer than
    ``min_tokens`` outputs, its EOS ids and ``stop_token_ids`` set to -inf;
    repetition penalty over prompt + output tokens (positive logits divided,
    negative multiplied); presence and frequency penalties over output tokens
    (``logit -= presence * (count > 0) + frequency * count``), or all three over
    the last ``repeat_last_n`` tokens of prompt + output (llama.cpp's way); DRY over the
    last ``dry_penalty_last_n`` tokens of prompt + output (``dry_penalties``).
    Token ids outside ``[0, V)`` are ignored (the server validates them against
    the tokenizer).
    """
    out = logits.clone()
    _apply_allowed(out, requests)
    _apply_bad_words(out, requests)
    _apply_logit_bias(out, requests)
    _apply_min_tokens(out, requests)
    out = _apply_repetition_penalty(out, requests)
    out = _apply_presence_frequency(out, requests)
    _apply_dry(out, requests)
    return out


def _apply_allowed(logits: torch.Tensor, requests: list[Request]) -> None:
    for i, r in enumerate(requests):
        allowed = r.sampling_params.allowed_token_ids
        if allowed is not None:
            keep = _long(tuple(allowed), logits)
            kept = logits[i, keep]
            logits[i] = float("-inf")
            logits[i, keep] = kept


def _apply_bad_words(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        out = r.output_token_ids
        for word in r.bad_words_token_ids:
            *head, last = word
            # A one-token word always; a longer one where the output ends with all but its last token.
            if last < vocab and (not head or (len(out) >= len(head) and out[len(out) - len(head):] == head)):
                logits[i, last] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[1]
    entries = [(i, tok, bias) for i, r in enumerate(requests)
               for tok, bias in r.sampling_params.logit_bias.items() if 0 <= tok < vocab]
    if entries:
        rows, toks, biases = zip(*entries)
        # (row, token) pairs are unique (dict keys), so plain indexed += is exact.
        logits[_long(rows, logits), _long(toks, logits)] += torch.tensor(biases, device=logits.device)


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[1]
    entries = [(i, tok) for i, r in enumerate(requests) if _min_tokens_active(r)
               for tok in _stop_ids(r) if 0 <= tok < vocab]
    if entries:
        rows, toks = zip(*entries)
        logits[_long(rows, logits), _long(toks, logits)] = float("-inf")


def _apply_repetition_penalty(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    penalties = [r.sampling_params.repetition_penalty for r in requests]
    if all(p == 1.0 for p in penalties):
        return logits
    tokens = [_penalised_tokens(r, r.all_token_ids) if p != 1.0 else [] for r, p in zip(requests, penalties)]
    seen = _token_counts(logits, tokens) > 0
    penalty = torch.tensor(penalties, device=logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _apply_presence_frequency(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    params = [r.sampling_params for r in requests]
    if all(p.presence_penalty == 0 and p.frequency_penalty == 0 for p in params):
        return logits
    counts = _token_counts(logits, [_penalised_tokens(r, r.output_token_ids) for r in requests])
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device).unsqueeze(1)
    return logits - presence * (counts > 0) - frequency * counts


def _apply_dry(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[1]
    entries = [(i, tok, penalty) for i, r in enumerate(requests) if r.sampling_params.dry_active
               for tok, penalty in dry_penalties(r.all_token_ids, r.sampling_params, r.dry_breakers).items()
               if tok < vocab]
    if entries:
        rows, toks, penalties = zip(*entries)
        # (row, token) pairs are unique (dict keys), so plain indexed -= is exact.
        logits[_long(rows, logits), _long(toks, logits)] -= torch.tensor(penalties, device=logits.device)


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


def _penalised_tokens(request: Request, default: list[int]) -> list[int]:
    """The tokens a penalty counts: ``default`` (vLLM's choice for that penalty) or, with
    ``repeat_last_n`` (llama.cpp's), the last that many of prompt and output."""
    n = request.sampling_params.repeat_last_n
    if n is None:
        return default
    if n == 0:
        return []
    tokens = request.all_token_ids
    return tokens[-n:] if n > 0 else tokens


def _token_counts(logits: torch.Tensor, rows: list[list[int]]) -> torch.Tensor:
    """How often each token id occurs in each row: float ``[S, V]``."""
    num_rows, vocab = logits.shape
    width = max(1, max(len(r) for r in rows))
    # Pad with an extra column V that is dropped afterwards; ids beyond the
    # sampled vocabulary land there too (they have no logit to penalise).
    ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.long)
    ids = ids.clamp_(max=vocab).to(logits.device)
    counts = torch.zeros(num_rows, vocab + 1, device=logits.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


# --------------------------------------------------------------------------- sampling


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, typical_p: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``logits [S, V]`` with -inf outside each row's top-k, typical set and nucleus.

    ``top_k [S]`` (long, 1..V) keeps the k largest logits and any tied with
    the k-th; ``typical_p [S]`` (0 < p <= 1) then keeps the locally typical
    tokens (``apply_typical_p``); ``top_p [S]`` (0 < p <= 1) then keeps the
    smallest set of most likely tokens whose probability reaches p (always at
    least one). Any may be None to skip it.
    """
    if top_p is None and typical_p is None:
        if top_k is None:
            return logits
        # No nucleus: a top-k of the largest k is enough, no full sort.
        top_values = logits.topk(int(top_k.max()), dim=-1).values
        kth = top_values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if typical_p is not None:
        sorted_logits = apply_typical_p(sorted_logits, typical_p)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # 0 for the most likely token: it always stays
        # top_p == 1 disables the nucleus; float rounding must not trim the tail then.
        threshold = torch.where(top_p >= 1, torch.full_like(top_p, float("inf")), top_p).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= threshold, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Return ``logits [S, V]`` with -inf outside each row's locally typical set (Meister
    et al.; llama.cpp's ``typ_p``): tokens in order of how far their surprise
    ``-log p`` is from the row's entropy, kept until their probability exceeds
    ``typical_p [S]`` (the token that crosses it stays; 1 keeps all)."""
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -torch.nansum(probs * log_probs, dim=-1, keepdim=True)  # 0 * -inf = nan: no mass
    distance = (-log_probs - entropy).abs()  # inf for masked tokens: they come last
    distance, by_distance = distance.sort(dim=-1)
    mass = probs.gather(1, by_distance).cumsum(dim=-1)
    # Kept: those before the first whose running mass exceeds p, and that one.
    cut = torch.where(typical_p >= 1, torch.full_like(typical_p, float("inf")), typical_p).unsqueeze(1)
    drop_sorted = (mass - probs.gather(1, by_distance)) > cut
    drop = torch.empty_like(drop_sorted).scatter_(1, by_distance, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Return ``logits [S, V]`` with -inf where prob < ``min_p [S]`` * the row's max prob."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_n_sigma(logits: torch.Tensor, top_n_sigma: torch.Tensor) -> torch.Tensor:
    """Return ``logits [S, V]`` with -inf below each row's largest logit minus ``top_n_sigma``
    standard deviations of its logits (Tang et al.; llama.cpp's ``top_n_sigma``; the
    deviation over the tokens not masked yet). A row's n <= 0 keeps all."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True)
    values = torch.where(finite, logits, torch.zeros_like(logits))
    mean = values.sum(dim=-1, keepdim=True) / count
    std = (torch.where(finite, logits - mean, torch.zeros_like(logits)).square().sum(dim=-1, keepdim=True)
           / count).sqrt()
    floor = logits.max(dim=-1, keepdim=True).values - top_n_sigma.unsqueeze(1) * std
    floor = torch.where(top_n_sigma.unsqueeze(1) > 0, floor, torch.full_like(floor, float("-inf")))
    return logits.masked_fill(logits < floor, float("-inf"))


def apply_xtc(logits: torch.Tensor, threshold: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """llama.cpp's XTC ("exclude top choices"): where ``excluded [S]`` (the row's coin came
    up), every token at least ``threshold [S]`` likely is set to -inf but the least likely
    of them, when two or more are; other rows stay as they are."""
    probs = logits.softmax(dim=-1)
    above = probs >= threshold.unsqueeze(1)
    # The least likely token above the threshold stays: the smallest probability among them.
    weakest = torch.where(above, probs, torch.full_like(probs, float("inf"))).min(dim=-1, keepdim=True).values
    drop = above & (probs > weakest) & excluded.unsqueeze(1) & (above.sum(dim=-1, keepdim=True) >= 2)
    return logits.masked_fill(drop, float("-inf"))


def _sample(logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, list[float | None]]:
    """Sample one token per row of processed ``logits [R, V]`` (non-greedy rows only);
    and each mirostat row's mu after its token (None for the others)."""
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.sampling_params for r in requests]
    coins, noise = _draws(requests, vocab, device)
    # Rows in llama.cpp's default order (or mirostat's) run together; a request's own
    # ``samplers`` order runs with the rows of the same order.
    groups: dict[tuple[str, ...] | None, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(None if p.mirostat else p.samplers, []).append(i)
    if len(groups) == 1:
        [order] = groups
        logits = _truncate(logits, params, coins, order)
    else:
        out = torch.empty_like(logits)
        for order, rows in groups.items():
            index = torch.tensor(rows, device=device)
            out[index] = _truncate(logits[index], [params[i] for i in rows],
                                   None if coins is None else [coins[i] for i in rows], order)
        logits = out
    probs = logits.softmax(dim=-1)
    # Each mirostat row's mu before this token.
    bounds = {i: r.mirostat_mu for i, r in enumerate(requests) if r.sampling_params.mirostat}
    for i, mu in bounds.items():
        assert mu is not None, "a mirostat request starts with its mu"
        probs[i] = apply_mirostat(probs[i], mu, params[i].mirostat)
    tokens = ops.argmax(probs / noise)
    mus: list[float | None] = [None] * num_rows
    for i, mu in bounds.items():
        assert mu is not None
        p, prob = params[i], float(probs[i, int(tokens[i])])
        # (A row with every token masked has no distribution: the sampler falls back to the
        # model's argmax, and mu stays.)
        mus[i] = mirostat_update(mu, prob, p.mirostat_tau, p.mirostat_eta) if prob > 0 else mu
    return tokens, mus


def _truncate(logits: torch.Tensor, params: list[SamplingParams], coins: list[float] | None,
              order: tuple[str, ...] | None) -> torch.Tensor:
    """Rows' logits after their temperature and truncations: in ``order`` (llama.cpp's
    ``samplers``, each step for every row), or with None the default order of the
    module's docstring."""
    if order is not None:
        return _truncate_in_order(logits, params, coins, order)
    vocab, device = logits.shape[1], logits.device
    # Mirostat replaces the truncations: a mirostat row is only divided by its temperature
    # here (llama.cpp's chain with mirostat: temperature, then mirostat).
    cut = [_NO_TRUNCATION if p.mirostat else p for p in params]
    # A row whose temperature comes last (llama.cpp's order, or a dynamic temperature) is
    # truncated on its logits as they are, and divided after.
    late = [c.temperature_last or c.dynatemp_range > 0 for c in cut]
    first = [1.0 if last else p.temperature for p, last in zip(params, late)]
    logits = logits / torch.tensor(first, device=device).unsqueeze(1)
    if any(c.top_n_sigma > 0 for c in cut):
        logits = apply_top_n_sigma(logits, torch.tensor([c.top_n_sigma for c in cut], device=device))
    top_k = _top_k_values(cut, vocab)
    top_p = [c.top_p for c in cut]
    typical_p = [c.typical_p for c in cut]
    logits = apply_top_k_top_p(
        logits,
        torch.tensor(top_k, device=device) if any(k < vocab for k in top_k) else None,
        torch.tensor(top_p, device=device) if any(p < 1 for p in top_p) else None,
        torch.tensor(typical_p, device=device) if any(p < 1 for p in typical_p) else None,
    )
    if any(c.min_p > 0 for c in cut):
        logits = apply_min_p(logits, torch.tensor([c.min_p for c in cut], device=device))
    if coins is not None:
        logits = _xtc(logits, params, coins)
    if any(late):
        rows = torch.tensor([i for i, last in enumerate(late) if last], device=device)
        logits[rows] = apply_temperature_last(logits[rows], [p for p, last in zip(params, late) if last])
    return logits


def _top_k_values(params: list[SamplingParams], vocab: int) -> list[int]:
    """Each row's k (its whole vocabulary where top-k is off or wider)."""
    return [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]


def _xtc(logits: torch.Tensor, params: list[SamplingParams], coins: list[float]) -> torch.Tensor:
    device = logits.device
    excluded = torch.tensor([p.xtc_active and c < p.xtc_probability for p, c in zip(params, coins)], device=device)
    return apply_xtc(logits, torch.tensor([p.xtc_threshold for p in params], device=device), excluded)


def _truncate_in_order(logits: torch.Tensor, params: list[SamplingParams], coins: list[float] | None,
                       order: tuple[str, ...]) -> torch.Tensor:
    """llama.cpp's chain of ``order``'s samplers, nothing else: a truncation the order
    leaves out is not applied whatever its value, and without ``temperature`` the logits
    are not divided (llama.cpp's ``samplers``)."""
    vocab, device = logits.shape[1], logits.device
    for step in order:
        if step == "temperature":
            logits = apply_temperature_last(logits, params)
        elif step == "top_k" and any(0 < p.top_k < vocab for p in params):
            logits = apply_top_k_top_p(logits, torch.tensor(_top_k_values(params, vocab), device=device), None)
        elif step == "top_p" and any(p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(logits, None, torch.tensor([p.top_p for p in params], device=device))
        elif step == "typ_p" and any(p.typical_p < 1 for p in params):
            logits = apply_typical_p(logits, torch.tensor([p.typical_p for p in params], device=device))
        elif step == "min_p" and any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        elif step == "top_n_sigma" and any(p.top_n_sigma > 0 for p in params):
            logits = apply_top_n_sigma(logits, torch.tensor([p.top_n_sigma for p in params], device=device))
        elif step == "xtc" and coins is not None:
            logits = _xtc(logits, params, coins)
    return logits


# What a mirostat row's truncations are: none.
_NO_TRUNCATION = SamplingParams()
# Mirostat 1 estimates the distribution's Zipf exponent from this many most likely tokens
# (llama.cpp's m, which its server fixes at 100, as the paper does).
MIROSTAT_M = 100


def apply_mirostat(probs: torch.Tensor, mu: float, version: int) -> torch.Tensor:
    """One row's probabilities ``[V]`` (after the temperature) truncated by mirostat at
    surprise bound ``mu`` and renormalised, as llama.cpp's samplers truncate.

    Version 2 keeps every token whose surprise ``-log2 p`` is at most ``mu`` (at least
    the most likely one). Version 1 keeps the ``k`` most likely, ``k`` from mu and the
    Zipf exponent ``s`` fitted (least squares through the origin) to the ratios of the
    ``MIROSTAT_M`` most likely tokens' probabilities:
    ``k = (e * 2**mu / (1 - V**-e)) ** (1 / s)``, ``e = s - 1``. Tokens of probability
    0 (masked) take no part in the fit, where llama.cpp's would read an infinite ratio;
    tokens tied with the k-th most likely all stay."""
    if version == 2:
        keep = -torch.log2(probs) <= mu
        if not bool(keep.any()):
            keep[ops.argmax(probs.unsqueeze(0))] = True
    else:
        # The fit needs the top MIROSTAT_M and the cut only the k-th largest probability:
        # a selection, not a sort of the vocabulary (0.3 ms against 4 at 49152 tokens).
        vocab = probs.shape[0]
        size = int((probs > 0).sum())
        if size == 0:
            return probs
        top = torch.topk(probs, min(MIROSTAT_M, size)).values
        k = _mirostat_k(top.double(), mu, vocab, size)
        keep = probs >= torch.kthvalue(probs, vocab - k + 1).values if k < size else probs > 0
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def _mirostat_k(top: torch.Tensor, mu: float, vocab: int, size: int) -> int:
    """Mirostat 1's number of tokens to keep (1 to ``size``) from the most likely
    probabilities ``top`` (descending, all above 0)."""
    if top.numel() < 2:
        return 1
    i = torch.arange(top.numel() - 1, dtype=torch.float64)
    t = torch.log((i + 2) / (i + 1))
    b = torch.log(top[:-1] / top[1:])
    s_hat = float((t * b).sum() / (t * t).sum())
    eps = s_hat - 1
    try:
        # At e = 0 the fraction's limit: 2**mu / ln V.
        k = (eps * 2.0 ** mu / (1 - vocab ** -eps) if eps else 2.0 ** mu / math.log(vocab)) ** (1 / s_hat)
    except (OverflowError, ZeroDivisionError):
        k = math.inf  # mu so large, or the fall so flat, that every token stays
    if isinstance(k, complex) or math.isnan(k):
        return 1
    return size if k >= size else max(int(k), 1)


def mirostat_update(mu: float, prob: float, tau: float, eta: float) -> float:
    """Mirostat's feedback: mu after sampling a token of (truncated, renormalised)
    probability ``prob``, moved by ``eta`` times its surprise's error against ``tau``."""
    return mu - eta * (-math.log2(prob) - tau)


def apply_temperature_last(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Divide each row of truncated ``logits [R, V]`` by its temperature, llama.cpp's last
    step: ``temperature``, or with ``dynatemp_range`` a temperature between
    ``temperature -/+ dynatemp_range`` (not below 0) that grows with the entropy of the
    tokens left, ``min + (max - min) * (entropy / log(count)) ** dynatemp_exponent``.
    A row of one token left is kept as it is; a temperature of 0 keeps only the largest."""
    temps = []
    finite = torch.isfinite(logits)
    counts = finite.sum(dim=-1).tolist()
    log_probs = logits.log_softmax(dim=-1)
    entropies = (-torch.nansum(log_probs.exp() * log_probs, dim=-1)).tolist()
    for p, count, entropy in zip(params, counts, entropies):
        if p.dynatemp_range <= 0:
            temps.append(p.temperature)
        elif count <= 1:
            temps.append(1.0)
        else:
            low, high = max(0.0, p.temperature - p.dynatemp_range), p.temperature + p.dynatemp_range
            temps.append(low + (high - low) * (entropy / math.log(count)) ** p.dynatemp_exponent)
    out = logits.clone()
    for i, t in enumerate(temps):
        if t > 0:
            out[i] = logits[i] / t
        else:
            out[i] = torch.where(logits[i] == logits[i].max(), logits[i], float("-inf"))
    return out


def _draws(requests: list[Request], vocab: int, device: torch.device) -> tuple[list[float] | None, torch.Tensor]:
    """Each row's XTC coin (None when no row has XTC on) and Exp(1) noise ``[R, V]``:
    a seeded row's from its own generator, coin first, others' from the shared one."""
    noise = torch.empty(len(requests), vocab, device=device)
    seeded = [i for i, r in enumerate(requests) if r.generator is not None]
    if len(seeded) < len(requests):
        noise.exponential_()
    xtc = [r.sampling_params.xtc_active for r in requests]
    coins = torch.rand(len(requests)).tolist() if any(xtc) else None
    # The loop over rows is unavoidable: each seeded request owns a generator.
    for i in seeded:
        coin, row = _seeded_draws(requests[i].generator, vocab, xtc[i])
        noise[i] = row.to(device)
        if coin is not None:
            assert coins is not None
            coins[i] = coin
    # Exp(1) can return exactly 0, and p / 0 would pick a masked token (0 / 0 = nan).
    return coins, noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _seeded_draws(generator: torch.Generator, vocab: int, xtc: bool) -> tuple[float | None, torch.Tensor]:
    """One sampled row's draws from a request's own generator (what ``replay_noise``
    redraws): its XTC coin when ``xtc``, then its Exp(1) noise."""
    coin = float(torch.rand(1, generator=generator)) if xtc else None
    return coin, torch.empty(vocab).exponential_(generator=generator)


def _logprobs(logits: torch.Tensor, token_ids: list[int],
              params: list[SamplingParams]) -> list[TokenLogprob | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = torch.tensor(rows, device=logits.device)
    entries = _entries(logits[index].log_softmax(dim=-1), [token_ids[i] for i in rows],
                       max(params[i].logprobs for i in rows))
    out: list[TokenLogprob | None] = [None] * len(params)
    for entry, i in zip(entries, rows):
        entry.top = entry.top[:params[i].logprobs]
        out[i] = entry
    return out


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int,
                    vocab_size: int) -> list[TokenLogprob]:
    """Row i's logprob of ``token_ids[i]`` (the prompt token after that position), its rank
    and its ``num_top`` best alternatives, from the model's logits alone: no logits processors
    and no grammar, which shape what is sampled, not how likely the prompt was.
    The same arithmetic as a sampled token's logprobs without processors, so a prompt
    token's entry equals what sampling it there would have reported."""
    out: list[TokenLogprob] = []
    # A chunk's rows a few at a time: a log-softmax of 2048 rows is 400 MB for SmolLM2.
    for start in range(0, len(token_ids), _PROMPT_ROWS_AT_ONCE):
        ids = token_ids[start:start + _PROMPT_ROWS_AT_ONCE]
        lp = logits[start:start + len(ids), :vocab_size].float().log_softmax(dim=-1)
        out.extend(_entries(lp, ids, num_top, with_rank=True))
    return out


def _entries(logprobs: torch.Tensor, token_ids: list[int], num_top: int,
             with_rank: bool = False) -> list[TokenLogprob]:
    """Row i of log-softmaxed ``logprobs``: its logprob of ``token_ids[i]``, the row's
    ``num_top`` best (best first) and, ``with_rank``, the token's rank in the row."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist() if with_rank else [None] * len(token_ids)
    num_top = min(num_top, logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0])
    return [TokenLogprob(token, value, [(int(t), v) for t, v in zip(ti, tv)], rank)
            for token, value, rank, tv, ti in zip(token_ids, chosen.squeeze(1).tolist(), ranks,
                                                  top_values.tolist(), top_ids.tolist())]


_PROMPT_ROWS_AT_ONCE = 256


# --------------------------------------------------------------------------- helpers


def picks_argmax(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its processed logits and nothing else is
    read from them (greedy, no logprobs). Masking such a row's disallowed tokens
    first changes nothing when its unmasked pick is allowed, so the engine masks
    it only when the pick is not (``LLMEngine._sample``)."""
    return _is_greedy(params) and params.logprobs is None


def _is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < _MIN_TEMPERATURE


def _stop_ids(request: Request) -> set[int]:
    # NOTE: like vLLM, EOS is masked for min_tokens even with ignore_eos.
    return set(request.eos_token_ids) | set(request.sampling_params.stop_token_ids)


def _min_tokens_active(request: Request) -> bool:
    return request.num_output_tokens < request.sampling_params.min_tokens


def _needs_processing(request: Request) -> bool:
    p = request.sampling_params
    return bool(p.logit_bias or p.allowed_token_ids is not None or request.bad_words_token_ids
                or (_min_tokens_active(request) and _stop_ids(request))
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.dry_active)


def _long(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
