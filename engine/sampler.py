"""Turns one step's logits into next tokens, vectorised over the batch.

Per step, in vLLM's order:

0. structured outputs: tokens a request's grammar does not allow next are
   set to -inf (``ops.apply_token_bitmask``, in place: the engine computed
   the masks while the forward ran);
1. logits processors (``apply_logits_processors``): logit bias, min_tokens
   masking of EOS and stop token ids, repetition penalty, presence and
   frequency penalties;
2. logprobs, when a request asks for them, from the processed logits;
3. greedy rows take the argmax; random rows are divided by their temperature,
   masked by top-k, top-p and min-p (``apply_top_k_top_p``, ``apply_min_p``)
   and sampled with the exponential race ``argmax(probs / q)``, q ~ Exp(1).

A seeded request draws its ``q`` from its own generator (on the CPU, a full
vocabulary row per step), so its tokens do not depend on which other requests
share the batch, on its row position, or on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParams
from models import ops

# NOTE: as in vLLM, temperatures this small are treated as greedy: dividing by
# them would overflow float32 logits to inf.
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    """The sampled token of each row and, where requested, its logprobs."""

    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none


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
        if not _is_greedy(request.sampling_params):
            for _ in range(num_rows):
                _seeded_noise(request.generator, self.vocab_size)

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

        raw_argmax = ops.argmax(logits)
        if needs_processing:
            logits = apply_logits_processors(logits, requests)
        tokens = ops.argmax(logits)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = _sample(logits[rows], [requests[i] for i in random_rows])
        # A row whose every token is masked (-inf) has no distribution to sample
        # from: fall back to the model's own choice rather than fail the batch.
        tokens = torch.where(torch.isfinite(logits).any(dim=-1), tokens, raw_argmax)
        token_ids = tokens.tolist()
        logprobs = _logprobs(logits, token_ids, params) if wants_logprobs else [None] * len(requests)
        return SamplerOutput(token_ids, logprobs)


# --------------------------------------------------------------------------- processors


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Return a copy of ``logits [S, V]`` with every request's processors applied.

    In order: every token but ``allowed_token_ids`` (where given) set to -inf;
    each bad word's last token set to -inf where it would complete the word;
    ``logit_bias`` added; while a request has fewer than
    ``min_tokens`` outputs, its EOS ids and ``stop_token_ids`` set to -inf;
    repetition penalty over prompt + output tokens (positive logits divided,
    negative multiplied); presence and frequency penalties over output tokens
    (``logit -= presence * (count > 0) + frequency * count``). Token ids
    outside ``[0, V)`` are ignored (the server validates them against the
    tokenizer).
    """
    out = logits.clone()
    _apply_allowed(out, requests)
    _apply_bad_words(out, requests)
    _apply_logit_bias(out, requests)
    _apply_min_tokens(out, requests)
    out = _apply_repetition_penalty(out, requests)
    return _apply_presence_frequency(out, requests)


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
    tokens = [r.all_token_ids if p != 1.0 else [] for r, p in zip(requests, penalties)]
    seen = _token_counts(logits, tokens) > 0
    penalty = torch.tensor(penalties, device=logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _apply_presence_frequency(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    params = [r.sampling_params for r in requests]
    if all(p.presence_penalty == 0 and p.frequency_penalty == 0 for p in params):
        return logits
    counts = _token_counts(logits, [r.output_token_ids for r in requests])
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device).unsqueeze(1)
    return logits - presence * (counts > 0) - frequency * counts


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
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Return ``logits [S, V]`` with -inf outside each row's top-k and nucleus.

    ``top_k [S]`` (long, 1..V) keeps the k largest logits and any tied with
    the k-th; ``top_p [S]`` (0 < p <= 1) then keeps the smallest set of most
    likely tokens whose probability reaches p (always at least one). Either
    may be None to skip it.
    """
    if top_p is None:
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
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # 0 for the most likely token: it always stays
    # top_p == 1 disables the nucleus; float rounding must not trim the tail then.
    threshold = torch.where(top_p >= 1, torch.full_like(top_p, float("inf")), top_p).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before >= threshold, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Return ``logits [S, V]`` with -inf where prob < ``min_p [S]`` * the row's max prob."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Sample one token per row of processed ``logits [R, V]`` (non-greedy rows only)."""
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.sampling_params for r in requests]
    logits = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    logits = apply_top_k_top_p(
        logits,
        torch.tensor(top_k, device=device) if any(k < vocab for k in top_k) else None,
        torch.tensor(top_p, device=device) if any(p < 1 for p in top_p) else None,
    )
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    probs = logits.softmax(dim=-1)
    return ops.argmax(probs / _exponential_noise(requests, vocab, device))


def _exponential_noise(requests: list[Request], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise ``[R, V]``: seeded rows from their own generator, others shared."""
    noise = torch.empty(len(requests), vocab, device=device)
    seeded = [i for i, r in enumerate(requests) if r.generator is not None]
    if len(seeded) < len(requests):
        noise.exponential_()
    # The loop over rows is unavoidable: each seeded request owns a generator.
    for i in seeded:
        noise[i] = _seeded_noise(requests[i].generator, vocab).to(device)
    # Exp(1) can return exactly 0, and p / 0 would pick a masked token (0 / 0 = nan).
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _seeded_noise(generator: torch.Generator, vocab: int) -> torch.Tensor:
    """One row's Exp(1) noise from a request's own generator (what ``replay_noise`` redraws)."""
    return torch.empty(vocab).exponential_(generator=generator)


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
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)


def _long(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
