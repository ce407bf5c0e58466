"""Logits processors: what changes a row's logits before anything is sampled or
logprobs are read (vLLM's processors and llama.cpp's penalties).

Allowed tokens, bad words, logit bias, min_tokens, the repetition, presence and
frequency penalties and DRY (``engine.dry``), in that order
(``apply_logits_processors``).
"""

from __future__ import annotations

import torch

from engine.dry import dry_penalties
from engine.request import Request


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


def _stop_ids(request: Request) -> set[int]:
    # NOTE: like vLLM, EOS is masked for min_tokens even with ignore_eos.
    return set(request.eos_token_ids) | set(request.sampling_params.stop_token_ids)


def _min_tokens_active(request: Request) -> bool:
    return request.num_output_tokens < request.sampling_params.min_tokens


def has_processors(request: Request) -> bool:
    """Whether any of ``apply_logits_processors``' steps changes this request's logits."""
    p = request.sampling_params
    return bool(p.logit_bias or p.allowed_token_ids is not None or request.bad_words_token_ids
                or (_min_tokens_active(request) and _stop_ids(request))
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.dry_active)


def _long(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
