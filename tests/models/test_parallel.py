"""Tensor parallelism in ``models``: the split is checked, and split ranks compute the
whole model's logits.

Each rank of ``parallel_ranks.py`` holds half the heads, half the MLP features
and half the vocabulary of a tiny random checkpoint; rank 0's logits (a prompt
and two decodes over each rank's own KV heads) must equal the whole model's up
to the order the row-parallel sums are added in.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.parallel import check_split

RANKS = Path(__file__).with_name("parallel_ranks.py")


def smollm2_like(**overrides) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  max_position_embeddings=2048)
    return ModelConfig(**(fields | overrides))


def test_a_split_must_divide_the_heads_and_features():
    check_split(smollm2_like(), 3, quantized=True)
    with pytest.raises(ValueError, match="size 2 does not divide the model's 9 query heads and 3 KV heads"):
        check_split(smollm2_like(), 2, quantized=False)
    with pytest.raises(ValueError, match="size 3 does not divide the model's 1000 MLP features"):
        check_split(smollm2_like(intermediate_size=1000), 3, quantized=False)


def test_a_quantized_split_keeps_whole_groups():
    # 8 heads of 64 split 8 ways: 64 inputs a rank, two groups of 32.
    check_split(smollm2_like(num_attention_heads=8, num_key_value_heads=8, intermediate_size=2048), 8,
                quantized=True)
    # 16 heads of 8 split 8 ways: 16 inputs a rank, half a group.
    config = smollm2_like(hidden_size=128, num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                          intermediate_size=2048)
    with pytest.raises(ValueError, match="slices of 16, not whole 4-bit groups of 32; use --quantization none"):
        check_split(config, 8, quantized=True)
    check_split(config, 8, quantized=False)


def run_ranks(world: int, model: Path, quantization: str, out: Path, adapter: Path | None = None) -> torch.Tensor:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(r), str(world), str(port), str(model),
                               quantization, str(out), *([str(adapter)] if adapter else [])])
             for r in range(world)]
    assert [p.wait(300) for p in procs] == [0] * world
    return torch.load(out, weights_only=True)


# qwen2: q/k/v biases, split with their rows, and a tied head; int4: each rank quantises its slices;
# qwen3: every rank norms its own heads with the one shared q/k norm.
@pytest.mark.parametrize("arch,quantization", [("llama", "none"), ("qwen2", "int4"), ("qwen3", "w4a8")])
def test_two_ranks_compute_the_whole_models_logits(tiny_checkpoint, tmp_path, arch, quantization):
    # 4 query heads, 2 KV heads, 96 MLP features: split 2 ways, whole 4-bit groups of
    # the 64 attention inputs but not of the 48 MLP inputs; hence 128 features here.
    path, _ = tiny_checkpoint(arch, intermediate_size=128, tie_word_embeddings=arch == "qwen2")
    whole = run_ranks(1, path, quantization, tmp_path / "whole.pt")
    split = run_ranks(2, path, quantization, tmp_path / "split.pt")
    assert split.shape == whole.shape == (23, 128)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)
    assert torch.equal(split.argmax(-1), whole.argmax(-1))


def test_two_ranks_run_a_lora_adapter_as_one_does(tiny_checkpoint, tmp_path, make_lora):
    # Each rank keeps the B rows of its heads and features (qkv, gate/up) and the A columns
    # of its inputs (o, down), whose partial updates the all-reduce sums.
    path, hf = tiny_checkpoint("llama", intermediate_size=128)
    adapter = make_lora(tmp_path / "adapter", hf.config, rank=4, seed=5, std=0.2)
    plain = run_ranks(1, path, "w4a8", tmp_path / "plain.pt")
    whole = run_ranks(1, path, "w4a8", tmp_path / "whole.pt", adapter)
    split = run_ranks(2, path, "w4a8", tmp_path / "split.pt", adapter)
    assert (whole - plain).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)
