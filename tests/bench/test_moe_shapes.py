"""bench.moe_shapes's gpt-oss file (written at its published types as random blocks) is one
kvserve loads as gpt-oss and runs with its layers in one kernel call: checked on a tiny shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.moe_shapes import GPTOSS, write_gptoss
from models import ops
from models.gguf_reader import read_gguf
from models.loader import load_model


@pytest.mark.skipif(not (ops.kernels_available() and ops.has_int8_dots()), reason="w4a8 needs the kernels")
def test_the_gpt_oss_shape_loads_as_gpt_oss_with_every_layer_in_one_call(smollm2_path, tmp_path):
    tiny = dataclasses.replace(GPTOSS, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4,
                               experts_used=2, expert_ffn=64, context=512)
    fields = {k: v for k, v in read_gguf(smollm2_path).fields.items() if k.startswith("tokenizer.")}
    path = tmp_path / "gptoss.gguf"
    write_gptoss(path, tiny, fields)
    loaded = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8")
    model, config = loaded.model, loaded.config
    assert config.architecture == "GptOssForCausalLM" and config.moe.experts_per_token == 2
    assert [layer.self_attn.window for layer in model.model.layers] == [128, 0]
    assert all(layer.fused_moe_weights() is not None for layer in model.model.layers)
    experts = model.model.layers[0].mlp.fused
    assert experts.activation.kind == ops.ExpertActivation.CLAMPED_SWIGLU
    assert torch.isfinite(model.model.layers[0].mlp(torch.randn(3, 64))).all()
