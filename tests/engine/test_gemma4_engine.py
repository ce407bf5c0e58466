"""Gemma 4 through the engine, with the published models' shape: full layers of four times
the windowed ones' head size and one KV head (global_head_dim, num_global_key_value_heads), the
last two layers reading earlier layers' caches, a window of 8 under prompts of up to 64
tokens. Its hybrid cache views each slot's memory at two row shapes (``kv_cache.allocate``);
a prompt's tokens and prompt logprobs are the same alone, batched and after prefix hits, and
its greedy tokens are transformers'."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from models import kv_cache
from tests.models.conftest import save_tiny_tokenizer, tiny_hf_model

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
GEMMA4 = dict(num_hidden_layers=6, head_dim=16, global_head_dim=64, sliding_window=8, attention_k_eq_v=True,
              num_global_key_value_heads=1, layer_types=["sliding_attention", "full_attention"] * 3,
              hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, num_kv_shared_layers=2)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    model = tiny_hf_model("gemma4", **GEMMA4)
    path = tmp_path_factory.mktemp("gemma4") / "tiny"
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path), model


def _prompts() -> list[list[int]]:
    return [torch.randint(128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 21, 40, 64)]


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_gemma4_answers_do_not_depend_on_the_batch(gemma4, quantization):
    engine = LLMEngine(EngineConfig(model=gemma4[0], dtype="float32", device="cpu", quantization=quantization,
                                    max_model_len=128))
    cfg = engine.model_config
    assert cfg.layer_attention == ((2, 16), (1, 64)) * 3 and cfg.kv_sources == (0, 1, 2, 3, 2, 3)
    # Two groups (windowed, full) of two layers; the KV-sharing layers hold no cache.
    assert engine.kv_layout.group_windows == (0, 8) and engine.kv_layout.num_slots == 2
    caches = engine.runner.kv_caches
    assert caches[0][0].shape[2:] == (2, 16) and caches[1][0].shape[2:] == (1, 64)
    # (a windowed layer's rows fill half of each block of the slot it shares with a full one)
    assert caches[0][0].stride(0) == 2 * caches[0][0][0].numel() and not caches[0][0].is_contiguous()
    assert caches[4][0].data_ptr() == caches[2][0].data_ptr()

    def answers(results) -> list[tuple[list[int], list]]:
        return [(r[0].token_ids, r[0].prompt_logprobs) for r in results]

    prompts = _prompts()
    alone = [answers(engine.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]
    together = answers(engine.generate(prompts, PARAMS, use_tqdm=False))
    again = answers(engine.generate(prompts[::-1], PARAMS, use_tqdm=False))[::-1]  # prefix hits

    assert together == alone
    assert again == alone
    assert engine.kv_cache.stats.num_blocks_used == 0 or engine.config.enable_prefix_caching


@torch.no_grad()
def test_gemma4_greedy_tokens_are_transformers(gemma4):
    path, reference = gemma4
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", quantization="none",
                                    max_model_len=128, kv_cache_dtype="float32"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in _prompts()[1:]:  # (21 to 64 tokens: past the window of 8)
        got = engine.generate([prompt], params, use_tqdm=False)[0][0].token_ids
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(prompt):]


def test_a_block_holds_the_full_layers_rows_in_each_slot(gemma4):
    # What the budget buys: a block id is 2 slots of the larger (full) layer's rows, K and V.
    engine = LLMEngine(EngineConfig(model=gemma4[0], dtype="float32", device="cpu", quantization="none",
                                    max_model_len=128, kv_cache_dtype="float16"))
    shapes = kv_cache.model_shapes(engine.model_config)
    assert kv_cache.block_bytes(engine.kv_layout, shapes, engine.block_size, torch.float16) == \
        2 * 2 * engine.block_size * max(2 * 16, 1 * 64) * 2


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """The 26B-A4B's shape, small: 8 experts (top-2) beside every layer's MLP."""
    model = tiny_hf_model("gemma4", **{**GEMMA4, "num_kv_shared_layers": 0, "enable_moe_block": True,
                                       "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32})
    path = tmp_path_factory.mktemp("gemma4-moe") / "tiny"
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path), model


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_gemma4_experts_answer_the_same_in_any_batch(gemma4_moe, quantization):
    # A token's experts and their sum do not depend on which tokens share them.
    engine = LLMEngine(EngineConfig(model=gemma4_moe[0], dtype="float32", device="cpu", quantization=quantization,
                                    max_model_len=128, kv_cache_dtype="float32"))
    assert engine.model_config.gemma4.experts.num_experts == 8
    prompts = _prompts()
    answers = [[(r[0].token_ids, r[0].prompt_logprobs) for r in engine.generate([p], PARAMS, use_tqdm=False)][0]
               for p in prompts]
    together = [(r[0].token_ids, r[0].prompt_logprobs) for r in engine.generate(prompts, PARAMS, use_tqdm=False)]
    assert together == answers
    if quantization == "none":  # and the greedy tokens are transformers' (a float32 cache: the exact path)
        reference = gemma4_moe[1]
        for prompt, (tokens, _) in zip(prompts[1:], answers[1:]):
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(len(tokens)):
                    ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
            assert tokens == ids[len(prompt):]
