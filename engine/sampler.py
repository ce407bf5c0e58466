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

from dataclasses import dataclass

import torch

from engine.dry import dry_breakers
from engine.logits_processors import apply_logits_processors, has_processors
from engine.logprobs import prompt_logprobs, sampled_logprobs
from engine.mirostat import apply_mirostat, mirostat_update
from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.truncation import (apply_min_p, apply_temperature_last, apply_top_k_top_p, apply_top_n_sigma,
                               apply_typical_p, apply_xtc)
from models import ops

# The sampler's API; dry_breakers and prompt_logprobs live in engine.dry and engine.logprobs,
# and are named here too because the engine imports them from this module.
__all__ = ["Sampler", "SamplerOutput", "dry_breakers", "picks_argmax", "prompt_logprobs"]

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
        needs_processing = any(has_processors(r) for r in requests)
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
        logprobs = sampled_logprobs(logits, token_ids, params) if wants_logprobs else [None] * len(requests)
        return SamplerOutput(token_ids, logprobs, mirostat_mu)


# --------------------------------------------------------------------------- sampling


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


# --------------------------------------------------------------------------- helpers


def picks_argmax(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its processed logits and nothing else is
    read from them (greedy, no logprobs). Masking such a row's disallowed tokens
    first changes nothing when its unmasked pick is allowed, so the engine masks
    it only when the pick is not (``LLMEngine._sample``)."""
    return _is_greedy(params) and params.logprobs is None


def _is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < _MIN_TEMPERATURE
