"""The decoder's small per-layer operations: fused C++ kernels with plain-torch twins.

A batch-1 decode step of a small model spends more time dispatching its
dozens of tiny eager ops per layer than computing them. The C++ kernels in
``csrc/`` fuse each chain into one call: ``rowwise.cpp`` (residual add +
RMSNorm, SiLU * up, RoPE + KV-cache write), ``paged_attention.cpp`` (decode
and prompt attention read in place, one arithmetic for both), ``argmax.cpp``,
``fused_layer.cpp`` (a whole decoder layer, dense or a mixture's) and ``grouped_gemm.cpp`` (the
grouped 4-/8-bit GEMMs); ``bindings.cpp`` exports them and ``kernels.h``
declares them. The module is compiled on first use with torch's C++
extension builder (g++ and the Python headers; under a minute, cached under
``~/.cache/kvserve/kernels`` or ``$KVSERVE_KERNEL_CACHE``, one build per CPU
and torch install) and runs on CPU tensors only. Where it cannot be built, or
with ``KVSERVE_KERNELS=0``, every function here falls back to its plain-torch
twin, which the tests compare it against.

The kernels compute in 16-lane vectors (``csrc/vec16.h``): AVX-512 where the
CPU has it, else AVX2, with the same arithmetic on both, so the two builds
give the same results bit for bit. ``KVSERVE_CPU_ISA=avx2`` builds the AVX2
kernels on an AVX-512 CPU, ``avx512bw`` the AVX-512 ones without VNNI,
``avx2-vnni`` the AVX2 ones with AVX-VNNI's dot products (the tests compare
them with the native build); the default, ``native``, builds for the CPU it
runs on.

The package's modules, one job each: ``isa`` (the ``KVSERVE_CPU_ISA`` and
``KVSERVE_AMX`` switches), ``build`` (compiling, caching and loading the kernels,
and what the loaded build can do here), ``rowwise`` (norms, activations, RoPE and
the KV-cache write, argmax, token bitmasks), ``attention`` (paged attention),
``layer`` (a whole decoder layer in one call) and ``linear`` (the packed GEMMs).
Every public name is exported here: callers use ``ops.name``, and a test that
replaces one of these functions must patch it where it is read (here, for callers
outside the package; ``models.ops.build`` for the build's own state).
"""

from __future__ import annotations

from models.ops.attention import decode_attention, prefill_attention
from models.ops.build import (amx_bf16_usable, amx_emulated_products, amx_enabled, amx_hardware, amx_usable,
                              cache_directory, has_int8_dots, int8_dots, kernels_available, kernels_enabled,
                              set_amx_emulated, set_amx_enabled, set_kernels_enabled, sources_digest, vector_isa)
from models.ops.isa import amx_mode, requested_isa
from models.ops.layer import (GEMM_A8_QUANT, GEMM_AMX_BF16, GEMM_AMX_QUANT, GEMM_AMX_W4A16, GEMM_GROUPED, GEMM_GROUPED_INT8,
                              ROUTER_SOFTMAX_TOPK, ROUTER_SOFTMAX_TOPK_NORM, ROUTER_TOPK_SOFTMAX, FusedExpertsWeights,
                              FusedStep, FusedWeights, fused_gemma_layer, fused_layer, fused_moe_layer)
from models.ops.linear import (amx_bf16_linear, amx_quant_linear, amx_w4a16_linear, amx_w8a16_linear, dense_linear,
                               a8_experts, gguf_a8_experts, gguf_a8_linear, gguf_rows, grouped_linear,
                               a8_empty, lora_expert_rows, mix_expert_rows, moe_experts, repack_gguf, repack_gguf_a8,
                               route_experts, ExpertActivation)
from models.ops.rowwise import (add_rms_norm, apply_rotary, apply_token_bitmask, argmax, rms_norm, rotary_and_cache,
                                silu_and_mul, write_kv)

__all__ = [
    # build: the kernels and what they can use here
    "kernels_available", "kernels_enabled", "set_kernels_enabled", "cache_directory", "sources_digest",
    "vector_isa", "int8_dots", "has_int8_dots", "amx_usable", "amx_bf16_usable", "amx_enabled",
    "set_amx_enabled", "set_amx_emulated", "amx_hardware", "amx_emulated_products",
    # isa: the switches
    "requested_isa", "amx_mode",
    # rowwise
    "rms_norm", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "apply_rotary", "write_kv", "argmax",
    "apply_token_bitmask",
    # attention
    "decode_attention", "prefill_attention",
    # layer
    "GEMM_GROUPED", "GEMM_GROUPED_INT8", "GEMM_AMX_BF16", "GEMM_AMX_W4A16", "GEMM_AMX_QUANT", "GEMM_A8_QUANT",
    "ROUTER_SOFTMAX_TOPK", "ROUTER_SOFTMAX_TOPK_NORM", "ROUTER_TOPK_SOFTMAX", "FusedWeights", "FusedExpertsWeights",
    "FusedStep", "fused_layer", "fused_moe_layer", "fused_gemma_layer",
    # linear
    "grouped_linear", "dense_linear", "amx_bf16_linear", "amx_w4a16_linear", "amx_w8a16_linear",
    "amx_quant_linear", "repack_gguf", "gguf_rows", "gguf_a8_linear", "repack_gguf_a8", "a8_empty", "a8_experts",
    "gguf_a8_experts",
    "mix_expert_rows", "route_experts", "moe_experts", "ExpertActivation", "lora_expert_rows",
]
