"""The truncations and temperatures a random row's logits go through before it is
sampled: vLLM's top-k, top-p and min-p, and llama.cpp's locally typical sampling,
top-n-sigma, XTC and its last-step (or dynamic) temperature.

Each works on a batch of rows ``[S, V]`` and sets what it drops to -inf; which rows
get which, and in what order, is ``engine.sampler``'s business.
"""

from __future__ import annotations

import math

import torch

from engine.sampling_params import SamplingParams


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
