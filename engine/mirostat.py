"""Mirostat (Basu et al.; llama.cpp's versions 1 and 2): a row truncated at a surprise
bound ``mu`` that feedback moves after each token towards the target ``tau``.

The engine keeps each request's mu (``Request.mirostat_mu``); ``engine.sampler``
truncates with it and reports the updated bound.
"""

from __future__ import annotations

import math

import torch

from models import ops


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
