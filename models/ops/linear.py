"""The GEMMs of packed weights (``csrc/grouped_gemm.cpp``, ``csrc/dense_gemm*.cpp``,
the AMX kernels): ``x [M, K] @ W^T`` for each packing of ``models.quant``,
``models.dense`` and ``models.gguf_linear``, and the repacking of a GGUF file's blocks.
They have no torch twin: a caller checks ``kernels_available`` (or an AMX query) first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.ops.build import kernels_for, load_extension


def grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                   int8_activations: bool = False, plain: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` (float32) for a weight packed by ``quant.pack_int4`` or ``quant.pack_int8``.

    ``int8_activations`` rounds every 16 inputs of ``x`` to 8 bits and runs
    integer dot products (see ``has_int8_dots``); ``plain`` takes
    the portable C++ instead of the vector code (for tests).
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("grouped_linear needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    ext.grouped_linear(out, x, codes, scales, int8_activations, plain)
    return out


def dense_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` for a weight packed by ``dense.pack_dense`` (float32, or bfloat16 for bfloat16 x).

    Each output is one chain of FMAs over the inputs in order, so a row's
    result does not depend on the other rows (MKL's and oneDNN's does).
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("dense_linear needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    ext.dense_linear(out, x, packed)
    return out


def amx_bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 on AMX-BF16 tiles, x's rows rounded to bfloat16 (RNE),
    for a weight packed by ``models.quant.pack_amx_bf16``. A row's result does not depend
    on the other rows; it is this CPU kind's own (tdpbf16ps rounds as the hardware does)."""
    return _amx_linear("amx_bf16_linear", x, out_features, packed)


def amx_w4a16_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 on AMX-BF16 tiles for 4-bit weights packed by
    ``models.quant.pack_w4a16``: the kernel makes each weight ``d * q + m`` a bfloat16
    and rounds x's rows to bfloat16 (RNE). ``amx_bf16_linear`` on those bfloat16
    weights gives the same bits; a row's result does not depend on the other rows."""
    return _amx_linear("amx_w4a16_linear", x, out_features, codes, scales)


def amx_w8a16_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """``amx_w4a16_linear`` for 8-bit weights packed by ``models.quant.pack_w8a16``: each
    weight ``d * q`` made a bfloat16 in the kernel."""
    return _amx_linear("amx_w8a16_linear", x, out_features, codes, scales)


def amx_quant_linear(x: torch.Tensor, parts: list[torch.Tensor], formats: list[int], out_features: int
                     ) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 on AMX-BF16 tiles for a weight of row ranges, each
    ``(codes, scales)`` in its format (``models.gguf_linear.AMX_FORMATS``; ``parts``: codes0,
    scales0, codes1, ...): each block made bfloat16 in the kernel, x's rows rounded to
    bfloat16 (RNE). A row's result does not depend on the other rows."""
    return _amx_linear("amx_quant_linear", x, out_features, parts, formats)


def repack_gguf(codes: torch.Tensor, scales: torch.Tensor, raw: torch.Tensor, type_id: int, fmt: int,
                source: torch.Tensor) -> bool:
    """Write a GGUF tensor's blocks (``raw [rows, row bytes]`` uint8 of ggml type ``type_id``)
    into ``codes`` and ``scales`` in ``amx_quant_linear``'s format ``fmt``, row ``r`` of the
    weight from ``raw`` row ``source[r]`` (-1: zeros). False where format W4's offsets are
    not exact (nothing else is wrong; take a format with 8-bit codes)."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("repack_gguf needs the fused CPU kernels")
    return ext.repack_gguf(codes, scales, raw, type_id, fmt, source)


def gguf_a8_linear(x: torch.Tensor, parts: list[torch.Tensor], formats: list[int], out_features: int,
                   plain: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` (float32) with x's rows rounded to int8 per 16 inputs and integer
    dots, for a weight of row ranges each ``(codes, scales)`` in its format
    (``models.gguf_linear.A8_FORMATS``: a GGUF tensor's own codes and scales; ``parts``:
    codes0, scales0, codes1, ...). A row's result does not depend on the other rows;
    ``plain`` runs the portable C++, which gives the same bits (the tests)."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("gguf_a8_linear needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    ext.gguf_a8_linear(out, x, parts, formats, plain)
    return out


def a8_experts(parts: list[torch.Tensor], formats: list[int], experts: int, in_features: int,
               out_features: int, bias: torch.Tensor | None = None) -> object:
    """A layer's experts' weights for one projection, as ``gguf_a8_experts`` takes them:
    ``parts`` each expert's ``gguf_a8_linear`` parts in turn, every expert in the same
    ``formats`` and shapes, checked here once; ``bias``: each
    expert's bias, float32 ``[experts, out_features]``, or None. It holds the tensors."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("a8_experts needs the fused CPU kernels")
    return ext.A8Experts(parts, formats, experts, in_features, out_features,
                         None if bias is None else bias.float().contiguous())


def gguf_a8_experts(x: torch.Tensor, weights: object, ids: list[int], counts: list[int], out_features: int,
                    plain: bool = False) -> torch.Tensor:
    """Each expert's rows of ``x [R, K]`` (``counts[i]`` rows for expert ``ids[i]``, in
    order) times its weight of ``weights`` (``a8_experts``), all in one call (llama.cpp's
    ``mul_mat_id``), plus its expert's bias where they have biases: float32
    ``[R, out_features]``, each row what its expert's own ``gguf_a8_linear`` (and ``+ bias``)
    gives, bit for bit."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("gguf_a8_experts needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    ext.gguf_a8_experts(out, x, weights, ids, counts, plain)
    return out


def mix_expert_rows(out: torch.Tensor, rows: torch.Tensor | None, weights: torch.Tensor) -> torch.Tensor:
    """``y [T, H]``: each token's k slots' rows of ``out [S, H]`` (slot ``t * k + j`` at row
    ``rows[t * k + j]``; None: at row ``t * k + j``) times ``weights [T, k]``, added in slot
    order; float32, the bits of ``(out[rows].view(T, k, H) * weights[..., None]).unbind(1)``
    added first two, then one by one."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("mix_expert_rows needs the fused CPU kernels")
    t, k = weights.shape
    rows = torch.arange(t * k) if rows is None else rows.contiguous()
    y = torch.empty(t, out.shape[1], dtype=torch.float32)
    ext.mix_expert_rows(y, out.contiguous(), rows, weights.contiguous())
    return y


def lora_expert_rows(y: torch.Tensor, x: torch.Tensor, expert: torch.Tensor, a: torch.Tensor,
                     bt: torch.Tensor) -> torch.Tensor:
    """``y [R, N]`` (float32) plus, in place, each row's ``B_e (A_e x_row)`` for its expert
    ``expert[row] = e`` (-1: none), ``a [E, r, K]`` and ``bt [E, r, N]`` (``B`` transposed, the
    scale in it): a mixture's experts' LoRA updates, each row's computed in a fixed order
    from that row alone."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("lora_expert_rows needs the fused CPU kernels")
    ext.lora_expert_rows(y, x if x.stride(-1) == 1 else x.contiguous(), expert.contiguous(), a, bt)
    return y


def route_experts(logits: torch.Tensor, experts_per_token: int, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, chosen [T, k] int64)`` of router logits ``[T, E]`` (float32)
    by the router ``kind`` (``ops.ROUTER_*``), each row's pairs in ascending expert id; plain
    float arithmetic a row in a fixed order, so a row's choice does not depend on its batch."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("route_experts needs the fused CPU kernels")
    weights, chosen = ext.route_experts(logits.contiguous(), experts_per_token, kind)
    return weights, chosen


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """What ``moe_experts`` runs between an expert's gate_up and down projections
    (csrc/kernels.h ExpertActivation): ``silu(gate) * up`` (``kind`` ``SILU_GLU``), gpt-oss's
    clamped SwiGLU, ``(clamp(up, -limit, limit) + 1) * silu(alpha min(gate, limit)) / alpha``
    (``CLAMPED_SWIGLU``), as ``models.moe.ClampedSwiGLUExpert.activate`` computes it, or
    Gemma's ``gelu_tanh(gate) * up`` (``GELU_TANH_GLU``), as ``models.gemma.GemmaMLP.activate``."""

    kind: int
    limit: float = 0.0
    alpha: float = 1.0

    SILU_GLU = 0
    CLAMPED_SWIGLU = 1
    GELU_TANH_GLU = 2


SILU_GLU = ExpertActivation(ExpertActivation.SILU_GLU)


def moe_experts(x: torch.Tensor, gate_up: object, down: object, weights: torch.Tensor, chosen: torch.Tensor,
                activation: ExpertActivation = SILU_GLU,
                lora: tuple[list[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, H], tokens routed to each expert [E] int64)``: each row of ``x`` (float32)
    through its chosen experts (``chosen [T, k]``, each row ascending; ``gate_up`` and
    ``down`` as ``a8_experts`` holds them, with their biases; ``activation`` between them),
    their outputs scaled by ``weights [T, k]`` and added: the bits of ``gguf_a8_experts``, the
    activation's torch ops (``silu_and_mul``), ``gguf_a8_experts`` and ``mix_expert_rows``
    called one by one, in one call; ``lora``: LoRA adapters' updates of the experts
    (``models.lora_experts.ExpertLoRA.kernel_args``), added to each projection's products
    as ``lora_expert_rows`` adds them."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("moe_experts needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = activation
    tensors, owner = lora if lora is not None else ([], None)
    y, routed = ext.moe_experts(x, gate_up, down, weights.contiguous(), chosen.contiguous(), a.kind, a.limit, a.alpha,
                                tensors, owner)
    return y, routed


def a8_empty(fmt: int, tiles: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised codes ``[tiles, groups, bits, 64]`` and scales of ``gguf_a8_linear``'s
    format ``fmt`` for ``tiles`` 16-row tiles and ``groups`` groups of 32 inputs: the shapes
    the kernels define (and check), for ``repack_gguf_a8`` to fill."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("a8_empty needs the fused CPU kernels")
    codes, scales = ext.a8_empty(fmt, tiles, groups)
    return codes, scales


def repack_gguf_a8(codes: torch.Tensor, scales: torch.Tensor, raw: torch.Tensor, type_id: int, fmt: int,
                   source: torch.Tensor) -> bool:
    """``repack_gguf`` for ``gguf_a8_linear``'s format ``fmt``: False where a scale made from
    the file's fields differs from the type's dequantisation (nothing else is wrong)."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("repack_gguf_a8 needs the fused CPU kernels")
    return ext.repack_gguf_a8(codes, scales, raw, type_id, fmt, source)


def gguf_rows(raw: torch.Tensor, type_id: int, ids: torch.Tensor, k: int) -> torch.Tensor | None:
    """Rows ``ids`` of ``raw [rows, row bytes]`` (a GGUF tensor's blocks of ggml type ``type_id``,
    ``k`` values a row) dequantised to float32 ``[len(ids), k]``, the values
    ``models.gguf_quants`` gives bit for bit; None where the kernels do not run (the caller
    splits the rows in torch)."""
    ext = kernels_for(ids)
    if ext is None:
        return None
    ids = ids.to(torch.long).contiguous()
    out = torch.empty(ids.numel(), k)
    ext.gguf_rows(out, raw, type_id, ids)
    return out


def _amx_linear(kernel: str, x: torch.Tensor, out_features: int, *weight) -> torch.Tensor:
    # Per call only what is cheap: AmxBf16Linear checked amx_bf16_usable() when it was
    # built, and the kernels refuse a CPU without AMX-BF16 themselves.
    ext = load_extension()
    if ext is None:
        raise RuntimeError(f"{kernel} needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    getattr(ext, kernel)(out, x, *weight)
    return out
