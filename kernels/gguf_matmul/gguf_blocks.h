// What the GGUF block kernels share (gguf_cpu.cpp's GEMV and dequantization, gguf_gemm_cpu.cpp's
// GEMM): the GGML type numbers and block sizes, the fp16 scale fields, the K-quants' 6-bit scale
// unpacking, the activation rows rounded to int16 per group (and to int8 per superblock: the
// GEMV's Q4_K / Q6_K), and the ops' argument checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace layerzoo_gguf {


constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12,
              kQ5_K = 13, kQ6_K = 14;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact
}

// (elements, bytes) of a block; {0, 0} for a type not handled here.
struct BlockSize {
  int64_t elems, bytes;
};
inline BlockSize block_size(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// Q4_K / Q5_K: the 8 6-bit scales and mins packed in 12 bytes.
inline void k_scale_min(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 48);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 48);
  }
}

// Q3_K: the 16 6-bit scales (biased by 32) packed in 12 bytes.
inline void q3k_scales(const uint8_t* s, int32_t* sc) {
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
    const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = (lo | (hi << 4)) - 32;
  }
}

// Bit i of x -> byte i 0xFF or 0.
inline __m256i bits_to_bytes(uint32_t x) {
  const __m256i spread = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(x)), spread);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));  // every bit but bit i % 8
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

// 32 nibbles of 16 bytes: low nibbles (elements 0-15), then high ones (16-31).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// -- activations --------------------------------------------------------------------------------

// The activation rows rounded to int16 per group of 32 (the 32-element formats) or 256 elements
// (the K-quants, one scale per superblock, so that a superblock's integer dots add up in int32
// before one fp32 conversion): q [M][K], for the GEMV each 32-block stored as its 16 even elements
// then its 16 odd ones (as its W16 holds the weights), for the GEMM in order (natural: it
// broadcasts pairs of neighbours); the values are the same either way; d [M][K/group] the scales max|x| / 32767 over the group;
// s32 [M][K/32] = d * sum(q) per 32-block and s16 [M][K/16] per half block (the min terms; the int
// sums, at most 32 * 32767 < 2^21, are exact in int32 and in fp32).
struct Acts {
  int64_t M = 0, K = 0, nb = 0, group = 32, ng = 0;
  std::vector<int16_t> q;
  std::vector<float> d, s32, s16;
};

inline __m256 abs_max(__m256 a, __m256 b, __m256 c, __m256 e) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  return _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b)),
                       _mm256_max_ps(_mm256_andnot_ps(sign, c), _mm256_andnot_ps(sign, e)));
}

inline float hmax(__m256 m) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One 32-block x[0, 32) rounded with the group's scale d > 0 into qb (evens, then odds; or in order
// where natural); returns the int sums of elements [0, 16) and [16, 32).
inline void quantize_block(const float* x, float d, int16_t* qb, int32_t& s_lo, int32_t& s_hi, bool natural) {
  const __m256 lim = _mm256_set1_ps(32767.f), nlim = _mm256_set1_ps(-32767.f), dv = _mm256_set1_ps(d);
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) {  // x / d, as the reference (a reciprocal could round differently)
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + 8 * j), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, nlim), lim));
  }
  const __m256i lo = _mm256_add_epi32(qi[0], qi[1]), hi = _mm256_add_epi32(qi[2], qi[3]);
  alignas(32) int32_t sums[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), hi);
  s_lo = 0, s_hi = 0;
  for (int j = 0; j < 8; ++j) s_lo += sums[j], s_hi += sums[8 + j];
  // qi[j] holds elements 8j .. 8j + 7 in int32. Pack them to int16 in order (packs_epi32
  // interleaves the 128-bit lanes; 64-bit pieces (0, 2, 1, 3) undo it), then split each int32
  // lane's two int16: the even elements to qb[0, 16), the odd ones to qb[16, 32).
  const __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);  // 0 .. 15
  const __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8);  // 16 .. 31
  if (natural) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), p1);
    return;
  }
  const __m256i ev = _mm256_packs_epi32(_mm256_srai_epi32(_mm256_slli_epi32(p0, 16), 16),
                                        _mm256_srai_epi32(_mm256_slli_epi32(p1, 16), 16));
  const __m256i od = _mm256_packs_epi32(_mm256_srai_epi32(p0, 16), _mm256_srai_epi32(p1, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permute4x64_epi64(ev, 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm256_permute4x64_epi64(od, 0xD8));
}

// group: 32 or 256 (a multiple of 32 dividing K), as reference.quantize_activations; natural: q in
// order (the GEMM's layout), else each 32-block evens then odds (the GEMV's).
inline Acts quantize_acts(const float* x, int64_t M, int64_t K, int64_t group, bool natural = false) {
  Acts a;
  a.M = M, a.K = K, a.nb = K / 32, a.group = group, a.ng = K / group;
  a.q.resize(M * K);
  a.d.resize(M * a.ng);
  a.s32.resize(M * a.nb);
  a.s16.resize(M * a.nb * 2);
  const int64_t per = group / 32;  // 32-blocks a group
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < a.ng; ++g) {
      const float* xg = x + m * K + g * group;
      __m256 mx = _mm256_setzero_ps();
      for (int64_t b = 0; b < per; ++b) {
        const float* xb = xg + 32 * b;
        mx = _mm256_max_ps(mx, abs_max(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                                       _mm256_loadu_ps(xb + 24)));
      }
      const float d = hmax(mx) / 32767.f;
      const bool zero = !(d > 0.f);  // an all-zero group (or one too small to scale): 0
      a.d[m * a.ng + g] = zero ? 0.f : d;
      for (int64_t b = 0; b < per; ++b) {
        const int64_t i = m * a.nb + g * per + b;
        int16_t* qb = a.q.data() + m * K + g * group + 32 * b;
        if (zero) {
          std::memset(qb, 0, 32 * sizeof(int16_t));
          a.s32[i] = 0.f, a.s16[2 * i] = 0.f, a.s16[2 * i + 1] = 0.f;
          continue;
        }
        int32_t s_lo, s_hi;
        quantize_block(xg + 32 * b, d, qb, s_lo, s_hi, natural);
        a.s32[i] = d * float(s_lo + s_hi);
        a.s16[2 * i] = d * float(s_lo);
        a.s16[2 * i + 1] = d * float(s_hi);
      }
    }
  }
  return a;
}

// The activation rows rounded to int8 per superblock of 256 (llama.cpp's Q8_K), for the GEMV of Q4_K
// and Q6_K: q [M][K] in order, d [M][K/256] = max|x| / 127 over the superblock (0 for an all-zero
// one, its q 0), s16 [M][K/16] the int sums of q per 16 elements (at most 16 * 127, exact in int16),
// and the same sums in fp32 (exact), per 16 (f16) and per 32 (f32) elements.
struct Acts8 {
  int64_t M = 0, K = 0, ng = 0;
  std::vector<int8_t> q;
  std::vector<float> d, f16, f32;
  std::vector<int16_t> s16;
};

inline Acts8 quantize_acts8(const float* x, int64_t M, int64_t K) {
  Acts8 a;
  a.M = M, a.K = K, a.ng = K / 256;
  a.q.resize(M * K);
  a.d.resize(M * a.ng);
  a.s16.resize(M * (K / 16));
  a.f16.resize(M * (K / 16));
  a.f32.resize(M * (K / 32));
  const __m256 lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < a.ng; ++g) {
      const float* xg = x + m * K + g * 256;
      int8_t* qg = a.q.data() + m * K + g * 256;
      int16_t* sg = a.s16.data() + m * (K / 16) + g * 16;
      __m256 mx = _mm256_setzero_ps();
      for (int b = 0; b < 8; ++b) {
        const float* xb = xg + 32 * b;
        mx = _mm256_max_ps(mx, abs_max(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                                       _mm256_loadu_ps(xb + 24)));
      }
      const float d = hmax(mx) / 127.f;
      if (!(d > 0.f)) {  // an all-zero group (or one too small to scale): 0
        a.d[m * a.ng + g] = 0.f;
        std::memset(qg, 0, 256);
        std::memset(sg, 0, 16 * sizeof(int16_t));
        std::fill_n(a.f16.data() + m * (K / 16) + g * 16, 16, 0.f);
        std::fill_n(a.f32.data() + m * (K / 32) + g * 8, 8, 0.f);
        continue;
      }
      a.d[m * a.ng + g] = d;
      const __m256 dv = _mm256_set1_ps(d);
      for (int b = 0; b < 8; ++b) {
        __m256i qi[4];
        for (int j = 0; j < 4; ++j) {  // x / d, as the reference (a reciprocal could round differently)
          const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xg + 32 * b + 8 * j), dv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qi[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, nlim), lim));
        }
        alignas(32) int32_t sums[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_add_epi32(qi[0], qi[1]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), _mm256_add_epi32(qi[2], qi[3]));
        int32_t lo = 0, hi = 0;
        for (int j = 0; j < 8; ++j) lo += sums[j], hi += sums[8 + j];
        sg[2 * b] = int16_t(lo), sg[2 * b + 1] = int16_t(hi);
        a.f16[m * (K / 16) + g * 16 + 2 * b] = float(lo), a.f16[m * (K / 16) + g * 16 + 2 * b + 1] = float(hi);
        a.f32[m * (K / 32) + g * 8 + b] = float(lo + hi);
        // int32 -> int16 (packs interleaves the 128-bit lanes) -> int8, then the lanes back in order
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        // p8's dwords hold elements (0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31)
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 32 * b), ordered);
      }
    }
  }
  return a;
}

inline BlockSize check_blocks(const char* op, const at::Tensor& blocks, int64_t qtype, int64_t k) {
  const BlockSize bs = block_size(qtype);
  TORCH_CHECK(bs.elems > 0, op, ": unsupported qtype ", qtype,
              " (expected a GGMLQuantizationType of Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, "
              "Q4_K=12, Q5_K=13, Q6_K=14)");
  TORCH_CHECK(k > 0 && k % bs.elems == 0, op, ": k=", k, " must be a positive multiple of the block of ", bs.elems,
              " elements of qtype ", qtype);
  TORCH_CHECK(blocks.device().is_cpu(), op, ": blocks must be a CPU tensor");
  TORCH_CHECK(blocks.scalar_type() == at::kByte, op, ": blocks must be uint8, got ", blocks.scalar_type());
  const int64_t rb = k / bs.elems * bs.bytes;
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == rb, op, ": blocks must be [N, ", rb, "] (k=", k, " of qtype ",
              qtype, ": ", k / bs.elems, " blocks of ", bs.bytes, " bytes a row), got ", blocks.sizes());
  TORCH_CHECK(blocks.is_contiguous(), op, ": blocks must be contiguous");
  return bs;
}

}  // namespace layerzoo_gguf
