"""Mixture-of-experts families equal transformers on tiny random checkpoints, and a token's
result does not depend on the tokens routed with it.

Each family: 2 layers, 8 experts, top-2 (Qwen3-MoE top-3, its weights renormalised),
every parameter random; Qwen2-MoE with its gated shared expert and a dense second layer
(mlp_only_layers), Granite with multipliers other than 1, gpt-oss with its sinks, biases,
YaRN, a window of 8 on its first layer (the 21-token prompt is longer) and a SwiGLU limit
low enough that its clamps cut.
"""

from __future__ import annotations

import re

from pathlib import Path

import numpy as np
import pytest
import torch

from models import ops
from models.loader import load_model
from models.moe import SparseMoeBlock, route
from tests.models.conftest import TINY_CONFIG, save_tiny_tokenizer
from tests.models.test_lora import TOL, alone, beside_the_base, peft_logits
from tests.models.test_llama import chunked_beside_another, max_diff, prefill, reference_greedy, reference_logits

FAMILIES = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen2moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                     shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=32,
                     norm_topk_prob=True),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, pad_token_id=0, eos_token_id=2),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=3.0,
                       attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
    "gptoss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
                   swiglu_limit=1.0),
}


def tiny_moe(arch: str, **overrides) -> torch.nn.Module:
    """A random transformers MoE model of ``arch`` (``FAMILIES``), float32, every parameter random."""
    import transformers

    config_cls, model_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "gptoss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY_CONFIG, **FAMILIES[arch], **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture
def moe_checkpoint(tmp_path: Path):
    """``moe_checkpoint(arch, **config)`` -> (HF checkpoint dir, transformers model)."""
    def build(arch: str, **overrides) -> tuple[Path, torch.nn.Module]:
        model = tiny_moe(arch, **overrides)
        path = tmp_path / f"tiny-{arch}"
        model.save_pretrained(path)
        save_tiny_tokenizer(path)
        return path, model

    return build


@pytest.mark.parametrize("arch, overrides", [*((arch, {}) for arch in FAMILIES), ("mixtral", {"sliding_window": 8})],
                         ids=[*FAMILIES, "mixtral-window"])
def test_moe_checkpoint_matches_transformers(moe_checkpoint, tiny_prompt, make_runner, arch, overrides):
    path, reference = moe_checkpoint(arch, **overrides)
    model = load_model(str(path), dtype="float32", device="cpu").model

    diff = max_diff(prefill(make_runner(model), tiny_prompt), reference_logits(reference, tiny_prompt))

    assert diff < 1e-4, f"max |logits diff| vs transformers is {diff:.2e}"
    assert make_runner(model).greedy(tiny_prompt, 4) == reference_greedy(reference, tiny_prompt, 4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe", "olmoe", "gptoss"])
@pytest.mark.parametrize("quantization", ["none", "int4", "w4a8", pytest.param("w4a16", marks=pytest.mark.skipif(
    not ops.amx_bf16_usable(), reason="w4a16 needs a CPU with AMX-BF16"))])
def test_moe_logits_do_not_depend_on_chunks_or_batch(moe_checkpoint, tiny_prompt, make_runner, arch, quantization):
    # The batch mate's tokens share experts with the prompt's: a row's sums must not change.
    path, _ = moe_checkpoint(arch)
    model = load_model(str(path), dtype="float32", device="cpu", quantization=quantization).model
    whole = prefill(make_runner(model), tiny_prompt)

    assert torch.equal(chunked_beside_another(make_runner(model, seed=1), tiny_prompt), whole)


def test_a_tokens_expert_output_does_not_depend_on_the_tokens_sharing_its_experts(moe_checkpoint):
    # Top-4 (sums of four, in a fixed order) and Qwen2-MoE's gated shared expert, over enough
    # rows that some of torch's elementwise loops run vectorised and others their scalar tail.
    path, _ = moe_checkpoint("qwen2moe", num_experts_per_tok=4)
    block = load_model(str(path), dtype="float32", device="cpu").model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.shared_expert is not None
    x = torch.randn(100, TINY_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3))

    together = block(x)

    assert all(torch.equal(block(x[i:i + 1])[0], together[i]) for i in range(len(x)))
    assert torch.equal(block(x[37:])[5], together[42])


def test_moe_refuses_lora_adapters_and_splits_that_cut_an_expert(moe_checkpoint, tmp_path):
    from models.lora import load_adapter
    from models.parallel import check_split

    config = load_model(str(moe_checkpoint("qwen2moe")[0]), dtype="float32", device="cpu").config
    with pytest.raises(ValueError, match="does not divide the model's 4 query heads and 2 KV heads and 32 expert features and 64 shared"):
        check_split(config, 3, quantized=False)
    # 2 ranks: 16 expert features each, half a 4-bit group
    with pytest.raises(ValueError, match="splits the 32 expert features down inputs into slices of 16"):
        check_split(config, 2, quantized=True)
    check_split(config, 2, quantized=False)
    # An adapter of a shared expert or a router, or of a sparse layer's MLP, names it; one of
    # a routed expert whose shapes do not fit says what they should be (models/lora_experts.py)
    for key in ("layers.0.mlp.shared_expert_gate", "layers.0.mlp.gate", "layers.0.mlp.up_proj"):
        tensors = {f"base_model.model.model.{key}.lora_A.weight": torch.zeros(2, 64),
                   f"base_model.model.model.{key}.lora_B.weight": torch.zeros(64, 2)}
        _write_adapter(tmp_path / key, tensors)
        with pytest.raises(ValueError, match=f"tensor '.*{re.escape(key)}.*' updates a router"):
            load_adapter("a", tmp_path / key, config, torch.float32, torch.device("cpu"))
    for key, message in (("layers.0.mlp.experts.3.down_proj", r"layer 0 expert 3 down_proj has lora_A \(2, 64\) "
                          r"and lora_B \(64, 2\), expected \(2, 32\) and \(64, 2\)"),
                         ("layers.0.block_sparse_moe.experts.1.w1", r"expected \(2, 64\) and \(32, 2\)"),
                         ("layers.0.mlp.experts.9.w1", "updates no projection of the model's 8 experts"),
                         ("layers.0.mlp.shared_expert.w9", "updates no projection of a shared expert"),
                         ("layers.1.mlp.experts.1.w1", "updates experts of layer 1, which has none"),
                         ("layers.0.mlp.experts", r"experts take \(8 r, 64\) and \(64, 8 r\) for gate_up_proj")):
        tensors = {f"base_model.model.model.{key}.lora_A.weight": torch.zeros(2, 64),
                   f"base_model.model.model.{key}.lora_B.weight": torch.zeros(64, 2)}
        _write_adapter(tmp_path / key, tensors)
        with pytest.raises(ValueError, match=message):
            load_adapter("a", tmp_path / key, config, torch.float32, torch.device("cpu"))


def _write_adapter(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))


# The attention's projections everywhere, and Qwen2-MoE's dense layer's MLP (layer 1).
MOE_LORA_TARGETS = r".*(self_attn\.(q|k|v|o)_proj|layers\.1\.mlp\.(gate|up|down)_proj)"


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe", "gptoss"])
def test_moe_lora_adapters_equal_peft_and_change_no_other_row(moe_checkpoint, tiny_prompt, make_runner,
                                                             tmp_path, arch):
    # OLMoE's norms over the whole q and k projections, gpt-oss's sinks, output bias and
    # windows: an adapter's update goes in where PEFT's does. Its rows beside the base
    # model's, in chunks, are what each gives alone.
    from models.lora import load_adapter

    path, hf = moe_checkpoint(arch)
    _, expected = peft_logits(hf, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8,
                              target_modules=MOE_LORA_TARGETS)
    model = load_model(str(path), dtype="float32", device="cpu").model
    adapter = load_adapter("a", tmp_path / "adapter", model.config, torch.float32, torch.device("cpu"))
    assert ("gate_up_proj" in adapter.layers[1]) == (arch == "qwen2moe")

    got = alone(make_runner, model, tiny_prompt, adapter)
    torch.testing.assert_close(got, expected, **TOL)
    beside_the_base(make_runner, model, tiny_prompt, adapter, got)


# Qwen2-MoE: its shared expert and its dense layer split too; gpt-oss: its sinks split by head,
# its output and experts' down biases added once; w4a8: every rank quantises its experts' slices.
@pytest.mark.parametrize("arch, quantization, overrides", [
    ("qwen2moe", "none", {}), ("gptoss", "w4a8", {"intermediate_size": 64, "swiglu_limit": 7.0})])
def test_two_ranks_compute_the_whole_moes_logits(moe_checkpoint, tmp_path, arch, quantization, overrides):
    from tests.models.test_parallel import run_ranks

    path, _ = moe_checkpoint(arch, **overrides)
    whole = run_ranks(1, path, quantization, tmp_path / "whole.pt")
    split = run_ranks(2, path, quantization, tmp_path / "split.pt")
    assert split.shape == whole.shape == (23, 128)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)
    assert torch.equal(split.argmax(-1), whole.argmax(-1))


# --- GGUF: llama.cpp's stacked expert tensors ---------------------------------------------

# transformers' family -> llama.cpp's general.architecture (Mixtral is `llama` with experts).
GGUF_ARCH = {"mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe", "olmoe": "olmoe",
             "granitemoe": "granitemoe", "gptoss": "gpt-oss"}
# HF module -> llama.cpp tensor kind, written out here so the test does not trust the loader's tables.
_GGUF_KINDS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate": "ffn_gate_inp", "block_sparse_moe.router": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.router": "ffn_gate_inp"}
# The types the gguf package cannot quantise: written as random blocks, the reference their values.
RANDOM_BLOCK_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def write_moe_gguf(path: Path, model, arch: str, expert_type: str | None = None, every_projection: bool = False
                   ) -> Path:
    """Write ``model`` (a transformers MoE of family ``arch``) as llama.cpp's converter does:
    each layer's experts stacked per projection, F32, or ``expert_type`` (a GGUF type the
    ``gguf`` package quantises) for the stacked experts (with ``every_projection``, for the
    attention's and the shared and dense MLPs' projections too), whose dequantised values
    then replace ``model``'s own so that it stays the reference."""
    import gguf

    from gguf_files import blocks, write_header
    from tests.models.test_loader import llama_cpp_permute

    cfg, state = model.config, model.state_dict()
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    write_header(writer, cfg)
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "granitemoe":  # (llama.cpp's converter writes Granite's multipliers so)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gptoss":  # (llama.cpp's converter: the window, YaRN's fields)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])

    def add(name: str, w: torch.Tensor, quantise: bool = False, heads: int | None = None) -> torch.Tensor:
        """Write ``w`` as tensor ``name`` (its rows in llama.cpp's order for ``heads``); return
        the values the file holds, in ``w``'s order."""
        data = w.numpy().astype(np.float32)
        qtype = gguf.GGMLQuantizationType[expert_type] if quantise and expert_type else None
        if qtype is not None and expert_type in RANDOM_BLOCK_TYPES:  # (no quantiser: random blocks)
            flat, held = blocks(expert_type, (data.size // data.shape[-1], data.shape[-1]), seed=len(writer.tensors[0]))
            raw, held = flat.reshape(*data.shape[:-1], -1), held.reshape(data.shape)
        else:
            raw = data if qtype is None else gguf.quants.quantize(data, qtype)
            held = w if qtype is None else torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(data.shape))
        if heads is not None:  # (whole rows move: a quantised row's blocks move with it)
            raw = llama_cpp_permute(raw, heads)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        return held

    for hf, w in list(state.items()):
        if hf in _GGUF_GLOBAL:
            add(_GGUF_GLOBAL[hf], w)
            continue
        _, _, layer, *module, kind = hf.split(".")
        if arch == "gptoss" and module[-1] == "experts":
            # [E, H, 2I] gate and up interleaved, [E, I, H], and their biases: llama.cpp's converter
            # writes them as the other families' stacks ([E, rows, columns]), gate and up apart.
            if kind == "gate_up_proj":
                rows = w.transpose(1, 2)
                gate = add(f"blk.{layer}.ffn_gate_exps.weight", rows[:, 0::2].contiguous(), quantise=True)
                up = add(f"blk.{layer}.ffn_up_exps.weight", rows[:, 1::2].contiguous(), quantise=True)
                state[hf] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
            elif kind == "gate_up_proj_bias":
                add(f"blk.{layer}.ffn_gate_exps.bias", w[:, 0::2].contiguous())
                add(f"blk.{layer}.ffn_up_exps.bias", w[:, 1::2].contiguous())
            elif kind == "down_proj":
                held = add(f"blk.{layer}.ffn_down_exps.weight", w.transpose(1, 2).contiguous(), quantise=True)
                state[hf] = held.transpose(1, 2)
            else:
                add(f"blk.{layer}.ffn_down_exps.bias", w)
            continue
        if arch == "gptoss" and (kind == "sinks" or module == ["post_attention_layernorm"]):
            add(f"blk.{layer}.{'attn_sinks' if kind == 'sinks' else 'post_attention_norm'}.weight", w)
            continue
        if hf.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate then up
            gate, up = w.chunk(2, dim=1)
            state[hf] = torch.cat([add(f"blk.{layer}.ffn_gate_exps.weight", gate, quantise=True),
                                   add(f"blk.{layer}.ffn_up_exps.weight", up, quantise=True)], dim=1)
        elif hf.endswith("experts.down_proj"):
            state[hf] = add(f"blk.{layer}.ffn_down_exps.weight", w, quantise=True)
        else:
            heads = None
            if arch in ("mixtral", "granitemoe") and module[-1] in ("q_proj", "k_proj") and kind == "weight":
                heads = cfg.num_attention_heads if module[-1] == "q_proj" else cfg.num_key_value_heads
            if module == ["mlp", "shared_expert_gate"]:
                w = w.reshape(-1)  # (llama.cpp's converter keeps it one row: 1-D)
            projection = every_projection and module[-1].endswith("_proj") and kind == "weight"
            held = add(f"blk.{layer}.{_GGUF_KINDS['.'.join(module)]}.{kind}", w, projection, heads)
            state[hf] = held.reshape(state[hf].shape)
    model.load_state_dict(state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.skipif(not ops.amx_bf16_usable(), reason="w4a16 needs a CPU with AMX-BF16")
@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_moe_gguf_runs_its_own_codes_on_w4a16(tiny_prompt, make_runner, tmp_path, arch):
    # Every projection Q8_0, the experts' too: each a NativeLinear of the file's blocks.
    from models.gguf_linear import NativeLinear

    reference = tiny_moe(arch)
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", reference, arch, "Q8_0", every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a16").model
    assert isinstance(model.model.layers[0].mlp.experts[7].down_proj, NativeLinear)
    whole = prefill(make_runner(model), tiny_prompt)

    # (inputs rounded to bfloat16 at every projection: near transformers, not equal)
    assert max_diff(whole, reference_logits(reference, tiny_prompt)) < 0.1
    assert torch.equal(chunked_beside_another(make_runner(model, seed=1), tiny_prompt), whole)


@pytest.mark.parametrize("arch, type_name", [("mixtral", "Q8_0"), ("qwen2moe", "Q8_0"), ("gptoss", "MXFP4")])
def test_moe_gguf_runs_its_own_codes_on_w4a8(tiny_prompt, make_runner, tmp_path, arch, type_name):
    # Every projection Q8_0 (gpt-oss: MXFP4), the experts' too: each a NativeA8Linear of the
    # file's blocks.
    from models.gguf_linear import NativeA8Linear

    reference = tiny_moe(arch, **({"swiglu_limit": 7.0} if arch == "gptoss" else {}))
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", reference, arch, type_name, every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    assert isinstance(model.model.layers[0].mlp.experts[7].down_proj, NativeA8Linear)
    whole = prefill(make_runner(model), tiny_prompt)

    # (inputs rounded to int8 per 16 at every projection: near transformers, not equal)
    assert max_diff(whole, reference_logits(reference, tiny_prompt)) < 0.1
    assert torch.equal(chunked_beside_another(make_runner(model, seed=1), tiny_prompt), whole)
    # One token alone is its row of a batch, bit for bit; the experts (Q8_0's D8; gpt-oss's
    # MXFP4 with biases and its clamped SwiGLU) one call a projection
    # (models.experts.FusedExperts), each slot what its expert's own call gives.
    from models.experts import _grouped

    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert block.fused is not None
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    weights, chosen = route(block.gate(x).float(), block.moe)
    fused, counts, rows = block.fused(x, chosen)
    grouped, grouped_counts = _grouped(block.experts, x, chosen)
    assert torch.equal(fused.index_select(0, rows), grouped) and counts == grouped_counts
    # ... and the kernel's whole experts call (biases, clamped SwiGLU) gives their mix's bits
    assert block.fused.activation.kind == (ops.ExpertActivation.CLAMPED_SWIGLU if arch == "gptoss"
                                           else ops.ExpertActivation.SILU_GLU)
    whole, routed = ops.moe_experts(x, block.fused.gate_up, block.fused.down, weights, chosen,
                                    block.fused.activation)
    assert torch.equal(whole, ops.mix_expert_rows(fused, rows, weights)) and routed.tolist() == counts
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    batch = block(x)
    assert all(torch.equal(block(x[i:i + 1])[0], batch[i]) for i in range(9))


@pytest.mark.skipif(not ops.has_int8_dots(), reason="w4a8 needs the kernels' integer dots")
@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "Q6_K", "IQ4_NL"])
def test_moe_gguf_experts_run_in_one_call_a_projection(tiny_prompt, make_runner, tmp_path, type_name):
    # Every projection of a K or table type: the experts held as one weight a projection
    # (FusedExperts), each step's chosen experts in one call, bit for bit their own calls'.
    from models.experts import _grouped

    reference = tiny_moe("qwen3moe", hidden_size=256, moe_intermediate_size=256, head_dim=64, num_experts=16,
                         num_experts_per_tok=4)
    path = write_moe_gguf(tmp_path / "qwen3moe.gguf", reference, "qwen3moe", type_name, every_projection=True)
    model = load_model(str(path), dtype="float32", device="cpu", quantization="w4a8").model
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(b, SparseMoeBlock) and b.fused is not None for b in blocks)
    whole = prefill(make_runner(model), tiny_prompt)
    want = reference_logits(reference, tiny_prompt)  # (x rounded to int8 per 16 at every projection)
    assert max_diff(whole, want) < 0.05 * want.abs().max()
    assert torch.equal(chunked_beside_another(make_runner(model, seed=1), tiny_prompt), whole)

    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    batch = blocks[0](x)
    assert all(torch.equal(blocks[0](x[i:i + 1])[0], batch[i]) for i in (0, 17, 39))
    _, chosen = route(blocks[0].gate(x).float(), blocks[0].moe)
    chosen = chosen.sort(dim=1).values
    fused, counts, rows = blocks[0].fused(x, chosen)
    grouped, grouped_counts = _grouped(blocks[0].experts, x, chosen)
    assert torch.equal(fused.index_select(0, rows), grouped) and counts == grouped_counts


@pytest.mark.parametrize("arch, expert_type", [("mixtral", None), ("qwen2moe", None), ("qwen3moe", None),
                                               ("olmoe", None), ("granitemoe", None), ("qwen2moe", "Q8_0"),
                                               ("gptoss", None), ("gptoss", "MXFP4")])
def test_moe_gguf_matches_transformers(tiny_prompt, make_runner, tmp_path, arch, expert_type):
    # (a gpt-oss file holds no SwiGLU limit: llama.cpp's graph fixes gpt-oss's own, 7)
    reference = tiny_moe(arch, **({"swiglu_limit": 7.0} if arch == "gptoss" else {}))
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", reference, arch, expert_type)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.architecture == type(reference).__name__

    diff = max_diff(prefill(make_runner(loaded.model), tiny_prompt), reference_logits(reference, tiny_prompt))

    assert diff < 1e-4, f"max |logits diff| vs transformers is {diff:.2e}"
    assert make_runner(loaded.model).greedy(tiny_prompt, 4) == reference_greedy(reference, tiny_prompt, 4)
