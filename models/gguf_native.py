"""Build a model straight from a GGUF file's blocks, each projection at its own GGUF type.

The path ``w4a16`` takes on a GGUF file whose projections are all of types
``models.gguf_quants`` splits (a CPU with AMX-BF16, one process): each projection
becomes a ``NativeLinear`` from its tensors' codes and scales, the embedding a
``QuantizedEmbedding`` over the mapped file, the LM head the head tensor's own
codes. The file is read tensor by tensor from its mapping, and no float copy of a
projection or of the embedding is made; only the norms and biases (a few MB) are
read as floats. Where the head or the embedding is not quantised (F16, F32),
it is kept as floats (the embedding) or as 8-bit codes (``w8a16``, the head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from models import ops
from models.config import ModelConfig
from models.gguf_linear import (A8_FORMATS, A8_TYPE_FORMATS, AMX_FORMATS, F4, F4K, F8, F8_G16, F8_G16S, FALLBACK,
                                FOLDED, W4, W8_AFFINE, W8_AFFINE_G16, W8_G16, NativeA8Linear, NativeLinear,
                                QuantizedEmbedding, file_bytes, folding, permuted_rows, plan_segments, type_format)
from models.gguf_loader import PERMUTED_ARCHITECTURES, dequantize, iter_gguf_weights, permute_back
from models.gguf_quants import SPLIT_TYPES, Codes, random_blocks, split
from models.gguf_reader import GGUFFile, GGUFTensor
from models.quant import AmxBf16Linear, QuantizedLinear
from models.registry import model_class
from models.repack_cache import RepackCache
from models.rope import interleave_rotary_rows

# GGUF tensor kinds each decoder projection (its block and name) is made of, in row order.
PROJECTIONS = {("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
                ("self_attn", "o_proj"): ("attn_output",),
                ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
                ("mlp", "down_proj"): ("ffn_down",)}


# The projection tensors of a layer, in FileTypes' order.
KINDS = tuple(k for parts in PROJECTIONS.values() for k in parts)
# Stacked experts' tensors ``[n_expert, rows, row bytes]`` (Gemma 4's 26B-A4B here; the MoE
# families': models.moe_loader), gate and up fused or apart.
EXPERT_KINDS = ("ffn_gate_up_exps", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_slice(stacked: GGUFTensor, e: int) -> GGUFTensor:
    """Expert ``e``'s matrix of a stacked ``[n_expert, rows, row bytes]`` tensor: its own blocks."""
    data = stacked.data[e]
    return GGUFTensor(f"{stacked.name}#{e}", stacked.tensor_type, tuple(stacked.shape[:2]), data,
                      stacked.offset + e * data.nbytes)


def layer_parts(config: ModelConfig, index: int) -> dict[tuple[str, str], tuple[str, ...]]:
    """The tensor kinds each projection of layer ``index`` is made of: ``PROJECTIONS``, but
    in Gemma 4's layers that read another layer's K/V (queries alone) and its full layers
    whose values are their keys (the key tensor twice: keys, then values)."""
    g = config.gemma4
    if g is not None and g.shares_kv(index):
        return {**PROJECTIONS, ("self_attn", "qkv_proj"): ("attn_q",)}
    if g is not None and g.values_from_keys and not config.layer_window(index):
        return {**PROJECTIONS, ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_k")}
    return PROJECTIONS


@dataclass(frozen=True)
class FileTypes:
    """The GGUF types of a file's projections, per layer (``KINDS`` order), and of its LM head:
    what the path choice's probes are made of."""

    layers: tuple[tuple[str, ...], ...]
    head: str

    def sample(self, n: int) -> list[tuple[str, ...]]:
        """``n`` layers' types, spread over the file (Q4_K_M keeps its 6-bit layers at both ends)."""
        count = len(self.layers)
        return [self.layers[(2 * i + 1) * count // (2 * n)] for i in range(n)]

    def a8(self) -> bool:
        """Whether an int8-activation format holds every projection's type (``A8_TYPE_FORMATS``)."""
        return {t for layer in self.layers for t in layer} <= set(A8_TYPE_FORMATS)

    def key(self) -> str:
        """A short summary for the path choice's cache key: each type's share of the tensors."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for t in layer:
                counts[t] = counts.get(t, 0) + 1
        fold = " folded" if folding() else ""
        return " ".join(f"{t}:{n}" for t, n in sorted(counts.items())) + f" head:{self.head}{fold}"


def file_types(reader: GGUFFile) -> FileTypes | None:
    """The file's ``FileTypes``, or None where a projection is of a type ``gguf_quants`` does
    not split (the file then runs dequantised or requantised)."""
    by_name = {t.name: type_name(t) for t in reader.tensors}
    if not splittable(reader) or any(f"blk.0.{k}.weight" not in by_name for k in KINDS):
        return None  # (Phi-3 keeps q, k, v and gate, up fused: such a file runs dequantised)
    count = 1 + max(int(name.split(".")[1]) for name in by_name if name.startswith("blk."))

    def kind_type(i: int, kind: str) -> str:
        # (Gemma 4: a full layer's values are its keys; a K/V-sharing layer may have no K/V of its own)
        own = by_name.get(f"blk.{i}.{kind}.weight") or (kind == "attn_v" and by_name.get(f"blk.{i}.attn_k.weight"))
        return own or by_name[f"blk.0.{kind}.weight"]

    layers = tuple(tuple(kind_type(i, k) for k in KINDS) for i in range(count))
    return FileTypes(layers, by_name.get("output.weight", by_name["token_embd.weight"]))


def a8_ready(types: FileTypes | None, reader: GGUFFile) -> str | None:
    """Why ``w4a8`` cannot keep this file's codes (``NativeA8Linear``), or None where it can:
    every projection of a type ``A8_TYPE_FORMATS`` holds and in whole 16-row tiles."""
    if types is None:
        return "its projections are not all of quantised types kvserve splits"
    return a8_holds(layer_tensors(reader, KINDS + EXPERT_KINDS))


def layer_tensors(reader: GGUFFile, kinds: tuple[str, ...]) -> list[GGUFTensor]:
    """The file's layer weights of these kinds (``blk.N.KIND.weight``)."""
    return [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".")[2] in kinds
            and t.name.endswith(".weight")]


def a8_holds(projections: list[GGUFTensor]) -> str | None:
    """Why the int8-activation formats cannot keep these projections' codes (None: they can):
    a type ``A8_TYPE_FORMATS`` lacks, or rows that are not whole 16-row tiles."""
    other = sorted({type_name(t) for t in projections} - set(A8_TYPE_FORMATS))
    if not projections or other:
        return f"no int8-activation format holds {', '.join(other) or 'its projections'}"
    if any(int(t.shape[1]) % 16 for t in projections):
        return "a projection's rows are not whole 16-row tiles"
    return None


def random_projection(kinds: tuple[str, ...], types: tuple[str, ...], shapes: list[tuple[int, int]],
                      seed: int, bias: bool = False, a8: bool = False) -> NativeLinear:
    """A ``NativeLinear`` (``a8``: ``NativeA8Linear``) of random blocks of ``types`` (one per
    part, ``shapes`` ``(N, K)``), as the path choice's probes time them."""
    tensors = [GGUFTensor(kind, int(GGMLQuantizationType[t]), (k, n), random_blocks(t, (n, k), seed + i,
                                                                                    one_scale=True))
               for i, (kind, t, (n, k)) in enumerate(zip(kinds, types, shapes))]
    return (a8_projection if a8 else projection)(None, tensors, [None] * len(tensors), bias)


def type_name(tensor: GGUFTensor) -> str:
    """The tensor's GGUF type, e.g. ``"Q4_K"``."""
    return GGMLQuantizationType(tensor.tensor_type).name


def splittable(reader: GGUFFile, kinds: tuple[str, ...] = KINDS + EXPERT_KINDS) -> bool:
    """Whether every projection tensor of the file (of these kinds) is of a type ``gguf_quants`` splits."""
    projections = layer_tensors(reader, kinds)
    return bool(projections) and all(type_name(t) in SPLIT_TYPES for t in projections)


def tensor_codes(tensor: GGUFTensor) -> Codes:
    """A 2-D quantised tensor's codes, shaped as the HF weight ``[out, in]``."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if len(shape) != 2:
        raise ValueError(f"tensor {tensor.name!r} has shape {shape}, expected a matrix")
    try:
        return split(type_name(tensor), tensor.data, shape)
    except ValueError as exc:
        raise ValueError(f"tensor {tensor.name!r}: {exc}") from None


def rotary_order(rows: int, heads: int, permuted: bool, rotary_dim: int = 0) -> torch.Tensor:
    """Which file row each Q or K row of kvserve's interleaved rotary order comes from: the
    row reordering ``iter_gguf_weights`` and ``load_weights`` apply to a float weight
    (llama.cpp's own order for llama-arch files, else HF's), applied to the row numbers."""
    order = np.arange(rows)
    if permuted:
        order = permute_back(order, heads)
    return interleave_rotary_rows(torch.from_numpy(np.ascontiguousarray(order)), heads, rotary_dim).contiguous()


def a8_projection(reader: GGUFFile | None, tensors: list[GGUFTensor], orders: list[torch.Tensor | None],
                  bias: bool = False) -> NativeA8Linear:
    """``projection`` for the int8-activation GEMMs: each run of tensors of one format one
    segment (a boundary inside a 16-row tile is refused: ``a8_ready`` checks first)."""
    rows = [int(t.shape[1]) for t in tensors]
    k = int(tensors[0].shape[0])
    formats = [A8_TYPE_FORMATS[type_name(t)] for t in tensors]
    segments = []
    for i, t in enumerate(tensors):
        if rows[i] % 16:  # (the K-quants' rows are whole super-blocks of 256 inputs by their type)
            raise ValueError(f"tensor {t.name!r}: its {rows[i]} rows are not whole 16-row tiles")
        codes, scales = ops.a8_empty(formats[i], rows[i] // 16, k // 32)
        source = orders[i] if orders[i] is not None else torch.arange(rows[i])
        if not ops.repack_gguf_a8(codes, scales, file_bytes(t.data), t.tensor_type, formats[i], source):
            raise ValueError(f"tensor {t.name!r}: its {type_name(t)} scales do not match their dequantisation")
        if segments and segments[-1][0] == formats[i]:
            fmt, c0, s0 = segments[-1]
            segments[-1] = (fmt, torch.cat([c0, codes]), torch.cat([s0, scales]))
        else:
            segments.append((formats[i], codes, scales))
        if reader is not None:
            reader.release(t)
    return NativeA8Linear(segments, k, sum(rows), bias)


def empty_format(fmt: int, tiles: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised codes and scales of ``pack_amx``'s shapes for ``fmt``."""
    if fmt == F4K:
        return torch.empty(tiles, groups, 8, 32, dtype=torch.uint8), torch.empty(tiles, groups // 8, 96)
    if fmt == W4:
        return torch.empty(tiles, groups, 4, 64, dtype=torch.uint8), torch.empty(tiles, groups, 2, 16)
    halves = 2 if fmt in (W8_G16, W8_AFFINE_G16, F8_G16, F8_G16S) else 1
    kinds = 2 if fmt in (W8_AFFINE, W8_AFFINE_G16, F4, F8, F8_G16) else 1
    scales = torch.empty(tiles, groups, halves, kinds, 16)
    if fmt == F4:
        return torch.empty(tiles, groups, 8, 32, dtype=torch.uint8), scales
    return torch.empty(tiles, groups, 16, 32, dtype=torch.uint8 if fmt in FOLDED else torch.int8), scales


def projection(reader: GGUFFile | None, tensors: list[GGUFTensor], orders: list[torch.Tensor | None],
               bias: bool = False) -> NativeLinear:
    """A ``NativeLinear`` of ``tensors``' rows in order, each reordered by its ``orders``
    entry (which file row each weight row is; None: as in the file), repacked from the
    file's blocks by the kernels; their pages are released once converted."""
    rows = [int(t.shape[1]) for t in tensors]
    k = int(tensors[0].shape[0])
    if any(r % 16 for r in rows) or k % 32:  # tiny test shapes: the torch reference
        parts = []
        for t, order in zip(tensors, orders):
            codes = tensor_codes(t)
            parts.append(codes if order is None else permuted_rows(codes, lambda w, o=order: w[o].contiguous()))
        return NativeLinear.from_codes(parts, bias)
    segments = []
    for fmt, members in plan_segments([type_format(type_name(t)) for t in tensors], rows):
        tiles = sum(rows[i] for i in members) // 16
        while True:
            codes, scales = empty_format(fmt, tiles, k // 32)
            exact, tile = True, 0
            for i in members:
                n = rows[i] // 16
                source = orders[i] if orders[i] is not None else torch.arange(rows[i])
                exact &= ops.repack_gguf(codes[tile:tile + n], scales[tile:tile + n], file_bytes(tensors[i].data),
                                         tensors[i].tensor_type, fmt, source)
                tile += n
            if exact:
                break
            fmt = FALLBACK[fmt]  # the offsets were not exact: 8-bit codes with their scales hold them
        segments.append((fmt, codes, scales))
    for t in tensors:
        if reader is not None:
            reader.release(t)
    return NativeLinear(segments, k, sum(rows), bias)


def build_model(reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, a8: bool = False,
                cache: RepackCache | None = None) -> nn.Module:
    """The model of ``config`` on the CPU, its projections ``NativeLinear``s of the file's codes
    (``a8``: ``NativeA8Linear``s, the int8-activation GEMMs), from ``cache`` where it has them."""
    make = a8_projection if a8 else projection
    cached = cache.projection if cache is not None else lambda name, bias, build: build()
    tensors = {t.name: t for t in reader.tensors}
    permuted = config.architecture in PERMUTED_ARCHITECTURES

    def get(name: str) -> GGUFTensor:
        if name not in tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        return tensors[name]

    with torch.device("meta"):
        model = model_class(config)(config)
    for i, layer in enumerate(model.model.layers):
        for (block, proj), kinds in layer_parts(config, i).items():
            parts = [get(f"blk.{i}.{kind}.weight") for kind in kinds]
            orders = []
            for j, (kind, t) in enumerate(zip(kinds, parts)):
                heads = {"attn_q": config.num_attention_heads, "attn_k": config.layer_kv_heads(i)}.get(kind)
                values = kind in kinds[:j]  # (the key tensor again: the values, in the file's order)
                orders.append(None if heads is None or values else
                              rotary_order(int(t.shape[1]), heads, permuted, config.rotary_dim))
            bias = getattr(getattr(layer, block), proj).bias is not None
            built = cached(f"blk.{i}.{block}.{proj}", bias,
                           lambda parts=parts, orders=orders, bias=bias: make(reader, parts, orders, bias))
            setattr(getattr(layer, block), proj, built)
        for e, expert in enumerate(getattr(layer, "experts", ())):  # (Gemma 4's: beside the MLP)
            gate_up = [f"blk.{i}.ffn_gate_up_exps.weight"] if f"blk.{i}.ffn_gate_up_exps.weight" in tensors else [
                f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"]
            for proj, names in (("gate_up_proj", gate_up), ("down_proj", [f"blk.{i}.ffn_down_exps.weight"])):
                parts = [expert_slice(get(name), e) for name in names]
                built = cached("+".join(t.name for t in parts), False,
                               lambda parts=parts: make(None, parts, [None] * len(parts), False))
                setattr(expert, proj, built)
    embed = get("token_embd.weight")
    head = tensors.get("output.weight", embed)
    model.lm_head = cached("lm_head", False, lambda: head_projection(reader, head, a8))
    model.model.embed_tokens = embedding_from(embed, dtype)
    skip = {"token_embd.weight", "output.weight"} | {
        f"blk.{i}.{k}.weight" for i in range(config.num_hidden_layers) for k in KINDS + EXPERT_KINDS}
    if "per_layer_token_embd.weight" in tensors:  # (Gemma 4's per-layer table: as the embedding)
        model.model.embed_tokens_per_layer = embedding_from(tensors["per_layer_token_embd.weight"], dtype)
        skip.add("per_layer_token_embd.weight")
    materialize(model, dtype)
    model.load_weights(iter_gguf_weights(reader, config, skip=skip))
    if hasattr(model, "prepare_extras"):
        model.prepare_extras()
    if a8 and hasattr(model, "fuse_experts"):  # (Gemma 4's experts: models.experts.FusedExperts)
        model.fuse_experts()
    return model


def head_projection(reader: GGUFFile, tensor: GGUFTensor, a8: bool = False) -> nn.Module:
    """The LM head of ``tensor``: its own codes, or (a float tensor or, with ``a8``, a type no
    int8-activation format holds) 8-bit codes of it, as ``w8a16`` or ``w4a8``'s head."""
    rows, k = int(tensor.shape[1]), int(tensor.shape[0])
    if a8 and type_name(tensor) in A8_TYPE_FORMATS and rows % 16 == 0:
        return a8_projection(reader, [tensor], [None])
    if not a8 and type_name(tensor) in SPLIT_TYPES:
        return projection(reader, [tensor], [None])
    dense = nn.Linear(k, rows, bias=False, device="meta")
    dense.weight = nn.Parameter(torch.from_numpy(np.array(dequantize(tensor), dtype=np.float32)), requires_grad=False)
    if a8:
        return QuantizedLinear(dense, "int8", int8_activations=True)
    return AmxBf16Linear(dense, "w8a16")  # 8-bit codes of the float head, as the other AMX paths' head


def embedding_from(tensor: GGUFTensor, dtype: torch.dtype) -> nn.Module:
    """The embedding of ``tensor``: lookups of its mapped blocks, or (a float tensor) its rows."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if type_name(tensor) in SPLIT_TYPES:
        return QuantizedEmbedding(type_name(tensor), tensor.data, shape, dtype)
    weight = torch.from_numpy(np.array(dequantize(tensor), dtype=np.float32)).to(dtype)
    embedding = nn.Embedding(*shape, _weight=weight)
    del embedding.weight  # (a buffer: filled here, not one of the parameters load_weights expects)
    embedding.register_buffer("weight", weight)
    return embedding


def materialize(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter still on the meta device (norms, biases) CPU memory to load into."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False))


def describe(model: nn.Module) -> str:
    """A log line: the projections' bytes by format."""
    by_format: dict[int, int] = {}
    total = 0
    for module in model.modules():
        if isinstance(module, NativeLinear):
            names = A8_FORMATS if isinstance(module, NativeA8Linear) else AMX_FORMATS
            for fmt, n in module.segment_bytes():
                by_format[names[fmt]] = by_format.get(names[fmt], 0) + n
                total += n
    parts = ", ".join(f"{name} {n / 1e6:.0f} MB" for name, n in sorted(by_format.items()))
    return f"projections and head {total / 1e6:.0f} MB: {parts}"
