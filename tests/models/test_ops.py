"""The fused C++ kernels (models/csrc/*.cpp) equal their plain-torch twins.

Each op runs twice on the same inputs, kernels on and off. float32 agrees to
rounding (the kernels' exp and reciprocal are polynomial, within 2e-7
relative); bfloat16 rounds where eager torch rounds, so it agrees to one
bfloat16 ulp at most. Paged decode and prefill attention are also checked
against dense attention in tests/models/test_attention.py, with the kernels
on and off.
"""

from __future__ import annotations

import pytest
import torch

from models import kv_cache, ops
from models.ops import build

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def both(fn):
    """``fn()`` with the kernels, then with the torch twins (inputs cloned for each run)."""
    try:
        ops.set_kernels_enabled(True)
        fused = fn()
        ops.set_kernels_enabled(False)
        plain = fn()
    finally:
        ops.set_kernels_enabled(True)
    return fused, plain


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_kernels_build_on_this_machine() -> None:
    # CI and `make test` run on machines with g++ and the Python headers: a
    # silent fallback to plain torch would hide a broken kernel build.
    assert ops.kernels_available(), "the kernels in models/csrc did not build; see the warning logged"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm(dtype: torch.dtype, rows: int) -> None:
    x, w = randn(rows, 576, dtype=dtype) * 3, randn(576, dtype=dtype, seed=1)

    fused, plain = both(lambda: ops.rms_norm(x, w, 1e-5))

    torch.testing.assert_close(fused, plain, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype: torch.dtype) -> None:
    x, res, w = randn(33, 576, dtype=dtype), randn(33, 576, dtype=dtype, seed=1), randn(576, dtype=dtype, seed=2)

    (n1, r1), (n2, r2) = both(lambda: ops.add_rms_norm(x, res.clone(), w, 1e-6))

    torch.testing.assert_close(r1, r2, atol=0, rtol=0)  # one rounded add, as torch
    torch.testing.assert_close(n1, n2, **TOL[dtype])
    torch.testing.assert_close(r1, res + x, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    # Wide inputs: the kernel's exp is clamped, silu saturates at both ends.
    gate_up = randn(9, 2 * 1536, dtype=dtype) * 8

    fused, plain = both(lambda: ops.silu_and_mul(gate_up))

    torch.testing.assert_close(fused, plain, **TOL[dtype])


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float16), (torch.float32, torch.int8),
                                                 (torch.bfloat16, torch.int8)])
def test_rotary_and_cache_rotates_q_k_and_fills_the_slots(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 20
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = randn(512, head_dim // 2, seed=1)
    rotations = torch.polar(torch.ones_like(angles), angles)
    positions = torch.randperm(512, generator=torch.Generator().manual_seed(2))[:tokens]
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(3))[:tokens]

    def run():
        caches = kv_cache.allocate(kv_cache.kv_layout((), 1, 0), [(kv_heads, head_dim)], 8, 16, cache_dtype)[0]
        q, k, v = ops.rotary_and_cache(qkv.clone(), rotations, positions, *caches, slots, heads, kv_heads)
        return q, k, v, caches

    (q1, k1, v1, c1), (q2, k2, v2, c2) = both(run)

    torch.testing.assert_close(q1, q2, **TOL[dtype])
    torch.testing.assert_close(k1, k2, **TOL[dtype])
    torch.testing.assert_close(v1, v2, atol=0, rtol=0)
    for a, b, new in zip(c1, c2, (k2, v2)):
        a, b = kv_cache.from_cache_rows(a, torch.float32), kv_cache.from_cache_rows(b, torch.float32)
        # int8: a key one ulp apart may round to the next code, a step of max|row| / 127.
        code_step = new.float().abs().amax().item() / 127 if cache_dtype == torch.int8 else 0.0
        torch.testing.assert_close(a, b, atol=TOL[dtype]["atol"] + code_step, rtol=TOL[dtype]["rtol"])
        # The slots hold the new rows, to within the format's rounding (float16: 2^-11 relative).
        rounding = {torch.int8: code_step / 2, torch.float16: 2.0 ** -11 * 5}.get(cache_dtype, 0.0)
        stored = a.flatten(0, 1)[slots]
        assert (stored - new.float()).abs().max() <= TOL[dtype]["atol"] + rounding
    assert torch.count_nonzero(c1[0].flatten(0, 1).abs().sum((1, 2))) == tokens


def paged_caches(lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                 cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches in ``cache_dtype`` and shuffled block tables for contexts of ``lens`` tokens
    (a few spare blocks that no table names)."""
    nblocks = [kv_cache.cdiv(n, block_size) for n in lens]
    pool = torch.randperm(sum(nblocks) + 3, generator=torch.Generator().manual_seed(0))
    tables = torch.zeros(len(lens), max(nblocks), dtype=torch.long)
    start = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = pool[start:start + n]
        start += n
    k_cache = kv_cache.to_cache_rows(randn(len(pool), block_size, kv_heads, head_dim, seed=1), cache_dtype)
    v_cache = kv_cache.to_cache_rows(randn(len(pool), block_size, kv_heads, head_dim, seed=2), cache_dtype)
    return tables, k_cache, v_cache


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float16), (torch.float32, torch.int8),
                                                 (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("group", [1, 2, 3, 6, 8])  # passes of up to 4 (64), 2 or 4 (128) heads
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])  # 64, 128: unrolled; 80: 16-wide rows; 40: scalar
def test_decode_attention_reads_the_pages_in_place(dtype: torch.dtype, cache_dtype: torch.dtype, group: int,
                                                   block_size: int, head_dim: int) -> None:
    kv_heads = 2
    lens = [1, 17, 300, 64]
    tables, k_cache, v_cache = paged_caches(lens, block_size, kv_heads, head_dim, cache_dtype)
    # Queries as the model passes them: a strided view into the fused qkv rows.
    qkv = randn(len(lens), (group * kv_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, :group * kv_heads * head_dim].view(len(lens), group * kv_heads, head_dim)
    context_lens = torch.tensor(lens)

    fused, plain = both(lambda: ops.decode_attention(q, k_cache, v_cache, tables, context_lens,
                                                     max(lens), head_dim ** -0.5))

    torch.testing.assert_close(fused, plain, **TOL[dtype])


@pytest.mark.skipif(not ops.kernels_available(), reason="compares the kernels' passes with each other")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_kv_heads_query_heads_get_the_bits_each_gets_alone(cache_dtype: torch.dtype, head_dim: int) -> None:
    # However many heads one pass over a KV head's rows takes (kMaxGroup, or AVX2's wide passes
    # at head size 128: 6 = 4 + 2), each head's scores and sums are its own, in one order.
    group, kv_heads, lens = 6, 2, [1, 17, 300]
    tables, k_cache, v_cache = paged_caches(lens, 16, kv_heads, head_dim, cache_dtype)
    q = randn(len(lens), group * kv_heads, head_dim, seed=3)
    context_lens = torch.tensor(lens)
    together = ops.decode_attention(q, k_cache, v_cache, tables, context_lens, max(lens), head_dim ** -0.5)
    for h in range(group * kv_heads):
        kv = h // group
        k1, v1 = (c[:, :, kv:kv + 1].contiguous() for c in (k_cache, v_cache))
        alone = ops.decode_attention(q[:, h:h + 1].contiguous(), k1, v1, tables, context_lens, max(lens),
                                     head_dim ** -0.5)
        assert torch.equal(alone[:, 0], together[:, h]), h


@pytest.mark.skipif(not ops.kernels_available(), reason="compares the kernels on two layouts")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_major_and_token_major_caches_give_the_same_bits(cache_dtype: torch.dtype, head_dim: int) -> None:
    # kv_cache.allocate packs a block head-major; a contiguous cache is token-major. The
    # kernels write and read both, each token's rows and arithmetic the same.
    block_size, kv_heads, group, lens = 16, 2, 3, [1, 17, 300]
    tables, token_k, token_v = paged_caches(lens, block_size, kv_heads, head_dim, cache_dtype)
    head_k, head_v = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (token_k, token_v))
    assert kv_cache.paged_layout(head_k) and head_k.stride(1) == head_k.shape[3] and token_k.is_contiguous()
    layouts = ((token_k, token_v), (head_k, head_v))
    # This step's rows, written by rotary_and_cache into the last 5 places of the contexts of
    # 17 and 300 tokens.
    qkv = randn(10, (group * kv_heads + 2 * kv_heads) * head_dim, seed=3)
    angles = randn(512, head_dim // 2, seed=4)
    rotations = torch.polar(torch.ones_like(angles), angles)
    places = torch.cat([torch.arange(n - 5, n) for n in lens[1:]])
    slots = tables[torch.tensor([1, 2]).repeat_interleave(5), places // block_size] * block_size + places % block_size
    rotated = [ops.rotary_and_cache(qkv.clone(), rotations, places, k, v, slots, group * kv_heads, kv_heads)[0]
               for k, v in layouts]
    assert torch.equal(*rotated)
    for a, b in zip(layouts[0], layouts[1]):
        assert torch.equal(a, b)  # (the same values in each place, whatever the strides)
    q = randn(len(lens), group * kv_heads, head_dim, seed=5)
    context_lens = torch.tensor(lens)
    decoded = [ops.decode_attention(q, k, v, tables, context_lens, max(lens), head_dim ** -0.5) for k, v in layouts]
    assert torch.equal(*decoded)
    qp = rotated[0]  # (the 10 tokens as prompt chunks after cached prefixes)
    prefilled = [ops.prefill_attention(qp, qp[:, :kv_heads], qp[:, :kv_heads], k, v, tables[1:], [5, 5], lens[1:],
                                       head_dim ** -0.5) for k, v in layouts]
    assert torch.equal(*prefilled)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float16), (torch.float32, torch.int8)])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 64, 128: 16-wide rows; 40: scalar
def test_prefill_attention_reads_the_pages_in_place(dtype: torch.dtype, cache_dtype: torch.dtype, group: int,
                                                    block_size: int, head_dim: int) -> None:
    kv_heads = 2
    # (query tokens, context): fresh prompts of 1, 16 (one query tile) and 37 tokens, a
    # one-token chunk, chunks after short and long cached prefixes (partial tiles).
    seqs = [(1, 1), (16, 16), (37, 37), (1, 9), (70, 100), (20, 300)]
    tables, k_cache, v_cache = paged_caches([ctx for _, ctx in seqs], block_size, kv_heads, head_dim, cache_dtype)
    # This step's K/V as the layer hands them over: what it has just written to the caches.
    slots = torch.cat([tables[i, torch.arange(ctx - n, ctx) // block_size] * block_size
                       + torch.arange(ctx - n, ctx) % block_size for i, (n, ctx) in enumerate(seqs)])
    k, v = (kv_cache.from_cache_rows(c.flatten(0, 1)[slots], dtype) for c in (k_cache, v_cache))
    tokens = sum(n for n, _ in seqs)
    qkv = randn(tokens, (group * kv_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, :group * kv_heads * head_dim].view(tokens, group * kv_heads, head_dim)

    fused, plain = both(lambda: ops.prefill_attention(q, k, v, k_cache, v_cache, tables, [n for n, _ in seqs],
                                                      [ctx for _, ctx in seqs], head_dim ** -0.5))

    torch.testing.assert_close(fused, plain, **TOL[dtype])


def test_prefill_attention_rejects_a_block_id_outside_the_cache() -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    q = torch.zeros(3, 1, 8)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        ops.prefill_attention(q, q[:, :1], q[:, :1], k_cache, k_cache, torch.tensor([[9]]), [3], [5], 1.0)


def test_decode_attention_rejects_a_block_id_outside_the_cache() -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        ops.decode_attention(q, k_cache, k_cache, torch.tensor([[9]]), torch.tensor([5]), 5, 1.0)


def greedy_with_logits(runner, ids: list[int], steps: int = 24) -> tuple[list[int], torch.Tensor]:
    """Prefill ``ids``, then ``steps - 1`` greedy decodes: the tokens and each step's last logits."""
    seq = runner.new_seq(len(ids) + steps)
    logits = [runner.step([(seq, ids)])[0][-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(runner.step([(seq, tokens[-1:])])[0][-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.slow
def test_default_model_decodes_the_same_tokens_with_and_without_kernels(smollm2, make_runner) -> None:
    ids = smollm2.tokenizer.encode("The three primary colours are")

    (t1, l1), (t2, l2) = both(lambda: greedy_with_logits(make_runner(smollm2.model), ids))

    assert t1 == t2
    diff = (l1 - l2).abs().max().item()
    assert diff < 1e-3, f"max |logits diff| kernels vs torch: {diff:.2e}"


# A float16 cache rounds each value to 11 bits; int8 to 8 bits of its row's
# max|x| (llama.cpp's q8_0 cache keeps a scale per 32 values, kvserve per row).
# Measured on the prompts below, teacher-forced, against a float32 cache:
# float16 moves the logits by at most 0.03, int8 by 0.7-1.1 (of a +-20 range).
KV_LOGIT_TOLERANCE = {torch.float16: 0.25, torch.int8: 1.75}
KV_PROMPTS = ["The three primary colours are", "def fibonacci(n):", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def float32_cache_runs(smollm2, make_runner) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Each of ``KV_PROMPTS``' ids, its 24 greedy tokens and their logits on a float32 cache
    (made once for both narrow caches)."""
    runs = []
    for prompt in KV_PROMPTS:
        ids = smollm2.tokenizer.encode(prompt)
        runs.append((ids, *greedy_with_logits(make_runner(smollm2.model, kv_dtype=torch.float32), ids, 24)))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8])
def test_narrow_kv_caches_keep_the_default_model_close(smollm2, make_runner, float32_cache_runs,
                                                         cache_dtype) -> None:
    """``--kv-cache-dtype float16`` / ``int8`` for float32 activations against a float32 cache."""
    worst, disagreements = 0.0, []
    for (ids, tokens, ref_logits), prompt in zip(float32_cache_runs, KV_PROMPTS):
        # Teacher-forced: the narrow cache sees the float32 run's tokens, so every step compares.
        narrow = make_runner(smollm2.model, kv_dtype=cache_dtype)
        seq_n = narrow.new_seq(len(ids) + 24)
        last_n = narrow.step([(seq_n, ids)])[0][-1]
        for step, tok in enumerate(tokens):
            last_r = ref_logits[step]
            worst = max(worst, (last_r - last_n).abs().max().item())
            if int(last_n.argmax()) != tok:
                best_two = last_r.topk(2).values
                disagreements.append((prompt, step, round((best_two[0] - best_two[1]).item(), 4)))
            last_n = narrow.step([(seq_n, [tok])])[0][-1]

    print(f"{cache_dtype} vs float32 KV cache: max |logits diff| {worst:.3f}; disagreements {disagreements}")
    assert worst < KV_LOGIT_TOLERANCE[cache_dtype], f"a {cache_dtype} KV cache moves the logits by {worst:.3f}"
    assert all(margin < 0.1 for *_, margin in disagreements), disagreements


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch) -> None:
    # A process killed mid-build leaves torch's lock file; torch would wait on it forever.
    import os
    import time

    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    stale = tmp_path / "old" / "lock"
    stale.parent.mkdir()
    stale.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = tmp_path / "building" / "lock"
    fresh.parent.mkdir()
    fresh.touch()

    assert build._build_directory("old") == stale.parent
    assert build._build_directory("building") == fresh.parent

    assert not stale.exists()
    assert fresh.exists()


@pytest.mark.parametrize("width", [1, 15, 16, 31, 32, 33, 100, 49152])
def test_argmax_takes_the_first_largest_value_as_torch_does(width: int) -> None:
    x = randn(9, width + 3)[:, :width]  # rows strided, as the sampler's slice of a padded head
    x[0] = 1.0  # all tied: the first
    x[1, width // 2] = float("nan")  # NaN beats every number
    x[2, -1] = x[2, 0] = float("inf")
    x[3] = float("-inf")
    if width > 3:
        x[4, 2] = x[4, 3] = float("nan")  # two NaNs: the first
        x[5, width - 2] = x[5, width - 1] = 99.0  # a tie in the tail
    x[6, width - 1] = 99.0  # the last index

    fused, plain = both(lambda: ops.argmax(x))

    assert fused.dtype == torch.long
    assert torch.equal(fused, plain), (fused, plain)


@pytest.mark.parametrize("width", [1, 31, 32, 33, 100, 49152])
def test_token_bitmask_forbids_exactly_the_cleared_bits(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    words = (width + 31) // 32
    masks = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    masks[0] = -1  # everything allowed: the row is untouched
    masks[1, 0] = 0  # a forbidden word
    logits = randn(5, width + 7)[:, :width]  # rows strided, as the sampler's slice

    def masked():
        out = logits.clone()
        ops.apply_token_bitmask(out, [4, 0, 2], masks)
        return out

    fused, plain = both(masked)

    assert torch.equal(fused, plain)
    bits = ((masks.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).view(3, -1)[:, :width].bool()
    for i, row in enumerate([4, 0, 2]):
        assert torch.equal(torch.isinf(fused[row]), ~bits[i])
        assert torch.equal(fused[row][bits[i]], logits[row][bits[i]])
    for row in (1, 3):  # rows without a mask
        assert torch.equal(fused[row], logits[row])
