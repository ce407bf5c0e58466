"""RoPE scaling equals transformers': linear, llama3, yarn, longrope and dynamic from a
checkpoint's config.json, and from a GGUF file's metadata (yarn) or rope_freqs tensor
(Llama 3.1's), over prompts longer than the original context the scaling stretches;
and the table a served context chooses never depends on a sequence's length."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.loader import load_model
from models.rope import RotaryEmbedding, rope_parameters
from tests.models.test_loader import write_gguf

ORIGINAL = 64  # the original context the scalings stretch; prompts below run past it
HALF = 8  # rotary pairs of the tiny model's 16-dimensional heads
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 1.3},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                 "long_factor": [2.0 + 0.5 * i for i in range(HALF)]},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def tiny_config(rope_scaling: dict) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=256, rope_scaling=rope_scaling)


def prompt(n: int) -> list[int]:
    return torch.randint(128, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def compare(model, reference, make_runner, ids: list[int]) -> float:
    runner = make_runner(model, num_blocks=16)
    ours = runner.step([(runner.new_seq(len(ids)), ids)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    return (ours - expected).abs().max().item()


@pytest.mark.parametrize("name", SCALINGS, ids=SCALINGS.keys())
def test_scaled_rope_from_config_json_matches_transformers(tiny_checkpoint, make_runner, name):
    path, reference = tiny_checkpoint("llama", rope_scaling=SCALINGS[name])
    model = load_model(str(path), dtype="float32", device="cpu").model  # served context: 256 positions
    for n in (21, 100):  # within, then past the original context
        if name == "longrope" and n <= ORIGINAL:
            continue  # (transformers picks the short factors for it: see the next test)
        diff = compare(model, reference, make_runner, prompt(n))
        assert diff < 1e-4, f"{name}, {n} tokens: max |logits diff| vs transformers is {diff:.2e}"


def test_longrope_takes_the_short_factors_for_a_context_within_the_original(tiny_checkpoint, make_runner):
    path, reference = tiny_checkpoint("llama", rope_scaling=SCALINGS["longrope"])
    model = load_model(str(path), dtype="float32", device="cpu", max_positions=ORIGINAL).model
    assert compare(model, reference, make_runner, prompt(40)) < 1e-4


def test_the_served_context_fixes_the_table_for_every_length():
    # A token's rotation depends on its position and the served context alone: the
    # first 64 rows of a 256-position table are those of the first 64 positions' table
    # wherever the context does not cross a switch (longrope's, dynamic's).
    config = tiny_config(SCALINGS["yarn"])
    long, short = RotaryEmbedding(config, 256, torch.device("cpu")), RotaryEmbedding(config, 64, torch.device("cpu"))
    assert torch.equal(long.rotations[:64], short.rotations)
    _, factor = rope_parameters(config, 256)
    assert factor == pytest.approx(0.1 * np.log(4.0) + 1)  # YaRN's attention factor scales the table
    assert long.rotations.abs().sub(factor).abs().max() < 1e-6


def test_an_incomplete_scaling_is_an_error_naming_what_is_missing():
    with pytest.raises(ValueError, match="rope_scaling of type longrope lacks long_factor"):
        tiny_config({"rope_type": "longrope", "short_factor": [1.0] * HALF, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="long_factor has 3 values; the 16 rotary dimensions need 8"):
        tiny_config({"rope_type": "longrope", "short_factor": [1.0] * HALF, "long_factor": [1.0] * 3,
                     "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="rope_scaling of type yarn lacks factor"):
        tiny_config({"rope_type": "yarn"})


def llama3_freq_factors(s: dict, dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs for Llama 3.1's scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_rope_freqs_and_yarn_metadata_match_transformers(tiny_checkpoint, make_runner, tmp_path):
    _, llama3 = tiny_checkpoint("llama", rope_scaling=SCALINGS["llama3"])
    path = write_gguf(tmp_path / "llama3.gguf", llama3,
                      extra={"rope_freqs.weight": llama3_freq_factors(SCALINGS["llama3"], 16, 10000.0)})
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.rope_scaling is None and len(loaded.config.rope_freq_factors) == HALF
    assert compare(loaded.model, llama3, make_runner, prompt(100)) < 1e-4

    _, yarn = tiny_checkpoint("llama", rope_scaling=SCALINGS["yarn"])

    def yarn_fields(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)

    loaded = load_model(str(write_gguf(tmp_path / "yarn.gguf", yarn, fields=yarn_fields)), dtype="float32",
                        device="cpu")
    assert loaded.config.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": ORIGINAL}
    assert compare(loaded.model, yarn, make_runner, prompt(100)) < 1e-4


def test_phi3_gguf_longrope_factors_match_transformers(tiny_checkpoint, make_runner, tmp_path):
    scaling = {k: v for k, v in SCALINGS["longrope"].items() if k != "original_max_position_embeddings"}
    _, phi3 = tiny_checkpoint("phi3", original_max_position_embeddings=ORIGINAL, rope_scaling=scaling)

    def longrope_fields(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)

    path = write_gguf(tmp_path / "phi3.gguf", phi3, arch="phi3", fields=longrope_fields, extra={
        "rope_factors_long.weight": np.array(scaling["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(scaling["short_factor"], dtype=np.float32)})
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.architecture == "Phi3ForCausalLM"
    assert loaded.config.rope_scaling["long_factor"] == pytest.approx(scaling["long_factor"])
    assert compare(loaded.model, phi3, make_runner, prompt(100)) < 1e-4
