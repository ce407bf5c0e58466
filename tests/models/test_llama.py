"""The Llama-family model equals transformers on the same weights, through the paged cache.

Measured on CPU, torch 2.13, transformers 5.24 (max |ours - transformers| over all
positions, float32): SmolLM2 GGUF 4.0e-5 (english), 5.4e-5 (chinese), 4.7e-5 (code);
tiny random checkpoints about 1.5e-6. bfloat16 vs float32 on SmolLM2: 0.62.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models.attention import SeqSpec, build_attention_metadata
from models.config import ModelConfig
from models.loader import load_model

PROMPTS = {
    "english": "The capital of France is Paris. The capital of Germany is",
    "chinese": "北京是中国的首都，上海是",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
}
LONG_PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
               "clockmaker who repaired every clock in the valley")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding.

    Other batch shapes pick other GEMM kernels; over 30 layers that reaches 1.2e-4
    (measured) on the first token's row, whose hidden state is the largest. In
    float64 the same comparisons give exactly 0; a logic error gives O(1).
    """
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=0)


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` for one unpadded sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def reference_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (it stops early only at EOS, which these prompts never reach)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()


def prefill(runner, ids: list[int]) -> torch.Tensor:
    """Logits of a fresh sequence prefilled in one forward."""
    return runner.step([(runner.new_seq(len(ids)), ids)])[0]


def chunked_beside_another(runner, ids: list[int]) -> torch.Tensor:
    """Logits of a fresh sequence prefilled in chunks of 7, 9 and the rest of ``ids``: the
    first beside another sequence's prompt, the second after that one's decode."""
    seq, mate = runner.new_seq(len(ids)), runner.new_seq(32)
    parts = [runner.step([(seq, ids[:7]), (mate, ids[::-1])])[0]]
    parts.append(runner.step([(mate, [5]), (seq, ids[7:16])])[1])
    parts.append(runner.step([(seq, ids[16:])])[0])
    return torch.cat(parts)


# --- SmolLM2 (the default model) vs transformers ---------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_default_model_logits_match_transformers(smollm2, reference_model, make_runner, prompt):
    ids = smollm2.tokenizer.encode(prompt)

    diff = max_diff(prefill(make_runner(smollm2.model), ids), reference_logits(reference_model, ids))

    print(f"max |logits diff| vs transformers: {diff:.2e}")
    assert diff < 2e-3, f"max |logits diff| vs transformers is {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_default_model_greedy_continuation_matches_transformers(smollm2, reference_model, make_runner,
                                                                 prompt):
    ids = smollm2.tokenizer.encode(prompt)

    ours = make_runner(smollm2.model).greedy(ids, max_new_tokens=32)

    assert ours == reference_greedy(reference_model, ids, max_new_tokens=32)


@pytest.mark.slow
def test_prompt_prefilled_in_chunks_gives_the_same_logits_as_one_prefill(smollm2, make_runner):
    ids = smollm2.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 16
    whole = prefill(make_runner(smollm2.model), ids)

    runner = make_runner(smollm2.model)
    seq = runner.new_seq(len(ids))
    chunks = [runner.step([(seq, part)])[0] for part in (ids[:7], ids[7:16], ids[16:])]

    assert_same_logits(torch.cat(chunks), whole)


@pytest.mark.slow
def test_decodes_batched_with_a_prefill_give_the_same_logits_as_separate_calls(smollm2, make_runner):
    a, b, c = (smollm2.tokenizer.encode(p) for p in PROMPTS.values())
    next_a, next_b = 11, 22  # any tokens will do: only the cache path matters

    alone = make_runner(smollm2.model)
    seq_a, seq_b, seq_c = alone.new_seq(64), alone.new_seq(64), alone.new_seq(64)
    alone.step([(seq_a, a)])
    alone.step([(seq_b, b)])
    expected = [alone.step([(seq_a, [next_a])])[0], alone.step([(seq_b, [next_b])])[0],
                alone.step([(seq_c, c)])[0]]

    batched = make_runner(smollm2.model, seed=1)
    seq_a, seq_b, seq_c = batched.new_seq(64), batched.new_seq(64), batched.new_seq(64)
    batched.step([(seq_a, a), (seq_b, b)])
    got = batched.step([(seq_a, [next_a]), (seq_b, [next_b]), (seq_c, c)])

    for g, e in zip(got, expected, strict=True):
        assert_same_logits(g, e)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2):
    """The default model cast to bfloat16, as load_model(dtype="bfloat16") casts before loading."""
    model = copy.deepcopy(smollm2.model).to(torch.bfloat16)
    model.init_rope(smollm2.config.max_position_embeddings)
    return model


@pytest.mark.slow
def test_bfloat16_logits_stay_close_to_float32(smollm2, smollm2_bf16, make_runner):
    ids = smollm2.tokenizer.encode(PROMPTS["english"])
    fp32 = prefill(make_runner(smollm2.model), ids)

    bf16 = prefill(make_runner(smollm2_bf16), ids)

    diff = max_diff(bf16, fp32)
    print(f"bfloat16 vs float32: max |logits diff| {diff:.2f}")
    # Logits spread over about +-20 (std 6): 1.5 still catches a broken cast or rope table.
    assert diff < 1.5, f"bfloat16 vs float32: max |logits diff| {diff:.2f}"
    assert bf16[-1].argmax() == fp32[-1].argmax()


# --- tiny random checkpoints vs transformers ---------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),  # q/k/v biases
    "qwen3": dict(arch="qwen3"),  # per-head q/k norms, a head_dim of its own
    "tied-embeddings": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
    "sharded": dict(arch="llama", max_shard_size="40KB"),
    "phi3": dict(arch="phi3"),
    # Phi-3's 128k models: LongRoPE, its original context beside rope_scaling in config.json
    "phi3-longrope": dict(arch="phi3", original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # Phi-4-mini: 3/4 of each head turned (12 of 16 rows, in halves of their own), LongRoPE
    # factors for those 6 pairs
    "phi4-mini": dict(arch="phi3", partial_rotary_factor=0.75, original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)]}),
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_tiny_checkpoint_logits_match_transformers(tiny_checkpoint, tiny_prompt, make_runner, variant):
    path, reference = tiny_checkpoint(**variant)
    if "max_shard_size" in variant:
        assert (path / "model.safetensors.index.json").exists()
    model = load_model(str(path), dtype="float32", device="cpu").model

    diff = max_diff(prefill(make_runner(model), tiny_prompt), reference_logits(reference, tiny_prompt))

    assert diff < 1e-4, f"max |logits diff| vs transformers is {diff:.2e}"


def test_logits_indices_pick_the_rows_sent_to_the_lm_head(tiny_checkpoint, tiny_prompt, make_runner):
    path, _ = tiny_checkpoint()
    model = load_model(str(path), dtype="float32", device="cpu").model
    n = len(tiny_prompt)
    every_row = prefill(make_runner(model), tiny_prompt)

    runner = make_runner(model)
    meta = build_attention_metadata([SeqSpec(n, n, runner.new_seq(n).block_table)], runner.block_size)
    picked = model(torch.tensor(tiny_prompt), torch.arange(n), meta, runner.kv_caches,
                   torch.tensor([n - 1, 3]))

    assert picked.shape == (2, model.config.vocab_size)
    assert max_diff(picked, every_row[[n - 1, 3]]) < 1e-5


FAMILIES = {"qwen3": dict(arch="qwen3"), "phi3-longrope": VARIANTS["phi3-longrope"], "phi4-mini": VARIANTS["phi4-mini"],
            "mistral-window": dict(arch="mistral", sliding_window=8),
            "gemma3": dict(arch="gemma3", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                           num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"]),
            "gemma2": dict(arch="gemma2", head_dim=16, sliding_window=8, num_hidden_layers=3,
                           attn_logit_softcapping=1.0, final_logit_softcapping=2.0),
            # (a per-layer input width of 16: torch's GELU computes a tensor's elements past the last
            # multiple of 16 in a scalar loop, whose last bit differs, and which elements those are
            # moves with the batch; a published model's widths are multiples of 256)
            "gemma4": dict(arch="gemma4", num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
                           vocab_size_per_layer_input=128, num_kv_shared_layers=2),
            "gemma4-moe": dict(arch="gemma4", num_hidden_layers=2, head_dim=16, global_head_dim=32, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=16,
                               vocab_size_per_layer_input=128, enable_moe_block=True, num_experts=8,
                               top_k_experts=2, moe_intermediate_size=32),
            "llama-yarn": dict(arch="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 16})}


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILIES.keys())
@pytest.mark.parametrize("quantization", ["none", "w4a8", "int4"])
def test_logits_do_not_depend_on_chunks_or_batch(tiny_checkpoint, tiny_prompt, make_runner, quantization, family):
    # Qwen3's per-head q/k norms run in the fused layer kernel; Phi-3 loads from
    # fused checkpoint tensors; YaRN and LongRoPE scale the rotation table: a row's result
    # must still be the same, bit for bit, in one prefill, in chunks, and beside others.
    path, _ = tiny_checkpoint(**FAMILIES[family])
    model = load_model(str(path), dtype="float32", device="cpu", quantization=quantization).model
    whole = prefill(make_runner(model), tiny_prompt)

    assert torch.equal(chunked_beside_another(make_runner(model, seed=1), tiny_prompt), whole)


def test_a_partial_rotary_turns_the_first_rows_of_each_head_and_leaves_the_rest(tiny_checkpoint, tiny_prompt):
    # Phi-4-mini's 3/4: kvserve's table turns 6 of a head's 8 pairs; the last 2 stay as they are.
    path, _ = tiny_checkpoint(**VARIANTS["phi4-mini"])
    model = load_model(str(path), dtype="float32", device="cpu").model
    assert model.config.rotary_dim == 12
    turns = model.rope.rotations[5]  # (position 5: [pairs] complex)
    assert torch.all(turns[6:] == 1) and not torch.any(turns[:6] == 1)


# Sliding windows shorter than the 21-token prompt: every layer (Mistral v0.1, Phi-3-mini-4k),
# or Qwen2's layers from max_window_layers on.
WINDOWED = {
    "mistral-window": dict(arch="mistral", sliding_window=8),
    "phi3-window": dict(arch="phi3", sliding_window=8),
    "qwen2-window": dict(arch="qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1),
}


@pytest.mark.parametrize("variant", WINDOWED.values(), ids=WINDOWED.keys())
def test_sliding_windows_match_transformers(tiny_checkpoint, tiny_prompt, make_runner, variant):
    path, reference = tiny_checkpoint(**variant)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert any(loaded.config.layer_windows), "the window must reach the model"
    diff = max_diff(prefill(make_runner(loaded.model), tiny_prompt), reference_logits(reference, tiny_prompt))
    assert diff < 1e-4, f"max |logits diff| vs transformers is {diff:.2e}"
    # and decoding past the window, token by token, gives transformers' greedy tokens
    assert make_runner(loaded.model).greedy(tiny_prompt, 6) == reference_greedy(reference, tiny_prompt, 6)



# Gemma 3: two windowed layers (window 8, their own RoPE base) and a full one (with YaRN on
# its table, as the long-context Gemma 3s scale theirs), head size 16, attention scaled by
# query_pre_attn_scalar.
GEMMA3 = dict(arch="gemma3", head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"])


# Gemma 2: transformers' own layer pattern (windowed, full, windowed), one RoPE base, no q/k
# norms; caps low enough to bend these tiny weights' scores and logits (real ones: 50 and 30).
GEMMA2 = dict(arch="gemma2", head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
              attn_logit_softcapping=1.0, final_logit_softcapping=2.0)


# Gemma 4: full layers of twice the windowed ones' head size (global_head_dim: 512 beside 256
# in the published models), proportional RoPE on them (4 of 16 pairs turned), per-layer
# input embeddings, the last two layers reading layers 2 and 3's K/V with double-wide MLPs,
# soft-capped logits; with the full layers' values from their key projection and one KV head
# (num_global_key_value_heads); and with every layer of one head size.
GEMMA4 = dict(arch="gemma4", num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"] * 3, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=128, num_kv_shared_layers=2, use_double_wide_mlp=True,
              final_logit_softcapping=3.0)


# The 26B-A4B's experts beside every layer's MLP: 8 experts, top-2, 32 features each (a
# multiple of 16: see FAMILIES' note on GELU).
GEMMA4_EXPERTS = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.parametrize("variant, windows", [
    (GEMMA3, (8, 8, 0)),
    ({**GEMMA3, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}}}, (8, 8, 0)),
    (GEMMA2, (8, 0, 8)), (GEMMA4, (8, 0) * 3),
    ({**GEMMA4, "attention_k_eq_v": True, "num_global_key_value_heads": 1}, (8, 0) * 3),
    ({**GEMMA4, "global_head_dim": 16}, (8, 0) * 3), ({**GEMMA4, **GEMMA4_EXPERTS}, (8, 0) * 3)],
    ids=["gemma3", "gemma3-scaled", "gemma2", "gemma4", "gemma4-k-eq-v", "gemma4-one-head-size", "gemma4-moe"])
def test_gemma_matches_transformers(tiny_checkpoint, tiny_prompt, make_runner, variant, windows):
    path, reference = tiny_checkpoint(**variant)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    # (Gemma 4's norms scale by w, 2 and 3's by 1 + w)
    assert loaded.config.layer_windows == windows and loaded.config.norm_offset == (variant["arch"] != "gemma4")
    diff = max_diff(prefill(make_runner(loaded.model), tiny_prompt), reference_logits(reference, tiny_prompt))
    assert diff < 1e-4, f"max |logits diff| vs transformers is {diff:.2e}"
    assert make_runner(loaded.model).greedy(tiny_prompt, 6) == reference_greedy(reference, tiny_prompt, 6)


@pytest.mark.parametrize("settings, refused", [
    ({"use_bidirectional_attention": "all"}, "bidirectional attention"),
    ({"per_layer_config": {"1": {"intermediate_size": 8}}}, "layer 1 sets intermediate_size"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "layers of one type must share a head size")])
def test_gemma4_features_kvserve_lacks_are_errors_naming_them(settings, refused):
    cfg = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "layer_types": ["sliding_attention", "full_attention"], **settings}
    with pytest.raises(ValueError, match=refused):
        ModelConfig.from_hf(cfg)


def test_gemma4_full_layers_take_their_own_head_size_and_kv_heads():
    # As transformers reads config.json: global_head_dim (512 unless given) for the full layers,
    # num_global_key_value_heads with attention_k_eq_v only; a saved per_layer_config as it says.
    cfg = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "layer_types": ["sliding_attention", "full_attention"], "num_global_key_value_heads": 1}
    config = ModelConfig.from_hf(cfg)
    assert config.layer_attention == ((2, 16), (2, 512)) and config.full_head_dim == 512
    assert len(config.rope_freq_factors) == 256  # (the full layers' table: 64 pairs turned of 256)
    assert ModelConfig.from_hf({**cfg, "attention_k_eq_v": True}).layer_attention == ((2, 16), (1, 512))
    saved = ModelConfig.from_hf({**cfg, "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 4}}})
    assert (saved.layer_kv_heads(1), saved.layer_head_dim(1), saved.layer_head_dim(0)) == (4, 32, 16)
    assert ModelConfig.from_hf({**cfg, "global_head_dim": 16}).layer_attention == ()


def test_a_gemma2_config_without_layer_types_windows_every_other_layer_from_the_first():
    # (Google's own config.json files give no layer_types: transformers' rule fills them)
    cfg = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "sliding_window": 4096, "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    config = ModelConfig.from_hf(cfg)
    assert config.layer_windows == (4096, 0, 4096, 0) and config.local_rope_theta is None
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.attention_scale) == (50.0, 30.0, 1 / 16)
