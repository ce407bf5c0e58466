"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names follow Hugging Face checkpoints, except that q/k/v and
gate/up projections are stored fused (``qkv_proj``, ``gate_up_proj``) so each
layer runs two matmuls fewer; ``load_weights`` maps checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from models import ops
from models.attention import AttentionMetadata, paged_attention
from models.config import ModelConfig
from models.fused import FUSED_PARTS, fused_part_sizes, split_fused_checkpoint
from models.gguf_linear import NativeLinear
from models.parallel import TensorParallel, embed
from models.quant import AmxBf16Linear, QuantizedLinear
from models.rope import RotaryEmbedding, interleave_rotary_rows

if TYPE_CHECKING:
    from models.lora import LayerLoRA, LoRABatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(residual + x), residual + x)`` in one pass."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim ** -0.5
        self.window = window  # a sliding window's positions per query (0: the whole context)
        self.softcap = config.attn_logit_softcap  # scores soft-capped to it (Gemma 2; 0: none)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        # Qwen3: one RMSNorm over head_dim, shared by every query head (and one by every
        # key head), before RoPE. Its weight is stored in the interleaved rotary order
        # of the q/k rows it scales (``load_weights``).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # gpt-oss's attention sinks: one logit per query head in its softmax (models/moe.py sets them).
        self.sinks: nn.Parameter | None = None
        self.tp: TensorParallel | None = None  # set by ``parallel.shard_model``

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` with each query and key head RMS-normalised (Qwen3's q_norm, k_norm)."""
        assert self.q_norm is not None and self.k_norm is not None
        # q_size and kv_size are this rank's when the heads are split (shard_model).
        t, d, q_size, kv_size = qkv.shape[0], self.head_dim, self.q_size, self.kv_size
        q = self.q_norm(qkv[:, :q_size].reshape(-1, d)).reshape(t, q_size)
        k = self.k_norm(qkv[:, q_size:q_size + kv_size].reshape(-1, d)).reshape(t, kv_size)
        return torch.cat([q, k, qkv[:, q_size + kv_size:]], dim=1)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                lora: LayerLoRA | None = None) -> torch.Tensor:
        t = x.shape[0]
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add("qkv_proj", x, qkv)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        q, k, v = ops.rotary_and_cache(qkv, rope.rotations, positions, k_cache, v_cache,
                                       meta.slot_mapping, self.num_heads, self.num_kv_heads)
        sinks = None if self.sinks is None else self.sinks.float()
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window,
                            self.softcap, sinks).reshape(t, self.q_size)
        out = self.o_proj(o)
        if lora is not None:
            out = lora.add("o_proj", o, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.tp: TensorParallel | None = None  # set by ``parallel.shard_model``

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add("gate_up_proj", x, gate_up)
        h = self.activate(gate_up)
        out = self.down_proj(h)
        if lora is not None:
            out = lora.add("down_proj", h, out)
        return out if self.tp is None else self.tp.all_reduce(out)

    @staticmethod
    def activate(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the gate_up projection's output (one row kernel)."""
        return ops.silu_and_mul(gate_up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, config.layer_window(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
                positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                lora: LayerLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the MLP output is added to the residual stream by the
        next norm, so each add travels with a norm in one fused pass. ``lora``: the
        adapters' updates of this layer's projections, for the rows that run one."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, positions, meta, kv_cache, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual

    def packed_int4(self) -> bool:
        """Whether every projection runs one of the fused layer's GEMMs (kvserve's int4
        kernel, or AMX-BF16's on bfloat16 or 4-bit weights), the same for all four, so
        ``forward_fused`` applies."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        fused = all(isinstance(p, (QuantizedLinear, AmxBf16Linear, NativeLinear)) and p.fused for p in projections)
        # (the kernel runs the attention's window, soft-capping and sinks, and o_proj's bias)
        return (fused and norms_fusable(self)
                and {p.kind for p in projections} in ({"int4"}, {"amx-bf16"}, {"w4a16"}, {"native"}, {"native-a8"})
                and all(p.bias is None for p in projections[2:]) and float32_bias(attn.o_proj))

    def fused_weights(self) -> ops.FusedWeights:
        """This layer's ``ops.fused_layer`` arguments that do not change between steps
        (``fused_weights``)."""
        return fused_weights(self, True)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, step: ops.FusedStep,
                      kv_cache: tuple[torch.Tensor, torch.Tensor],
                      lora: LayerLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` in one fused kernel call (see ``packed_int4``) for the step ``step``
        describes; ``lora``: the adapters' updates (``LoRABatch.fusable`` ones)."""
        return ops.fused_layer(x, residual, self.fused_weights(), step, kv_cache[0], kv_cache[1],
                               lora=lora.fused_args() if lora is not None else None)


def same_fused_gemm(*projections: nn.Module) -> bool:
    """Whether every projection runs one of the fused layer kernels' GEMMs, the same one."""
    return (all(getattr(p, "fused", False) for p in projections)
            and len({p.fused_gemm for p in projections}) == 1)


def float32_bias(projection: nn.Module) -> bool:
    """Whether the fused layer kernels add ``projection``'s bias as its forward does: none, or
    float32 (added to the float32 product)."""
    return projection.bias is None or projection.bias.dtype == torch.float32


def norms_fusable(layer: nn.Module) -> bool:
    """Whether the fused layer kernels run ``layer``'s q/k norms (none, or with its norms' eps)."""
    q_norm = layer.self_attn.q_norm
    return q_norm is None or q_norm.eps == layer.input_layernorm.eps


# Modules, parameters and buffers registered anywhere so far (torch's global registration
# hooks count them): a layer's fused arguments, built from its modules, stay what they were
# while this count does. Walking a layer's modules to check cost 17-28 us a layer, about 1%
# of a one-stream decode step (nn.Module.__getattr__ at each step of the walk).
_registrations = 0


def _count_registration(*_args: object) -> None:
    global _registrations
    _registrations += 1


for _hook in (nn.modules.module.register_module_module_registration_hook,
              nn.modules.module.register_module_parameter_registration_hook,
              nn.modules.module.register_module_buffer_registration_hook):
    _hook(_count_registration)


def registrations() -> int:
    """How many modules, parameters and buffers have been registered in this process: unchanged,
    no module anywhere has gained, swapped or replaced one."""
    return _registrations


def fused_weights(layer: nn.Module, with_mlp: bool) -> ops.FusedWeights:
    """A decoder layer's ``ops.FusedWeights`` (its attention and norms, and, ``with_mlp``, its
    MLP's ``gate_up`` and ``down`` projections), built once and rebuilt when a projection or
    norm is replaced (quantised, packed, sharded): checked again only after a registration
    anywhere (``registrations``)."""
    cached = layer.__dict__.get("_fused_weights")
    if cached is not None and cached[2] == _registrations:
        return cached[1]
    attn = layer.self_attn
    mlp = (layer.mlp.gate_up_proj, layer.mlp.down_proj) if with_mlp else ()
    # (Gemma's MLP norms too, where the layer has them)
    mlp_norms = (getattr(layer, "pre_feedforward_layernorm", None), getattr(layer, "post_feedforward_layernorm", None))
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm, *mlp_norms)
    key = (attn.qkv_proj, attn.o_proj, *mlp, *norms)
    if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key)):
        projections = [p.fused_args for p in key[:2 + len(mlp)]]
        gate_up, down = projections[2:] if mlp else ([], [])
        q_norm, k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        sinks = None if attn.sinks is None else attn.sinks.detach().float().contiguous()
        weights = ops.FusedWeights(
            norms[0].weight, norms[1].weight, norms[0].eps, projections[0], attn.qkv_proj.bias, projections[1],
            gate_up, down, attn.num_heads, attn.num_kv_heads, attn.scale, attn.qkv_proj.fused_gemm, q_norm, k_norm,
            attn.o_proj.bias, attn.window, attn.softcap, sinks, *(None if n is None else n.weight for n in mlp_norms))
    else:
        weights = cached[1]
    # A plain attribute (nn.Module.__setattr__ would not register a tuple anyway).
    layer.__dict__["_fused_weights"] = (key, weights, _registrations)
    return weights


class FusedSteps:
    """The ``ops.FusedStep`` of each layer of one step, made on first use: one per group of a
    hybrid cache's layers (their attention metadata)."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        d = meta.num_decodes
        self._starts = meta.query_start_loc[d:] - meta.query_start_loc[d] if d < meta.num_seqs else None
        self._rope, self._positions, self._meta = rope, positions, meta
        self._steps: dict[int, ops.FusedStep] = {}

    def layer(self, i: int) -> ops.FusedStep:
        """Layer ``i``'s step."""
        m = self._meta.for_layer(i)
        step = self._steps.get(id(m))
        if step is None:
            step = self._steps[id(m)] = ops.FusedStep(self._rope.rotations, self._positions, m.slot_mapping,
                                                      m.block_tables, m.context_lens, self._meta.num_decodes,
                                                      self._starts)
        return step


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # An uninitialised weight (load_weights fills it): nn.Embedding's own
        # normal_ init imports torch._dynamo on the meta device the loader builds
        # on, one second of every start-up.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM; ``forward`` runs one flat batch and returns logits for chosen rows."""

    # Whether ``forward`` runs LoRA adapters' rows (``models.lora``); a family whose layers
    # do not says so here, and the engine refuses its adapters when they load.
    runs_lora = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None
        # This rank's place when the layers are split (``parallel.shard_model``).
        self.tp: TensorParallel | None = None

    def init_rope(self, max_positions: int) -> None:
        """Build the cos/sin tables on the model's device and dtype (after weights are loaded)."""
        self.rope = RotaryEmbedding(self.config, max_positions, self.model.norm.weight.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor | None = None, lora: LoRABatch | None = None,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run ``input_ids [T]`` at ``positions [T]``; return float32 logits ``[len(logits_indices), V]``.

        ``logits_indices`` picks the rows to project through the LM head (all rows if None):
        the head is the largest matmul, so only sampled positions pay for it. ``lora``:
        the rows that run a LoRA adapter (``models.lora``); the others run the base model.
        With ``hidden_indices``, returns ``(logits, hidden)``: ``hidden`` holds those rows'
        final hidden states (after the final norm, float32), an embedding's source.
        """
        assert self.rope is not None, "call init_rope() before forward()"
        tp = self.tp
        x = self.model.embed_tokens(input_ids) if tp is None else embed(self.model.embed_tokens, input_ids, tp)
        residual = None
        # With int4-packed projections each layer runs as one kernel call (decodes
        # and prompt chunks alike, LoRA rows too): no per-op Python dispatch. A
        # split layer runs op by op: the kernel cannot stop for the all-reduces.
        # Both paths give a row the same result, bit for bit (tests/models/test_lora.py,
        # tests/models/test_quant.py), so a request's logits do not depend on the path.
        first = self.model.layers[0]
        fused = (tp is None and (lora is None or lora.fusable) and x.dtype == torch.float32
                 and ops.kernels_enabled(x.device) and first.packed_int4())
        if fused:
            steps = FusedSteps(self.rope, positions, meta)
            for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
                x, residual = layer.forward_fused(x, residual, steps.layer(i), kv,
                                                  lora.layer(i) if lora is not None else None)
        else:
            for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
                x, residual = layer(x, residual, self.rope, positions, meta.for_layer(i), kv,
                                    lora.layer(i) if lora is not None else None)
        x, hidden = self.final_norm(x, residual, logits_indices, hidden_indices)
        if tp is None:
            logits = self.lm_head(x).float()
        else:
            # Vocabulary-parallel head: rank 0 gets every rank's slice (others keep their own).
            logits = tp.gather_rows(self.lm_head(x).float())
            logits = logits[:, :self.config.vocab_size] if tp.rank == 0 else logits
        return logits if hidden is None else (logits, hidden)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor | None,
                   hidden_indices: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final norm of the rows ``logits_indices`` picks (all if None), for the LM head, and
        of the rows ``hidden_indices`` picks as float32 hidden states (None if not asked)."""
        hidden = None
        if hidden_indices is not None:
            # The norm is row by row: these rows' values are what they are in any batch.
            hidden = self.model.norm(x.index_select(0, hidden_indices),
                                     residual.index_select(0, hidden_indices))[0].float()
        if logits_indices is not None:
            x, residual = x.index_select(0, logits_indices), residual.index_select(0, logits_indices)
        return self.model.norm(x, residual)[0], hidden

    def use_column_major_weights(self) -> None:
        """Store each projection's weight column-major (same shape, transposed strides).

        ``F.linear`` multiplies by ``weight.t()``, which is then contiguous: MKL's
        CPU GEMM is about 2x faster that way for 4 to 16 rows (a decode batch of
        a few streams) and the same elsewhere (measured, SmolLM2 layer shapes).
        A tied LM head keeps the embedding's row-major layout for the lookups.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not self.model.embed_tokens.weight:
                module.weight.data = module.weight.data.t().contiguous().t()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, checking names and shapes.

        Raises ``ValueError`` naming the tensor for an unknown name, a wrong shape
        or a parameter the checkpoint does not provide.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        for name, tensor in (part for item in weights for part in split_fused_checkpoint(*item, cfg)):
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt, (fused, idx) in FUSED_PARTS.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(ckpt, fused), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {cfg.architecture}")
            dst = param.data
            if cfg.norm_offset and target.endswith("norm.weight"):
                tensor = tensor.float() + cfg.norm_offset  # (Gemma's 1 + w, made once here)
            if shard in (0, 1) and target.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                heads = cfg.num_attention_heads if shard == 0 else cfg.num_key_value_heads
                tensor = interleave_rotary_rows(tensor, heads, cfg.rotary_dim)
            elif target.endswith(("q_norm.weight", "k_norm.weight")):
                tensor = interleave_rotary_rows(tensor, 1)  # scales one head's rows, reordered so
            if shard is not None:
                dst = _shard(dst, target, shard, cfg)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name if shard is None else f"{target}#{shard}")
        expected = set()
        for pname in params:
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected.update(f"{pname}#{i}" for i in range(3))
            elif pname.endswith("gate_up_proj.weight"):
                expected.update(f"{pname}#{i}" for i in range(2))
            else:
                expected.add(pname)
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(_checkpoint_name(m) for m in missing[:5])
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {shown}")


def _checkpoint_name(key: str) -> str:
    """``...gate_up_proj.weight#1`` -> ``...up_proj.weight``: the name the checkpoint lacks."""
    name, _, idx = key.partition("#")
    for ckpt, (fused, i) in FUSED_PARTS.items():
        if idx and f".{fused}." in name and int(idx) == i:
            return name.replace(f".{fused}.", f".{ckpt}.")
    return name


def _shard(fused: torch.Tensor, name: str, idx: int, cfg: ModelConfig) -> torch.Tensor:
    """The rows of a fused parameter that one checkpoint projection fills."""
    sizes = fused_part_sizes("qkv_proj" if "qkv_proj" in name else "gate_up_proj", cfg)
    start = sum(sizes[:idx])
    return fused[start:start + sizes[idx]]
