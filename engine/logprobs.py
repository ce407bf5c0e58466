"""Logprobs of sampled and prompt tokens: the chosen token's, its rank and the
row's best alternatives (``TokenLogprob``)."""

from __future__ import annotations

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


def sampled_logprobs(logits: torch.Tensor, token_ids: list[int],
                     params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Each row's logprob entry for its sampled token ``token_ids[i]`` (its ``logprobs``
    best alternatives), from the processed ``logits [S, V]``; None where the request asked for none."""
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
