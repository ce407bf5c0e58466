"""LoRA adapters (models/lora.py) equal PEFT's own forward, and never change another row.

PEFT writes and runs the reference adapters: a tiny random Llama wrapped by
``peft.get_peft_model`` with random A and B (``init_lora_weights=False``),
saved with ``save_pretrained``, gives the logits kvserve must reproduce from
the saved files on the unchanged base checkpoint.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from models import ops
from models.llama import DecoderLayer
from models.loader import load_model
from models.lora import load_adapter

TOL = dict(atol=1e-3, rtol=0)  # float32 rounding (up to 2.1e-4 on EPYCs, 5.0e-4 on a Xeon with AMX); a wrong scale, order or part gives O(0.1)


def peft_adapter(hf_model, path, **lora):
    """Wrap ``hf_model`` in a random PEFT LoRA, save it to ``path``; return the PEFT model."""
    import peft

    torch.manual_seed(1)
    cfg = peft.LoraConfig(init_lora_weights=False, **lora)
    model = peft.get_peft_model(hf_model, cfg).eval()
    with torch.no_grad():  # PEFT's random B is small; make the update as large as the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    model.save_pretrained(path)
    return model


def peft_logits(hf_model, path, ids, **lora) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, adapted)``: ``hf_model``'s logits for ``ids`` before and after ``peft_adapter``
    wraps it (saved to ``path``), checking that the adapter matters."""
    with torch.no_grad():
        base = hf_model(torch.tensor([ids])).logits[0]
        adapted = peft_adapter(hf_model, path, **lora)(torch.tensor([ids])).logits[0]
    assert (adapted - base).abs().max() > 0.1  # the adapter matters
    return base, adapted


def alone(make_runner, model, ids, adapter=None) -> torch.Tensor:
    """The logits of ``ids`` prefilled alone (under ``adapter``, if any)."""
    runner = make_runner(model)
    return runner.step([(runner.new_seq(len(ids)), ids)], [adapter])[0]


def beside_the_base(make_runner, model, ids, adapter, got) -> None:
    """``ids`` under ``adapter`` beside the base model's reversed ``ids``, in two chunks (9
    and 12 tokens first): the adapter's rows are ``got`` (its logits alone), bit for bit,
    and the base model's what it gives alone."""
    base = alone(make_runner, model, ids[::-1])
    runner = make_runner(model, seed=1)
    seq, mate = runner.new_seq(len(ids)), runner.new_seq(len(ids))
    first = runner.step([(seq, ids[:9]), (mate, ids[::-1][:12])], [adapter, None])
    rest = runner.step([(seq, ids[9:]), (mate, ids[::-1][12:])], [adapter, None])
    assert torch.equal(torch.cat([first[0], rest[0]]), got)
    assert torch.equal(torch.cat([first[1], rest[1]]), base)


def load(path, quantization="none"):
    return load_model(str(path), dtype="float32", device="cpu", quantization=quantization).model


def adapter_for(model, path, name="a"):
    return load_adapter(name, path, model.config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("lora", [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"]),
    # Parts of the fused projections left out, rsLoRA's scale, and one rank per module.
    dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "up_proj", "down_proj"],
         rank_pattern={"down_proj": 2}),
    # One alpha per module: a name's end, and a regex naming one layer's module only.
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
         alpha_pattern={"down_proj": 2, r".*layers\.1\.self_attn\.v_proj": 32}),
], ids=["every-projection", "some-rslora-rank-pattern", "alpha-pattern"])
def test_logits_equal_peft(tiny_checkpoint, tiny_prompt, make_runner, tmp_path, lora):
    path, hf = tiny_checkpoint()
    base_ref, expected = peft_logits(hf, tmp_path / "adapter", tiny_prompt, **lora)

    model = load(path)
    adapter = adapter_for(model, tmp_path / "adapter")
    torch.testing.assert_close(alone(make_runner, model, tiny_prompt, adapter), expected, **TOL)
    torch.testing.assert_close(alone(make_runner, model, tiny_prompt), base_ref, **TOL)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_adapters_equal_peft(tiny_checkpoint, tiny_prompt, make_runner, tmp_path, arch):
    # Gemma's layer (four norms, GELU, soft-capping, Gemma 3's q/k norms and windows) runs
    # the updates where Llama's does; its rows beside the base model's are what each gives alone.
    path, hf = tiny_checkpoint(arch)
    _, expected = peft_logits(hf, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = load(path)
    adapter = adapter_for(model, tmp_path / "adapter")
    got = alone(make_runner, model, tiny_prompt, adapter)
    torch.testing.assert_close(got, expected, **TOL)
    base = alone(make_runner, model, tiny_prompt[::-1])
    runner = make_runner(model, seed=1)
    seq, mate = runner.new_seq(len(tiny_prompt)), runner.new_seq(len(tiny_prompt))
    together = runner.step([(seq, tiny_prompt), (mate, tiny_prompt[::-1])], [adapter, None])
    assert torch.equal(together[0], got) and torch.equal(together[1], base)


def test_an_adapter_for_gemma4_is_refused_when_it_loads(tiny_checkpoint, make_lora, tmp_path):
    from engine.lora_registry import LoRARegistry

    path, _ = tiny_checkpoint("gemma4")
    loaded = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    registry = LoRARegistry(loaded, "m", None, {})
    with pytest.raises(ValueError, match="Gemma4ForCausalLM runs no LoRA adapters yet"):
        registry.read("a", str(make_lora(tmp_path / "a", loaded.config)))


@pytest.mark.parametrize("quantization", ["none", "w4a8", "int4"])
def test_rows_of_other_adapters_and_chunks_change_nothing(tiny_checkpoint, tiny_prompt, make_runner,
                                                          make_lora, tmp_path, quantization):
    # Base rows run the fused layer kernel alone and op by op beside adapter rows; adapter
    # rows run alone, in chunks and beside the base and another adapter: bit for bit the same.
    path, _ = tiny_checkpoint()
    model = load(path, quantization)
    a = adapter_for(model, make_lora(tmp_path / "a", model.config, seed=1), "a")
    b = adapter_for(model, make_lora(tmp_path / "b", model.config, rank=2, seed=2), "b")
    other = tiny_prompt[::-1]

    want = {name: alone(make_runner, model, ids, adapter) for name, adapter, ids in
            [("base", None, tiny_prompt), ("a", a, tiny_prompt), ("b", b, other)]}
    assert not torch.equal(want["a"], alone(make_runner, model, tiny_prompt))

    runner = make_runner(model, seed=1)
    seq_a, seq_base, seq_b = (runner.new_seq(len(tiny_prompt)) for _ in range(3))
    got = {"a": [], "base": [], "b": []}
    first = runner.step([(seq_a, tiny_prompt[:7]), (seq_base, tiny_prompt[:10]), (seq_b, other[:5])], [a, None, b])
    for name, logits in zip(["a", "base", "b"], first):
        got[name].append(logits)
    rest = runner.step([(seq_a, tiny_prompt[7:]), (seq_base, tiny_prompt[10:]), (seq_b, other[5:])], [a, None, b])
    for name, logits in zip(["a", "base", "b"], rest):
        got[name].append(logits)
    for name, parts in got.items():
        assert torch.equal(torch.cat(parts), want[name]), name


@pytest.mark.parametrize("quantization", ["w4a8", "int4"])
def test_adapter_rows_in_the_fused_layer_kernel_equal_the_op_by_op_layers(
        tiny_checkpoint, tiny_prompt, make_runner, make_lora, tmp_path, quantization, monkeypatch):
    # With packed projections a step with adapter rows still runs each layer as one kernel
    # call, the updates inside it: prompt chunks beside the base model and another
    # adapter, then decodes, give the op-by-op layers' logits bit for bit.
    path, _ = tiny_checkpoint()
    model = load(path, quantization)
    assert model.model.layers[0].packed_int4()
    a = adapter_for(model, make_lora(tmp_path / "a", model.config, seed=1), "a")
    b = adapter_for(model, make_lora(tmp_path / "b", model.config, rank=2, seed=2,
                                     targets=("k_proj", "down_proj")), "b")
    other = tiny_prompt[::-1]

    def steps():
        runner = make_runner(model)
        seqs = [runner.new_seq(len(tiny_prompt) + 1) for _ in range(3)]
        adapters = [a, None, b]
        out = runner.step([(seqs[0], tiny_prompt[:7]), (seqs[1], tiny_prompt[:10]), (seqs[2], other[:5])], adapters)
        out += runner.step([(seqs[0], tiny_prompt[7:]), (seqs[1], tiny_prompt[10:]), (seqs[2], other[5:])],
                           adapters)
        out += runner.step([(s, [int(lg[-1].argmax())]) for s, lg in zip(seqs, out[3:])], adapters)
        return torch.cat(out)

    calls = []
    fused_layer = ops.fused_layer
    monkeypatch.setattr(ops, "fused_layer", lambda *args, **kw: calls.append(kw["lora"]) or fused_layer(*args, **kw))
    fused = steps()
    layers = len(model.model.layers)
    # Every layer of every step ran fused with both adapters' row ranges.
    assert len(calls) == 3 * layers and all(lora is not None and len(lora[1]) == 4 for lora in calls)
    calls.clear()
    monkeypatch.setattr(DecoderLayer, "packed_int4", lambda self: False)
    plain = steps()
    assert not calls
    assert torch.equal(fused, plain)


def _refused(tmp_path, model, make_lora, match, edit=None, **options):
    path = make_lora(tmp_path / "bad", model.config, **options)
    if edit is not None:
        edit(path)
    with pytest.raises(ValueError, match=match):
        adapter_for(model, path, "bad")


def test_adapters_kvserve_cannot_run_are_refused_by_name(tiny_checkpoint, make_lora, tmp_path):
    path, _ = tiny_checkpoint()
    model = load(path)
    _refused(tmp_path, model, make_lora, "use_dora=True is not supported", use_dora=True)
    _refused(tmp_path, model, make_lora, "modules_to_save", modules_to_save=["lm_head"])
    _refused(tmp_path, model, make_lora, "bias='all'", bias="all")
    _refused(tmp_path, model, make_lora, "not a LoRA adapter", peft_type="IA3")
    _refused(tmp_path, model, make_lora, "lora_alpha must be a positive number", lora_alpha=0)
    _refused(tmp_path, model, make_lora, r"alpha_pattern\['down_proj'\] must be a positive number",
             alpha_pattern={"down_proj": -1})
    _refused(tmp_path, model, make_lora, "is not a regex", alpha_pattern={"(": 2})

    def add_tensor(name, shape):
        def edit(p):
            from safetensors.torch import load_file, save_file
            tensors = load_file(str(p / "adapter_model.safetensors"))
            tensors[name] = torch.zeros(shape)
            save_file(tensors, str(p / "adapter_model.safetensors"))
        return edit

    _refused(tmp_path, model, make_lora, "does not update a decoder projection",
             add_tensor("base_model.model.lm_head.lora_A.weight", (4, 64)))
    _refused(tmp_path, model, make_lora, "layer 7",
             add_tensor("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", (4, 64)))

    def wrong_rank(p):
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(p / "adapter_model.safetensors"))
        key = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
        tensors[key] = torch.zeros(96, 3)
        save_file(tensors, str(p / "adapter_model.safetensors"))

    _refused(tmp_path, model, make_lora, r"layer 0 up_proj has lora_A \(4, 64\) and lora_B \(96, 3\)", wrong_rank)
    _refused(tmp_path, model, make_lora, r"layer 0 q_proj has lora_A \(\)",
             add_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", ()))
    _refused(tmp_path, model, make_lora, r"layer 0 q_proj has lora_A \(0, 64\)",
             add_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (0, 64)))
    _refused(tmp_path, model, make_lora, "has no adapter_model.safetensors",
             lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"))
    _refused(tmp_path, model, make_lora, "not a readable safetensors file",
             lambda p: (p / "adapter_model.safetensors").write_bytes(b"not safetensors"))
    _refused(tmp_path, model, make_lora, "is not JSON",
             lambda p: (p / "adapter_config.json").write_text("{"))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        adapter_for(model, tmp_path / "nowhere")


def gguf_adapter_file(path, tensors: dict[str, np.ndarray], arch: str = "llama", alpha: float | None = None,
                      qtype=None):
    """A GGUF LoRA adapter file as llama.cpp writes one: ``general.type`` adapter,
    ``adapter.type`` lora, ``adapter.lora.alpha`` (unless None), then the tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, w in tensors.items():
        if qtype is None:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    return path


def write_gguf_adapter(path, peft_dir, hf_config, alpha: float | None, qtype=None):
    """The PEFT adapter in ``peft_dir`` as llama.cpp's convert_lora_to_gguf.py writes it:
    ``blk.N.<tensor>.weight.lora_a`` / ``.lora_b``, B's q/k rows permuted as the base
    model's are."""
    from safetensors.torch import load_file
    from test_loader import gguf_name, llama_cpp_permute

    tensors = {}
    for key, tensor in load_file(str(peft_dir / "adapter_model.safetensors")).items():
        hf, _, ab = key.removeprefix("base_model.model.").rpartition(".lora_")
        w = tensor.numpy()
        if ab == "B.weight" and ".q_proj" in hf:
            w = llama_cpp_permute(w, hf_config.num_attention_heads)
        elif ab == "B.weight" and ".k_proj" in hf:
            w = llama_cpp_permute(w, hf_config.num_key_value_heads)
        tensors[f"{gguf_name(hf + '.weight')}.lora_{ab[0].lower()}"] = w
    return gguf_adapter_file(path, tensors, alpha=alpha, qtype=qtype)


def test_a_llama_cpp_gguf_adapter_equals_its_peft_original(tiny_checkpoint, tiny_prompt, make_runner, tmp_path):
    path, hf = tiny_checkpoint()
    reference = peft_adapter(hf, tmp_path / "peft", r=4, lora_alpha=8,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    with torch.no_grad():
        expected = reference(torch.tensor([tiny_prompt])).logits[0]
    model = load(path)

    def logits(adapter):
        runner = make_runner(model)
        return runner.step([(runner.new_seq(len(tiny_prompt)), tiny_prompt)], [adapter])[0]

    peft_logits = logits(adapter_for(model, tmp_path / "peft"))
    gguf_file = write_gguf_adapter(tmp_path / "a.gguf", tmp_path / "peft", hf.config, alpha=8)
    gguf_logits = logits(adapter_for(model, gguf_file))
    torch.testing.assert_close(gguf_logits, expected, **TOL)
    assert torch.equal(gguf_logits, peft_logits)

    # No alpha: the update unscaled (llama.cpp's rule), here 1 instead of 8 / 4.
    half = logits(adapter_for(model, write_gguf_adapter(tmp_path / "b.gguf", tmp_path / "peft", hf.config, None)))
    assert not torch.equal(half, gguf_logits)
    # F16 tensors: the same update as the PEFT adapter's tensors saved in float16.
    import gguf
    from safetensors.torch import load_file, save_file

    f16 = logits(adapter_for(model, write_gguf_adapter(tmp_path / "c.gguf", tmp_path / "peft", hf.config, 8,
                                                        qtype=gguf.GGMLQuantizationType.F16)))
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    save_file({k: v.half() for k, v in tensors.items()}, str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert torch.equal(f16, logits(adapter_for(model, tmp_path / "peft")))
    assert not torch.equal(f16, gguf_logits)


def test_gguf_files_that_are_not_adapters_for_the_model_are_refused(tiny_checkpoint, tmp_path):
    from test_loader import write_gguf

    path, hf = tiny_checkpoint()
    model = load(path)
    with pytest.raises(ValueError, match="not a GGUF LoRA adapter"):
        adapter_for(model, write_gguf(tmp_path / "model.gguf", hf))
    gguf_adapter_file(tmp_path / "qwen.gguf", {"blk.0.attn_q.weight.lora_a": np.zeros((4, 64), np.float32)},
                      arch="qwen2")
    with pytest.raises(ValueError, match="is for a 'qwen2' model, the model is LlamaForCausalLM"):
        adapter_for(model, tmp_path / "qwen.gguf")
    gguf_adapter_file(tmp_path / "embd.gguf", {"token_embd.weight.lora_a": np.zeros((4, 128), np.float32)})
    with pytest.raises(ValueError, match="tensor 'token_embd.weight.lora_a' does not update a decoder projection"):
        adapter_for(model, tmp_path / "embd.gguf")
