"""The batch-invariant dense GEMM (``ops.dense_linear``, csrc/dense_gemm.cpp) behind ``--quantization none``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import ops
from models.dense import PackedLinear, pack_dense

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="needs the fused CPU kernels")

# SmolLM2's projection shapes (out, in) and one with a partial last tile.
SHAPES = [(960, 576), (576, 1536), (3072, 576), (40, 96)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_linear_is_the_matmul(dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(37, k, generator=gen).to(dtype)

    got = ops.dense_linear(x, pack_dense(w), n)

    assert got.dtype == dtype and got.shape == (37, n)
    want = x.double() @ w.double().t()
    # float32 sums: rounding only; bfloat16 output: one rounding to 8 bits.
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_a_rows_result_does_not_depend_on_the_batch(dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(1)
    packed = pack_dense(torch.randn(n, k, generator=gen).to(dtype))
    x = torch.randn(300, k, generator=gen).to(dtype)
    alone = torch.cat([ops.dense_linear(x[i:i + 1], packed, n) for i in range(x.shape[0])])

    for rows in (2, 5, 7, 16, 48, 49, 100, 300):
        assert torch.equal(ops.dense_linear(x[:rows], packed, n), alone[:rows]), f"{rows} rows"
    # Also where a row sits in the batch: the last 7 rows on their own.
    assert torch.equal(ops.dense_linear(x[-7:], packed, n), alone[-7:])


@pytest.mark.parametrize("out_features", [64, 80, 32, 16])
def test_a_small_projection_is_shared_out_and_each_tile_keeps_its_bits(out_features):
    # (a router's few tiles go out in claims of fewer tiles, their number set by the threads:
    # a tile's products are the same in any claim, and alone or beside another)
    gen = torch.Generator().manual_seed(out_features)
    packed = pack_dense(torch.randn(out_features, 2048, generator=gen))
    x = torch.randn(3, 2048, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            results.append(ops.dense_linear(x, packed, out_features))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    torch.testing.assert_close(results[0], x @ packed_weight(packed, out_features).t(), atol=1e-3, rtol=1e-5)


def packed_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_dense's [N/16, K, 16] back to [N, K]."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:out_features]


def test_mkl_is_not_batch_invariant_here_which_is_why_none_packs():
    # Documents the reason for dense_gemm.cpp; if torch's GEMM ever becomes
    # invariant on these shapes this fails and the packing can be reconsidered.
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(576, 576, generator=gen)
    x = torch.randn(64, 576, generator=gen)
    alone = torch.cat([nn.functional.linear(x[i:i + 1], w) for i in range(64)])
    assert not torch.equal(nn.functional.linear(x, w), alone)


def test_packed_linear_matches_nn_linear_with_bias():
    gen = torch.Generator().manual_seed(3)
    dense = nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(40, 96, generator=gen))
        dense.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(9, 96, generator=gen)

    torch.testing.assert_close(PackedLinear(dense)(x), dense(x), atol=1e-4, rtol=1e-5)


def test_packed_linear_refuses_float16():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinear(nn.Linear(32, 16).half())
