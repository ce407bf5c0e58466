"""Gemma 4 GGUF files as llama.cpp's converter writes them: the full layers' head size in
``attention.key_length`` (the windowed ones' in ``key_length_swa``), KV heads per layer, the
layer kinds as ``sliding_window_pattern``, no ``attn_v`` where a full layer's values are its
keys, proportional RoPE as ``rope_freqs``, the per-layer input tensors, norms as they are
(w), and the ``gemma4`` tokenizer (SentencePiece-style BPE with its merges listed)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import blocks
from models import ops
from models.gguf_linear import NativeA8Linear
from models.loader import load_model
from models.tokenizer import Tokenizer

# The published models' shape, small: full layers of twice the windowed ones' head size with
# one KV head and their values from their keys, the last two layers reading layers 2 and 3's
# K/V with MLPs twice as wide, per-layer inputs of 32, soft-capped logits.
GEMMA4 = dict(num_hidden_layers=6, head_dim=32, global_head_dim=64, sliding_window=8, attention_k_eq_v=True,
              num_global_key_value_heads=1, layer_types=["sliding_attention", "full_attention"] * 3,
              hidden_size_per_layer_input=32, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
              use_double_wide_mlp=True, final_logit_softcapping=3.0, intermediate_size=128)

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
          "pre_feedforward_layernorm_2": "pre_ffw_norm_2", "post_feedforward_layernorm_1": "post_ffw_norm_1",
          "post_feedforward_layernorm_2": "post_ffw_norm_2", "router.proj": "ffn_gate_inp"}
# The 26B-A4B's parameters without a module's weight, as the converter names them.
_OWN = {"layer_scalar": "layer_output_scale.weight", "router.scale": "ffn_gate_inp.scale",
        "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
        "experts.down_proj": "ffn_down_exps.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
           "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
           "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, *module, kind = hf.split(".")
    own = ".".join([*module, kind])
    if own in _OWN:
        return f"blk.{layer}.{_OWN[own]}"
    return f"blk.{layer}.{_LAYER['.'.join(module)]}.{kind}"


def write_gemma4_gguf(path: Path, hf_model, quantize: gguf.GGMLQuantizationType | None = None,
                      expert_type: str | None = None) -> Path:
    """``hf_model`` as llama.cpp's Gemma 4 converter writes it (projections of 64 inputs or more
    and the embedding tables in ``quantize``, the rest F32), with a minimal gpt2 tokenizer;
    ``expert_type``: the stacked experts as random blocks of that type instead (a type the
    gguf package cannot quantise; the file no longer holds ``hf_model``'s experts)."""
    cfg = hf_model.config
    layers, types = cfg.num_hidden_layers, cfg.layer_types
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    full_dim = cfg.per_layer_config[full[0]].head_dim
    swa_dim = cfg.per_layer_config[types.index("sliding_attention")].head_dim
    shared_from = layers - cfg.num_kv_shared_layers
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length([cfg.intermediate_size * (2 if cfg.use_double_wide_mlp and i >= shared_from else 1)
                               for i in range(layers)])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.per_layer_config[i].num_key_value_heads for i in range(layers)])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.enable_moe_block:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    turned = int(full_dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turned + [1e30] * (full_dim // 2 - turned), np.float32))
    for hf, tensor in hf_model.state_dict().items():
        if hf == "lm_head.weight":
            continue  # (tied)
        data = tensor.numpy().astype(np.float32)
        name = _gguf_name(hf)
        projection = name.split(".")[2:3] in (["attn_q"], ["attn_k"], ["attn_v"], ["attn_output"], ["ffn_gate"],
                                              ["ffn_up"], ["ffn_down"], ["ffn_gate_up_exps"]) or (
            name.endswith("ffn_down_exps.weight"))
        table = name in ("token_embd.weight", "per_layer_token_embd.weight")
        if expert_type is not None and name.endswith(("ffn_gate_up_exps.weight", "ffn_down_exps.weight")):
            raw, _ = blocks(expert_type, (data.size // data.shape[-1], data.shape[-1]), len(w.tensors[0]))
            w.add_tensor(name, raw.reshape(*data.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[expert_type])
        elif quantize is not None and (projection or table) and data.shape[-1] >= 32:
            w.add_tensor(name, gguf.quants.quantize(data, quantize), raw_dtype=quantize)
        else:
            w.add_tensor(name, data.reshape(1) if data.ndim == 0 else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def gemma4(tiny_checkpoint):
    """(checkpoint dir, transformers model) of the tiny Gemma 4."""
    return tiny_checkpoint("gemma4", **GEMMA4)


def _greedy(reference, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_gemma4_gguf_matches_transformers(gemma4, tiny_prompt, make_runner, tmp_path):
    _, reference = gemma4
    loaded = load_model(str(write_gemma4_gguf(tmp_path / "g4.gguf", reference)), dtype="float32", device="cpu",
                        quantization="none")
    cfg = loaded.config
    assert cfg.layer_attention == ((2, 32), (1, 64)) * 3 and cfg.kv_sources == (0, 1, 2, 3, 2, 3)
    assert cfg.layer_windows == (8, 0) * 3 and cfg.gemma4.values_from_keys and cfg.norm_offset == 0
    assert cfg.gemma4.mlp_sizes == (128,) * 4 + (256,) * 2 and cfg.final_logit_softcap == 3.0
    runner = make_runner(loaded.model)
    ours = runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([tiny_prompt])).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4
    assert make_runner(loaded.model).greedy(tiny_prompt, 6) == _greedy(reference, tiny_prompt, 6)


def test_a_quantised_gemma4_gguf_keeps_its_codes_on_w4a8(gemma4, tiny_prompt, make_runner, tmp_path):
    # Every projection keeps the file's Q8_0 codes (a K/V-sharing layer's queries alone, a full
    # layer's keys twice: keys and values), the embedding tables stay the file's blocks, and a
    # row's logits do not depend on its chunks or batch.
    path = write_gemma4_gguf(tmp_path / "g4-q8.gguf", gemma4[1], quantize=gguf.GGMLQuantizationType.Q8_0)
    exact = load_model(str(path), dtype="float32", device="cpu", quantization="none").model
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    layers = model.model.layers
    assert all(isinstance(layer.self_attn.qkv_proj, NativeA8Linear) for layer in layers)
    assert layers[4].self_attn.qkv_proj.out_features == 4 * 32  # (queries alone)
    assert layers[1].self_attn.qkv_proj.out_features == 4 * 64 + 2 * 64  # (keys, then keys as values)
    assert not isinstance(model.model.embed_tokens_per_layer, torch.nn.Embedding)
    ids = torch.tensor(tiny_prompt)
    assert torch.equal(model.model.embed_tokens_per_layer(ids), exact.model.embed_tokens_per_layer(ids))
    # Each projection is the exact model's (the file's values, dequantised, in kvserve's row
    # order) but for the int8 rounding of its inputs: a row in another place would miss by far more.
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(layers, exact.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            _assert_within_int8_rounding(ours.get_submodule(name), theirs.get_submodule(name), x, name)
    _assert_chunks_and_batch_change_nothing(model, make_runner, tiny_prompt)


def _assert_within_int8_rounding(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor, name: str) -> None:
    want = b(x[:, :b.in_features])
    assert (a(x[:, :b.in_features]) - want).abs().max() < 0.02 * want.abs().max(), name


def _assert_chunks_and_batch_change_nothing(model, make_runner, prompt: list[int]) -> None:
    alone = make_runner(model)
    whole = alone.step([(alone.new_seq(len(prompt)), prompt)])[0]
    runner = make_runner(model, seed=1)
    seq, other = runner.new_seq(len(prompt)), runner.new_seq(8)
    first = runner.step([(seq, prompt[:13]), (other, [5, 6, 7])])[0]
    second = runner.step([(seq, prompt[13:])])[0]
    assert torch.equal(torch.cat([first, second]), whole)


def test_a_gemma4_gguf_without_its_layer_pattern_is_an_error_naming_it(gemma4, tmp_path):
    path = write_gemma4_gguf(tmp_path / "g4.gguf", gemma4[1])
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "gemma4")
    for field in reader.fields.values():
        if field.name.startswith("gemma4.") and field.name != "gemma4.attention.sliding_window_pattern":
            value = field.contents()
            key = field.name.removeprefix("gemma4.")
            writer.add_key_value(f"gemma4.{key}", value, field.types[0], field.types[-1] if len(field.types) > 1
                                 else None)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(128)])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed([int(d) for d in t.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        load_model(str(tmp_path / "bad.gguf"), dtype="float32", device="cpu", quantization="none")


def test_the_gemma4_tokenizer_merges_as_listed_within_newline_runs():
    # SentencePiece-style: spaces are U+2581, no prefix space, unknown bytes as <0x..> tokens;
    # the listed merges apply in their order, and never across a newline run's edge.
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<0x0A>", "<0x21>", "\u2581", "a", "b", "c", "\n", "ab", "\u2581c",
              "abc", "\n\n", "\u2581cab"]
    merges = ["a b", "\u2581 c", "ab c", "\n \n", "\u2581c ab"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 2 + [
        gguf.TokenType.NORMAL] * 10
    fields = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
              "tokenizer.ggml.merges": merges, "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.bos_token_id": 2,
              "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_gguf_fields(fields)
    ids = tok.encode("abc cab\n\nab!", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["abc", "\u2581cab", "\n\n", "ab", "<0x21>"]
    assert tok.decode(ids) == "abc cab\n\nab!"
    assert tok.encode("a", add_special_tokens=True)[0] == 2


@pytest.mark.parametrize("quantize", [None, gguf.GGMLQuantizationType.Q8_0], ids=["f32", "q8_0-w4a8"])
def test_a_gemma4_gguf_with_experts_loads(tiny_checkpoint, tiny_prompt, make_runner, tmp_path, quantize):
    # The 26B-A4B's shape, small: its stacked experts (gate and up fused), router scales and
    # norms as the converter writes them; the exact path equals transformers, and on w4a8
    # every expert keeps the file's codes, each within int8 rounding of the exact model's.
    _, reference = tiny_checkpoint("gemma4", **{**GEMMA4, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
                                                "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                                                "moe_intermediate_size": 32})
    path = write_gemma4_gguf(tmp_path / "g4-moe.gguf", reference, quantize=quantize)
    exact = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    assert exact.config.gemma4.experts.num_experts == 8
    runner = make_runner(exact.model)
    ours = runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)])[0]
    if quantize is None:
        with torch.no_grad():
            expected = reference(torch.tensor([tiny_prompt])).logits[0]
        assert (ours - expected).abs().max().item() < 1e-4
        return
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for mine, theirs in zip(model.model.layers, exact.model.model.layers):
        for a_expert, b_expert in zip(mine.experts, theirs.experts):
            for name in ("gate_up_proj", "down_proj"):
                assert isinstance(getattr(a_expert, name), NativeA8Linear)
                _assert_within_int8_rounding(getattr(a_expert, name), getattr(b_expert, name), x, name)
    _assert_chunks_and_batch_change_nothing(model, make_runner, tiny_prompt)


def test_a_gemma4_gguf_with_k_quant_experts_runs_them_in_one_call(tiny_checkpoint, tiny_prompt, make_runner,
                                                                   tmp_path):
    # Q4_K experts (GELU-tanh MLPs) on w4a8: each expert layer's experts held as one weight a
    # projection (models.experts.FusedExperts), each expert within int8 rounding of the exact
    # model's, the one-call path equal to one call an expert, chunks and batches changing nothing.
    from models.experts import _grouped

    _, reference = tiny_checkpoint("gemma4", **{**GEMMA4, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
                                                "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                                                "hidden_size": 256, "moe_intermediate_size": 256})
    path = write_gemma4_gguf(tmp_path / "g4-q4k.gguf", reference, quantize=gguf.GGMLQuantizationType.Q8_0,
                             expert_type="Q4_K")
    exact = load_model(str(path), dtype="float32", device="cpu", quantization="none").model
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for mine, theirs in zip(model.model.layers, exact.model.layers):
        assert mine.fused is not None and mine.fused.activate is type(mine.experts[0]).activate
        for a_expert, b_expert in zip(mine.experts, theirs.experts):
            for name in ("gate_up_proj", "down_proj"):
                _assert_within_int8_rounding(getattr(a_expert, name), getattr(b_expert, name), x, name)
        weights, chosen = mine.router(x)
        chosen, by_id = chosen.sort(dim=1)
        weights = weights.gather(1, by_id)
        out, counts, rows = mine.fused(x, chosen)
        assert torch.equal(out.index_select(0, rows), _grouped(mine.experts, x, chosen)[0])
        # ... and the kernels' whole call (GELU-tanh between the projections) gives their mix's bits
        assert mine.fused.activation.kind == ops.ExpertActivation.GELU_TANH_GLU
        whole, routed = ops.moe_experts(x, mine.fused.gate_up, mine.fused.down, weights, chosen,
                                        mine.fused.activation)
        assert torch.equal(whole, ops.mix_expert_rows(out, rows, weights)) and routed.tolist() == counts
    _assert_chunks_and_batch_change_nothing(model, make_runner, tiny_prompt)
