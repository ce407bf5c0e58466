"""A mixture of experts through the engine: a prompt's tokens and prompt logprobs are the same
alone, batched with others (their tokens routed to the same experts) and after prefix hits
(Qwen2-MoE; gpt-oss with its sinks and a window of 8 on every other layer, shorter than most
prompts, so that its windowed layers' blocks are let go)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.models.conftest import save_tiny_tokenizer
from tests.models.test_moe import tiny_moe

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)


def _checkpoint(tmp_path_factory, arch: str) -> str:
    path = tmp_path_factory.mktemp("moe") / arch
    tiny_moe(arch).save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> str:
    """A tiny Qwen2-MoE checkpoint: 8 experts, top-2, a gated shared expert, a dense second layer."""
    return _checkpoint(tmp_path_factory, "qwen2moe")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "gptoss")


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_moe_answers_do_not_depend_on_the_batch(request, family, quantization):
    engine = LLMEngine(EngineConfig(model=request.getfixturevalue(family), dtype="float32", device="cpu",
                                    quantization=quantization, max_model_len=128))
    # Steps of 100 rows and more: some of a row's elementwise ops run in torch's vector loops
    # in one batch and in their scalar tails in another (Qwen2-MoE's sigmoid gate did differ).
    prompts = [torch.randint(128, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 21, 40, 9, 64, 33)]

    def answers(results) -> list[tuple[list[int], list]]:
        return [(r[0].token_ids, r[0].prompt_logprobs) for r in results]

    alone = [answers(engine.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]
    together = answers(engine.generate(prompts, PARAMS, use_tqdm=False))
    again = answers(engine.generate(prompts[::-1], PARAMS, use_tqdm=False))[::-1]  # prefix hits

    assert together == alone
    assert again == alone


def test_routing_metrics_count_every_token_at_each_sparse_layer(qwen2_moe, tmp_path):
    engine = LLMEngine(EngineConfig(model=qwen2_moe, dtype="float32", device="cpu", quantization="none",
                                    max_model_len=128, expert_routing_metrics=True))
    steps = _kept_steps(engine)
    engine.generate([[5, 6, 7, 8], list(range(40))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    moe = engine.model_config.moe
    sparse = [i for i in range(engine.model_config.num_hidden_layers) if moe.is_sparse(i)]
    assert sparse and all(s.routed_tokens.keys() == set(sparse) for s in steps if s.num_batched_tokens)
    # Every token of a step goes to k experts at every sparse layer.
    for s in steps:
        for counts in s.routed_tokens.values():
            assert len(counts) == moe.num_experts and sum(counts) == s.num_batched_tokens * moe.experts_per_token
    assert sum(s.num_batched_tokens for s in steps) == 44 + 2 * 3
    # Off by default; a dense model has no experts to count.
    assert not any(s.routed_tokens for s in _steps(LLMEngine(EngineConfig(model=qwen2_moe, dtype="float32",
                                                                          device="cpu", max_model_len=128))))
    with pytest.raises(ValueError, match="has no experts"):
        LLMEngine(EngineConfig(model="smollm2", dtype="float32", quantization="none", max_model_len=128,
                               kv_cache_memory=8 << 20, expert_routing_metrics=True))


def _kept_steps(engine: LLMEngine) -> list:
    """The list the engine's StepStats are appended to, step after step, from now on."""
    steps = []
    engine.stat_loggers.append(type("Keep", (), {"record": lambda self, s: steps.append(s)})())
    return steps


def _steps(engine: LLMEngine) -> list:
    steps = _kept_steps(engine)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    return steps
