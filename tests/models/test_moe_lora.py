"""LoRA on a mixture's routed experts (models/lora_experts.py) equals PEFT's, and never changes
another row: PEFT's ``target_parameters`` on transformers 5's stacked experts (what PEFT 0.22
writes for an MoE's gate/up/down), and the per-expert modules of older adapters, against the
base weights with each update merged in."""

from __future__ import annotations

import pytest
import torch

from models.loader import load_model
from models.lora import load_adapter
from models.lora_experts import SHARED
from tests.models.test_lora import TOL, alone, beside_the_base, peft_logits
from tests.models.test_moe import _write_adapter, moe_checkpoint, write_moe_gguf  # noqa: F401 (a fixture)

# Each family's experts module, as transformers 5 names it.
EXPERTS = {"mixtral": "mlp.experts", "qwen2moe": "mlp.experts", "qwen3moe": "mlp.experts", "olmoe": "mlp.experts",
           "granitemoe": "block_sparse_moe.experts", "gptoss": "mlp.experts"}


@pytest.mark.parametrize("arch", sorted(EXPERTS))
def test_lora_on_the_stacked_experts_equals_peft(moe_checkpoint, tiny_prompt, make_runner, tmp_path, arch):
    # PEFT's ParamWrapper: lora_A [r E, in], lora_B [out, r E] a parameter, the second one
    # nested (experts.base_layer.lora_*); gpt-oss's interleaved gate and up; the attention too.
    # Qwen2-MoE's shared expert too (an MLP of linear layers: per module).
    path, hf = moe_checkpoint(arch)
    module = EXPERTS[arch]
    shared = [f"shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")] if arch == "qwen2moe" else []
    _, expected = peft_logits(hf, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8,
                              target_modules=["q_proj", "o_proj", *shared],
                              target_parameters=[f"{module}.gate_up_proj", f"{module}.down_proj"])
    model = load_model(str(path), dtype="float32", device="cpu").model
    adapter = load_adapter("a", tmp_path / "adapter", model.config, torch.float32, torch.device("cpu"))
    sparse = [i for i in range(model.config.num_hidden_layers) if model.config.moe.is_sparse(i)]
    ids = [*range(8), *([SHARED] if shared else [])]
    assert sparse and all(sorted(adapter.experts[i]) == sorted(ids) for i in sparse)
    assert adapter.rank == 4 and adapter.fusable

    got = alone(make_runner, model, tiny_prompt, adapter)
    torch.testing.assert_close(got, expected, **TOL)
    beside_the_base(make_runner, model, tiny_prompt, adapter, got)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_lora_on_expert_modules_equals_the_merged_weights(moe_checkpoint, tiny_prompt, make_runner, tmp_path,
                                                          names):
    # transformers 4's experts were modules (Mixtral's w1 / w3 / w2): an update of some of
    # them, some projections only, is the base weight plus s B A in transformers' stacked one.
    path, hf = moe_checkpoint("qwen3moe")
    h, i, r, alpha = 64, 32, 2, 6.0
    gen = torch.Generator().manual_seed(5)
    tensors, merged = {}, {k: v.clone() for k, v in hf.state_dict().items()}
    for layer, expert, name in ((0, 1, names[0]), (0, 1, names[2]), (0, 6, names[1]), (1, 3, names[0])):
        a = torch.randn(r, i if name == names[2] else h, generator=gen)
        b = torch.randn(h if name == names[2] else i, r, generator=gen)
        key = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{name}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
        delta = alpha / r * b @ a
        if name == names[2]:
            merged[f"model.layers.{layer}.mlp.experts.down_proj"][expert] += delta
        else:
            rows = slice(0, i) if name == names[0] else slice(i, 2 * i)
            merged[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert][rows] += delta
    _write_adapter(tmp_path / "adapter", tensors)
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 6}')
    hf.load_state_dict(merged)
    with torch.no_grad():
        expected = hf(torch.tensor([tiny_prompt])).logits[0]

    model = load_model(str(path), dtype="float32", device="cpu").model
    adapter = load_adapter("a", tmp_path / "adapter", model.config, torch.float32, torch.device("cpu"))
    assert sorted(adapter.experts[0]) == [1, 6] and sorted(adapter.experts[1]) == [3]
    assert sorted(adapter.experts[0][1]) == ["down_proj", "gate_up_proj"] and adapter.rank == r
    got = alone(make_runner, model, tiny_prompt, adapter)
    torch.testing.assert_close(got, expected, **TOL)
    assert (got - alone(make_runner, model, tiny_prompt)).abs().max() > 0.1  # (the update matters)


@pytest.mark.parametrize("arch, type_name", [("qwen3moe", "Q8_0"), ("gptoss", "MXFP4")])
def test_lora_on_experts_held_by_the_kernels(moe_checkpoint, tiny_prompt, make_runner, tmp_path, arch, type_name):
    # A GGUF's experts on w4a8, one weight a projection (FusedExperts): a step holding an
    # expert adapter leaves the layer's one call, the experts' products stay one call a
    # projection and the kernels add each slot's update (ops.lora_expert_rows; gpt-oss's
    # biases and clamped SwiGLU between). Its rows and the base model's beside them are what
    # each gives alone, and the block's output is one call an expert's, to rounding.
    from models import ops
    from models.experts import mix_experts
    from models.lora import LoRABatch
    from models.moe import route

    if not (ops.kernels_available() and ops.has_int8_dots()):
        pytest.skip("w4a8 needs the kernels' integer dots")
    path, hf = moe_checkpoint(arch, **({"swiglu_limit": 7.0} if arch == "gptoss" else {}))
    gguf = write_moe_gguf(tmp_path / "e.gguf", hf, arch, type_name, every_projection=True)  # (hf: its values)
    base, expected = peft_logits(hf, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8, target_modules=[],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = load_model(str(gguf), dtype="float32", device="cpu", quantization="w4a8").model
    assert all(layer.mlp.fused is not None for layer in model.model.layers)
    adapter = load_adapter("a", tmp_path / "adapter", model.config, torch.float32, torch.device("cpu"))
    block = model.model.layers[0].mlp
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, chosen = route(block.gate(x).float(), block.moe)
    lora = LoRABatch.of_spans([(adapter, 1, 4)]).layer(0).experts(7)  # (rows 1-4 under the adapter)
    held = mix_experts(block.experts, x, weights, chosen, block.fused, lora)[0]
    assert adapter.experts[0].made == []  # (the kernels' stacks only: the adapter held once)
    each = mix_experts(block.experts, x, weights, chosen, None, lora)[0]
    assert adapter.experts[0].made  # (one call an expert: its own updates, made from the stacks)
    torch.testing.assert_close(held, each, rtol=1e-4, atol=1e-4)
    plain = mix_experts(block.experts, x, weights, chosen, block.fused)[0]
    assert torch.equal(held[[0, 5, 6]], plain[[0, 5, 6]]) and (held[1:5] - plain[1:5]).abs().max() > 1e-2
    got = alone(make_runner, model, tiny_prompt, adapter)
    # The file's exact path equals PEFT; on w4a8 x is rounded to int8 per 16 at every
    # projection, which the adapted experts' larger activations carry further (0.13 on a
    # change of 3.8 for Qwen3-MoE, 0.56 on 3.9 for gpt-oss): the change the adapter makes
    # there points where PEFT's does.
    exact = load_model(str(gguf), dtype="float32", device="cpu", quantization="none").model
    torch.testing.assert_close(alone(make_runner, exact, tiny_prompt, adapter), expected, **TOL)
    change = (got - alone(make_runner, model, tiny_prompt)).flatten()
    assert torch.nn.functional.cosine_similarity(change, (expected - base).flatten(), dim=0) > 0.99
    beside_the_base(make_runner, model, tiny_prompt, adapter, got)


def test_an_expert_adapter_through_the_engine_answers_the_same_alone_and_batched(moe_checkpoint, tmp_path):
    # `--lora-modules` to a request's answer: an expert adapter's request, arriving beside
    # the base model's and in chunks, gets the logprobs it gets alone, and they are not the
    # base model's.
    from engine.config import EngineConfig, LoRAModule
    from engine.llm_engine import LLMEngine
    from tests.engine.test_lora_engine import run

    path, hf = moe_checkpoint("olmoe")
    peft_logits(hf, tmp_path / "adapter", list(range(3, 20)), r=4, lora_alpha=8, target_modules=[],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    loaded = load_model(str(path), dtype="float32", device="cpu")

    def engine(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", max_model_len=256,
                                      lora_modules=(LoRAModule("moe", str(tmp_path / "adapter")),),
                                      **overrides), loaded=loaded)

    prompts = [list(range(5, 40)), list(range(60, 71))]
    # (greedy, 6 tokens and their logprobs: tests/engine/test_lora_engine.py's run)
    cold = {(a, i): run(engine(enable_prefix_caching=False), [("r", p, a)])["r"][:2]
            for a in (None, "moe") for i, p in enumerate(prompts)}
    assert all(cold[("moe", i)][1] != cold[(None, i)][1] for i in range(len(prompts)))
    work = [(f"{a}-{i}", p, a) for a in (None, "moe") for i, p in enumerate(prompts)]
    got = run(engine(max_num_batched_tokens=16), work, {rid: k for k, (rid, _, _) in enumerate(work)})
    assert all(got[f"{a}-{i}"][:2] == cold[(a, i)] for a in (None, "moe") for i in range(len(prompts)))


@pytest.mark.parametrize("k, n", [(64, 48), (70, 33)])  # (vector widths dividing both, and neither)
def test_the_kernels_expert_updates_are_each_rows_own(k, n):
    # ops.lora_expert_rows: y[s] += B_e (A_e x[s]) for its expert e (-1: none), as float64
    # computes it to rounding, and a row's update the same bits alone or among any rows.
    from models import ops

    if not ops.kernels_available():
        pytest.skip("the C++ kernels")
    gen = torch.Generator().manual_seed(2)
    experts, r, rows = 5, 3, 9
    a, bt = torch.randn(experts, r, k, generator=gen), torch.randn(experts, r, n, generator=gen)
    x, y = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
    expert = torch.tensor([0, 4, -1, 2, 2, 4, -1, 1, 3])
    got = ops.lora_expert_rows(y.clone(), x, expert, a, bt)
    want = y.double().clone()
    for s, e in enumerate(expert.tolist()):
        if e >= 0:
            want[s] += bt[e].double().T @ (a[e].double() @ x[s].double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[expert < 0], y[expert < 0])
    for s in range(rows):
        alone = ops.lora_expert_rows(y[s:s + 1].clone(), x[s:s + 1], expert[s:s + 1], a, bt)
        assert torch.equal(alone[0], got[s])


@pytest.mark.parametrize("arch, type_name", [("qwen3moe", "Q4_K"), ("gptoss", "MXFP4"), ("qwen2moe", "Q4_K")])
def test_an_expert_adapter_runs_in_the_fused_moe_layer_with_the_op_by_op_bits(moe_checkpoint, tiny_prompt,
                                                                                make_runner, tmp_path, monkeypatch,
                                                                                arch, type_name):
    # A step holding an expert adapter (and the attention's; Qwen2-MoE's shared expert's too)
    # keeps each sparse layer one kernel call (ops.fused_moe_layer; the experts' updates added
    # inside moe_experts, the shared expert's by its MLP): the adapter's rows and the base
    # model's beside them are the op-by-op layers' bits.
    from models import ops
    from models.moe import MoEDecoderLayer, SparseMoeBlock

    if not (ops.kernels_available() and ops.has_int8_dots()):
        pytest.skip("the fused layers are C++ kernels; w4a8 needs integer dots")
    shapes = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "moe_intermediate_size": 256}
    overrides = {"swiglu_limit": 7.0} if arch == "gptoss" else shapes if arch == "qwen3moe" else {
        **shapes, "shared_expert_intermediate_size": 256, "intermediate_size": 256}
    path, hf = moe_checkpoint(arch, **overrides)
    gguf = write_moe_gguf(tmp_path / "e.gguf", hf, arch, type_name, every_projection=True)
    shared = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"] * (arch == "qwen2moe")
    peft_logits(hf, tmp_path / "adapter", tiny_prompt, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", *shared],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = load_model(str(gguf), dtype="float32", device="cpu", quantization="w4a8").model
    adapter = load_adapter("a", tmp_path / "adapter", model.config, torch.float32, torch.device("cpu"))
    sparse = [layer for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert adapter.fusable and sparse and all(layer.fused_moe_weights() is not None for layer in sparse)

    calls = []
    fused_moe_layer = ops.fused_moe_layer
    monkeypatch.setattr(ops, "fused_moe_layer", lambda *a, **kw: calls.append(a[-1]) or fused_moe_layer(*a, **kw))
    got = alone(make_runner, model, tiny_prompt, adapter)
    assert calls and all(args is not None for args in calls)  # (the experts' updates went in)
    beside_the_base(make_runner, model, tiny_prompt, adapter, got)
    monkeypatch.setattr(MoEDecoderLayer, "fused_moe_weights", lambda self: None)
    assert torch.equal(alone(make_runner, model, tiny_prompt, adapter), got)
    # The kernels added the routed experts' updates from their stacks: no expert's own made.
    assert all(layer.made == [SHARED] * (arch == "qwen2moe") for layer in adapter.experts if layer)


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "mixtral", "gptoss"])
def test_a_llama_cpp_gguf_expert_adapter_equals_its_per_module_original(moe_checkpoint, tiny_prompt, make_runner,
                                                                        tmp_path, arch):
    # llama.cpp's convert_lora_to_gguf.py stacks an expert adapter as the model's experts
    # (blk.N.ffn_{gate,up,down}_exps.weight.lora_a [E, r, in], .lora_b [E, out, r], which its
    # build_lora_mm_id reads; Qwen2-MoE's shared expert as ffn_*_shexp, Mixtral under the
    # `llama` architecture): read back one an expert, it is the per-module PEFT adapter it was
    # made from, bit for bit, in the kernels' stacked form too.
    from models import gguf_loader
    from models.moe_config import GGUF_MOE_ARCHITECTURES
    from tests.models.test_lora import gguf_adapter_file

    path, hf = moe_checkpoint(arch)
    model = load_model(str(path), dtype="float32", device="cpu").model
    cfg = model.config
    e_count, h, r, alpha = cfg.moe.num_experts, cfg.hidden_size, 2, 6.0
    gen = torch.Generator().manual_seed(11)
    peft, gguf = {}, {}
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.moe.is_sparse(i)]
    for layer in sparse:
        kinds = [("experts", "exps", e_count, cfg.moe.expert_size)]
        if arch == "qwen2moe":
            kinds.append(("shared_expert", "shexp", 0, cfg.moe.shared_expert_size))
        for module, suffix, count, i in kinds:
            for proj, out, inn in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                a = torch.randn(max(count, 1), r, inn, generator=gen) * 0.5
                b = torch.randn(max(count, 1), out, r, generator=gen) * 0.5
                name = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_{suffix}.weight"
                gguf[f"{name}.lora_a"], gguf[f"{name}.lora_b"] = (a.numpy(), b.numpy()) if count else (a[0].numpy(),
                                                                                                        b[0].numpy())
                for e in range(max(count, 1)):
                    key = f"base_model.model.model.layers.{layer}.mlp.{module}" + (f".{e}" if count else "")
                    peft[f"{key}.{proj}.lora_A.weight"], peft[f"{key}.{proj}.lora_B.weight"] = a[e], b[e]
    _write_adapter(tmp_path / "peft", peft)
    (tmp_path / "peft" / "adapter_config.json").write_text(f'{{"peft_type": "LORA", "r": {r}, "lora_alpha": {alpha}}}')
    arch_name = "llama" if arch == "mixtral" else next(k for k, v in {**gguf_loader.ARCHITECTURES,
                                                                      **GGUF_MOE_ARCHITECTURES}.items()
                                                        if v == cfg.architecture)
    as_gguf = gguf_adapter_file(tmp_path / "a.gguf", gguf, arch=arch_name, alpha=alpha)

    def read(where):
        return load_adapter("a", where, cfg, torch.float32, torch.device("cpu"))

    original, converted = read(tmp_path / "peft"), read(as_gguf)
    for layer in sparse:
        assert sorted(converted.experts[layer]) == sorted(original.experts[layer])
        for proj, stack in original.expert_stacks[layer].items():
            assert all(torch.equal(x, y) for x, y in zip(stack, converted.expert_stacks[layer][proj]))
    got = alone(make_runner, model, tiny_prompt, converted)
    assert torch.equal(got, alone(make_runner, model, tiny_prompt, original))
    assert (got - alone(make_runner, model, tiny_prompt)).abs().max() > 0.1  # (the update matters)
    # Without adapter.lora.alpha llama.cpp runs the update unscaled, and so does kvserve.
    unscaled = read(gguf_adapter_file(tmp_path / "b.gguf", gguf, arch=arch_name))
    layer, proj = sparse[0], "down_proj"
    torch.testing.assert_close(unscaled.expert_stacks[layer][proj].bt * (alpha / r),
                               converted.expert_stacks[layer][proj].bt)


def test_gguf_expert_adapters_that_do_not_fit_are_refused(moe_checkpoint, tmp_path):
    # A router's update, experts of another count, llama.cpp's fused gate_up experts: a
    # message naming the tensor, never a crash at the first step.
    import numpy as np

    from tests.models.test_lora import gguf_adapter_file

    path, _ = moe_checkpoint("qwen3moe")
    cfg = load_model(str(path), dtype="float32", device="cpu").config
    h, i, e_count = cfg.hidden_size, cfg.moe.expert_size, cfg.moe.num_experts
    cases = {
        "router": ({"blk.0.ffn_gate_inp.weight.lora_a": np.zeros((2, h), np.float32),
                    "blk.0.ffn_gate_inp.weight.lora_b": np.zeros((e_count, 2), np.float32)}, "router"),
        "count": ({"blk.0.ffn_up_exps.weight.lora_a": np.zeros((e_count + 1, 2, h), np.float32),
                   "blk.0.ffn_up_exps.weight.lora_b": np.zeros((e_count + 1, i, 2), np.float32)},
                  r"ffn_up_exps\.weight\.lora_a' has shape"),
        "fused": ({"blk.0.ffn_gate_up_exps.weight.lora_a": np.zeros((e_count, 2, h), np.float32),
                   "blk.0.ffn_gate_up_exps.weight.lora_b": np.zeros((e_count, 2 * i, 2), np.float32)},
                  "fused gate_up experts"),
        "rank": ({"blk.0.ffn_down_exps.weight.lora_a": np.zeros((e_count, 2, i), np.float32),
                  "blk.0.ffn_down_exps.weight.lora_b": np.zeros((e_count, h, 3), np.float32)},
                 "layer 0 expert 0 down_proj has lora_A"),
    }
    for case, (tensors, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_adapter("a", gguf_adapter_file(tmp_path / f"{case}.gguf", tensors, arch="qwen3moe"), cfg,
                         torch.float32, torch.device("cpu"))
