"""Builders for the model tests: a paged-cache runner and tiny random HF checkpoints."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from models import kv_cache
from models.attention import SeqSpec, build_attention_metadata
from models.lora import LoRABatch

# Small enough to build in milliseconds; 4 query heads over 2 KV heads exercises GQA.
TINY_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@dataclass
class Seq:
    """One sequence in a ``PagedRunner``: its blocks and how many of its tokens are cached."""

    block_table: list[int]
    num_cached: int = 0
    tokens: list[int] = field(default_factory=list)


class PagedRunner:
    """Drives a model through a paged KV cache the way the engine's runner does.

    Block ids are handed out in a shuffled order, so block tables are never contiguous.
    """

    def __init__(self, model: torch.nn.Module, block_size: int = 16, num_blocks: int = 64,
                 seed: int = 0, kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        dtype = kv_dtype or model.model.norm.weight.dtype
        self.model = model
        self.block_size = block_size
        self.kv_caches = kv_cache.allocate_model(cfg, num_blocks, block_size, dtype)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)

    def new_seq(self, max_tokens: int) -> Seq:
        """A sequence with room for ``max_tokens`` tokens."""
        n = kv_cache.cdiv(max_tokens, self.block_size)
        table, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return Seq(table)

    def step(self, work: list[tuple[Seq, list[int]]], adapters: list | None = None) -> list[torch.Tensor]:
        """One forward over a flat batch: each sequence's new tokens follow its cached ones.

        Decodes (one new token) must come first. ``adapters``: per sequence, the
        ``models.lora.LoRAAdapter`` its rows run (None: the base model). Returns,
        per sequence, float32 logits ``[len(new tokens), vocab]``.
        """
        ids, positions, specs, spans = [], [], [], []
        for i, (seq, new) in enumerate(work):
            spans.append((adapters[i] if adapters else None, len(ids), len(new)))
            ids += new
            positions += range(seq.num_cached, seq.num_cached + len(new))
            specs.append(SeqSpec(len(new), seq.num_cached + len(new), seq.block_table))
        meta = build_attention_metadata(specs, self.block_size)
        logits = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches,
                            lora=LoRABatch.of_spans(spans))
        for seq, new in work:
            seq.num_cached += len(new)
            seq.tokens += new
        return list(logits.split([len(new) for _, new in work]))

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Prefill ``prompt``, then decode one argmax token per step; EOS does not stop it."""
        seq = self.new_seq(len(prompt) + max_new_tokens)
        logits = self.step([(seq, prompt)])[0]
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.step([(seq, out[-1:])])[0][-1].argmax()))
        return out


@pytest.fixture(scope="session")  # (the class: module fixtures build runners too)
def make_runner() -> Callable[..., PagedRunner]:
    """``make_runner(model, block_size=16, num_blocks=64, seed=0)`` -> a fresh ``PagedRunner``."""
    return PagedRunner


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers Llama, Qwen2, Qwen3, Phi-3, Mistral or Gemma 2, 3, 4 with ``TINY_CONFIG`` (+ overrides), float32.

    Every parameter is random, norms and biases included, so a loader that
    drops or misplaces any of them changes the logits.
    """
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),  # q, k, v and gate, up stored fused
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
    }[arch]
    if arch in ("phi3", "gemma2", "gemma3", "gemma4"):
        overrides = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    if arch == "qwen3":
        # Qwen3's head_dim is its own (128 where hidden / heads is 64): 32 here, not 16.
        overrides = {"head_dim": 32, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY_CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # (Gemma 4's, saved as a weight)
                b.copy_(0.5 + torch.rand_like(b))
    return model


def save_tiny_tokenizer(path: Path, vocab_size: int = TINY_CONFIG["vocab_size"]) -> None:
    """A word-level ``tokenizer.json`` (``t0``..``t{n-1}``) covering the tiny vocabulary."""
    import tokenizers
    import transformers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(path)


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """``tiny_checkpoint(arch="llama", max_shard_size=None, **config)`` -> (checkpoint dir, HF model).

    The directory holds what ``save_pretrained`` writes (config.json, safetensors)
    plus a tokenizer.json, as a real checkpoint does.
    """
    def build(arch: str = "llama", max_shard_size: str | None = None, **overrides):
        model = tiny_hf_model(arch, **overrides)
        path = tmp_path / f"tiny-{arch}"
        extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, safe_serialization=True, **extra)
        save_tiny_tokenizer(path)
        return path, model

    return build


@pytest.fixture
def tiny_prompt() -> list[int]:
    """21 reproducible random token ids of the tiny vocabulary: more than one 16-token block."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(TINY_CONFIG["vocab_size"], (21,), generator=gen).tolist()
