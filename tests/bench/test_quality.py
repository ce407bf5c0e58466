"""bench.quality's arithmetic and parsing (the real run loads every path; `python -m bench.quality`)."""

from __future__ import annotations

import math

import pytest
import torch

from bench import quality

CTX = 8


def test_windows_are_whole_and_back_to_back():
    assert quality.windows(list(range(20)), CTX) == [list(range(8)), list(range(8, 16))]


def test_the_text_is_long_enough():
    words = quality.TEXT.read_text().split()
    assert len(words) > 3000  # at least 4k tokens for any BPE vocabulary of this size


def fake_paths(monkeypatch, logits_by_path):
    def fake(path, chunks, ctx):
        for _ in chunks:
            yield torch.log_softmax(logits_by_path[path], dim=-1)
    monkeypatch.setattr(quality, "path_logprobs", fake)


def test_measure_compares_each_path_with_the_first(monkeypatch):
    ref, same, other = ("float32", "none", "float32"), ("a", "b", "c"), ("x", "y", "z")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(CTX // 2 - 1, 10, generator=gen)
    flipped = base.clone()
    flipped[0] = -flipped[0]  # one position's top token changes
    fake_paths(monkeypatch, {ref: base, same: base, other: flipped})
    chunks = [list(range(CTX)), list(range(CTX))]

    rows = quality.measure(chunks, CTX, [ref, same, other])

    assert [r.tokens for r in rows] == [2 * (CTX // 2 - 1)] * 3
    assert rows[0].mean_kld is None
    assert rows[1].mean_kld == 0 and rows[1].same_top == 1
    assert rows[2].mean_kld > 0 and rows[2].p99_kld >= rows[2].mean_kld
    assert rows[2].same_top == pytest.approx(1 - 2 / rows[2].tokens)
    # Perplexity: exp of the mean NLL of each window's next tokens (positions ctx/2 + 1 ..).
    logp = torch.log_softmax(base, dim=-1)
    targets = torch.tensor(chunks[0][CTX // 2 + 1:])
    nll = -logp.gather(1, targets[:, None]).mean().item()
    assert rows[0].perplexity == pytest.approx(math.exp(nll), rel=1e-6)


def test_llama_perplexity_figures_are_read_from_its_output():
    out = ("kl_divergence: computing over 11 chunks, n_ctx=512, batch_size=512, n_seq=1\n"
           "Mean PPL(Q)                   :  17.123456 ±   0.400000\n"
           "Mean    KLD:   0.051234 ±   0.001000\n"
           "99.0%   KLD:   0.401000\n"
           "Same top p: 91.234 ± 0.500 %\n")
    assert quality._number(r"over (\d+) chunks", out) == 11
    assert quality._number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", out) == 17.123456
    assert quality._number(r"Mean\s+KLD:\s*([0-9.]+)", out) == 0.051234
    assert quality._number(r"99\.0%\s+KLD:\s*([0-9.]+)", out) == 0.401
    assert quality._number(r"Same top p:\s*([0-9.]+)", out) == 91.234
    with pytest.raises(RuntimeError, match="printed no"):
        quality._number(r"Final estimate: PPL = ([0-9.]+)", out)
