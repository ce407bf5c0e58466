// The Python module: every kernel of kernels.h and grouped_gemm.h, as
// models/ops/ calls them.
#include <torch/csrc/utils/pybind.h>

#include "grouped_gemm.h"
#include "grouped_gemm_amx.h"
#include "kernels.h"
#include "vec16.h"

#include <string>

namespace {

std::string vector_isa() {
#if defined(KVSERVE_V16)
  return kvserve::kV16Isa;
#else
  return "scalar";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &vector_isa, "the vectors the kernels were built for: avx512, avx2 or scalar");
  m.def("grouped_linear", &grouped_linear, "out = x @ W^T, W packed in 4- or 8-bit groups of 32 (float scales)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_linear", &kvserve::dense_linear, "out = x @ W^T, W float32 or bfloat16 packed in 16-row tiles",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_dots", &int8_dots, "what the int8-activation GEMMs' dots run on: avx512-vnni, avx512-bw, avx2 or ''");
  m.def("amx_available", &kvserve::amx_available, "whether the CPU and the OS let the GEMMs use AMX-INT8");
  m.def("amx_bf16_available", &kvserve::amx_bf16_available, "whether the CPU and the OS let GEMMs use AMX-BF16");
  m.def("amx_bf16_linear", &kvserve::amx_bf16_linear,
        "out (float32) = x @ W^T on AMX-BF16 tiles, W packed by pack_amx_bf16",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_w4a16_linear", &kvserve::amx_w4a16_linear,
        "out (float32) = x @ W^T on AMX-BF16 tiles, W as pack_w4a16's 4-bit codes and scales",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_w8a16_linear", &kvserve::amx_w8a16_linear,
        "out (float32) = x @ W^T on AMX-BF16 tiles, W as pack_w8a16's 8-bit codes and scales",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_quant_linear", &kvserve::amx_quant_linear,
        "out (float32) = x @ W^T on AMX-BF16 tiles, W as row ranges of (codes, scales) in their formats",
        py::call_guard<py::gil_scoped_release>());
  m.def("repack_gguf", &kvserve::repack_gguf,
        "a GGUF tensor's blocks as amx_quant_linear's codes and scales of a format (false: W4 inexact)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_a8_linear", &kvserve::gguf_a8_linear,
        "out = x @ W^T with x rounded to int8, W as row ranges of a GGUF file's codes in their formats",
        py::call_guard<py::gil_scoped_release>());
  py::class_<kvserve::A8Experts, std::shared_ptr<kvserve::A8Experts>>(
      m, "A8Experts", "a layer's experts' weights for one projection, as gguf_a8_experts takes them")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                    const c10::optional<at::Tensor>&>());
  m.def("gguf_a8_experts", &kvserve::gguf_a8_experts,
        "each expert's rows of x @ its W^T (x rounded to int8), every expert's tiles in one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("mix_expert_rows", &kvserve::mix_expert_rows,
        "each token's expert rows scaled by its router weights and added in slot order",
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_expert_rows", &kvserve::lora_expert_rows,
        "each row's LoRA update of its expert added in place, in a fixed order a row",
        py::call_guard<py::gil_scoped_release>());
  m.def("route_experts", &kvserve::route_experts,
        "each row's experts and weights from its router logits, in ascending expert id",
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts", &kvserve::moe_experts,
        "each row through its chosen experts, mixed by its weights; and the tokens per expert",
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_rows", &kvserve::gguf_rows, "rows of a GGUF tensor's blocks dequantised (an embedding's lookups)");
  m.def("a8_empty", &kvserve::a8_empty,
        "uninitialised codes and scales of gguf_a8_linear's format for 16-row tiles and K/32 groups");
  m.def("repack_gguf_a8", &kvserve::repack_gguf_a8,
        "a GGUF tensor's blocks as gguf_a8_linear's codes and scales of a format (false: not exact)",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_enabled", &kvserve::amx_enabled, "whether the int8-activation GEMMs use AMX now");
  m.def("set_amx_enabled", &kvserve::set_amx_enabled, "let the int8-activation GEMMs use AMX, or not");
  m.def("set_amx_emulated", &kvserve::set_amx_emulated, "tests: AMX's tile instructions in software");
  m.def("amx_emulated", &kvserve::amx_emulated, "whether AMX's tile instructions run in software");
  m.def("amx_emulated_products", &kvserve::amx_emulated_products, "tile products the software tiles computed");
  py::class_<kvserve::LayerArgs>(m, "LayerArgs", "a decoder layer's fused-kernel arguments that stay from step to step")
      .def(py::init<at::Tensor, at::Tensor, double, std::vector<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, std::vector<at::Tensor>,
                    c10::optional<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                    double, int64_t, double, c10::optional<at::Tensor>, int64_t, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>>());
  py::class_<kvserve::ExpertsArgs>(m, "ExpertsArgs", "a mixture's router and experts for fused_moe_layer")
      .def(py::init<at::Tensor, c10::optional<at::Tensor>, std::shared_ptr<kvserve::A8Experts>,
                    std::shared_ptr<kvserve::A8Experts>, int64_t, int64_t, int64_t, double, double,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, c10::optional<at::Tensor>, double, int64_t>());
  py::class_<kvserve::StepArgs>(m, "StepArgs", "what a step's fused layers share")
      .def(py::init([](at::Tensor rotations, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                       at::Tensor context_lens, int64_t num_decodes, c10::optional<at::Tensor> prefill_query_start) {
        return kvserve::StepArgs{std::move(rotations), std::move(positions), std::move(slot_mapping),
                                 std::move(block_tables), std::move(context_lens), num_decodes,
                                 std::move(prefill_query_start)};
      }));
  m.def("fused_layer", &kvserve::fused_layer,
        "one decoder layer for a step's decodes and prompt chunks, packed projections",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_gemma_layer", &kvserve::fused_gemma_layer,
        "one Gemma 2 or 3 decoder layer for a step's decodes and prompt chunks, packed projections",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_moe_layer", &kvserve::fused_moe_layer,
        "one mixture-of-experts decoder layer for a step's decodes and prompt chunks",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &kvserve::rms_norm, "out = rms_norm(x) * weight");
  m.def("add_rms_norm", &kvserve::add_rms_norm, "residual += x; out = rms_norm(residual) * weight");
  m.def("silu_and_mul", &kvserve::silu_and_mul, "out = silu(gate) * up");
  m.def("rotary_and_cache", &kvserve::rotary_and_cache, "rotate Q/K in place and write K/V to the paged caches");
  m.def("paged_decode_attention", &kvserve::paged_decode_attention, "one query token per sequence over paged caches",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &kvserve::argmax_rows, "index of each row's largest value (first on ties, NaN largest)",
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask", &kvserve::apply_token_bitmask,
        "set the logits of tokens a row's bitmask forbids to -inf, in place");
  m.def("paged_prefill_attention", &kvserve::paged_prefill_attention,
        "causal attention of prompt chunks over paged caches", py::call_guard<py::gil_scoped_release>());
}
