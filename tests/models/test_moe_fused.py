"""A whole mixture-of-experts layer in one kernel call (``ops.fused_moe_layer``) gives the
op-by-op layer's bits: logits, KV caches and routed-token counts, for OLMoE's norms over the
whole q/k projections, Qwen3-MoE's per-head norms and Mixtral's plain attention, in one
prefill, in chunks beside another sequence and in decode steps; and gpt-oss's (sinks, windows,
biases, its clamped SwiGLU), and on Q4_0, Q8_0 and Q4_1 experts. The kernels' router
(``ops.route_experts``) picks what torch's softmax and top-k pick, and its rows do not
depend on the batch. The fused dense layer runs Qwen3's per-head norms too, the same bits.
"""

from __future__ import annotations

import pytest
import torch

from models import ops
from models.llama import DecoderLayer
from models.loader import load_model
from models.moe import MoEDecoderLayer
from models.moe_config import MoESettings
from tests.models.test_llama import chunked_beside_another, max_diff, prefill, reference_logits
from tests.models.test_moe import tiny_moe, write_moe_gguf

pytestmark = pytest.mark.skipif(not (ops.kernels_available() and ops.has_int8_dots()),
                                reason="the fused layers are C++ kernels; w4a8 needs integer dots")

# Widths of whole Q4_K super-blocks (256), 16 experts, top 4.
SHAPES = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = {
    "olmoe": dict(SHAPES, intermediate_size=256, num_experts=16, num_experts_per_tok=4),
    "qwen3moe": dict(SHAPES, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4),
    "mixtral": dict(SHAPES, intermediate_size=256, num_local_experts=16, num_experts_per_tok=4),
    # (a dense first layer, op by op, before a fused one: the residual stream passes between them)
    "qwen3moe-dense-first": dict(SHAPES, moe_intermediate_size=256, intermediate_size=256, num_experts=16,
                                 num_experts_per_tok=4, mlp_only_layers=[0]),
    # (Granite's multipliers: embedding, attention, residual, logits)
    "granitemoe": dict(SHAPES, intermediate_size=256),
    # (a gated shared expert beside the routed ones)
    "qwen2moe": dict(SHAPES, moe_intermediate_size=256, shared_expert_intermediate_size=256, intermediate_size=256,
                     num_experts=16, num_experts_per_tok=4),
}


def runs(model, make_runner, prompt: list[int]) -> tuple[torch.Tensor, list, list[int], dict]:
    """Logits of a prefill, the same prompt in chunks beside another, 4 decode steps of two
    sequences and one of the first alone (one token: its row rounded once for all its experts);
    the decode runner's caches, its greedy tokens and the tokens routed per expert."""
    model.count_routed_tokens()
    whole = prefill(make_runner(model), prompt)
    chunked = chunked_beside_another(make_runner(model, seed=1), prompt)
    runner = make_runner(model, seed=2)
    seqs = [runner.new_seq(len(prompt) + 5), runner.new_seq(len(prompt) + 5)]
    logits = runner.step([(seqs[0], prompt), (seqs[1], prompt[::-1])])
    steps, tokens = [], []
    for _ in range(4):
        last = [int(lg[-1].argmax()) for lg in logits]
        tokens.append(last)
        logits = runner.step([(s, [t]) for s, t in zip(seqs, last)])
        steps.append(torch.stack([lg[-1] for lg in logits]))
    last = int(logits[0][-1].argmax())
    tokens.append([last])
    steps.append(runner.step([(seqs[0], [last])])[0][-1:])
    return torch.cat([whole, chunked, *steps]), runner.kv_caches, tokens, model.take_routed_tokens()


def fused_equals_op_by_op(model, make_runner, prompt: list[int], monkeypatch) -> torch.Tensor:
    """``runs`` with the fused MoE layer (asserting it ran) and op by op: the same logits,
    caches, tokens and routed counts, bit for bit. Returns the logits."""
    calls = []
    fused_moe_layer = ops.fused_moe_layer
    monkeypatch.setattr(ops, "fused_moe_layer", lambda *a, **kw: calls.append(1) or fused_moe_layer(*a, **kw))
    fused, fused_caches, fused_tokens, fused_routed = runs(model, make_runner, prompt)
    assert calls, "the fused MoE layer must run"

    monkeypatch.setattr(MoEDecoderLayer, "fused_moe_weights", lambda self: None)
    plain, plain_caches, plain_tokens, plain_routed = runs(model, make_runner, prompt)
    assert torch.equal(fused, plain)
    assert all(torch.equal(a, b) for pair in zip(fused_caches, plain_caches) for a, b in zip(*pair))
    assert fused_tokens == plain_tokens and fused_routed == plain_routed
    assert fused_routed and all(sum(counts) > 0 for counts in fused_routed.values())
    return fused


@pytest.mark.parametrize("arch", FAMILIES)
def test_fused_moe_layers_equal_the_op_by_op_layers(tiny_prompt, make_runner, tmp_path, monkeypatch, arch):
    family = arch.split("-")[0]
    reference = tiny_moe(family, **FAMILIES[arch])
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", reference, family, "Q4_K", every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    fused_layers = [layer.fused_moe_weights() is not None for layer in model.model.layers]
    # (every sparse layer: qwen3moe-dense-first's and the tiny Qwen2-MoE's first is dense)
    assert fused_layers == ([False, True] if arch == "qwen3moe-dense-first"
                            else [True, False] if arch == "qwen2moe" else [True, True])
    fused = fused_equals_op_by_op(model, make_runner, tiny_prompt, monkeypatch)
    # (x rounded to int8 per 16 inputs at every projection: near transformers, not equal)
    want = reference_logits(reference, tiny_prompt)
    assert max_diff(fused[:len(tiny_prompt)], want) < 0.05 * want.abs().max()


@pytest.mark.parametrize("arch, kind", [("olmoe", "Q4_0"), ("mixtral", "Q8_0"), ("qwen3moe", "Q4_1")])
def test_fused_moe_layers_of_q4_0_q8_0_q4_1_equal_the_op_by_op_layers(tiny_prompt, make_runner, tmp_path,
                                                                      monkeypatch, arch, kind):
    # (D4, D8 and A4: every format's experts one call a projection)
    reference = tiny_moe(arch, **FAMILIES[arch])
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", reference, arch, kind, every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    assert all(layer.fused_moe_weights() is not None for layer in model.model.layers)
    fused = fused_equals_op_by_op(model, make_runner, tiny_prompt, monkeypatch)
    # (x rounded to int8 at every projection of the quantiser's own weights, every projection
    # quantised: 2.8-3.3% of the logits' norm here, where each projection alone is 0.5%)
    want = reference_logits(reference, tiny_prompt)
    assert (fused[:len(tiny_prompt)] - want).norm() < 0.05 * want.norm()


def test_gpt_oss_layers_run_fused_with_the_op_by_op_bits(tiny_prompt, make_runner, tmp_path, monkeypatch):
    # gpt-oss: sinks, a window on every other layer, biases on o_proj, the router and the
    # experts, the router's softmax over its top k, the clamped SwiGLU; MXFP4 experts.
    reference = tiny_moe("gptoss", swiglu_limit=7.0)
    path = write_moe_gguf(tmp_path / "gptoss.gguf", reference, "gptoss", "MXFP4", every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    layers = model.model.layers
    assert all(layer.fused_moe_weights() is not None for layer in layers)
    assert [bool(layer.self_attn.window) for layer in layers] == [True, False]
    assert all(layer.self_attn.sinks is not None and layer.mlp.gate.bias is not None for layer in layers)
    fused = fused_equals_op_by_op(model, make_runner, tiny_prompt, monkeypatch)
    # (x rounded to int8 per 16 inputs at every projection: near transformers, not equal)
    assert max_diff(fused[:len(tiny_prompt)], reference_logits(reference, tiny_prompt)) < 0.1


@pytest.mark.parametrize("router, norm", [("softmax-topk", True), ("softmax-topk", False), ("topk-softmax", True)])
def test_the_kernels_router_picks_torchs_experts_and_a_row_alone_is_its_row(router, norm):
    from models.moe import route

    moe = MoESettings(num_experts=64, experts_per_token=8, expert_size=32, norm_topk_prob=norm, router=router)
    logits = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)) * 3
    weights, chosen = route(logits, moe)
    ops.set_kernels_enabled(False)
    try:
        want_weights, want_chosen = route(logits, moe)
    finally:
        ops.set_kernels_enabled(True)
    want_chosen, by_id = want_chosen.sort(dim=1)
    assert torch.equal(chosen, want_chosen)  # each row's experts in ascending id
    torch.testing.assert_close(weights, want_weights.gather(1, by_id), rtol=1e-6, atol=1e-7)
    for i in (0, 17, 49):
        alone = route(logits[i:i + 1], moe)
        assert torch.equal(alone[0][0], weights[i]) and torch.equal(alone[1][0], chosen[i])
    # ties go to the lower expert id
    tied = ops.route_experts(torch.zeros(1, 8), 3, ops.ROUTER_SOFTMAX_TOPK_NORM)
    assert tied[1].tolist() == [[0, 1, 2]] and torch.equal(tied[0], torch.full((1, 3), 1 / 3))


def test_fused_dense_layers_run_qwen3s_per_head_norms_op_by_ops_bits(tiny_checkpoint, tiny_prompt, make_runner,
                                                                       monkeypatch):
    path, _ = tiny_checkpoint(arch="qwen3")
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    assert all(layer.packed_int4() for layer in model.model.layers)

    def logits() -> torch.Tensor:
        whole = prefill(make_runner(model), tiny_prompt)
        return torch.cat([whole, chunked_beside_another(make_runner(model), tiny_prompt)])

    fused = logits()
    monkeypatch.setattr(DecoderLayer, "packed_int4", lambda self: False)
    assert torch.equal(fused, logits())


def test_fused_moe_layers_run_lora_rows_with_the_op_by_op_bits(tiny_prompt, make_runner, tmp_path, monkeypatch):
    # An adapter on the attention's projections: its rows beside the base model's, in chunks
    # and then in decode steps, in one call a layer as op by op.
    from tests.models.test_lora import adapter_for, peft_logits

    reference = tiny_moe("olmoe", **FAMILIES["olmoe"])
    path = write_moe_gguf(tmp_path / "olmoe.gguf", reference, "olmoe", "Q4_K", every_projection=True)
    peft_logits(reference, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8,
                target_modules=r".*self_attn\.(q|k|v|o)_proj")
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    adapter = adapter_for(model, tmp_path / "adapter")
    prompts = [tiny_prompt, tiny_prompt[::-1]]

    def run() -> torch.Tensor:
        runner = make_runner(model)
        seqs = [runner.new_seq(len(tiny_prompt) + 4) for _ in prompts]
        out = runner.step([(s, p[:9]) for s, p in zip(seqs, prompts)], [adapter, None])
        out = runner.step([(s, p[9:]) for s, p in zip(seqs, prompts)], [adapter, None])
        rows = [torch.cat(out)]
        for _ in range(3):
            out = runner.step([(s, [int(lg[-1].argmax())]) for s, lg in zip(seqs, out)], [adapter, None])
            rows.append(torch.cat(out))
        return torch.cat(rows)

    calls = []
    fused_moe_layer = ops.fused_moe_layer
    monkeypatch.setattr(ops, "fused_moe_layer", lambda *a, **kw: calls.append(a[7] if len(a) > 7 else kw.get("lora"))
                        or fused_moe_layer(*a, **kw))
    fused = run()
    assert calls and all(lora is not None for lora in calls), "the fused MoE layer must run the LoRA rows"
    monkeypatch.setattr(MoEDecoderLayer, "fused_moe_weights", lambda self: None)
    assert torch.equal(fused, run())
