"""A mixture's experts in one call a projection (``models.experts.FusedExperts``): for SiLU and
Gemma's GELU experts of a GGUF's codes on the int8-activation GEMMs, every (token, choice)
slot's output equals the one-call-an-expert path's bit for bit, for one token and for many,
in float32 and bfloat16; experts it cannot hold as one weight run one call each."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from models import ops
from models.config import ModelConfig
from models.experts import FusedExperts, _grouped, mix_experts
from models.gemma import GemmaMLP
from models.gguf_native import a8_projection
from models.gguf_quants import random_blocks
from models.gguf_reader import GGUFTensor
from models.llama import MLP

pytestmark = pytest.mark.skipif(not (ops.kernels_available() and ops.has_int8_dots()),
                                reason="the int8-activation GEMMs are C++ kernels with integer dots")

HIDDEN, SIZE, EXPERTS, TOP = 512, 256, 12, 4
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=HIDDEN, intermediate_size=SIZE,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                     max_position_embeddings=64)


def projection(type_name: str, shape: tuple[int, int], seed: int) -> nn.Module:
    n, k = shape
    raw = random_blocks(type_name, shape, seed, one_scale=True)
    return a8_projection(None, [GGUFTensor("t", int(GGMLQuantizationType[type_name]), (k, n), raw)], [None])


def experts_of(kind: type, gate_up: str = "Q4_K", down: str = "Q6_K") -> nn.ModuleList:
    with torch.device("meta"):
        experts = nn.ModuleList(kind(CONFIG) for _ in range(EXPERTS))
    for e, expert in enumerate(experts):
        expert.gate_up_proj = projection(gate_up, (2 * SIZE, HIDDEN), 2 * e)
        expert.down_proj = projection(down, (HIDDEN, SIZE), 2 * e + 1)
    return experts


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP] for _ in range(tokens)])
    return torch.rand(tokens, TOP, generator=gen), chosen


@pytest.mark.parametrize("kind", [MLP, GemmaMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q4_0", "Q8_0"), ("Q5_1", "Q4_1")])
def test_experts_in_one_call_are_each_experts_own_call(kind: type, dtype: torch.dtype, types: tuple[str, str]) -> None:
    # (Q4_0 and Q8_0: D4, D8; Q5_1 and Q4_1: A5, A4, with an offset per 32)
    experts = experts_of(kind, *types)
    fused = FusedExperts.of(experts)
    assert fused is not None and fused.activate is kind.activate
    # (the kernels run the activation: mix_experts below is one ops.moe_experts call in float32)
    assert fused.activation.kind == {MLP: ops.ExpertActivation.SILU_GLU,
                                     GemmaMLP: ops.ExpertActivation.GELU_TANH_GLU}[kind]
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        weights, chosen = routing(tokens, tokens)
        ordered = chosen.sort(dim=1).values
        out, counts, rows = fused(x, ordered)
        want, want_counts = _grouped(experts, x, ordered)
        in_slot_order = out if rows is None else out.index_select(0, rows)
        assert out.dtype == dtype and torch.equal(in_slot_order, want) and counts == want_counts
        mixed, _ = mix_experts(experts, x, weights, chosen, fused)
        assert torch.equal(mixed, mix_experts(experts, x, weights, chosen)[0])
        # a token alone is its row of the step
        assert torch.equal(mix_experts(experts, x[-1:], weights[-1:], chosen[-1:], fused)[0][0], mixed[-1])


def test_experts_it_cannot_hold_as_one_weight_run_one_call_each() -> None:
    mixed = experts_of(MLP)
    mixed[3].down_proj = projection("Q4_K", (HIDDEN, SIZE), 99)  # (one expert's down of another type)
    assert FusedExperts.of(mixed) is None
    kinds = experts_of(MLP)
    kinds[0] = experts_of(GemmaMLP)[0]
    assert FusedExperts.of(kinds) is None


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_mixing_the_slots_rows_in_place_gives_torchs_products_and_sums(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    tokens, hidden = 37, 70  # (a row length no vector width divides)
    out = torch.randn(tokens * k, hidden, generator=gen) * 3
    weights = torch.rand(tokens, k, generator=gen)
    rows = torch.randperm(tokens * k, generator=gen)
    parts = (out.index_select(0, rows).view(tokens, k, -1) * weights.unsqueeze(-1)).unbind(1)
    want = parts[0]
    if k > 1:
        want = parts[0] + parts[1]
        for part in parts[2:]:
            want += part
    assert torch.equal(ops.mix_expert_rows(out, rows, weights), want)
    in_order = out.index_select(0, rows)
    assert torch.equal(ops.mix_expert_rows(in_order, None, weights), want)

