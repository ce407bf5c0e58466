"""The fused layer kernels (``ops.fused_layer``, ``ops.fused_moe_layer``) run the attention's
sliding window, soft-capping, sink logits and output-projection bias: a layer with any of them
runs in one call and gives the op-by-op layer's bits, in a prefill, in chunks beside another
sequence and in decode steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models import ops
from models.llama import DecoderLayer
from models.loader import load_model
from models.moe import MoEDecoderLayer
from tests.models.test_llama import chunked_beside_another, prefill
from tests.models.test_moe import tiny_moe, write_moe_gguf

pytestmark = pytest.mark.skipif(not (ops.kernels_available() and ops.has_int8_dots()),
                                reason="the fused layers are C++ kernels; w4a8 needs integer dots")


def runs(model, make_runner, prompt: list[int]) -> torch.Tensor:
    """Logits of a prefill, of the same prompt in chunks beside another, and of 4 greedy
    decode steps of two sequences."""
    whole = prefill(make_runner(model), prompt)
    chunked = chunked_beside_another(make_runner(model, seed=1), prompt)
    runner = make_runner(model, seed=2)
    seqs = [runner.new_seq(len(prompt) + 5), runner.new_seq(len(prompt) + 5)]
    logits = runner.step([(seqs[0], prompt), (seqs[1], prompt[::-1])])
    steps = []
    for _ in range(4):
        logits = runner.step([(s, [int(lg[-1].argmax())]) for s, lg in zip(seqs, logits)])
        steps.append(torch.stack([lg[-1] for lg in logits]))
    return torch.cat([whole, chunked, *steps])


def fused_and_plain(model, make_runner, prompt, monkeypatch, layer_class, switch: str, off) -> tuple:
    """``runs`` with the fused kernel (asserting it ran), then with ``layer_class.switch``
    patched to ``off`` (op by op)."""
    name = "fused_moe_layer" if layer_class is MoEDecoderLayer else "fused_layer"
    calls = []
    kernel = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    fused = runs(model, make_runner, prompt)
    assert calls, f"ops.{name} must run"
    monkeypatch.setattr(layer_class, switch, off)
    return fused, runs(model, make_runner, prompt)


def test_windowed_layers_run_fused_with_the_op_by_op_bits(tiny_checkpoint, tiny_prompt, make_runner, monkeypatch):
    # Mistral's sliding window, 8 positions: the 21-token prompt and its decodes pass it.
    path, _ = tiny_checkpoint(arch="mistral", sliding_window=8)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    assert all(layer.self_attn.window == 8 and layer.packed_int4() for layer in model.model.layers)
    fused, plain = fused_and_plain(model, make_runner, tiny_prompt, monkeypatch, DecoderLayer, "packed_int4",
                                   lambda self: False)
    assert torch.equal(fused, plain)


def with_attention_extras(model, window: int) -> None:
    """Sinks, soft-capping, an output bias and (on the last layer) a window on every layer."""
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.sinks = nn.Parameter(torch.randn(attn.num_heads, generator=gen), requires_grad=False)
        attn.softcap = 2.0
        hidden = attn.o_proj.out_features
        attn.o_proj.bias = nn.Parameter(0.1 * torch.randn(hidden, generator=gen), requires_grad=False)
    model.model.layers[-1].self_attn.window = window


def test_sinks_softcap_and_an_output_bias_run_fused_with_the_op_by_op_bits(tiny_checkpoint, tiny_prompt, make_runner,
                                                                            monkeypatch):
    path, _ = tiny_checkpoint(arch="llama")
    bare = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    with_attention_extras(model, window=6)
    assert all(layer.packed_int4() for layer in model.model.layers)
    fused, plain = fused_and_plain(model, make_runner, tiny_prompt, monkeypatch, DecoderLayer, "packed_int4",
                                   lambda self: False)
    assert torch.equal(fused, plain)
    # (the kernel does use them: the same model without them answers otherwise)
    assert not torch.equal(fused, runs(bare, make_runner, tiny_prompt))


def test_moe_layers_with_attention_extras_run_fused_with_the_op_by_op_bits(tiny_prompt, make_runner, tmp_path,
                                                                          monkeypatch):
    reference = tiny_moe("mixtral", hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, num_local_experts=16, num_experts_per_tok=4)
    path = write_moe_gguf(tmp_path / "mixtral.gguf", reference, "mixtral", "Q4_K", every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    with_attention_extras(model, window=6)
    assert all(layer.fused_moe_weights() is not None for layer in model.model.layers)
    fused, plain = fused_and_plain(model, make_runner, tiny_prompt, monkeypatch, MoEDecoderLayer,
                                   "fused_moe_weights", lambda self: None)
    assert torch.equal(fused, plain)


def test_a_layers_fused_arguments_follow_a_replaced_module_and_only_then_are_rebuilt(tmp_path):
    # The arguments are kept while nothing anywhere registers a module, parameter or buffer
    # (models.llama.registrations), and the experts' plain attributes stay; a replaced
    # projection or norm, or experts unfused, is seen at the next call.
    reference = tiny_moe("mixtral", hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, num_local_experts=16, num_experts_per_tok=4)
    path = write_moe_gguf(tmp_path / "mixtral.gguf", reference, "mixtral", "Q4_K", every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    layer = model.model.layers[0]
    weights, experts = layer.fused_moe_weights()
    assert layer.fused_moe_weights()[0] is weights and layer.fused_moe_weights()[1] is experts
    o_proj = copy.deepcopy(layer.self_attn.o_proj)
    layer.self_attn.o_proj = o_proj
    again = layer.fused_moe_weights()[0]
    assert again is not weights
    assert all(a is b for a, b in zip(again.o_proj, o_proj.fused_args))
    norm = copy.deepcopy(layer.input_layernorm)
    layer.input_layernorm = norm
    assert layer.fused_moe_weights()[0].input_norm is norm.weight
    fused, layer.mlp.fused = layer.mlp.fused, None  # (a plain attribute: no registration)
    assert layer.fused_moe_weights() is None
    layer.mlp.fused = fused
    assert layer.fused_moe_weights()[1] is not None
