// A GGUF tensor's blocks straight into amx_quant_linear's formats, tile by tile.
//
// Each row of the file's blocks is split into its integer codes q and, per 16 inputs,
// the scale d and offset m it stands for (w = d * q + m), as models/gguf_quants.py
// does in torch (the readable reference, which the tests hold this equal to); then
// every 16 x 32 block of 16 such rows is written in the format asked for (the layouts
// of models/quant.py pack_w4a16 and pack_w8a16, and the scales of
// models/gguf_linear.py pack_amx). One pass over the file's bytes, no float copy, the
// tiles spread over the threads: a 1.5B model's 1 GB of blocks in about a second
// where the torch reference took 15 s and 4 GB.
#include <ATen/core/Tensor.h>

#include "gguf_tables.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvserve {
namespace {

// ggml's type ids (gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};

// 2^(e - 128) exactly (ggml's GGML_E8M0_TO_FP32_HALF: e < 2 is a subnormal).
float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do {
        m <<= 1;
        ++e;
      } while (!(m & 0x400));
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((m & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Block bytes and values per block.
bool block_shape(int64_t type, int64_t& bytes, int64_t& values) {
  switch (type) {
    case kQ4_0: bytes = 18, values = 32; return true;
    case kQ4_1: bytes = 20, values = 32; return true;
    case kQ5_0: bytes = 22, values = 32; return true;
    case kQ5_1: bytes = 24, values = 32; return true;
    case kQ8_0: bytes = 34, values = 32; return true;
    case kQ2_K: bytes = 84, values = 256; return true;
    case kQ3_K: bytes = 110, values = 256; return true;
    case kQ4_K: bytes = 144, values = 256; return true;
    case kQ5_K: bytes = 176, values = 256; return true;
    case kQ6_K: bytes = 210, values = 256; return true;
    case kIQ4_NL: bytes = 18, values = 32; return true;
    case kIQ4_XS: bytes = 136, values = 256; return true;
    case kMXFP4: bytes = 17, values = 32; return true;
    default: return false;
  }
}

void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One block of `type` at b: its codes q[values] and, per 16 values, d and m.
void decode_block(int64_t type, const uint8_t* b, int8_t* q, float* d, float* m) {
  switch (type) {
    case kQ4_0:
    case kQ4_1:
    case kIQ4_NL: {
      const float dd = f16(b);
      const float mm = type == kQ4_1 ? f16(b + 2) : (type == kQ4_0 ? -8 * dd : 0.0f);
      const uint8_t* qs = b + (type == kQ4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        int lo = qs[i] & 0xF, hi = qs[i] >> 4;
        if (type == kIQ4_NL) lo = kIq4Values[lo], hi = kIq4Values[hi];
        q[i] = static_cast<int8_t>(lo);
        q[16 + i] = static_cast<int8_t>(hi);
      }
      d[0] = d[1] = dd;
      m[0] = m[1] = mm;
      return;
    }
    case kMXFP4: {
      for (int i = 0; i < 16; ++i) {
        q[i] = kMxfp4Values[b[1 + i] & 0xF];
        q[16 + i] = kMxfp4Values[b[1 + i] >> 4];
      }
      d[0] = d[1] = e8m0_half(b[0]);
      m[0] = m[1] = 0.0f;
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool one = type == kQ5_1;
      const float dd = f16(b), mm = one ? f16(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        const int lo = (qs[i] & 0xF) | (((qh >> i) & 1) << 4), hi = (qs[i] >> 4) | (((qh >> (16 + i)) & 1) << 4);
        q[i] = static_cast<int8_t>(one ? lo : lo - 16);
        q[16 + i] = static_cast<int8_t>(one ? hi : hi - 16);
      }
      d[0] = d[1] = dd;
      m[0] = m[1] = mm;
      return;
    }
    case kQ8_0: {
      const float dd = f16(b);
      std::memcpy(q, b + 2, 32);
      d[0] = d[1] = dd;
      m[0] = m[1] = 0.0f;
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = type == kQ5_K;
      const float dd = f16(b), dmin = f16(b + 2);
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int s = 0; s < 8; ++s) {
        int scale, mn;
        k_scale_min(sc, s, scale, mn);
        const float ds = dd * static_cast<float>(scale), ms = -(dmin * static_cast<float>(mn));
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = qs[32 * (s / 2) + i];
          int v = (s % 2) ? byte >> 4 : byte & 0xF;
          if (five) v |= ((qh[i] >> s) & 1) << 4;
          q[32 * s + i] = static_cast<int8_t>(v);
        }
        d[2 * s] = d[2 * s + 1] = ds;
        m[2 * s] = m[2 * s + 1] = ms;
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float dd = f16(b + 208);
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
          for (int i = 0; i < 32; ++i) {
            const uint8_t byte = ql[64 * h + 32 * (j % 2) + i];
            const int lo = (j / 2) ? byte >> 4 : byte & 0xF;
            const int hi = (qh[32 * h + i] >> (2 * j)) & 3;
            q[128 * h + 32 * j + i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
          }
        }
      }
      for (int s = 0; s < 16; ++s) d[s] = dd * static_cast<float>(sc[s]), m[s] = 0.0f;
      return;
    }
    case kQ3_K: {
      const uint8_t* hmask = b;
      const uint8_t* qs = b + 32;
      const uint8_t* s = b + 96;
      const float dd = f16(b + 108);
      for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        d[j] = dd * static_cast<float>((lo | (hi << 4)) - 32);
        m[j] = 0.0f;
      }
      for (int h = 0; h < 2; ++h) {
        for (int sh = 0; sh < 4; ++sh) {
          for (int i = 0; i < 32; ++i) {
            const int bit = 4 * h + sh;
            const int low = (qs[32 * h + i] >> (2 * sh)) & 3;
            const int high = (hmask[i] >> bit) & 1;
            q[32 * bit + i] = static_cast<int8_t>(low - (high ? 0 : 4));
          }
        }
      }
      return;
    }
    case kQ2_K: {
      const uint8_t* s = b;
      const uint8_t* qs = b + 16;
      const float dd = f16(b + 80), dmin = f16(b + 82);
      for (int j = 0; j < 16; ++j) {
        d[j] = dd * static_cast<float>(s[j] & 0xF);
        m[j] = -(dmin * static_cast<float>(s[j] >> 4));
      }
      for (int h = 0; h < 2; ++h)
        for (int sh = 0; sh < 4; ++sh)
          for (int i = 0; i < 32; ++i)
            q[128 * h + 32 * sh + i] = static_cast<int8_t>((qs[32 * h + i] >> (2 * sh)) & 3);
      return;
    }
    case kIQ4_XS: {
      const float dd = f16(b);
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      const uint8_t* sl = b + 4;
      const uint8_t* qs = b + 8;
      for (int s = 0; s < 8; ++s) {
        const int lo = (s % 2) ? sl[s / 2] >> 4 : sl[s / 2] & 0xF;
        const int hi = (sh >> (2 * s)) & 3;
        const float ds = dd * static_cast<float>((lo | (hi << 4)) - 32);
        for (int i = 0; i < 16; ++i) {
          q[32 * s + i] = kIq4Values[qs[16 * s + i] & 0xF];
          q[32 * s + 16 + i] = kIq4Values[qs[16 * s + i] >> 4];
        }
        d[2 * s] = d[2 * s + 1] = ds;
        m[2 * s] = m[2 * s + 1] = 0.0f;
      }
      return;
    }
    default: TORCH_CHECK(false, "GGUF type ", type, " has no repack");
  }
}

// The folded formats' codes u = q + offset, u < 2^bits (bits <= 7): false for the types
// whose codes span 8 bits (Q8_0, IQ4_NL, IQ4_XS, MXFP4).
bool fold_span(int64_t type, int& bits, int& offset) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ4_K: bits = 4, offset = 0; return true;
    case kQ5_0: bits = 5, offset = 16; return true;
    case kQ5_1: case kQ5_K: bits = 5, offset = 0; return true;
    case kQ6_K: bits = 6, offset = 32; return true;
    case kQ3_K: bits = 3, offset = 4; return true;
    case kQ2_K: bits = 2, offset = 0; return true;
    default: return false;
  }
}

// A repack's input, checked: raw [rows, row bytes] of whole blocks of `type`, and `source`, the
// raw row of each output row (-1: zeros), in range and whole 16-row tiles.
struct Blocks {
  int64_t type, block_bytes = 0, per_block = 0, k = 0, tiles = 0, rs = 0;
  const uint8_t* rp = nullptr;
  const int64_t* src = nullptr;

  Blocks(const at::Tensor& raw, int64_t type_id, const at::Tensor& source) : type(type_id) {
    TORCH_CHECK(block_shape(type, block_bytes, per_block), "GGUF type ", type, " has no repack");
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1, "raw must be uint8 rows");
    TORCH_CHECK(raw.size(1) % block_bytes == 0, "a row is not whole blocks of its type");
    TORCH_CHECK(source.scalar_type() == at::kLong && source.is_contiguous() && source.numel() % 16 == 0,
                "source must be int64 rows, whole tiles");
    src = source.data_ptr<int64_t>();
    for (int64_t r = 0; r < source.numel(); ++r) TORCH_CHECK(src[r] < raw.size(0), "source row out of range");
    k = raw.size(1) / block_bytes * per_block;
    tiles = source.numel() / 16;
    rp = raw.data_ptr<uint8_t>();
    rs = raw.stride(0);
  }
};

// One tile's 16 rows decoded: q [16][K], d and m [16][K / 16].
struct TileRows {
  std::vector<int8_t> q;
  std::vector<float> d, m;

  explicit TileRows(int64_t k) : q(16 * k), d(k), m(k) {}

  // Output rows 16 tile .. 16 tile + 15 from their raw rows (-1: codes `zero`, scales 0).
  void decode(const Blocks& in, int64_t tile, int8_t zero) {
    const int64_t k = in.k;
    for (int o = 0; o < 16; ++o) {
      int8_t* qo = q.data() + o * k;
      float* dso = d.data() + o * (k / 16);
      float* mo = m.data() + o * (k / 16);
      const int64_t row = in.src[tile * 16 + o];
      if (row < 0) {
        std::memset(qo, zero, k);
        std::fill(dso, dso + k / 16, 0.0f);
        std::fill(mo, mo + k / 16, 0.0f);
        continue;
      }
      for (int64_t blk = 0; blk < k / in.per_block; ++blk)
        decode_block(in.type, in.rp + row * in.rs + blk * in.block_bytes, qo + blk * in.per_block,
                     dso + blk * in.per_block / 16, mo + blk * in.per_block / 16);
    }
  }
};

// Whether gguf_a8_linear's `format` holds `type`'s values exactly, and its code bytes u = q + shift.
// The kernels centre the codes on their middle (c = 8, 16, 32 or 128), where the integer dots
// meet x's rounding. D4 keeps Q4_0's codes 0..15 (decode_block's m = -8 d: the centre), D5
// Q5_0's signed codes as u = q + 16, D8 Q8_0's as u = q + 128, K3 Q3_K's -4..3 as u = q + 4;
// A4 and A5 Q4_1's and Q5_1's codes 0..15 and 0..31 as they are, with the file's m.
bool a8_fits(int64_t type, int64_t format, int& shift) {
  shift = format == kA8D8 ? 128 : format == kA8S16 ? 32 : format == kA8D5 ? 16 : format == kA8K3 ? 4 : 0;
  switch (format) {
    case kA8D4: return type == kQ4_0;
    case kA8D5: return type == kQ5_0;
    case kA8D8: return type == kQ8_0;
    case kA8A4: return type == kQ4_1;
    case kA8A5: return type == kQ5_1;
    case kA8MX4: return type == kMXFP4;  // (the codes are table indices: no shift)
    case kA8NL4: return type == kIQ4_NL;
    case kA8NX4: return type == kIQ4_XS;
    case kA8K4: return type == kQ4_K;
    case kA8K5: return type == kQ5_K;
    case kA8S16: return type == kQ6_K || type == kQ3_K;
    case kA8K3: return type == kQ3_K;
    case kA8K2: return type == kQ2_K;
    default: return false;
  }
}

// A K, S16, K3, K2 or NX4 block's super-block scale D (and M = -dmin) and its integer scales: K's
// sc and mn per 32 inputs, S16's and K3's sc per 16, K2's sc and mn per 16, IQ4_XS's ls - 32 per 32.
void a8_block_scales(int64_t type, const uint8_t* b, float& big_d, float& big_m, int* sc, int* mn) {
  big_m = 0.0f;
  if (type == kIQ4_XS) {
    big_d = f16(b);
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    for (int j = 0; j < 8; ++j) sc[j] = (((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((high >> (2 * j)) & 3) << 4)) - 32;
  } else if (type == kQ4_K || type == kQ5_K) {
    big_d = f16(b);
    big_m = -f16(b + 2);
    for (int j = 0; j < 8; ++j) k_scale_min(b + 4, j, sc[j], mn[j]);
  } else if (type == kQ2_K) {
    big_d = f16(b + 80);
    big_m = -f16(b + 82);
    for (int j = 0; j < 16; ++j) sc[j] = b[j] & 0xF, mn[j] = b[j] >> 4;
  } else if (type == kQ6_K) {
    big_d = f16(b + 208);
    for (int j = 0; j < 16; ++j) sc[j] = reinterpret_cast<const int8_t*>(b + 192)[j];
  } else {  // Q3_K
    big_d = f16(b + 108);
    const uint8_t* s = b + 96;
    for (int j = 0; j < 16; ++j) {
      const int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
      const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      sc[j] = (lo | (hi << 4)) - 32;
    }
  }
}

}  // namespace

// raw [rows, row bytes] uint8 (a GGUF tensor's blocks of `type`) -> codes and scales of
// `format` for the weight whose output row r is raw row source[r] (-1: a zero row, the
// padding to whole tiles). Returns false, having written all it could, where an offset
// (W4's M = m - 16 d, a folded format's M = m - (offset + 2^bits) d) is not exact in
// float32 (the caller takes an 8-bit format with offsets).
bool repack_gguf(at::Tensor& codes, at::Tensor& scales, const at::Tensor& raw, int64_t type, int64_t format,
                 const at::Tensor& source) {
  const Blocks in(raw, type, source);
  const int64_t block_bytes = in.block_bytes, per_block = in.per_block, k = in.k, groups = k / 32, tiles = in.tiles;
  TORCH_CHECK(format >= kAmxW4 && format <= kAmxF4K, "unknown format ", format);
  const bool folded = format >= kAmxF4, q4k = format == kAmxF4K;
  const bool nibbles = format == kAmxW4 || format == kAmxF4 || q4k;
  const bool sym = format == kAmxF8G16Sym;
  const bool halves = format == kAmxW8G16 || format == kAmxW8AffineG16 || format == kAmxF8G16 || sym;
  const bool affine = format == kAmxW4 || format == kAmxW8Affine || format == kAmxW8AffineG16 || (folded && !sym);
  const int64_t code_bytes = nibbles ? 256 : 512;
  const int64_t scale_floats = q4k ? 12 : (halves ? 2 : 1) * (affine ? 32 : 16);
  TORCH_CHECK(!q4k || type == kQ4_K, "format F4K holds Q4_K only");
  int bits = 8, offset = 0;
  TORCH_CHECK(!folded || fold_span(type, bits, offset), "GGUF type ", type, "'s codes span 8 bits: no folded format");
  TORCH_CHECK(format != kAmxF4 || bits == 4, "format F4 holds 4-bit codes only");
  TORCH_CHECK(!sym || ((type == kQ6_K || type == kQ3_K) && offset == 1 << (bits - 1)),
              "GGUF type ", type, " is not symmetric: no format F8G16Sym");
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == tiles * groups * code_bytes && codes.element_size() == 1,
              "codes must hold ", tiles * groups * code_bytes, " bytes");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.numel() == tiles * groups * scale_floats, "scales must hold ", tiles * groups * scale_floats,
              " floats");
  const int64_t* src = in.src;
  const uint8_t* rp = in.rp;
  const int64_t rs = in.rs;
  auto* cp = reinterpret_cast<uint8_t*>(codes.data_ptr());
  float* sp = scales.data_ptr<float>();
  std::atomic<bool> exact{true};
  parallel_chunks(tiles, 4, [&](int64_t begin, int64_t end) {
    TileRows t(k);
    for (int64_t tile = begin; tile < end; ++tile) {
      t.decode(in, tile, static_cast<int8_t>(-offset));  // (u = 0)
      if (q4k) {
        // per super-block: sc[8][16] and mn[8][16] bytes, then 16d[16] and dmin[16] (kAmxF4K)
        for (int64_t sb = 0; sb < groups / 8; ++sb) {
          float* rec = sp + (tile * (groups / 8) + sb) * 96;
          auto* ints = reinterpret_cast<uint8_t*>(rec);
          for (int o = 0; o < 16; ++o) {
            const int64_t row = src[tile * 16 + o];
            const uint8_t* b = row < 0 ? nullptr : rp + row * rs + sb * block_bytes;
            for (int j = 0; j < 8; ++j) {
              int scale = 0, mn = 0;
              if (b) k_scale_min(b + 4, j, scale, mn);
              ints[j * 16 + o] = static_cast<uint8_t>(scale);
              ints[128 + j * 16 + o] = static_cast<uint8_t>(mn);
            }
            rec[64 + o] = b ? 16 * f16(b) : 0.0f;
            rec[80 + o] = b ? f16(b + 2) : 0.0f;
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* c = cp + (tile * groups + g) * code_bytes;
        float* s = sp + (tile * groups + g) * scale_floats;
        const auto qat = [&](int o, int in) { return t.q[o * k + 32 * g + in]; };
        if (format == kAmxW4) {
          for (int v = 0; v < 4; ++v)
            for (int lane = 0; lane < 16; ++lane)
              for (int r = 0; r < 4; ++r) {
                const int in = 2 * (4 * v + r) + lane % 2;
                c[v * 64 + lane * 4 + r] =
                    static_cast<uint8_t>((qat(lane / 2, in) & 0xF) | ((qat(8 + lane / 2, in) & 0xF) << 4));
              }
          for (int o = 0; o < 16; ++o) {
            const float dd = t.d[o * (k / 16) + 2 * g], mm = t.m[o * (k / 16) + 2 * g];
            const float big = 16 * dd, off = mm - big;
            if (static_cast<double>(off) != static_cast<double>(mm) - 16.0 * static_cast<double>(dd)) exact = false;
            s[o] = big;
            s[16 + o] = off;
          }
          continue;
        }
        if (format == kAmxF4 || q4k) {
          // byte j of chunk p: B row p's word j (output j / 2, input 2p + j % 2) low, row p + 8's high
          for (int p = 0; p < 8; ++p)
            for (int j = 0; j < 32; ++j)
              c[p * 32 + j] = static_cast<uint8_t>(qat(j / 2, 2 * p + j % 2) | (qat(j / 2, 16 + 2 * p + j % 2) << 4));
        } else {
          const int shift = folded ? 7 - bits : 0;
          for (int p = 0; p < 16; ++p)
            for (int lane = 0; lane < 16; ++lane) {
              c[p * 32 + lane] = static_cast<uint8_t>((qat(lane / 2, 2 * p + lane % 2) + offset) << shift);
              c[p * 32 + 16 + lane] = static_cast<uint8_t>((qat(8 + lane / 2, 2 * p + lane % 2) + offset) << shift);
            }
        }
        const int nh = halves ? 2 : 1;  // (F4K: one half, its D and M only checked)
        for (int h = 0; h < nh; ++h) {
          float* sh = s + h * (affine ? 32 : 16);  // sym: 16
          for (int o = 0; o < 16; ++o) {
            const float dd = t.d[o * (k / 16) + 2 * g + h], mm = t.m[o * (k / 16) + 2 * g + h];
            if (!folded) {
              sh[o] = dd;
              if (affine) sh[16 + o] = mm;
              continue;
            }
            // D = 2^bits d and M = m - (offset + 2^bits) d: (offset + 2^bits) d is exact (a code
            // scale of at most 19 bits times at most 96), so M rounds at most once
            const float span = static_cast<float>(offset + (1 << bits));
            const float big = std::ldexp(dd, bits), off = mm - span * dd;
            if (static_cast<double>(off) != static_cast<double>(mm) - static_cast<double>(span) * dd) exact = false;
            if (q4k) continue;  // F4K keeps the super-block's own fields (written above)
            sh[o] = big;
            if (!sym) sh[16 + o] = off;  // sym: the kernel's M = -1.5 D is this off (m = 0), exactly
          }
        }
      }
    }
  });
  return exact;
}

}  // namespace kvserve

namespace kvserve {

// raw [rows, row bytes] uint8 of ggml type `type` -> gguf_a8_linear's codes and scales of
// `format` (kernels.h A8Format; the layouts are gguf_a8.cpp's), output row r from raw row
// source[r] (-1: a zero row). Every group's scale is checked against decode_block's (the
// values models/gguf_quants.py gives): false where one differs (nothing else is wrong).
bool repack_gguf_a8(at::Tensor& codes, at::Tensor& scales, const at::Tensor& raw, int64_t type, int64_t format,
                    const at::Tensor& source) {
  const Blocks in(raw, type, source);
  const int64_t block_bytes = in.block_bytes, per_block = in.per_block, k = in.k, groups = k / 32, tiles = in.tiles;
  int shift;
  TORCH_CHECK(a8_fits(type, format, shift), "GGUF type ", type, " has no int8-activation format ", format);
  const bool sym = format == kA8S16 || format == kA8K3, xs = format == kA8NX4, k2 = format == kA8K2;
  const bool compact = format == kA8K4 || format == kA8K5 || sym || xs || k2;
  const bool lut = format == kA8MX4 || format == kA8NL4 || xs, affine = format == kA8A4 || format == kA8A5;
  const bool half = a8_float16_scales(format);
  const int bits = a8_code_bits(format);
  // (S16 and the 5-bit formats: a plane of the low 4 bits, then the high bits; K2 and K3: two planes
  // of the low 2 bits, then K3's 3rd; L4: table indices)
  const bool five = bits == 5, nibbles = bits < 8;
  const int64_t code_bytes = bits * 64, record = a8_record_floats(format);
  const int64_t scale_floats = compact ? tiles * (groups / 8) * record : tiles * groups * (affine ? 32 : 16);
  // L4: each table value's index (MXFP4's two zeros: the first)
  int index_of[256];
  std::fill(index_of, index_of + 256, -1);
  if (lut) {
    const int8_t* table = a8_table(format);
    for (int i = 15; i >= 0; --i) index_of[static_cast<uint8_t>(table[i])] = i;
  }
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == tiles * groups * code_bytes && codes.element_size() == 1,
              "codes must hold ", tiles * groups * code_bytes, " bytes");
  const bool e8m0 = format == kA8MX4;  // (the scales as the file's E8M0 bytes)
  const at::ScalarType scale_type = half ? at::kHalf : e8m0 ? at::kByte : at::kFloat;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == scale_type && scales.numel() == scale_floats,
              "scales must hold ", scale_floats, " of ", scale_type);
  const int64_t* src = in.src;
  const uint8_t* rp = in.rp;
  const int64_t rs = in.rs;
  auto* cp = reinterpret_cast<uint8_t*>(codes.data_ptr());
  float* sp = half || e8m0 ? nullptr : scales.data_ptr<float>();
  uint8_t* ep = e8m0 ? scales.data_ptr<uint8_t>() : nullptr;
  c10::Half* hp = half ? scales.data_ptr<c10::Half>() : nullptr;
  std::atomic<bool> exact{true};
  parallel_chunks(tiles, 4, [&](int64_t begin, int64_t end) {
    TileRows t(k);
    for (int64_t tile = begin; tile < end; ++tile) {
      t.decode(in, tile, 0);
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* c = cp + (tile * groups + g) * code_bytes;
        const auto u = [&](int o, int in) {
          const int8_t q = t.q[o * k + 32 * g + in];
          return static_cast<uint8_t>(lut ? std::max(0, index_of[static_cast<uint8_t>(q)]) : q + shift);  // (a zero row: 0)
        };
        if (bits <= 3) {  // two planes: byte b of lane o of plane p, bits 2t, of code vector 4p + t
          for (int p = 0; p < 2; ++p)
            for (int o = 0; o < 16; ++o)
              for (int b = 0; b < 4; ++b) {
                int packed = 0;
                for (int t = 0; t < 4; ++t) packed |= (u(o, 16 * p + 4 * t + b) & 3) << (2 * t);
                c[p * 64 + o * 4 + b] = static_cast<uint8_t>(packed);
              }
        }
        for (int j = 0; j < (bits <= 3 ? 0 : nibbles ? 4 : 8); ++j)
          for (int o = 0; o < 16; ++o)
            for (int b = 0; b < 4; ++b)
              c[j * 64 + o * 4 + b] = nibbles ? static_cast<uint8_t>((u(o, 4 * j + b) & 0xF) |
                                                                     ((u(o, 16 + 4 * j + b) & 0xF) << 4))
                                              : u(o, 4 * j + b);
        if (five || bits == 3) {  // the 5th (3rd) bits: byte b of lane o, bit t, of code vector t
          const int top = bits - 1;
          for (int o = 0; o < 16; ++o)
            for (int b = 0; b < 4; ++b) {
              int high = 0;
              for (int j = 0; j < 8; ++j) high |= ((u(o, j < 4 ? 4 * j + b : 16 + 4 * (j - 4) + b) >> top) & 1) << j;
              c[64 * top + o * 4 + b] = static_cast<uint8_t>(high);  // (after the low bits' 128 or 256 bytes)
            }
        }
        if (bits == 6) {  // the high 2 bits: byte b of lane o of the v-th vector, bits 2t, of code vector 4v + t
          for (int v = 0; v < 2; ++v)
            for (int o = 0; o < 16; ++o)
              for (int b = 0; b < 4; ++b) {
                int high = 0;
                for (int t = 0; t < 4; ++t) {
                  const int j = 4 * v + t, in = j < 4 ? 4 * j + b : 16 + 4 * (j - 4) + b;
                  high |= (u(o, in) >> 4) << (2 * t);
                }
                c[256 + v * 64 + o * 4 + b] = static_cast<uint8_t>(high);
              }
        }
        if (compact) continue;
        if (half) {  // the file's float16 d per 32 inputs (m: D4's -8 d, D5's, D8's and NL4's 0; A's the file's)
          c10::Half* s = hp + (tile * groups + g) * (affine ? 32 : 16);
          for (int o = 0; o < 16; ++o) {
            const int64_t at = o * (k / 16) + 2 * g;
            s[o] = c10::Half(t.d[at]);
            const float m = affine ? t.m[at] : format == kA8D4 ? -8.0f * t.d[at] : 0.0f;
            if (affine) s[16 + o] = c10::Half(m);
            if (static_cast<float>(s[o]) != t.d[at] || t.d[at + 1] != t.d[at] || t.m[at] != m || t.m[at + 1] != m ||
                (affine && static_cast<float>(s[16 + o]) != m))
              exact = false;
          }
          continue;
        }
        if (e8m0) {  // the block's exponent byte: d = 2^(e - 128) (e8m0_half)
          uint8_t* s = ep + (tile * groups + g) * 16;
          for (int o = 0; o < 16; ++o) {
            const int64_t at = o * (k / 16) + 2 * g;
            int x = 0;
            std::frexp(t.d[at], &x);  // (d = 2^(x - 1); a zero row: 0)
            s[o] = t.d[at] > 0.0f ? static_cast<uint8_t>(x + 127) : 0;
            // the kernel's e = 0 is 0, not 2^-128: right only where the block's values are all 0
            const float made = s[o] ? std::ldexp(1.0f, static_cast<int>(s[o]) - 128) : 0.0f;
            const int8_t* q = t.q.data() + o * k + 32 * g;
            const bool right =
                made == t.d[at] || (s[o] == 0 && std::all_of(q, q + 32, [](int8_t v) { return v == 0; }));
            if (!right || t.d[at + 1] != t.d[at] || t.m[at] != 0.0f) exact = false;
          }
          continue;
        }
      }
      if (!compact) continue;
      for (int64_t sb = 0; sb < groups / 8; ++sb) {
        float* rec = sp + (tile * (groups / 8) + sb) * record;
        auto* big = reinterpret_cast<c10::Half*>(rec);  // D[16], then K's M[16]: the file's float16 values
        auto* ints = reinterpret_cast<int8_t*>(rec + a8_record_ints(format));
        for (int o = 0; o < 16; ++o) {
          const int64_t row = src[tile * 16 + o];
          float big_d = 0.0f, big_m = 0.0f;
          int sc[16] = {0}, mn[16] = {0};
          if (row >= 0) a8_block_scales(type, rp + row * rs + sb * block_bytes, big_d, big_m, sc, mn);
          big[o] = c10::Half(big_d);
          if (!sym && !xs) big[16 + o] = c10::Half(big_m);
          if (static_cast<float>(big[o]) != big_d || (!sym && !xs && static_cast<float>(big[16 + o]) != big_m))
            exact = false;
          for (int h = 0; h < 16; ++h) {  // each 16 inputs' scale, checked against decode_block's
            const int j = sym || k2 ? h : h / 2;
            const float dd = big_d * static_cast<float>(sc[j]), mm = big_m * static_cast<float>(mn[j]);
            const int64_t at = o * (k / 16) + sb * 16 + h;
            if (dd != t.d[at] || (!sym && mm != t.m[at])) exact = false;
          }
          for (int j = 0; j < 8; ++j) {
            if (k2) {  // (the file's bytes: sc | mn << 4)
              for (int h = 0; h < 2; ++h)
                ints[j * 32 + 16 * h + o] = static_cast<int8_t>(sc[2 * j + h] | (mn[2 * j + h] << 4));
            } else if (sym) {
              ints[j * 32 + o] = static_cast<int8_t>(sc[2 * j]);
              ints[j * 32 + 16 + o] = static_cast<int8_t>(sc[2 * j + 1]);
            } else {
              ints[j * 16 + o] = static_cast<int8_t>(sc[j]);
              if (!xs) ints[128 + j * 16 + o] = static_cast<int8_t>(mn[j]);
            }
          }
        }
      }
    }
  });
  return exact;
}

}  // namespace kvserve

namespace kvserve {

// out [n, K] float32 = the rows `ids` [n] of raw [rows, row bytes] (a GGUF tensor's blocks of
// `type`) dequantised: q * d, then + m for the types whose split has an offset (Q4_0, Q4_1,
// Q5_1, Q2_K, Q4_K, Q5_K), each product and sum rounded as models/gguf_quants.py's
// Codes.dequantize rounds them (no contraction into one FMA, no + 0 turning a -0 into +0):
// the embedding's lookups, the same float32 values as the whole table dequantised.
__attribute__((optimize("fp-contract=off"))) void gguf_rows(at::Tensor& out, const at::Tensor& raw, int64_t type,
                                                             const at::Tensor& ids) {
  int64_t block_bytes = 0, per_block = 0;
  TORCH_CHECK(block_shape(type, block_bytes, per_block), "GGUF type ", type, " has no integer split");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1 && raw.size(1) % block_bytes == 0,
              "raw must be uint8 rows of whole blocks");
  const int64_t k = raw.size(1) / block_bytes * per_block, n = ids.numel();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be int64");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                  out.size(1) == k, "out must be float32 [len(ids), K]");
  const bool offset = type == kQ4_0 || type == kQ4_1 || type == kQ5_1 || type == kQ2_K || type == kQ4_K ||
                      type == kQ5_K;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < raw.size(0), "id ", ip[r], " out of range");
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  std::vector<int8_t> q(static_cast<size_t>(per_block));
  std::vector<float> d(static_cast<size_t>(per_block / 16)), m(d.size());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t blk = 0; blk < k / per_block; ++blk) {
      decode_block(type, rp + ip[r] * raw.stride(0) + blk * block_bytes, q.data(), d.data(), m.data());
      float* w = op + r * k + blk * per_block;
      for (int64_t i = 0; i < per_block; ++i) w[i] = static_cast<float>(q[i]) * d[i / 16];
      if (offset)
        for (int64_t i = 0; i < per_block; ++i) w[i] = w[i] + m[i / 16];
    }
  }
}

}  // namespace kvserve
