"""LoRA adapters: low-rank updates of a loaded model's projections, per request.

An adapter trained with PEFT (a directory holding ``adapter_config.json`` and
``adapter_model.safetensors``, or the ``.gguf`` file llama.cpp's
``convert_lora_to_gguf.py`` makes of one) changes each targeted projection ``W`` of the
base model into ``W + s * B @ A`` (``A [r, in]``, ``B [out, r]``, ``s =
lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA; ``alpha_pattern``'s alpha for the modules
it names, as PEFT reads it). The base weights are never
changed: a forward adds ``s * (x @ A^T) @ B^T`` to the projection's output for
the rows of the requests that asked for the adapter (``LoRABatch``), so one
server answers the base model and any number of adapters in the same batch.

The model stores q/k/v and gate/up fused (``models.fused``); an adapter's
updates of those are stacked the same way: the ``A`` matrices one above the
other, the ``B`` matrices block-diagonal, with the q and k rows in the
interleaved rotary order of the fused weight. The scale is folded into ``B``.

A mixture's routed experts take updates too, read per expert (``models.lora_experts``) and
added in each expert's own call on its rows (``models.experts``).

On a CPU with kvserve's kernels both products run ``ops.dense_linear``, whose
result for a row does not depend on the other rows, so a request's logits are
the same however it was batched (and beside whichever adapters). A layer that
runs as one fused kernel call (``ops.fused_layer``) makes the same calls
inside it (``LoRABatch.fused_args``), so the path changes no bit either.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from models import gguf_loader, ops
from models.config import ModelConfig
from models.dense import DTYPES, pack_dense
from models.fused import FUSED_PARTS, fused_part_sizes
from models.lora_experts import (EXPERT_TENSOR, SHARED, ExpertLoRA, ExpertStack, ExpertUpdates, gguf_expert_tensors,
                                 pair_rank, read_expert_updates, stack_experts, stack_parts)
from models.moe_config import GGUF_MOE_ARCHITECTURES
from models.parallel import RankSlices, TensorParallel, rank_slices
from models.rope import interleave_rotary_rows

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Checkpoint projection -> (the model's fused projection, place in it).
_TARGETS = {**FUSED_PARTS, "o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0)}
# The fused layer kernel's order of a layer's projections (models/csrc/fused_layer.cpp).
_FUSED_ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_NO_UPDATE = torch.empty(0)
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# An MoE's experts, shared experts and routers (Mixtral's are under block_sparse_moe).
_EXPERT = re.compile(r"(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts|shared_expert\w*|gate|router)\.")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")

# PEFT options that change what the adapter computes, with the value that means
# "plain LoRA". An adapter that sets any other value is refused, not run wrong.
_PLAIN = {
    "use_dora": False, "modules_to_save": None, "bias": "none", "lora_bias": False,
    "fan_in_fan_out": False, "layer_replication": None,
    "trainable_token_indices": None, "alora_invocation_tokens": None,
}
# (``target_parameters``, LoRA on a module's parameters such as an MoE's stacked experts, is
# not an option to refuse: PEFT 0.22 names them in every adapter of an MoE model. The
# tensors it saves for the experts are read as their updates, ``models.lora_experts``.)


class LoRAUpdate:
    """One fused projection's update: ``delta(x) = (x @ A^T) @ B^T``, the scale in ``B``
    (``A [rank, in]``: for a fused projection, the sum of its parts' ranks)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.rank, self.out_features = a.shape[0], b.shape[0]
        # Packed for ops.dense_linear where the kernels run this dtype (see the module's docstring).
        self.packed = ops.kernels_enabled(a.device) and a.dtype in DTYPES
        self.a = pack_dense(a) if self.packed else a.contiguous()
        self.b = pack_dense(b) if self.packed else b.contiguous()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return ops.dense_linear(ops.dense_linear(x, self.a, self.rank), self.b, self.out_features)
        return F.linear(F.linear(x, self.a), self.b)


@dataclass
class LoRAAdapter:
    """A loaded adapter: per decoder layer, the updates of the projections it targets."""

    name: str
    path: str
    rank: int  # the largest rank of its projections
    layers: list[dict[str, LoRAUpdate]]
    # Per decoder layer, a mixture's experts' updates: expert -> projection -> update
    # (``models.lora_experts.ExpertUpdates``; ``SHARED``: the shared expert); empty where it
    # updates none.
    experts: list[Mapping[int, dict[str, LoRAUpdate]]] = field(default_factory=list)
    # ... and the routed experts' stacked per projection, for the kernels (``ExpertStack``).
    expert_stacks: list[dict[str, ExpertStack]] = field(default_factory=list)

    @cached_property
    def fusable(self) -> bool:
        """Whether ``ops.fused_layer`` and ``ops.fused_moe_layer`` can run its updates: every
        one is packed for ``ops.dense_linear`` in float32, the fused kernels' activations (the
        routed experts' the kernels add from ``expert_stacks``)."""
        shared = [u for layer in self.experts for u in layer.get(SHARED, {}).values()]
        return all(u.packed and u.a.dtype == torch.float32
                   for u in (*shared, *(u for layer in self.layers for u in layer.values())))

    @cached_property
    def fused_layers(self) -> list[list[torch.Tensor]]:
        """Per decoder layer, ``(A, B)`` of each projection in ``ops.fused_layer``'s order
        (empty tensors where the adapter leaves one alone); a sparse layer's MLP updates are
        its shared expert's (``ops.fused_moe_layer`` runs them there)."""
        return [[t for proj in _FUSED_ORDER
                 for t in ((own[proj].a, own[proj].b) if proj in own else (_NO_UPDATE, _NO_UPDATE))]
                for own in ({**(self.experts[i].get(SHARED, {}) if self.experts else {}), **layer}
                            for i, layer in enumerate(self.layers))]


def load_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel | None = None) -> LoRAAdapter:
    """Read the LoRA adapter at ``path``, named ``name``, for a model of ``config`` whose
    activations are ``dtype`` on ``device``: a PEFT directory, or a llama.cpp GGUF
    adapter file (``convert_lora_to_gguf.py``'s output).

    With ``tp``, only this rank's part is kept, split as the model's projections
    are (``models.parallel``): the B rows of the column-parallel ones, the A
    columns of the row-parallel ones (whose partial updates the layer's
    all-reduce sums with the partial products).

    Raises ``ValueError`` naming what is wrong: a missing file, an adapter
    kind or option kvserve does not run (DoRA, biases, ``modules_to_save``,
    ...), a tensor that updates something other than a decoder projection
    (the embedding, the LM head), or a shape that does not fit the model.
    """
    path = Path(path)
    patterns: dict[str, float] = {}
    if path.suffix == ".gguf" and path.is_file():
        where, tensors, alpha, rslora = _read_gguf_adapter(name, path, config)
    else:
        where, tensors, alpha, rslora, patterns = _read_peft_adapter(name, path)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    module_of: dict[tuple[int, str], str] = {}  # (layer, projection) -> the module's name, for alpha_pattern
    expert_tensors: list[tuple[str, re.Match[str], torch.Tensor]] = []
    for key, tensor in tensors:
        m = _TENSOR.search(key)
        if _updates_an_expert(key, m, config):
            if config.moe is not None and (em := EXPERT_TENSOR.search(key)) is not None:
                expert_tensors.append((key, em, tensor.to(torch.float32)))
                continue
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} updates a router (the experts' or a "
                             "shared expert's gate) or a sparse layer's MLP; on a mixture of experts kvserve runs "
                             "LoRA on the attention, the dense MLP layers and the routed and shared experts")
        if m is None or m.group(2) not in _TARGETS:
            raise _not_a_projection(name, key)
        layer = int(m.group(1))
        if layer >= config.num_hidden_layers:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, "
                             f"the model has {config.num_hidden_layers}")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor.to(torch.float32)
        module_of[(layer, m.group(2))] = key[:m.end(2)].removeprefix("base_model.model.")
    if not pairs and not expert_tensors:
        raise ValueError(f"LoRA adapter {name!r}: {where} holds no LoRA tensors")

    shapes = _projection_shapes(config)
    # Per layer, per fused projection: each part's (A, B), in the fused order.
    updates: list[dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]] = [
        {} for _ in range(config.num_hidden_layers)]
    max_rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_"
                             f"{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        r = pair_rank(name, f"layer {layer} {proj}", a, b, *shapes[proj])
        max_rank = max(max_rank, r)
        # No alpha (a GGUF adapter may have none): the update unscaled, as llama.cpp runs it.
        a_of = _pattern_alpha(patterns, module_of[(layer, proj)], alpha)
        b = b * (a_of / (math.sqrt(r) if rslora else r) if a_of else 1.0)
        if proj in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if proj == "q_proj" else config.num_key_value_heads
            b = interleave_rotary_rows(b, heads, config.rotary_dim)
        fused, idx = _TARGETS[proj]
        updates[layer].setdefault(fused, [None] * len(fused_part_sizes(fused, config)))[idx] = (a, b)
    part = rank_slices(config, tp) if tp is not None and tp.world_size > 1 else None
    layers = [{fused: _stack(fused, parts, fused_part_sizes(fused, config), part, dtype, device)
               for fused, parts in layer.items()} for layer in updates]
    if expert_tensors:
        if part is not None:
            raise ValueError(f"LoRA adapter {name!r} updates experts, which kvserve does not split across "
                             "tensor-parallel ranks; serve it on one")

        def scale(module: str, r: int) -> float:
            a_of = _pattern_alpha(patterns, module, alpha)
            return a_of / (math.sqrt(r) if rslora else r) if a_of else 1.0

        def make(a: torch.Tensor, b: torch.Tensor) -> LoRAUpdate:
            return LoRAUpdate(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))

        by_expert, expert_rank = read_expert_updates(name, expert_tensors, config, scale)
        experts: list[Mapping[int, dict[str, LoRAUpdate]]] = []
        stacks = []
        for layer in range(config.num_hidden_layers):
            mine = {e: by_proj for (i, e), by_proj in by_expert.items() if i == layer}
            stacks.append(stack_experts(mine, config.moe.num_experts))
            ranks = {(e, proj): a.shape[0] for e, by_proj in mine.items() if e != SHARED
                     for proj, (a, _) in by_proj.items()}
            shared = {proj: make(a, b) for proj, (a, b) in mine.get(SHARED, {}).items()}
            experts.append(ExpertUpdates(stacks[-1], ranks, shared, make) if mine else {})
        max_rank = max(max_rank, expert_rank)
        return LoRAAdapter(name, str(path), max_rank, layers, experts, stacks)
    return LoRAAdapter(name, str(path), max_rank, layers)


def _updates_an_expert(key: str, m: re.Match[str] | None, config: ModelConfig) -> bool:
    """Whether tensor ``key`` (``m``: its ``_TENSOR`` match) updates an MoE's expert, shared
    expert or router, or the MLP of a sparse layer (whose MLP is its experts)."""
    if config.moe is None:
        return False
    if _EXPERT.search(key):
        return True
    if m is None or m.group(2) not in _MLP_PARTS:
        return False
    layer = int(m.group(1))
    return layer < config.num_hidden_layers and config.moe.is_sparse(layer)


def _not_a_projection(name: str, tensor: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: tensor {tensor!r} does not update a decoder "
                      "projection (q/k/v/o, gate/up/down); kvserve cannot apply it")


def _positive(value: object) -> bool:
    """Whether a config's ``value`` is a positive number (JSON's true is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _pattern_alpha(patterns: dict[str, float], module: str, alpha: float) -> float:
    """``module``'s alpha: that of the first ``alpha_pattern`` key naming it, as PEFT's
    ``get_pattern_key`` matches them (a regex matching the whole name or its end after a
    dot), else ``alpha``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?(?:{key})$", module):
            return value
    return alpha


def _read_peft_adapter(name: str, path: Path
                       ) -> tuple[Path, Iterator[tuple[str, torch.Tensor]], float, bool, dict[str, float]]:
    """A PEFT directory's weights file, tensors, ``lora_alpha``, rsLoRA switch and
    ``alpha_pattern``."""
    cfg_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE} (nor is it a .gguf adapter)")
    if not weights_file.is_file():
        # NOTE: PEFT's older adapter_model.bin is a pickle; it is never loaded.
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE} "
                         "(a .bin adapter is not read: convert it to safetensors)")
    try:
        peft = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {cfg_file} is not JSON ({e})") from None
    if not isinstance(peft, dict) or peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: {cfg_file} is not a LoRA adapter "
                         f"(peft_type {peft.get('peft_type') if isinstance(peft, dict) else None!r})")
    for key, plain in _PLAIN.items():
        value = peft.get(key)
        if value not in (None, plain, {}, []):
            raise ValueError(f"LoRA adapter {name!r}: {key}={peft[key]!r} is not supported "
                             f"(kvserve runs plain LoRA: {key}={plain!r})")
    alpha = peft.get("lora_alpha")
    if not _positive(alpha):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a positive number, got {alpha!r}")
    patterns = peft.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"LoRA adapter {name!r}: alpha_pattern must map module names to alphas, got {patterns!r}")
    for key, value in patterns.items():
        if not _positive(value):
            raise ValueError(f"LoRA adapter {name!r}: alpha_pattern[{key!r}] must be a positive number, "
                             f"got {value!r}")
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"LoRA adapter {name!r}: alpha_pattern key {key!r} is not a regex ({e})") from None
    return (weights_file, _read_tensors(weights_file), float(alpha), bool(peft.get("use_rslora", False)),
            {str(k): float(v) for k, v in patterns.items()})


def _read_gguf_adapter(name: str, path: Path, config: ModelConfig
                       ) -> tuple[Path, Iterator[tuple[str, torch.Tensor]], float, bool]:
    """A llama.cpp GGUF adapter's tensors under PEFT's names (the q/k rows of B put back
    in Hugging Face's order, as the loader does for a GGUF model's; a mixture's stacked
    experts one an expert, ``gguf_expert_tensors``), and its alpha."""
    reader = gguf_loader.open_gguf(path)
    kind = (gguf_loader.field_value(reader, "general.type"), gguf_loader.field_value(reader, "adapter.type"))
    if kind != ("adapter", "lora"):
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a GGUF LoRA adapter "
                         f"(general.type {kind[0]!r}, adapter.type {kind[1]!r})")
    arch = gguf_loader.field_value(reader, "general.architecture")
    model_of = {**gguf_loader.ARCHITECTURES, **GGUF_MOE_ARCHITECTURES}.get(arch)
    if model_of != config.architecture and (arch, config.architecture) != ("llama", "MixtralForCausalLM"):
        raise ValueError(f"LoRA adapter {name!r}: {path} is for a {arch!r} model, "
                         f"the model is {config.architecture}")
    permuted = config.architecture in gguf_loader.PERMUTED_ARCHITECTURES

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            # blk.3.attn_q.weight.lora_a -> model.layers.3.self_attn.q_proj.lora_A.weight
            base, _, ab = t.name.rpartition(".lora_")
            if ab not in ("a", "b"):
                raise _not_a_projection(name, t.name)
            w = np.array(gguf_loader.dequantize(t), dtype=np.float32)
            parts = base.split(".")
            moe = (gguf_expert_tensors(name, t.name, int(parts[1]), parts[2], ab, torch.from_numpy(w), config)
                   if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" else None)
            if moe is not None:  # (an MoE block's tensor: per expert, as PEFT names an expert module's)
                yield from moe
                continue
            try:
                key = f"{gguf_loader.hf_name(base).removesuffix('.weight')}.lora_{ab.upper()}.weight"
            except ValueError:
                key = ""
            if _TENSOR.search(key) is None:
                raise _not_a_projection(name, t.name)
            if ab == "b" and permuted and (".q_proj." in key or ".k_proj." in key):
                heads = config.num_attention_heads if ".q_proj." in key else config.num_key_value_heads
                w = np.ascontiguousarray(gguf_loader.permute_back(w, heads))
            yield key, torch.from_numpy(w)

    return path, tensors(), float(gguf_loader.field_value(reader, "adapter.lora.alpha", 0.0)), False


def _read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


def _projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Checkpoint projection -> (out_features, in_features) of the whole (unsplit) model."""
    h, d = config.hidden_size, config.head_dim
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _stack(fused: str, parts: list[tuple[torch.Tensor, torch.Tensor] | None], sizes: list[int],
           rank_part: RankSlices | None, dtype: torch.dtype, device: torch.device) -> LoRAUpdate:
    """One update for a fused projection from its parts' ``(A, B)`` (``stack_parts``); with
    ``rank_part``, this tensor-parallel rank's slice of it."""
    a, b = stack_parts(parts, sizes)
    if rank_part is not None:
        if fused == "qkv_proj":
            b = b.index_select(0, rank_part.qkv_rows)
        elif fused == "gate_up_proj":
            b = b.index_select(0, rank_part.gate_up_rows)
        else:
            a = a[:, rank_part.o_cols if fused == "o_proj" else rank_part.down_cols]
    return LoRAUpdate(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))


@dataclass(frozen=True)
class LoRABatch:
    """Which rows of a flat batch run which adapter (rows of no adapter run the base model)."""

    # (adapter, the row ranges [start, stop) it runs), ranges in row order, adjacent ones merged.
    groups: tuple[tuple[LoRAAdapter, tuple[tuple[int, int], ...]], ...]

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection ``proj`` of layer ``layer`` applied to ``x``) plus each
        adapter's update on its rows, in place."""
        for adapter, ranges in self.groups:
            update = adapter.layers[layer].get(proj)
            if update is not None:
                # NOTE: row ranges are views: no gather or scatter (which cost as much
                # as the two small matmuls at a decode batch's size, measured).
                for start, stop in ranges:
                    y[start:stop].add_(update.delta(x[start:stop]))
        return y

    @classmethod
    def of_spans(cls, spans: Iterable[tuple[LoRAAdapter | None, int, int]]) -> "LoRABatch | None":
        """The batch for ``(adapter or None, first row, number of rows)`` spans of a flat
        batch; None when no row runs an adapter (the step runs the base model alone).
        Spans of one adapter that follow each other make one range (the engine puts
        the requests of an adapter side by side)."""
        # By object: an adapter unloaded and loaded again is another one of the same name.
        ranges: dict[int, list[list[int]]] = {}
        adapters: dict[int, LoRAAdapter] = {}
        for adapter, start, count in spans:
            if adapter is None or count == 0:
                continue
            adapters[id(adapter)] = adapter
            own = ranges.setdefault(id(adapter), [])
            if own and own[-1][1] == start:
                own[-1][1] += count
            else:
                own.append([start, start + count])
        if not ranges:
            return None
        return cls(tuple((adapters[key], tuple((a, b) for a, b in r)) for key, r in ranges.items()))

    def layer(self, index: int) -> "LayerLoRA":
        """This batch's updates for decoder layer ``index``."""
        return LayerLoRA(self, index)

    @property
    def fusable(self) -> bool:
        """Whether ``ops.fused_layer`` can run these updates (``LoRAAdapter.fusable``)."""
        return all(adapter.fusable for adapter, _ in self.groups)

    def fused_args(self, index: int) -> tuple[list[torch.Tensor], list[int]]:
        """Layer ``index``'s updates as ``ops.fused_layer`` takes them: per row range, its
        adapter's ``LoRAAdapter.fused_layers`` entry, and the ranges' ``start, stop`` pairs."""
        tensors: list[torch.Tensor] = []
        rows: list[int] = []
        for adapter, ranges in self.groups:
            for start, stop in ranges:
                tensors += adapter.fused_layers[index]
                rows += (start, stop)
        return tensors, rows


@dataclass(frozen=True)
class LayerLoRA:
    """A ``LoRABatch`` seen from one decoder layer."""

    batch: LoRABatch
    index: int

    def add(self, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``LoRABatch.add`` for this layer."""
        return self.batch.add(self.index, proj, x, y)

    def fused_args(self) -> tuple[list[torch.Tensor], list[int]]:
        """``LoRABatch.fused_args`` for this layer."""
        return self.batch.fused_args(self.index)

    def experts(self, rows: int) -> ExpertLoRA | None:
        """The adapters' updates of this layer's experts (``models.lora_experts.SHARED``: its
        shared expert), for a step of ``rows`` tokens: per adapter that has any, its updates
        by expert, and per row the index of its adapter in that list (-1: none); None where
        no adapter of the batch updates them."""
        updates: list[Mapping[int, dict[str, LoRAUpdate]]] = []
        stacks: list[dict[str, ExpertStack]] = []
        owner = None
        for adapter, ranges in self.batch.groups:
            by_expert = adapter.experts[self.index] if adapter.experts else {}
            if by_expert:
                owner = torch.full((rows,), -1, dtype=torch.long) if owner is None else owner
                for start, stop in ranges:
                    owner[start:stop] = len(updates)
                updates.append(by_expert)
                stacks.append(adapter.expert_stacks[self.index])
        return None if owner is None else ExpertLoRA(updates, stacks, owner)
