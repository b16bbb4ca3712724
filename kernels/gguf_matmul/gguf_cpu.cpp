// Products by GGUF (llama.cpp) block-quantized weights, read in their own format, on CPU.
//
//   gguf_dequantize(blocks, qtype, k, rows?): the fp32 weight [N, k] (or the listed rows [R, k],
//       an embedding's lookup), bitwise reference.dequantize: fp16 scales widened exactly, then
//       ggml's steps in fp32 (e.g. Q4_K (d * sc) * q - dmin * m; built with -ffp-contract=off, so
//       none of them fuse into an FMA).
//   gguf_gemv(x, blocks, qtype, k, bias?): y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few rows
//       (decode). Each activation row is rounded to int16 per group, 32 elements for the 32-element
//       formats and 256 (a superblock) for the K-quants (scale max|x| / 32767 over the group, as
//       reference.quantize_activations), then every 32 weights of a block, widened to int16 in
//       place (even and odd bytes split; the activations are stored evens then odds to match), are
//       multiplied with each row's 32 in int32, exactly (AVX2 vpmaddwd, or vpdpwssd with VNNI).
//       32-element formats: acc += (d_w * d_x) * dot per block. K-quants: the sub-block scales are
//       multiplied into the int16 weights, the rows' dots add up in int32 over the superblock (Q6_K:
//       half of it; the bounds at the K-quant formats) and convert once: acc += (d_w * d_x) * sum.
//       The formats with a min subtract m * d_x * sum(q_x) (precomputed per 32 or 16 elements).
//       Why int16, not llama.cpp's int8 (max|x| / 127): on SmolLM2-135M int8 gave 0.5-1.7%
//       relative error per linear, and over 30 layers the greedy answer to "What is the capital
//       of France?" flipped at a near tie (dense logits "The" 25.33 vs "L" 25.24, int8 24.23 vs
//       24.63); int16 gives ~2e-5 on random data (int8 ~5e-3). A thread streams its own band of weight rows once, decoding
//       each block into registers and multiplying it with up to 4 activation rows before moving
//       on; more rows take further passes over the row (in cache).
//       A row's result does not depend on the rows beside it (same operations, same order).
//       Q4_K and Q6_K (llama.cpp's Q4_K_M files) instead round the activations to int8 per
//       superblock, as llama.cpp does (its Q8_K), and multiply unsigned weight bytes with them in
//       vpmaddubsw, then with the sub-block scales in vpmaddwd / vpdpwssd: half the multiplies of
//       the int16 path, 1.4-1.6x faster at one row (FQ4_K8, FQ6_K8 below). int16's reason above
//       is SmolLM2's Q4_1, which keeps it; on SmolLM2 requantized to Q4_K_M the int8 rounding
//       moved perplexity through the GEMV by 0.17% (README.md). The GEMM rounds these two alike.
//       Q8_0 keeps int16 (SmolLM2's tied Q8_0 embedding is its lm_head: int8 per 32 flips the
//       answer above); where the CPU has AVX-512 VNNI its dots run by bytes in vpdpbusd
//       (gemv_q8_0_vnni), the same integers.
//
// Shapes: blocks [N, row_bytes] uint8 (K / elems blocks of each row, as in the file), x [M, K]
// fp32 contiguous, bias [N] fp32 or none -> [M, N] fp32. Layouts: README.md. Built by
// layerzoo.kernels.cpp_build with -march=native; the AVX2 path is what needs to be there (the
// build is refused on CPUs without AVX2). Where the CPU has AVX-512 VNNI (or AVX-VNNI), a
// vpmaddwd + vpaddd is one vpdpwssd (the same int32 lanes, exactly).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../cpu_gemv/row_groups.h"
#include "gguf_blocks.h"

namespace {

using namespace layerzoo_gguf;

#ifndef LAYERZOO_GGUF_PREFETCH
#define LAYERZOO_GGUF_PREFETCH 1024
#endif
constexpr int64_t kPrefetch = LAYERZOO_GGUF_PREFETCH;  // bytes ahead in the weight stream

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), LAYERZOO_WEIGHT_HINT); }

// -- dequantization (scalar, ggml's rounding steps) ---------------------------------------------

void dequant_block(int64_t qtype, const uint8_t* b, float* out) {
  switch (qtype) {
    case kQ8_0: {
      const float d = f16(b);
      for (int i = 0; i < 32; ++i) out[i] = float(int8_t(b[2 + i])) * d;
      break;
    }
    case kQ4_0: {
      const float d = f16(b);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * float((b[2 + i] & 15) - 8);
        out[i + 16] = d * float((b[2 + i] >> 4) - 8);
      }
      break;
    }
    case kQ4_1: {
      const float d = f16(b), m = f16(b + 2);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * float(b[4 + i] & 15) + m;
        out[i + 16] = d * float(b[4 + i] >> 4) + m;
      }
      break;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool q51 = qtype == kQ5_1;
      const float d = f16(b), m = q51 ? f16(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (q51 ? 4 : 2), 4);
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int i = 0; i < 32; ++i) {
        const int q = (i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4)) | (((qh >> i) & 1) << 4);
        out[i] = q51 ? d * float(q) + m : d * float(q - 16);
      }
      break;
    }
    case kQ2_K: {
      const float d = f16(b + 80), dmin = f16(b + 82);
      const uint8_t* qs = b + 16;
      for (int j = 0; j < 16; ++j) {
        const float dl = d * float(b[j] & 15), ml = dmin * float(b[j] >> 4);
        for (int l = 0; l < 16; ++l) {
          const int e = j * 16 + l;
          const int q = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
          out[e] = dl * float(q) - ml;
        }
      }
      break;
    }
    case kQ3_K: {
      int32_t sc[16];
      q3k_scales(b + 96, sc);
      const float d = f16(b + 108);
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32;
      for (int j = 0; j < 16; ++j) {
        const float dl = d * float(sc[j]);
        for (int l = 0; l < 16; ++l) {
          const int e = j * 16 + l;
          const int lo = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
          const int h = (hm[e % 32] >> (e / 32)) & 1;
          out[e] = dl * float(lo - (h ? 0 : 4));
        }
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = qtype == kQ5_K;
      const float d = f16(b), dmin = f16(b + 2);
      int32_t sc[8], mn[8];
      k_scale_min(b + 4, sc, mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        const float dl = d * float(sc[j]), ml = dmin * float(mn[j]);
        for (int l = 0; l < 32; ++l) {
          int q = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 15;
          if (q5) q |= ((qh[l] >> j) & 1) << 4;
          out[j * 32 + l] = dl * float(q) - ml;
        }
      }
      break;
    }
    case kQ6_K: {
      const float d = f16(b + 208);
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int j = 0; j < 16; ++j) {
        const float dl = d * float(sc[j]);
        for (int l = 0; l < 16; ++l) {
          const int e = j * 16 + l, h = e / 128, r = e % 128;
          const int lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 15;
          const int hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
          out[e] = dl * float((lo | (hi << 4)) - 32);
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "gguf_dequantize: unsupported qtype ", qtype);
  }
}


// -- integer dot products of one 32-block -------------------------------------------------------

// A weight 32-block widened to int16, as the activations are stored (Acts): ev the even elements
// 0, 2, .., 30, od the odd ones. Splitting the bytes of each 16-bit lane (shifts, no shuffles)
// widens them in place: int16 lane i of ev is element 2i, of od element 2i + 1.
struct W16 {
  __m256i ev, od;
};
inline W16 widen_s(__m256i w) {  // 32 signed int8 weights
  return {_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), _mm256_srai_epi16(w, 8)};
}
inline W16 widen_u(__m256i w) {  // 32 unsigned int8 weights
  return {_mm256_and_si256(w, _mm256_set1_epi16(0x00FF)), _mm256_srli_epi16(w, 8)};
}
// A 32-block's int16 scale vector s (pick16): lanes 0-7 (elements 0-15) the first 16-element
// sub-block's scale, lanes 8-15 (16-31) the second's, or all one 32-element sub-block's.
// Signed weights times their sub-block scales, in int16: |q * sc| <= 32 * 128 (Q6_K), 4 * 32 (Q3_K).
inline W16 scaled(W16 w, __m256i s) { return {_mm256_mullo_epi16(w.ev, s), _mm256_mullo_epi16(w.od, s)}; }
// 32 unsigned bytes times scales s (int16 lanes, each in [0, 127]), widened in the same
// step: vpmaddubsw with the scale in the low byte of each 16-bit lane (0 in the high one) gives
// w[2i] * s, with it in the high byte w[2i + 1] * s; one product a lane, at most 255 * 127 < 2^15,
// so nothing saturates. (Q4_K q * sc <= 15 * 63, Q5_K 31 * 63, Q2_K 3 * 15.)
inline W16 widen_u_scaled(__m256i w, __m256i s, __m256i s_hi) {  // s_hi = s << 8
  return {_mm256_maddubs_epi16(w, s), _mm256_maddubs_epi16(w, s_hi)};
}

// dot of a widened weight block with one row's 32 int16 activations (evens, then odds): 8 int32
// lanes, lane j the products of elements [4j, 4j + 4) (the same lanes on every path; lanes 0-3
// elements 0-15, lanes 4-7 elements 16-31). Exact in int32: |x| <= 32767 and |w| <= 128 unscaled
// (Q8_0 may hold -128), so a vpmaddwd pair sums to at most 2 * 128 * 32767 < 2^23, a lane (4
// products) to < 2^24 and a whole block to < 2^28. (The fp32 conversion of a lane above 2^24
// rounds, by at most 2^-24 relative, as the reference's fp32 sums do.)
inline __m256i dot16(const W16& w, const int16_t* x) {
  const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w.ev, xe), w.od, xo);  // vpdpwssd: no saturation, same sums
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w.ev, xe), w.od, xo);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w.ev, xe), _mm256_madd_epi16(w.od, xo));
#endif
}

// e += the even products of a block's dot, o += the odd ones (two independent int32 chains; e + o
// lane j is dot16's lane j summed over the blocks added). Non-saturating on every path.
inline void dot16_acc(const W16& w, const int16_t* x, __m256i& e, __m256i& o) {
  const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  e = _mm256_dpwssd_epi32(e, w.ev, xe);
  o = _mm256_dpwssd_epi32(o, w.od, xo);
#elif defined(__AVXVNNI__)
  e = _mm256_dpwssd_avx_epi32(e, w.ev, xe);
  o = _mm256_dpwssd_avx_epi32(o, w.od, xo);
#else
  e = _mm256_add_epi32(e, _mm256_madd_epi16(w.ev, xe));
  o = _mm256_add_epi32(o, _mm256_madd_epi16(w.od, xo));
#endif
  // Keep them chains: integer adds may be reassociated, and GCC then computed every block's
  // vpmaddwd first and spilled them to the stack (4 rows x 8 blocks x 2 do not fit 16 registers).
  __asm__("" : "+x"(e), "+x"(o));
}

// The int16 scale vectors of a superblock's 32-blocks, one vpshufb each: T holds 8 int16 scales
// in each 128-bit half; pick(T, j) broadcasts int16 element j within each half. With the 8 scales
// of 32-element sub-blocks in both halves, pick(T, j) is sub-block j's scale everywhere; with the
// even sub-blocks' (16-element) scales in the low half and the odd ones' in the high half
// (evens_odds16), it is sc[2j] in lanes 0-7 and sc[2j + 1] in lanes 8-15.
inline __m256i pick16(__m256i t, int j) {
  return _mm256_shuffle_epi8(t, _mm256_set1_epi16(int16_t((2 * j) | ((2 * j + 1) << 8))));
}

// Q3_K's 12 bytes of 16 6-bit scales -> the 16 scales (minus their bias 32) as int8, as ggml's AVX2
// code unpacks them (q3k_scales' values; its byte i is scale i).
inline __m128i q3k_scales8(const uint8_t* s) {
  uint32_t a[3];
  std::memcpy(a, s, 12);
  constexpr uint32_t m1 = 0x03030303, m2 = 0x0f0f0f0f;
  const uint32_t u0 = (a[0] & m2) | (((a[2] >> 0) & m1) << 4), u1 = (a[1] & m2) | (((a[2] >> 2) & m1) << 4);
  const uint32_t u2 = ((a[0] >> 4) & m2) | (((a[2] >> 4) & m1) << 4), u3 = ((a[1] >> 4) & m2) | (((a[2] >> 6) & m1) << 4);
  return _mm_sub_epi8(_mm_set_epi32(int32_t(u3), int32_t(u2), int32_t(u1), int32_t(u0)), _mm_set1_epi8(32));
}

// The 16 int8 scales of 16-element sub-blocks -> int16, the even sub-blocks' in the low half and the
// odd ones' in the high half (for pick16).
inline __m256i evens_odds16(__m128i sc8) {
  const __m128i evod = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, evod));
}

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (k_scale_min) -> 8 scales as int16, and the 8 mins
// as int16 in the high half of *mins (as ggml's AVX2 code unpacks them).
inline __m128i k_scales_mins16(const uint8_t* s, __m128i* mins) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);  // mins 4-7
  const uint32_t mins03 = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);  // scales 4-7
  u[2] = mins03;
  u[0] &= m1;  // scales 0-3
  const __m256i v = _mm256_cvtepu8_epi16(_mm_set_epi32(int32_t(u[3]), int32_t(u[2]), int32_t(u[1]), int32_t(u[0])));
  *mins = _mm256_extracti128_si256(v, 1);
  return _mm256_castsi256_si128(v);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The activation rows [m0, m0 + MT) of one call.
template <int64_t MT>
struct Rows {
  const int16_t* q[MT];
  const float* d[MT];
  const float* s32[MT];
  const float* s16[MT];
  Rows(const Acts& a, int64_t m0) {
    for (int64_t i = 0; i < MT; ++i) {
      q[i] = a.q.data() + (m0 + i) * a.K;
      d[i] = a.d.data() + (m0 + i) * a.ng;
      s32[i] = a.s32.data() + (m0 + i) * a.nb;
      s16[i] = a.s16.data() + (m0 + i) * a.nb * 2;
    }
  }
  const int16_t* x(int64_t i, int64_t kb) const { return q[i] + kb * 32; }
};

// Per-row accumulators: acc (scaled dots, 8 lanes), macc (min terms, 8 lanes), msum (scalar min terms).
template <int64_t MT>
struct Acc {
  __m256 acc[MT], macc[MT];
  float msum[MT];
  Acc() {
    for (int64_t i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps(), macc[i] = _mm256_setzero_ps(), msum[i] = 0.f;
  }
  // acc[i] += (dw * d_x[kb]) * dot (the 32-element formats: a scale per 32-block)
  inline void add(int64_t i, __m256 dw, const Rows<MT>& r, int64_t kb, __m256i dot) {
    acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(r.d[i] + kb)), _mm256_cvtepi32_ps(dot), acc[i]);
  }
  float result(int64_t i) const { return (hsum(acc[i]) + hsum(macc[i])) + msum[i]; }
};

// The K-quants' per-row int32 sums over the 32-blocks of (part of) a superblock, whose sub-block
// scales are in the int16 weights: one fp32 conversion and one FMA with (d_w * d_x) per flush
// instead of per 32-block. Each format's block() proves its sums fit int32 before a flush.
template <int64_t MT>
struct ISums {
  __m256i e[MT], o[MT];
  ISums() { clear(); }
  void clear() {
    for (int64_t i = 0; i < MT; ++i) e[i] = _mm256_setzero_si256(), o[i] = _mm256_setzero_si256();
  }
  // a.acc[i] += (dw * d_x of superblock g) * (e + o), then the sums restart
  inline void flush(Acc<MT>& a, float dw, const Rows<MT>& r, int64_t g) {
    for (int64_t i = 0; i < MT; ++i)
      a.acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * r.d[i][g]), _mm256_cvtepi32_ps(_mm256_add_epi32(e[i], o[i])), a.acc[i]);
    clear();
  }
};

// -- the formats: block(b, kb, rows, acc) multiplies one weight block (first 32-block kb) with each row

struct FQ8_0 {
  static constexpr int64_t kElems = 32, kBytes = 34;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const __m256 dw = _mm256_set1_ps(f16(b));
    const W16 w = widen_s(load32(b + 2));
    for (int64_t i = 0; i < MT; ++i) a.add(i, dw, r, kb, dot16(w, r.x(i, kb)));
  }
};

struct FQ4_0 {
  static constexpr int64_t kElems = 32, kBytes = 18;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const __m256 dw = _mm256_set1_ps(f16(b));
    const W16 w = widen_s(_mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)));
    for (int64_t i = 0; i < MT; ++i) a.add(i, dw, r, kb, dot16(w, r.x(i, kb)));
  }
};

struct FQ4_1 {
  static constexpr int64_t kElems = 32, kBytes = 20;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const __m256 dw = _mm256_set1_ps(f16(b));
    const float m = f16(b + 2);
    const W16 w = widen_u(nibbles16(b + 4));
    for (int64_t i = 0; i < MT; ++i) {
      a.add(i, dw, r, kb, dot16(w, r.x(i, kb)));
      a.msum[i] += m * r.s32[i][kb];
    }
  }
};

struct FQ5_0 {
  static constexpr int64_t kElems = 32, kBytes = 22;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const __m256 dw = _mm256_set1_ps(f16(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    __m256i w = _mm256_or_si256(nibbles16(b + 6), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
    const W16 w16 = widen_s(_mm256_sub_epi8(w, _mm256_set1_epi8(16)));
    for (int64_t i = 0; i < MT; ++i) a.add(i, dw, r, kb, dot16(w16, r.x(i, kb)));
  }
};

struct FQ5_1 {
  static constexpr int64_t kElems = 32, kBytes = 24;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const __m256 dw = _mm256_set1_ps(f16(b));
    const float m = f16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const W16 w = widen_u(_mm256_or_si256(nibbles16(b + 8), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10))));
    for (int64_t i = 0; i < MT; ++i) {
      a.add(i, dw, r, kb, dot16(w, r.x(i, kb)));
      a.msum[i] += m * r.s32[i][kb];
    }
  }
};

// The K-quants below (superblocks of 256, kb = 8 * superblock index) sum their 32-blocks' dots
// in int32 and convert once (Q6_K twice) per superblock. The bounds, with |x| <= 32767 and e + o
// lane j holding 4 products a 32-block (elements 4j .. 4j + 3 of it):
//   Q4_K |q * sc| <= 15 * 63 = 945:     8 blocks, 32 products <= 32 * 945 * 32767 = 990,874,080
//   Q5_K |q * sc| <= 31 * 63 = 1953:    8 blocks, 32 products <= 2,047,806,432
//   Q6_K |(q - 32) * sc| <= 32 * 128 = 4096: 4 blocks, 16 products <= 2,147,418,112 (8 would not fit)
//   Q3_K |q * sc| <= 4 * 32 = 128:      8 blocks <= 134,213,632
//   Q2_K |q * sc| <= 3 * 15 = 45:       8 blocks <= 47,184,480
// all below 2^31 - 1 = 2,147,483,647, so the int32 sums are exact (each of e, o holds half of them).

// Q4_K / Q5_K: 8 sub-blocks of 32, w = (d * sc_j) * q - (dmin * m_j), q in [0, 16) or [0, 32).
template <bool kQ5>
struct FQ45_K {
  static constexpr int64_t kElems = 256, kBytes = kQ5 ? 176 : 144;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const float d = f16(b);
    const __m256 dmin = _mm256_set1_ps(f16(b + 2));
    __m128i mn16;
    const __m128i sc16 = k_scales_mins16(b + 4, &mn16);
    const __m256i t = _mm256_set_m128i(sc16, sc16), t8 = _mm256_slli_epi16(t, 8);  // scales in the low / high bytes
    const uint8_t* qs = b + (kQ5 ? 48 : 16);
    __m256i hb = kQ5 ? load32(b + 16) : _mm256_setzero_si256();
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    ISums<MT> s;
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load32(qs + 32 * g);
      __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if (kQ5) {
        w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
        w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
        hb = _mm256_srli_epi16(hb, 2);
      }
      const W16 v0 = widen_u_scaled(w0, pick16(t, 2 * g), pick16(t8, 2 * g));
      const W16 v1 = widen_u_scaled(w1, pick16(t, 2 * g + 1), pick16(t8, 2 * g + 1));
      for (int64_t i = 0; i < MT; ++i) {
        dot16_acc(v0, r.x(i, kb + 2 * g), s.e[i], s.o[i]);
        dot16_acc(v1, r.x(i, kb + 2 * g + 1), s.e[i], s.o[i]);
      }
    }
    s.flush(a, d, r, kb / 8);
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(mn16));
    for (int64_t i = 0; i < MT; ++i)
      a.macc[i] = _mm256_fnmadd_ps(dmin, _mm256_mul_ps(mins, _mm256_loadu_ps(r.s32[i] + kb)), a.macc[i]);
  }
};

// Q6_K: 16 sub-blocks of 16, w = (d * sc_j) * (q - 32), q 6 bits (4 in ql, 2 in qh).
struct FQ6_K {
  static constexpr int64_t kElems = 256, kBytes = 210;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const float dw = f16(b + 208);
    const __m256i t = evens_odds16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));  // int8 scales
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    ISums<MT> s;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
      __m256i w[4];
      w[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
      w[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
      w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
      w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t j = 4 * h + c;  // 32-block of the superblock
        const W16 ws = scaled(widen_s(_mm256_sub_epi8(w[c], off)), pick16(t, int(j)));
        for (int64_t i = 0; i < MT; ++i) dot16_acc(ws, r.x(i, kb + j), s.e[i], s.o[i]);
      }
      s.flush(a, dw, r, kb / 8);  // every 4 blocks: 8 of Q6_K's could overflow int32
    }
  }
};

// Q3_K: 16 sub-blocks of 16, w = (d * sc_j) * q, q = 2 low bits - (high bit ? 0 : 4).
struct FQ3_K {
  static constexpr int64_t kElems = 256, kBytes = 110;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const float dw = f16(b + 108);
    const __m256i t = evens_odds16(q3k_scales8(b + 96));
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
    __m256i hm = load32(b);
    ISums<MT> s;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(b + 32 + 32 * h);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t j = 4 * h + c;
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * c), three);
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(hm, one), 2);
        hm = _mm256_srli_epi16(hm, 1);
        const W16 ws = scaled(widen_s(_mm256_sub_epi8(_mm256_or_si256(lo, hi), four)), pick16(t, int(j)));
        for (int64_t i = 0; i < MT; ++i) dot16_acc(ws, r.x(i, kb + j), s.e[i], s.o[i]);
      }
    }
    s.flush(a, dw, r, kb / 8);
  }
};

// Q2_K: 16 sub-blocks of 16, w = (d * sc_j) * q - (dmin * m_j), q 2 bits.
struct FQ2_K {
  static constexpr int64_t kElems = 256, kBytes = 84;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t kb, const Rows<MT>& r, Acc<MT>& a) {
    const float dw = f16(b + 80);
    const __m256 dmin = _mm256_set1_ps(f16(b + 82));
    const __m256i three = _mm256_set1_epi8(3);
    const __m128i sc8 = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), _mm_set1_epi8(0x0F));
    const __m256i t = evens_odds16(sc8), t8 = _mm256_slli_epi16(t, 8);  // 4-bit scales
    ISums<MT> s;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(b + 16 + 32 * h);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t j = 4 * h + c;
        const __m256i w = _mm256_and_si256(_mm256_srli_epi16(v, 2 * c), three);
        const W16 ws = widen_u_scaled(w, pick16(t, int(j)), pick16(t8, int(j)));
        for (int64_t i = 0; i < MT; ++i) dot16_acc(ws, r.x(i, kb + j), s.e[i], s.o[i]);
      }
    }
    s.flush(a, dw, r, kb / 8);
    const __m128i sb = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 4),
                                     _mm_set1_epi8(0x0F));
    const __m256 m_lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sb));
    const __m256 m_hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sb, 8)));
    for (int64_t i = 0; i < MT; ++i) {
      const float* s16 = r.s16[i] + 2 * kb;
      const __m256 t = _mm256_fmadd_ps(m_hi, _mm256_loadu_ps(s16 + 8), _mm256_mul_ps(m_lo, _mm256_loadu_ps(s16)));
      a.macc[i] = _mm256_fnmadd_ps(dmin, t, a.macc[i]);
    }
  }
};

// -- the GEMV -----------------------------------------------------------------------------------

template <typename Body>
inline void over_chunks(int64_t M, const Body& body) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m;
    if (left >= 4) { body(m, std::integral_constant<int64_t, 4>{}); m += 4; }
    else if (left == 3) { body(m, std::integral_constant<int64_t, 3>{}); m += 3; }
    else if (left == 2) { body(m, std::integral_constant<int64_t, 2>{}); m += 2; }
    else { body(m, std::integral_constant<int64_t, 1>{}); m += 1; }
  }
}

template <typename F>
void gemv_impl(const uint8_t* w, int64_t N, int64_t K, const Acts& acts, const float* bias, float* y) {
  const int64_t nblk = K / F::kElems, rb = nblk * F::kBytes, sub = F::kElems / 32;
  const int64_t M = acts.M;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / rb);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wr = w + n * rb;
      over_chunks(M, [&](int64_t m, auto MT_) {
        constexpr int64_t MT = decltype(MT_)::value;
        const Rows<MT> rows(acts, m);
        Acc<MT> a;
        for (int64_t blk = 0; blk < nblk; ++blk) {
          const uint8_t* b = wr + blk * F::kBytes;
          for (int64_t p = 0; p < F::kBytes; p += 64) prefetch(b + kPrefetch + p);
          F::template block<MT>(b, blk * sub, rows, a);
        }
        for (int64_t i = 0; i < MT; ++i) {
          const float v = a.result(i);
          y[(m + i) * N + n] = bias ? v + bias[n] : v;
        }
      });
    }
  });
}

// -- Q4_K and Q6_K with int8 activations ---------------------------------------------------------
//
// The two types of llama.cpp's Q4_K_M files run their few-row products as llama.cpp does: the
// activations rounded to int8 per superblock of 256 (its Q8_K: d_x = max|x| / 127), each 32-block's
// unsigned weights times the int8 activations in one vpmaddubsw (pairs of products in int16),
// then times the sub-block scales into int32 in one vpmaddwd (+ vpaddd, or one vpdpwssd with VNNI):
// two multiplies a 32-block and row instead of int16's four, and the weight's scales applied
// once per 32-block in the integers. Bounds (|x| <= 127): Q4_K a pair 2 * 15 * 127 = 3810 in
// int16, a lane 8 blocks * 2 * 3810 * 63 = 3,840,480; Q6_K (q 0-63 before its offset 32) a pair 2 *
// 63 * 127 = 16,002, a lane 8 * 2 * 16,002 * 128 = 32,774,144; the offset (32 * sc_j * the
// sub-block's int sum, <= 16 * 32 * 128 * 2032) and the mins in their own int32 sums.

// Q4_K's 12 bytes of 6-bit scales and mins at s -> the 8 scales in bytes 0-7 and the 8 mins in
// bytes 8-15 (k_scale_min's values), in vector ops (reads 16 bytes at s: the block goes on past them).
inline __m128i k_scales_mins8(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  // scales 0-3: s[0-3] & 63; scales 4-7: s[8-11] & 15 | (s[0-3] >> 2) & 48;
  // mins 0-3: s[4-7] & 63; mins 4-7: s[8-11] >> 4 | (s[4-7] >> 2) & 48
  const __m128i x = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i y = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i lo = _mm_and_si128(x, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i hi4 = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(y, 2), _mm_set1_epi8(48));  // bits 6-7 to 4-5 of each byte
  return _mm_or_si128(_mm_or_si128(lo, hi4), top);
}

// The activation rows [m0, m0 + MT) rounded to int8 (Acts8).
template <int64_t MT>
struct Rows8 {
  const int8_t* q[MT];
  const float* d[MT];
  const int16_t* s16[MT];
  Rows8(const Acts8& a, int64_t m0) {
    for (int64_t i = 0; i < MT; ++i) {
      q[i] = a.q.data() + (m0 + i) * a.K;
      d[i] = a.d.data() + (m0 + i) * a.ng;
      s16[i] = a.s16.data() + (m0 + i) * (a.K / 16);
    }
  }
};

// acc += the int16 pairs p times the int16 scales s, in int32 (vpmaddwd + vpaddd, or vpdpwssd).
inline __m256i madd_acc(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  acc = _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
  acc = _mm256_dpwssd_avx_epi32(acc, p, s);
#else
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
  __asm__("" : "+x"(acc));  // chains stay chains (see dot16_acc); one row takes two
  return acc;
}

template <int64_t MT>
struct Acc8 {
  __m256 acc[MT];
  Acc8() {
    for (int64_t i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  }
  float result(int64_t i) const { return hsum(acc[i]); }
};

struct FQ4_K8 {
  static constexpr int64_t kBytes = 144;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t sb, const Rows8<MT>& r, Acc8<MT>& a) {
    const float d = f16(b), dmin = f16(b + 2);
    const __m128i sm = k_scales_mins8(b + 4);
    const __m128i sc16 = _mm_cvtepu8_epi16(sm);
    const __m256i t = _mm256_set_m128i(sc16, sc16);  // pick16(t, j): scale j in every lane
    // mins, each twice (the two 16-element halves of its 32-block): with the int sums per 16,
    // one vpmaddwd gives m_j * sum(x of 32-block j) in int32 lane j
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    const uint8_t* qs = b + 16;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i s[MT], s2[MT];
    for (int64_t i = 0; i < MT; ++i) s[i] = _mm256_setzero_si256(), s2[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load32(qs + 32 * g);
      const __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const __m256i s0 = pick16(t, 2 * g), s1 = pick16(t, 2 * g + 1);
      for (int64_t i = 0; i < MT; ++i) {
        const int8_t* x = r.q[i] + sb * 256 + 64 * g;
        s[i] = madd_acc(s[i], _mm256_maddubs_epi16(w0, load32(reinterpret_cast<const uint8_t*>(x))), s0);
        __m256i& s_odd = MT == 1 ? s2[i] : s[i];  // one row: a second chain
        s_odd = madd_acc(s_odd, _mm256_maddubs_epi16(w1, load32(reinterpret_cast<const uint8_t*>(x + 32))), s1);
      }
    }
    if (MT == 1) s[0] = _mm256_add_epi32(s[0], s2[0]);
    for (int64_t i = 0; i < MT; ++i) {
      const float dx = r.d[i][sb];
      const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.s16[i] + 16 * sb)), mins);
      a.acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(s[i]), a.acc[i]);
      a.acc[i] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(m), a.acc[i]);
    }
  }
};

struct FQ6_K8 {
  static constexpr int64_t kBytes = 210;
  template <int64_t MT>
  static inline void block(const uint8_t* b, int64_t sb, const Rows8<MT>& r, Acc8<MT>& a) {
    const float dw = f16(b + 208);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256i t = evens_odds16(sc8);  // pick16(t, j): sc[2j] in lanes 0-7, sc[2j + 1] in 8-15
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  // the 16 scales in order, for the offset
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256i s[MT], s2[MT];
    for (int64_t i = 0; i < MT; ++i) s[i] = _mm256_setzero_si256(), s2[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
      __m256i w[4];  // q in [0, 64), before the offset 32
      w[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
      w[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
      w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
      w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * h + c;  // 32-block of the superblock
        const __m256i sj = pick16(t, j);
        for (int64_t i = 0; i < MT; ++i) {
          const int8_t* x = r.q[i] + sb * 256 + 32 * j;
          __m256i& sc = (MT == 1 && (c & 1)) ? s2[i] : s[i];  // one row: a second chain
          sc = madd_acc(sc, _mm256_maddubs_epi16(w[c], load32(reinterpret_cast<const uint8_t*>(x))), sj);
        }
      }
    }
    if (MT == 1) s[0] = _mm256_add_epi32(s[0], s2[0]);
    for (int64_t i = 0; i < MT; ++i) {
      // the offset: 32 * sum over the 16 sub-blocks of sc_j * (int sum of the row's x in it)
      const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.s16[i] + 16 * sb)), sc16);
      const __m256i v = _mm256_sub_epi32(s[i], _mm256_slli_epi32(off, 5));
      a.acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * r.d[i][sb]), _mm256_cvtepi32_ps(v), a.acc[i]);
    }
  }
};

template <typename F>
void gemv8_impl(const uint8_t* w, int64_t N, int64_t K, const Acts8& acts, const float* bias, float* y) {
  const int64_t nblk = K / 256, rb = nblk * F::kBytes;
  const int64_t M = acts.M;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / rb);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wr = w + n * rb;
      over_chunks(M, [&](int64_t m, auto MT_) {
        constexpr int64_t MT = decltype(MT_)::value;
        const Rows8<MT> rows(acts, m);
        Acc8<MT> a;
        for (int64_t blk = 0; blk < nblk; ++blk) {
          const uint8_t* b = wr + blk * F::kBytes;
          for (int64_t p = 0; p < F::kBytes; p += 64) prefetch(b + kPrefetch + p);
          F::template block<MT>(b, blk, rows, a);
        }
        for (int64_t i = 0; i < MT; ++i) {
          const float v = a.result(i);
          y[(m + i) * N + n] = bias ? v + bias[n] : v;
        }
      });
    }
  });
}

// -- Q8_0 on AVX-512 VNNI: the int16 activations' integer dots in vpdpbusd ------------------------
//
// The same math as the int16 path (the activations rounded to int16 per 32-block, quantize_acts;
// dots exact in int32, acc += (d_w * d_x) * dot per block), with the int8 weights multiplied by
// bytes in vpdpbusd (u8 x s8, 4 products an int32 lane, 64 a zmm): each activation q (int16) is
// split into its bytes, q = 256 * (q >> 8) + (q & 255), the low byte unsigned as it is (lo), the
// high one signed, stored as hi = (q >> 8) + 128 (vpdpbusd's first operand is unsigned), so
//   dot(q, w) = 256 * (dot(hi, w) - 128 * sum(w)) + dot(lo, w),
// one chain a row: start at -128 * sum(w) (a vpdpbusd of 128s with the weights, shared by the
// rows), add the hi products, shift left by 8, add the lo products. Exact in int32: a lane of a
// group (below) holds 16 products, |dot(q >> 8, w)| <= 16 * 128 * 128 = 262,144, times 256, plus
// |dot(lo, w)| <= 16 * 255 * 128 = 522,240: below 2^27.
//
// A group of 8 blocks (256 weights, 4 zmm) is laid out so that int32 lane L of all 4 vectors
// holds block L % 8 (two lanes a block, its dwords 2v + L / 8 in vector v): a row's 8 vpdpbusd
// then chain into one int32 vector of the 8 blocks' dots, converted and scaled once:
// acc += float(dot) * (d_w * d_x), the group's [8 blocks' d_w] x 2 times the row's [8 d_x] x 2.
// That is 8 vpdpbusd + 1 shift + 3 fp32 operations a row per 256 weights, where the AVX2 int16
// path takes 5 (ymm) operations per 32. The weights' layout costs 12 shuffles a group (4 inserts,
// 8 vpermt2d), shared by up to 8 rows (one pass over the weight row for a decode batch of 8); the
// activations are stored in it once a call.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LAYERZOO_Q8_0_VNNI512 1

// Where dword c of block j of a group sits among the group's 64 activation dwords (vector c / 2, lane
// 8 (c % 2) + j), as the weights' shuffles below put it.
constexpr int q8_0_slot(int j, int c) { return (c >> 1) * 16 + (c & 1) * 8 + j; }

// The rows rounded to int16 per 32-block (quantize_acts: the int16 path's integers and scales), in
// groups of 8 blocks: hi, lo [M][G * 256] the bytes (q >> 8) + 128 and q & 255 in the group layout
// (G = ceil(K / 256); missing blocks of the last group q 0: hi 128, lo 0), d [M][G * 8] the blocks'
// scales (0 for an all-zero or missing block).
struct ActsQ8 {
  int64_t M = 0, G = 0;
  std::vector<uint8_t> hi, lo;
  std::vector<float> d;
};

inline ActsQ8 q8_0_acts(const float* x, int64_t M, int64_t K) {
  const Acts q = quantize_acts(x, M, K, 32, /*natural=*/true);
  ActsQ8 a;
  const int64_t nb = K / 32;
  a.M = M, a.G = (nb + 7) / 8;
  a.hi.assign(M * a.G * 256, 128);
  a.lo.assign(M * a.G * 256, 0);
  a.d.assign(M * a.G * 8, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      a.d[m * a.G * 8 + b] = q.d[m * q.ng + b];
      const __m512i v = _mm512_loadu_si512(q.q.data() + m * K + 32 * b);  // 32 int16 in order
      alignas(32) uint32_t hb[8], lb[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(hb),
                         _mm256_xor_si256(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)), _mm256_set1_epi8(char(0x80))));
      _mm256_store_si256(reinterpret_cast<__m256i*>(lb), _mm512_cvtepi16_epi8(v));  // the low bytes
      uint32_t* hg = reinterpret_cast<uint32_t*>(a.hi.data() + (m * a.G + b / 8) * 256);
      uint32_t* lg = reinterpret_cast<uint32_t*>(a.lo.data() + (m * a.G + b / 8) * 256);
      for (int c = 0; c < 8; ++c) hg[q8_0_slot(int(b % 8), c)] = hb[c], lg[q8_0_slot(int(b % 8), c)] = lb[c];
    }
  return a;
}

// One group's weights (8 blocks at b, 34 bytes apart) in the layout above: v[0..3], and its scales
// [d_w of the 8 blocks] x 2; s = -128 * sum(w) per lane, where the rows' sums start.
struct Q8Group {
  __m512i v[4], s;
  __m512 dw;
};

inline Q8Group q8_0_group(const uint8_t* b) {
  // dword c' of block j at lane 4c' + j (blocks 0-3 of a pair of 2-block vectors; idx_b: dwords 4-7)
  const __m512i idx_a = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
  const __m512i idx_b = _mm512_add_epi32(idx_a, _mm512_set1_epi32(4));
  // lanes 8t + j: block j's dword 2v + t, j < 4 from the first source (dwords 4 (2v + t) + j), the rest the second
  const __m512i idx_v0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i idx_v1 = _mm512_add_epi32(idx_v0, _mm512_set1_epi32(8));
  __m512i z[4];  // blocks 2i and 2i + 1, 8 dwords each
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b + 68 * i + 2)), load32(b + 68 * i + 36), 1);
  const __m512i a0 = _mm512_permutex2var_epi32(z[0], idx_a, z[1]), b0 = _mm512_permutex2var_epi32(z[0], idx_b, z[1]);
  const __m512i a1 = _mm512_permutex2var_epi32(z[2], idx_a, z[3]), b1 = _mm512_permutex2var_epi32(z[2], idx_b, z[3]);
  Q8Group g;
  g.v[0] = _mm512_permutex2var_epi32(a0, idx_v0, a1);
  g.v[1] = _mm512_permutex2var_epi32(a0, idx_v1, a1);
  g.v[2] = _mm512_permutex2var_epi32(b0, idx_v0, b1);
  g.v[3] = _mm512_permutex2var_epi32(b0, idx_v1, b1);
  const __m512i k128 = _mm512_set1_epi8(char(0x80)), zero = _mm512_setzero_si512();
  __m512i t = _mm512_dpbusd_epi32(zero, k128, g.v[0]);
  for (int v = 1; v < 4; ++v) t = _mm512_dpbusd_epi32(t, k128, g.v[v]);
  g.s = _mm512_sub_epi32(zero, t);
  uint64_t h[2];
  for (int i = 0; i < 2; ++i) {
    uint16_t e[4];
    for (int j = 0; j < 4; ++j) std::memcpy(&e[j], b + 34 * (4 * i + j), 2);
    h[i] = uint64_t(e[0]) | uint64_t(e[1]) << 16 | uint64_t(e[2]) << 32 | uint64_t(e[3]) << 48;
  }
  g.dw = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_set_epi64x(int64_t(h[1]), int64_t(h[0]))));
  return g;
}

// NW weight rows wr[0, NW) (nb blocks each) times activation rows [m0, m0 + MT) -> out[w][i]. Each
// activation vector loaded serves the NW weight rows (the loads, not the multiplies, bound one).
template <int64_t MT, int64_t NW>
inline void q8_0_rows(const uint8_t* const* wr, int64_t nb, const ActsQ8& a, int64_t m0, float (*out)[8]) {
  __m512 acc[NW][MT];
  const uint8_t* hi[MT];
  const uint8_t* lo[MT];
  const float* d[MT];
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t r = 0; r < NW; ++r) acc[r][i] = _mm512_setzero_ps();
    hi[i] = a.hi.data() + (m0 + i) * a.G * 256;
    lo[i] = a.lo.data() + (m0 + i) * a.G * 256;
    d[i] = a.d.data() + (m0 + i) * a.G * 8;
  }
  const auto group = [&](const Q8Group* g, int64_t gi) {
    for (int64_t i = 0; i < MT; ++i) {
      const uint8_t* h = hi[i] + 256 * gi;
      const uint8_t* l = lo[i] + 256 * gi;
      __m512i dot[NW];
      for (int64_t r = 0; r < NW; ++r) dot[r] = g[r].s;
      for (int v = 0; v < 4; ++v) {
        const __m512i x = _mm512_loadu_si512(h + 64 * v);
        for (int64_t r = 0; r < NW; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], x, g[r].v[v]);
      }
      for (int64_t r = 0; r < NW; ++r) dot[r] = _mm512_slli_epi32(dot[r], 8);
      for (int v = 0; v < 4; ++v) {
        const __m512i x = _mm512_loadu_si512(l + 64 * v);
        for (int64_t r = 0; r < NW; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], x, g[r].v[v]);
      }
      const __m512 dx = _mm512_broadcast_f32x8(_mm256_loadu_ps(d[i] + 8 * gi));
      for (int64_t r = 0; r < NW; ++r)
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(g[r].dw, dx), acc[r][i]);
    }
  };
  const int64_t full = nb / 8;
  Q8Group g[NW];
  for (int64_t gi = 0; gi < full; ++gi) {
    for (int64_t r = 0; r < NW; ++r) {
      const uint8_t* b = wr[r] + 272 * gi;
      // Two weight streams: prefetched 4x the other kernels' distance ahead (a group goes fast);
      // one stream as the other kernels prefetch theirs.
      for (int64_t p = 0; p < 320; p += 64) prefetch(b + (NW == 2 ? 4 : 1) * kPrefetch + p);  // 272 bytes a group
      g[r] = q8_0_group(b);
    }
    group(g, gi);
  }
  if (full * 8 < nb) {  // the last blocks, in a group padded with zero blocks (d_w 0, q 0)
    alignas(64) uint8_t tail[272] = {};
    for (int64_t r = 0; r < NW; ++r) {
      std::memcpy(tail, wr[r] + 272 * full, 34 * (nb - 8 * full));
      g[r] = q8_0_group(tail);
    }
    group(g, full);
  }
  for (int64_t r = 0; r < NW; ++r)
    for (int64_t i = 0; i < MT; ++i) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int64_t NW>
inline void q8_0_chunk(const uint8_t* const* wr, int64_t nb, const ActsQ8& a, int64_t m, int64_t rows, float (*out)[8]) {
  switch (rows) {
    case 8: q8_0_rows<8, NW>(wr, nb, a, m, out); break;
    case 7: q8_0_rows<7, NW>(wr, nb, a, m, out); break;
    case 6: q8_0_rows<6, NW>(wr, nb, a, m, out); break;
    case 5: q8_0_rows<5, NW>(wr, nb, a, m, out); break;
    case 4: q8_0_rows<4, NW>(wr, nb, a, m, out); break;
    case 3: q8_0_rows<3, NW>(wr, nb, a, m, out); break;
    case 2: q8_0_rows<2, NW>(wr, nb, a, m, out); break;
    default: q8_0_rows<1, NW>(wr, nb, a, m, out); break;
  }
}

// Activation rows up to eight at a time (a decode batch of 8 in one pass over the weights; what
// does not fit the 32 registers the compiler keeps on the stack). From kPairRows rows on, weight
// rows go two at a time (an activation load serves both, the last row alone); fewer rows stream one
// weight row at a time: two interleaved weight streams ran slower from memory there. Either way
// every (row, output) takes the same operations in the same order, so rows stay independent of
// whatever shares their call.
constexpr int64_t kPairRows = 3;

void gemv_q8_0_vnni(const uint8_t* w, int64_t N, int64_t K, const ActsQ8& acts, const float* bias, float* y) {
  const int64_t nb = K / 32, rb = nb * 34, M = acts.M;
  const int64_t grain = std::max<int64_t>(2, (64 * 1024) / rb);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end;) {
      const int64_t nw = std::min<int64_t>(M >= kPairRows ? 2 : 1, end - n);
      const uint8_t* wr[2] = {w + n * rb, w + (n + nw - 1) * rb};
      for (int64_t m = 0; m < M;) {
        const int64_t rows = std::min<int64_t>(8, M - m);
        float out[2][8];
        if (nw == 2) q8_0_chunk<2>(wr, nb, acts, m, rows, out);
        else q8_0_chunk<1>(wr, nb, acts, m, rows, out);
        for (int64_t r = 0; r < nw; ++r)
          for (int64_t i = 0; i < rows; ++i) y[(m + i) * N + n + r] = bias ? out[r][i] + bias[n + r] : out[r][i];
        m += rows;
      }
      n += nw;
    }
  });
}
#endif

// -- ops ----------------------------------------------------------------------------------------


at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t qtype, int64_t k, const std::optional<at::Tensor>& rows) {
  const BlockSize bs = check_blocks("gguf_dequantize", blocks, qtype, k);
  const int64_t N = blocks.size(0), rb = blocks.size(1), nblk = k / bs.elems;
  const int64_t* idx = nullptr;
  at::Tensor rows_c;
  int64_t R = N;
  if (rows) {
    TORCH_CHECK(rows->device().is_cpu() && rows->scalar_type() == at::kLong && rows->dim() == 1,
                "gguf_dequantize: rows must be a CPU int64 [R] tensor, got ", rows->scalar_type(), " ", rows->sizes());
    rows_c = rows->contiguous();
    idx = rows_c.const_data_ptr<int64_t>();
    R = rows_c.numel();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(idx[r] >= 0 && idx[r] < N, "gguf_dequantize: row ", idx[r], " out of range [0, ", N, ")");
  }
  at::Tensor out = at::empty({R, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, k * 4));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = src + (idx ? idx[r] : r) * rb;
      for (int64_t blk = 0; blk < nblk; ++blk) dequant_block(qtype, row + blk * bs.bytes, dst + r * k + blk * bs.elems);
    }
  });
  return out;
}

at::Tensor gguf_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t k,
                     const std::optional<at::Tensor>& bias) {
  const BlockSize bs = check_blocks("gguf_gemv", blocks, qtype, k);
  TORCH_CHECK(x.device().is_cpu(), "gguf_gemv: x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_gemv: x must be fp32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_gemv: x must be [M, k=", k, "], got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "gguf_gemv: x must be contiguous");
  const int64_t M = x.size(0), N = blocks.size(0);
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "gguf_gemv: bias must be contiguous fp32 [N=", N, "], got ", bias->scalar_type(), " ", bias->sizes());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // the K-quants round the activations per superblock (one d_x a superblock), the others per 32-block
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  if (qtype == kQ4_K || qtype == kQ6_K) {  // int8 activations per superblock (see FQ4_K8)
    const Acts8 acts = quantize_acts8(x.const_data_ptr<float>(), M, k);
    if (qtype == kQ4_K) gemv8_impl<FQ4_K8>(w, N, k, acts, bp, yp);
    else gemv8_impl<FQ6_K8>(w, N, k, acts, bp, yp);
    return y;
  }
#if defined(LAYERZOO_Q8_0_VNNI512)
  if (qtype == kQ8_0) {  // the int16 path's integers, multiplied by bytes in vpdpbusd
    gemv_q8_0_vnni(w, N, k, q8_0_acts(x.const_data_ptr<float>(), M, k), bp, yp);
    return y;
  }
#endif
  const Acts acts = quantize_acts(x.const_data_ptr<float>(), M, k, bs.elems);
  switch (qtype) {
    case kQ4_0: gemv_impl<FQ4_0>(w, N, k, acts, bp, yp); break;
    case kQ4_1: gemv_impl<FQ4_1>(w, N, k, acts, bp, yp); break;
    case kQ5_0: gemv_impl<FQ5_0>(w, N, k, acts, bp, yp); break;
    case kQ5_1: gemv_impl<FQ5_1>(w, N, k, acts, bp, yp); break;
    case kQ8_0: gemv_impl<FQ8_0>(w, N, k, acts, bp, yp); break;
    case kQ2_K: gemv_impl<FQ2_K>(w, N, k, acts, bp, yp); break;
    case kQ3_K: gemv_impl<FQ3_K>(w, N, k, acts, bp, yp); break;
    case kQ4_K: gemv_impl<FQ45_K<false>>(w, N, k, acts, bp, yp); break;
    case kQ5_K: gemv_impl<FQ45_K<true>>(w, N, k, acts, bp, yp); break;
    case kQ6_K: gemv_impl<FQ6_K>(w, N, k, acts, bp, yp); break;
    default: TORCH_CHECK(false, "gguf_gemv: unsupported qtype ", qtype);
  }
  return y;
}

// Which integer kernel gguf_gemv runs for weights of qtype in this build (the path its ISA takes).
std::string gguf_gemv_kernel(int64_t qtype) {
  TORCH_CHECK(block_size(qtype).elems > 0, "gguf_gemv_kernel: unsupported qtype ", qtype);
  constexpr bool kVnni16 =
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
      true;
#else
      false;
#endif
#if defined(LAYERZOO_Q8_0_VNNI512)
  if (qtype == kQ8_0) return "int16 per 32 by bytes, vpdpbusd zmm (AVX-512 VNNI)";
#endif
  if (qtype == kQ4_K || qtype == kQ6_K) return "int8 per 256, vpmaddubsw";
  return kVnni16 ? "int16, vpdpwssd" : "int16, vpmaddwd";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("gguf_dequantize(Tensor blocks, int qtype, int k, Tensor? rows) -> Tensor");
  m.def("gguf_gemv(Tensor x, Tensor blocks, int qtype, int k, Tensor? bias) -> Tensor");
  m.def("gguf_gemv_kernel(int qtype) -> str", &gguf_gemv_kernel);
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_gemv", &gguf_gemv);
}
