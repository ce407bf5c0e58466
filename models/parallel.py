"""Tensor parallelism: one model's layers split across ranks of a ``torch.distributed`` group.

Megatron's split, as vLLM and SGLang do it: each rank keeps ``1/N`` of the
query heads and of the KV heads (so its KV cache holds only its own heads) and
``1/N`` of the MLP's intermediate features:

* ``qkv_proj`` and ``gate_up_proj`` are column-parallel: a rank keeps the output
  rows of its heads / features, so it needs no communication;
* ``o_proj`` and ``down_proj`` are row-parallel: a rank multiplies its slice of
  the inputs and one all-reduce sums the partial products;
* the embedding and the LM head are vocabulary-parallel: a rank keeps
  ``ceil(V/N)`` rows; a lookup is summed over ranks (one rank holds each token's
  row, the others add zeros: exact), the logits are gathered on rank 0.

A mixture of experts splits each expert (and Qwen2-MoE's shared expert) as a dense MLP:
every rank keeps ``1/N`` of each expert's intermediate features and runs the same routing
(the router is whole on every rank); the experts block's output, its experts' partial sums
weighted and added, is all-reduced once. A bias after a row-parallel product (gpt-oss's
output projection and experts' down projections) is added on rank 0 only.

The split is applied to the dense weights after loading and before
quantisation (``quant.prepare_projections``), so every rank quantises its own
slices; 4-bit groups (32 inputs) must not straddle ranks. The fused one-call
layer kernel (``ops.fused_layer``) cannot stop for the all-reduces, so a split
model runs its layers op by op (``LlamaForCausalLM.forward``).

The sums of a row-parallel product are added in another order than on one
rank, so logits differ from one rank's in the last bits (within 1e-4 in
float32); the greedy tokens are the same in practice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.config import ModelConfig

# Inputs per 4-bit quantisation group (``quant.GROUP_SIZE``): a row-parallel
# slice must hold whole groups for the quantised paths.
_QUANT_GROUP = 32
# Tensors up to this many elements (a decode batch's hidden states) are summed
# over ranks by an all-gather, larger ones by gloo's all-reduce.
_GATHER_SUM_LIMIT = 1 << 15


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (the default process group)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place; returns it. Every rank gets the same bits."""
        if x.is_cuda or x.numel() > _GATHER_SUM_LIMIT:
            dist.all_reduce(x)
            return x
        # NOTE: gloo's ring all-reduce of a few rows is latency-bound: measured here
        # (2 vCPUs, 576 floats) 1.5 ms between 2 ranks and 2.9 ms among 3, against
        # 0.55 / 1.9-2.3 ms for an all-gather. So small tensors are gathered and
        # added in rank order, in float32: the same sum on every rank.
        parts = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(parts.unbind(0)), x.contiguous())
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's ``x [R, C]`` side by side, ``[R, N*C]``; other ranks: ``x``."""
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.gather(x, parts, dst=0)
            return torch.cat(parts, dim=1)
        dist.gather(x, None, dst=0)
        return x


def check_split(config: ModelConfig, world_size: int, quantized: bool) -> None:
    """Raise ``ValueError`` naming the numbers if ``config`` cannot be split ``world_size`` ways."""
    if world_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world_size}")
    mlps = _mlp_widths(config)
    problems = []
    for what, n in (("query heads", config.num_attention_heads),
                    ("KV heads", config.num_key_value_heads), *mlps):
        if n % world_size:
            problems.append(f"{n} {what}")
    if problems:
        raise ValueError(f"tensor parallel size {world_size} does not divide the model's "
                         f"{' and '.join(problems)}; choose a divisor of "
                         f"{config.num_key_value_heads} (the KV heads)")
    if quantized:
        for what, width in (("attention output inputs", config.num_attention_heads * config.head_dim),
                            *((f"{name} down inputs", n) for name, n in mlps)):
            if (width // world_size) % _QUANT_GROUP:
                raise ValueError(f"tensor parallel size {world_size} splits the {width} {what} into "
                                 f"slices of {width // world_size}, not whole 4-bit groups of "
                                 f"{_QUANT_GROUP}; use --quantization none")


def _mlp_widths(config: ModelConfig) -> list[tuple[str, int]]:
    """``(what, intermediate features)`` of each kind of MLP the model has."""
    moe = config.moe
    if moe is None:
        return [("MLP features (intermediate_size)", config.intermediate_size)]
    widths = [("expert features", moe.expert_size)]
    if moe.shared_expert_size:
        widths.append(("shared expert features", moe.shared_expert_size))
    if moe.sparse_layers and not all(moe.sparse_layers):
        widths.append(("MLP features (intermediate_size)", config.intermediate_size))
    return widths


def local_kv_heads(config: ModelConfig, world_size: int) -> int:
    """KV heads one rank's cache holds."""
    return config.num_key_value_heads // world_size


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Embedding / LM head rows per rank (the last rank's tail is zero padding)."""
    return -(-vocab_size // world_size)


@dataclass(frozen=True)
class RankSlices:
    """One rank's part of each decoder projection: the output rows it keeps of the
    column-parallel ones (``qkv_proj``, ``gate_up_proj``), the input columns of the
    row-parallel ones (``o_proj``, ``down_proj``)."""

    qkv_rows: torch.Tensor
    gate_up_rows: torch.Tensor
    o_cols: slice
    down_cols: slice


def rank_slices(cfg: ModelConfig, tp: TensorParallel) -> RankSlices:
    """``tp.rank``'s slices of a model of ``cfg`` split ``tp.world_size`` ways."""
    n, r = tp.world_size, tp.rank
    d = cfg.head_dim
    hq, hkv = cfg.num_attention_heads // n, cfg.num_key_value_heads // n
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    # qkv rows: [q heads | k heads | v heads]; this rank's heads of each.
    qkv_rows = torch.cat([torch.arange(r * hq * d, (r + 1) * hq * d),
                          q + torch.arange(r * hkv * d, (r + 1) * hkv * d),
                          q + kv + torch.arange(r * hkv * d, (r + 1) * hkv * d)])
    gate_up_rows, down_cols = _feature_slices(cfg.intermediate_size, tp)
    return RankSlices(qkv_rows, gate_up_rows, slice(r * hq * d, (r + 1) * hq * d), down_cols)


def _feature_slices(features: int, tp: TensorParallel) -> tuple[torch.Tensor, slice]:
    """``tp.rank``'s share of an MLP of ``features`` intermediate features: its rows of
    ``gate_up_proj`` ([gate | up]) and its columns of ``down_proj``."""
    inter, r = features // tp.world_size, tp.rank
    mine = torch.arange(r * inter, (r + 1) * inter)
    return torch.cat([mine, features + mine]), slice(r * inter, (r + 1) * inter)


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Keep this rank's slices of a loaded Llama-family model's dense weights, in place.

    Call after ``load_weights`` and before ``quant.prepare_projections``, once
    ``check_split`` has accepted the split (``loader.load_model`` checks it).
    """
    cfg: ModelConfig = model.config
    n, r = tp.world_size, tp.rank
    d = cfg.head_dim
    hq, hkv = cfg.num_attention_heads // n, cfg.num_key_value_heads // n
    part = rank_slices(cfg, tp)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.qkv_proj, part.qkv_rows)
        _keep_cols(attn.o_proj, part.o_cols, tp)
        if attn.sinks is not None:  # (gpt-oss: one per query head)
            attn.sinks = nn.Parameter(attn.sinks.data[r * hq:(r + 1) * hq].clone(), requires_grad=False)
        attn.num_heads, attn.num_kv_heads = hq, hkv
        attn.q_size, attn.kv_size = hq * d, hkv * d
        attn.tp = mlp.tp = tp
        experts = getattr(mlp, "experts", None)  # (models.moe.SparseMoeBlock, which imports this module)
        if experts is None:
            _split_mlp(mlp, tp)
            continue
        for expert in experts:
            _split_mlp(expert, tp)
        if mlp.shared_expert is not None:
            _split_mlp(mlp.shared_expert, tp)
    # Vocabulary-parallel embedding and head; a tied head stays tied.
    rows = vocab_rows(cfg.vocab_size, n)
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    embed.weight = nn.Parameter(_vocab_slice(embed.weight.data, r, rows), requires_grad=False)
    if tied:
        model.lm_head.weight = embed.weight
    else:
        model.lm_head.weight = nn.Parameter(_vocab_slice(model.lm_head.weight.data, r, rows),
                                            requires_grad=False)
    model.lm_head.out_features = embed.num_embeddings = rows
    model.tp = tp


def embed(embedding: nn.Embedding, ids: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Vocabulary-parallel lookup: this rank's rows, zeros elsewhere, summed over ranks."""
    rows = embedding.weight.shape[0]
    local = ids - tp.rank * rows
    mine = (local >= 0) & (local < rows)
    x = embedding(torch.where(mine, local, torch.zeros_like(local)))
    x = x * mine.unsqueeze(-1).to(x.dtype)
    return tp.all_reduce(x)


def _split_mlp(mlp: nn.Module, tp: TensorParallel) -> None:
    """Keep this rank's share of an MLP's intermediate features (gate and up rows, down columns)."""
    rows, cols = _feature_slices(mlp.intermediate_size, tp)
    _keep_rows(mlp.gate_up_proj, rows)
    _keep_cols(mlp.down_proj, cols, tp)
    mlp.intermediate_size = cols.stop - cols.start


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, rows).contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, rows).contiguous(), requires_grad=False)
    linear.out_features = len(rows)


def _keep_cols(linear: nn.Linear, cols: slice, tp: TensorParallel) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, cols].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and tp.rank:  # (the partial products are summed: one rank adds it)
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)


def _vocab_slice(weight: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    part = weight[rank * rows:(rank + 1) * rows]
    out = weight.new_zeros(rows, weight.shape[1])
    out[:part.shape[0]] = part
    return out
