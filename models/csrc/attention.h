// What the paged decode and prefill attention kernels share
// (decode_attention.cpp, prefill_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvserve {

// The shapes both paged attention kernels read, checked: q [N, H, D] with
// packed heads (rows may be strided), out like q, caches [NB, BS, KVH, row],
// one block table and context length per sequence, every block a context
// touches inside the cache.
struct PagedShapes {
  int64_t heads, head_dim, block_size, kv_heads, max_blocks;
  const int64_t* tables;
  const int64_t* lens;
};

// Defined in decode_attention.cpp.
PagedShapes check_paged(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens);

}  // namespace kvserve
