"""Gemma 2's and 3's layers in one kernel call (``ops.fused_gemma_layer``) give the op-by-op
layers' bits: logits and KV caches, in a prefill, in chunks beside another sequence and in
decode steps, with windowed layers on their own RoPE table (Gemma 3), soft-capped scores
(Gemma 2), per-head q/k norms and LoRA rows.
"""

from __future__ import annotations

import pytest
import torch

from models import ops
from models.gemma import GemmaDecoderLayer
from models.loader import load_model
from tests.models.test_fused_attention import runs
from tests.models.test_llama import GEMMA2, GEMMA3

pytestmark = pytest.mark.skipif(not (ops.kernels_available() and ops.has_int8_dots()),
                                reason="the fused layers are C++ kernels; w4a8 needs integer dots")


def fused_and_plain(model, run, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()`` with every layer in one call (asserting it), then op by op."""
    assert all(layer.fusable() for layer in model.model.layers)
    calls = []
    kernel = ops.fused_gemma_layer
    monkeypatch.setattr(ops, "fused_gemma_layer", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    fused = run()
    assert len(calls) >= len(model.model.layers), "every layer must run in one call"
    monkeypatch.setattr(GemmaDecoderLayer, "fusable", lambda self: False)
    return fused, run()


@pytest.mark.parametrize("variant", [GEMMA3, GEMMA2], ids=["gemma3", "gemma2"])
def test_fused_gemma_layers_equal_the_op_by_op_layers(tiny_checkpoint, tiny_prompt, make_runner, monkeypatch,
                                                      variant):
    path, _ = tiny_checkpoint(**variant)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    assert any(layer.self_attn.window for layer in model.model.layers)
    fused, plain = fused_and_plain(model, lambda: runs(model, make_runner, tiny_prompt), monkeypatch)
    assert torch.equal(fused, plain)


def test_fused_gemma_layers_run_lora_rows_with_the_op_by_op_bits(tiny_checkpoint, tiny_prompt, make_runner,
                                                                 monkeypatch, tmp_path):
    from tests.models.test_lora import adapter_for, peft_logits

    path, hf = tiny_checkpoint(**GEMMA3)
    peft_logits(hf, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    adapter = adapter_for(model, tmp_path / "adapter")

    def run() -> torch.Tensor:
        runner = make_runner(model)
        prompts = [tiny_prompt, tiny_prompt[::-1]]
        seqs = [runner.new_seq(len(tiny_prompt) + 3) for _ in prompts]
        runner.step([(s, p[:9]) for s, p in zip(seqs, prompts)], [adapter, None])
        out = runner.step([(s, p[9:]) for s, p in zip(seqs, prompts)], [adapter, None])
        rows = [torch.cat(out)]
        for _ in range(2):
            out = runner.step([(s, [int(lg[-1].argmax())]) for s, lg in zip(seqs, out)], [adapter, None])
            rows.append(torch.cat(out))
        return torch.cat(rows)

    fused, plain = fused_and_plain(model, run, monkeypatch)
    assert torch.equal(fused, plain)
