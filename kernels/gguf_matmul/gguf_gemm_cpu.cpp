// The GEMM by GGUF (llama.cpp) block-quantized weights, for many activation rows (prefill, batched
// decode), in integers: what gguf_cpu.cpp's GEMV computes, with each weight tile decoded once.
//
//   gguf_gemm(x, blocks, qtype, k, bias?): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// The activations are rounded to int16 once a call, per group exactly as the GEMV (32 elements for
// the 32-element formats, 256 for the K-quants; scale max|x| / 32767; gguf_blocks.h), kept in
// order. Output rows are taken in tiles of kNT = 32 (threads split the tiles); per tile, K in
// chunks of kKC = 256. Each chunk of the tile's 32 weight rows is decoded once into int16 (the
// K-quants' sub-block scales multiplied in, as the GEMV does in registers), then laid out as pairs
// of neighbours by output: wq[p][n] = (w[n][2p], w[n][2p + 1]). The micro-kernel takes MR
// activation rows at a time: per pair p, the tile's 32 outputs in int32 lanes (one zmm of 16, or
// two ymm of 8, a vector), += w pair x the row's pair broadcast: one vpdpwssd (AVX-512 VNNI) or
// vpmaddwd + vpaddd (AVX2) a vector and row. The int32 sums are exact over kE elements (a run of
// the format, below), then convert: acc += float(sum) * (S_w * d_x) in fp32, and the formats with
// a min add Mn_w * (d_x * sum(q_x)) per 32 (Q2_K: 16) elements. kE and the int32 bounds, with
// |x| <= 32767 and every product of a lane in one run:
//   Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (a block's d): 32 products, |w| <= 128 -> < 2^28
//   Q4_K |sc * q| <= 63 * 15:   64 -> 64 * 945 * 32767   = 1,981,808,160
//   Q5_K |sc * q| <= 63 * 31:   32 -> 32 * 1953 * 32767  = 2,047,806,432
//   Q6_K |sc * (q - 32)| <= 128 * 32: 16 -> 16 * 4096 * 32767 = 2,147,418,112
//   Q3_K |sc * q| <= 32 * 4:   256 -> 256 * 128 * 32767 = 1,073,709,056
//   Q2_K |sc * q| <= 15 * 3:   256 -> 256 * 45 * 32767  = 377,475,840
// all below 2^31 - 1 = 2,147,483,647. Every (row, output) takes the same operations in the same
// order whatever rows share the call or tile, so a row's result does not depend on its batch
// (it differs from the GEMV's in fp32 summation order only: the GEMV sums 8 lanes, then them).
//
// Q4_K and Q6_K (llama.cpp's Q4_K_M types) round the activations to int8 per superblock instead, as
// the GEMV and llama.cpp do, and multiply unsigned weight bytes with them in vpdpbusd (4 products a
// lane where vpdpwssd takes 2): 1.25-1.5x faster at 128 rows (DQ4_K8, DQ6_K8 below).
//
// Shapes: blocks [N, row_bytes] uint8 (as in the file), x [M, K] fp32 contiguous, bias [N] fp32 or
// none -> [M, N] fp32. The AVX-512 path (zmm, with or without VNNI) is chosen where the build's
// -march=native has AVX-512 BW, else AVX2 (with AVX-VNNI's vpdpwssd where there is one).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"

namespace {

using namespace layerzoo_gguf;

constexpr int64_t kNT = 32;   // output rows of a tile
constexpr int64_t kKC = 256;  // K elements of a chunk: a superblock, or up to 8 blocks of 32
constexpr int64_t kMaxRuns = kKC / 16;  // int32 runs a chunk (Q6_K's 16 elements) or min units (Q2_K's)

// -- the formats: decode(b, w, S, Mn) turns one weight block of one row into w [kElems] int16 in
// order (the K-quants' sub-block scales multiplied in), S [kElems / kE] the fp32 scale of each run
// of kE elements, and (kU > 0) Mn [kElems / kU] the fp32 weight of each kU elements' d_x * sum(q_x)
// (the min terms, signed as they add). Plain loops over constant bounds: the compiler vectorizes them.

// 32 bytes in order -> 32 int16 at w (signed or unsigned bytes), times the int16 scales s_lo
// (elements 0-15) and s_hi (16-31) where given.
inline void widen32(__m256i v, bool is_signed, int16_t* w) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), is_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16), is_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi));
}
inline void widen32_scaled(__m256i v, bool is_signed, int16_t s_lo, int16_t s_hi, int16_t* w) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m256i a = is_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
  const __m256i b = is_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), _mm256_mullo_epi16(a, _mm256_set1_epi16(s_lo)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16), _mm256_mullo_epi16(b, _mm256_set1_epi16(s_hi)));
}

struct DQ8_0 {
  static constexpr int64_t kElems = 32, kBytes = 34, kE = 32, kU = 0;
  static void decode(const uint8_t* b, int16_t* w, float* S, float*) {
    S[0] = f16(b);
    widen32(load32(b + 2), true, w);
  }
};

struct DQ4_0 {
  static constexpr int64_t kElems = 32, kBytes = 18, kE = 32, kU = 0;
  static void decode(const uint8_t* b, int16_t* w, float* S, float*) {
    S[0] = f16(b);
    widen32(_mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)), true, w);
  }
};

struct DQ4_1 {
  static constexpr int64_t kElems = 32, kBytes = 20, kE = 32, kU = 32;
  static void decode(const uint8_t* b, int16_t* w, float* S, float* Mn) {
    S[0] = f16(b), Mn[0] = f16(b + 2);
    widen32(nibbles16(b + 4), false, w);
  }
};

template <bool kQ51>
struct DQ5 {
  static constexpr int64_t kElems = 32, kBytes = kQ51 ? 24 : 22, kE = 32, kU = kQ51 ? 32 : 0;
  static void decode(const uint8_t* b, int16_t* w, float* S, float* Mn) {
    S[0] = f16(b);
    if (kQ51) Mn[0] = f16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + (kQ51 ? 4 : 2), 4);
    const __m256i q = _mm256_or_si256(nibbles16(b + (kQ51 ? 8 : 6)), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
    if (kQ51) widen32(q, false, w);
    else widen32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), true, w);
  }
};

struct DQ2_K {
  static constexpr int64_t kElems = 256, kBytes = 84, kE = 256, kU = 16;
  static void decode(const uint8_t* b, int16_t* w, float* S, float* Mn) {
    S[0] = f16(b + 80);
    const float dmin = f16(b + 82);
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 16; ++j) Mn[j] = -(dmin * float(b[j] >> 4));
    for (int h = 0; h < 2; ++h)  // element 128 h + 32 c + l: bits 2c of qs[32 h + l], sub-block e / 16
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const int e = 128 * h + 32 * c + l;
          w[e] = int16_t(((qs[32 * h + l] >> (2 * c)) & 3) * (b[e / 16] & 15));
        }
  }
};

struct DQ3_K {
  static constexpr int64_t kElems = 256, kBytes = 110, kE = 256, kU = 0;
  static void decode(const uint8_t* b, int16_t* w, float* S, float*) {
    int32_t sc[16];
    q3k_scales(b + 96, sc);
    S[0] = f16(b + 108);
    const uint8_t* qs = b + 32;
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const int e = 128 * h + 32 * c + l;
          const int lo = (qs[32 * h + l] >> (2 * c)) & 3, hi = (b[l] >> (e / 32)) & 1;
          w[e] = int16_t((lo - (hi ? 0 : 4)) * sc[e / 16]);
        }
  }
};

template <bool kQ5>
struct DQ45_K {
  static constexpr int64_t kElems = 256, kBytes = kQ5 ? 176 : 144, kE = kQ5 ? 32 : 64, kU = 32;
  static void decode(const uint8_t* b, int16_t* w, float* S, float* Mn) {
    const float d = f16(b), dmin = f16(b + 2);
    int32_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    for (int r = 0; r < 256 / kE; ++r) S[r] = d;
    for (int j = 0; j < 8; ++j) Mn[j] = -(dmin * float(mn[j]));
    const uint8_t* qs = b + (kQ5 ? 48 : 16);
    __m256i hb = kQ5 ? load32(b + 16) : _mm256_setzero_si256();  // bit j of byte l: sub-block j, element l
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int g = 0; g < 4; ++g) {  // 32 bytes of qs: sub-block 2g in the low nibbles, 2g + 1 in the high ones
      const __m256i v = load32(qs + 32 * g);
      __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if (kQ5) {
        w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
        w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
        hb = _mm256_srli_epi16(hb, 2);
      }
      widen32_scaled(w0, false, int16_t(sc[2 * g]), int16_t(sc[2 * g]), w + 64 * g);
      widen32_scaled(w1, false, int16_t(sc[2 * g + 1]), int16_t(sc[2 * g + 1]), w + 64 * g + 32);
    }
  }
};

struct DQ6_K {
  static constexpr int64_t kElems = 256, kBytes = 210, kE = 16, kU = 0;
  static void decode(const uint8_t* b, int16_t* w, float* S, float*) {
    const float d = f16(b + 208);
    for (int r = 0; r < 16; ++r) S[r] = d;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {  // element 128 h + r: ql[64 h + r % 64] >> 4 (r / 64), qh[32 h + r % 32] >> 2 (r / 32)
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
      for (int c = 0; c < 4; ++c)  // 32 elements, sub-blocks 8h + 2c and 8h + 2c + 1
        widen32_scaled(_mm256_sub_epi8(q[c], off), true, sc[8 * h + 2 * c], sc[8 * h + 2 * c + 1], w + 128 * h + 32 * c);
    }
  }
};

// -- vectors: I int32 lanes (pairs of int16), F fp32 lanes, L lanes ----------------------------

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Vec {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t L = 16, MR = 6;  // MR rows x 2 vectors: 12 int32 + 12 fp32 accumulators of 32 zmm
  static I izero() { return _mm512_setzero_si512(); }
  static I load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static I pair(const int16_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I dot(I acc, I w, I x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);  // vpdpwssd: no saturation, the same int32 sums
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
struct Vec {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t L = 8, MR = 3;  // MR rows x 2 vectors: 6 int32 + 6 fp32 accumulators of 16 ymm
  static I izero() { return _mm256_setzero_si256(); }
  static I load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I pair(const int16_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static I dot(I acc, I w, I x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif
constexpr int64_t kVN = 2;  // vectors a micro-kernel pass covers: kVN * L outputs

// The kTB x kTB block of 32-bit words at src (rows src_stride apart) transposed to dst (rows
// dst_stride apart): dst[c][r] = src[r][c].
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kTB = 16;
inline void transpose_block(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: (r0[c], r1[c]) pairs of columns 4L + c
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c] lane L: rows 4i .. 4i + 3 of column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_si512(dst + (c) * dst_stride, _mm512_shuffle_i32x4(a, e, 0x88));
    _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(a, e, 0xDD));
    _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(b, f, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(b, f, 0xDD));
  }
}
#else
constexpr int64_t kTB = 8;
inline void transpose_block(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m256i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * src_stride));
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // r[4i + c] lane L: rows 4i .. 4i + 3 of column 4L + c
    r[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * dst_stride), _mm256_permute2x128_si256(r[c], r[4 + c], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (4 + c) * dst_stride), _mm256_permute2x128_si256(r[c], r[4 + c], 0x31));
  }
}
#endif

// One decoded chunk of a tile: wq [kc / kPack][kNT], a uint32 of kPack weights of type Q (int16
// pairs, or byte quads), S [runs][kNT], Mn [units][kNT].
template <typename Q>
struct TileOf {
  static constexpr int64_t kPack = 4 / sizeof(Q);
  alignas(64) uint32_t wq[kKC / kPack * kNT];
  alignas(64) float S[kMaxRuns * kNT];
  alignas(64) float Mn[kMaxRuns * kNT];
  alignas(64) Q rows[kNT * kKC];  // decoding scratch: the rows in order, [kNT][kKC]
  float rS[kNT * kMaxRuns], rMn[kNT * kMaxRuns];

  // The decoded rows' first ``runs`` scales and ``units`` mins by output: S[r][j] = rS[j][r], Mn likewise.
  void scales_by_output(int64_t runs, int64_t units) {
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t j = 0; j < kNT; ++j) S[r * kNT + j] = rS[j * kMaxRuns + r];
    for (int64_t u = 0; u < units; ++u)
      for (int64_t j = 0; j < kNT; ++j) Mn[u * kNT + j] = rMn[j * kMaxRuns + u];
  }
};
using Tile = TileOf<int16_t>;

// Decode weight rows [n0, n0 + kNT) (those below N; the rest 0) over K elements [k0, k0 + kc).
template <typename D>
void decode_tile(const uint8_t* w, int64_t rb, int64_t N, int64_t n0, int64_t k0, int64_t kc, Tile& t) {
  constexpr int64_t runs_per_block = D::kElems / D::kE, units_per_block = D::kU ? D::kElems / D::kU : 0;
  const int64_t nblk = kc / D::kElems, runs = kc / D::kE, pairs = kc / 2;
  for (int64_t j = 0; j < kNT; ++j) {
    int16_t* out = t.rows + j * kKC;
    float* S = t.rS + j * kMaxRuns;
    float* Mn = t.rMn + j * kMaxRuns;
    if (n0 + j >= N) {
      std::memset(out, 0, kc * sizeof(int16_t));
      std::fill(S, S + kMaxRuns, 0.f), std::fill(Mn, Mn + kMaxRuns, 0.f);
      continue;
    }
    const uint8_t* row = w + (n0 + j) * rb + k0 / D::kElems * D::kBytes;
    for (int64_t blk = 0; blk < nblk; ++blk)
      D::decode(row + blk * D::kBytes, out + blk * D::kElems, S + blk * runs_per_block, Mn + blk * units_per_block);
  }
  // to pairs by output: wq[p][j] = rows[j][2p, 2p + 2)
  const uint32_t* r32 = reinterpret_cast<const uint32_t*>(t.rows);
  int64_t p0 = 0;
  for (; p0 + kTB <= pairs; p0 += kTB)
    for (int64_t j0 = 0; j0 < kNT; j0 += kTB) transpose_block(r32 + j0 * (kKC / 2) + p0, kKC / 2, t.wq + p0 * kNT + j0, kNT);
  for (int64_t p = p0; p < pairs; ++p)
    for (int64_t j = 0; j < kNT; ++j) t.wq[p * kNT + j] = r32[j * (kKC / 2) + p];
  t.scales_by_output(runs, D::kU ? kc / D::kU : 0);
}

// Rows [m0, m0 + MR) of C [M][kNT] (outputs c0 .. c0 + kVN * L of the tile) += this chunk.
template <typename D, int64_t MR>
inline void micro(const Tile& t, const Acts& a, int64_t m0, int64_t k0, int64_t kc, int64_t c0, float* C) {
  using I = Vec::I;
  using F = Vec::F;
  constexpr int64_t L = Vec::L, pairs_per_run = D::kE / 2, units_per_run = D::kU ? D::kE / D::kU : 0;
  const int64_t runs = kc / D::kE;
  F acc[MR][kVN];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t v = 0; v < kVN; ++v) acc[i][v] = Vec::fload(C + (m0 + i) * kNT + c0 + v * L);
  const int16_t* xr[MR];
  const float* dx[MR];
  for (int64_t i = 0; i < MR; ++i) xr[i] = a.q.data() + (m0 + i) * a.K + k0, dx[i] = a.d.data() + (m0 + i) * a.ng;
  for (int64_t r = 0; r < runs; ++r) {
    I s[MR][kVN];
    for (int64_t i = 0; i < MR; ++i)
      for (int64_t v = 0; v < kVN; ++v) s[i][v] = Vec::izero();
    const uint32_t* wp = t.wq + r * pairs_per_run * kNT + c0;
#pragma GCC unroll 4
    for (int64_t p = 0; p < pairs_per_run; ++p) {
      I w[kVN];
      for (int64_t v = 0; v < kVN; ++v) w[v] = Vec::load(wp + p * kNT + v * L);
      const int64_t e = 2 * (r * pairs_per_run + p);
      for (int64_t i = 0; i < MR; ++i) {
        const I x = Vec::pair(xr[i] + e);
        for (int64_t v = 0; v < kVN; ++v) s[i][v] = Vec::dot(s[i][v], w[v], x);
      }
    }
    const int64_t g = (k0 + r * D::kE) / a.group;  // the activations' group of this run
    for (int64_t i = 0; i < MR; ++i) {
      const F d = Vec::set1(dx[i][g]);
      for (int64_t v = 0; v < kVN; ++v)
        acc[i][v] = Vec::fmadd(Vec::cvt(s[i][v]), Vec::mul(Vec::fload(t.S + r * kNT + c0 + v * L), d), acc[i][v]);
    }
    for (int64_t u = r * units_per_run; u < (r + 1) * units_per_run; ++u) {  // the min terms of this run
      for (int64_t i = 0; i < MR; ++i) {
        const float sx = D::kU == 16 ? a.s16[(m0 + i) * a.nb * 2 + (k0 + 16 * u) / 16]
                                     : a.s32[(m0 + i) * a.nb + (k0 + 32 * u) / 32];
        const F sv = Vec::set1(sx);
        for (int64_t v = 0; v < kVN; ++v) acc[i][v] = Vec::fmadd(Vec::fload(t.Mn + u * kNT + c0 + v * L), sv, acc[i][v]);
      }
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t v = 0; v < kVN; ++v) Vec::fstore(C + (m0 + i) * kNT + c0 + v * L, acc[i][v]);
}

template <typename D>
void micro_rows(const Tile& t, const Acts& a, int64_t m0, int64_t rows, int64_t k0, int64_t kc, int64_t c0, float* C) {
  static_assert(Vec::MR <= 6, "the row tails below");
  switch (rows) {
    case 6: micro<D, 6>(t, a, m0, k0, kc, c0, C); break;
    case 5: micro<D, 5>(t, a, m0, k0, kc, c0, C); break;
    case 4: micro<D, 4>(t, a, m0, k0, kc, c0, C); break;
    case 3: micro<D, 3>(t, a, m0, k0, kc, c0, C); break;
    case 2: micro<D, 2>(t, a, m0, k0, kc, c0, C); break;
    default: micro<D, 1>(t, a, m0, k0, kc, c0, C); break;
  }
}

// Ask for the bytes of weight rows [n0, n0 + kNT) over K elements [k0, k0 + kc): the tile's rows
// are rb bytes apart, 32 streams the hardware prefetchers do not all follow; decoding waited on
// them (half the time of a call of few rows).
template <typename D>
inline void prefetch_chunk(const uint8_t* w, int64_t rb, int64_t N, int64_t n0, int64_t k0, int64_t kc) {
  const int64_t bytes = kc / D::kElems * D::kBytes, off = k0 / D::kElems * D::kBytes;
  for (int64_t j = 0; j < kNT && n0 + j < N; ++j) {
    const uint8_t* p = w + (n0 + j) * rb + off;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + bytes - 1), _MM_HINT_T0);
  }
}

// -- Q4_K and Q6_K with int8 activations ---------------------------------------------------------
//
// As the GEMV does for these two types (and llama.cpp): the activations rounded to int8 per
// superblock (quantize_acts8), the weights decoded to their unsigned bytes (Q4_K's q in [0, 16),
// Q6_K's in [0, 64) before its offset 32), laid out as quads of neighbours by output (wq[p][n] =
// w[n][4p .. 4p + 4)), and per quad one vpdpbusd (u8 weights x s8 activations, 4 products a lane,
// exact) a vector and row, or vpmaddubsw + vpmaddwd + vpaddd without VNNI (a pair at most 2 * 63 *
// 127 = 16,002: no saturation). Runs of kE elements share a scale: Q4_K's sub-blocks of 32 (S =
// d * sc_j, Mn = -dmin * m_j per 32), Q6_K's of 16 (S = d * sc_j, and the offset as a min term: Mn
// = -32 * d * sc_j per 16, exact: a power of 2). A run's int32 sums stay below 32 * 63 * 127.

struct DQ4_K8 {
  static constexpr int64_t kElems = 256, kBytes = 144, kE = 32, kU = 32;
  static void decode(const uint8_t* b, uint8_t* w, float* S, float* Mn) {
    const float d = f16(b), dmin = f16(b + 2);
    int32_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) S[j] = d * float(sc[j]), Mn[j] = -(dmin * float(mn[j]));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {  // 32 bytes of qs: sub-block 2g in the low nibbles, 2g + 1 in the high ones
      const __m256i v = load32(b + 16 + 32 * g);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 64 * g), _mm256_and_si256(v, low4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 64 * g + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
    }
  }
};

struct DQ6_K8 {
  static constexpr int64_t kElems = 256, kBytes = 210, kE = 16, kU = 16;
  static void decode(const uint8_t* b, uint8_t* w, float* S, float* Mn) {
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) S[j] = d * float(sc[j]), Mn[j] = -32.f * S[j];
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // element 128 h + r: ql[64 h + r % 64] >> 4 (r / 64), qh[32 h + r % 32] >> 2 (r / 32)
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
      for (int c = 0; c < 4; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 128 * h + 32 * c), q[c]);
    }
  }
};

// acc += the u8 quads of w times the s8 quad x (broadcast), per int32 lane.
inline Vec::I dot8(Vec::I acc, Vec::I w, Vec::I x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// One decoded chunk of a tile in bytes: wq [kc / 4][kNT] quads.
using Tile8 = TileOf<uint8_t>;

// Decode weight rows [n0, n0 + kNT) (those below N; the rest 0) over the superblock at K element k0.
template <typename D>
void decode_tile8(const uint8_t* w, int64_t rb, int64_t N, int64_t n0, int64_t k0, Tile8& t) {
  static_assert(D::kElems == kKC, "a chunk is one superblock");
  constexpr int64_t runs = kKC / D::kE, units = kKC / D::kU, quads = kKC / 4;
  for (int64_t j = 0; j < kNT; ++j) {
    uint8_t* out = t.rows + j * kKC;
    float* S = t.rS + j * kMaxRuns;
    float* Mn = t.rMn + j * kMaxRuns;
    if (n0 + j >= N) {
      std::memset(out, 0, kKC);
      std::fill(S, S + kMaxRuns, 0.f), std::fill(Mn, Mn + kMaxRuns, 0.f);
      continue;
    }
    D::decode(w + (n0 + j) * rb + k0 / D::kElems * D::kBytes, out, S, Mn);
  }
  // to quads by output: wq[p][j] = rows[j][4p, 4p + 4)
  const uint32_t* r32 = reinterpret_cast<const uint32_t*>(t.rows);
  for (int64_t p0 = 0; p0 < quads; p0 += kTB)
    for (int64_t j0 = 0; j0 < kNT; j0 += kTB) transpose_block(r32 + j0 * quads + p0, quads, t.wq + p0 * kNT + j0, kNT);
  t.scales_by_output(runs, units);
}

// Rows [m0, m0 + MR) of C [M][kNT] (outputs c0 .. c0 + kVN * L of the tile) += this superblock.
// The superblock's d_x is one a row: its runs add up without it (S * sum, Mn * sum of the run's
// activations) and C takes d_x times their total once.
template <typename D, int64_t MR>
inline void micro8(const Tile8& t, const Acts8& a, int64_t m0, int64_t k0, int64_t c0, float* C) {
  using I = Vec::I;
  using F = Vec::F;
  constexpr int64_t L = Vec::L, quads_per_run = D::kE / 4, runs = kKC / D::kE;
  static_assert(D::kU == D::kE && (D::kE == 32 || D::kE == 16), "one min term a run");
  const int64_t g = k0 / kKC;
  F acc[MR][kVN];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t v = 0; v < kVN; ++v) acc[i][v] = Vec::fzero();
  const int8_t* xr[MR];
  const float* sr[MR];  // the runs' int sums of activations, in fp32
  for (int64_t i = 0; i < MR; ++i) {
    xr[i] = a.q.data() + (m0 + i) * a.K + k0;
    sr[i] = D::kE == 32 ? a.f32.data() + (m0 + i) * (a.K / 32) + k0 / 32 : a.f16.data() + (m0 + i) * (a.K / 16) + k0 / 16;
  }
  for (int64_t r = 0; r < runs; ++r) {
    I s[MR][kVN];
    for (int64_t i = 0; i < MR; ++i)
      for (int64_t v = 0; v < kVN; ++v) s[i][v] = Vec::izero();
    const uint32_t* wp = t.wq + r * quads_per_run * kNT + c0;
#pragma GCC unroll 8
    for (int64_t p = 0; p < quads_per_run; ++p) {
      I w[kVN];
      for (int64_t v = 0; v < kVN; ++v) w[v] = Vec::load(wp + p * kNT + v * L);
      const int64_t e = 4 * (r * quads_per_run + p);
      for (int64_t i = 0; i < MR; ++i) {
        int32_t q4;
        std::memcpy(&q4, xr[i] + e, 4);
        const I x = Vec::set1i(q4);
        for (int64_t v = 0; v < kVN; ++v) s[i][v] = dot8(s[i][v], w[v], x);
      }
    }
    const float* S = t.S + r * kNT + c0;
    const float* Mn = t.Mn + r * kNT + c0;
    for (int64_t i = 0; i < MR; ++i) {
      // the run's min term: Mn * (int sum of the run's activations)
      const F sx = Vec::set1(sr[i][r]);
      for (int64_t v = 0; v < kVN; ++v)
        acc[i][v] = Vec::fmadd(Vec::fload(Mn + v * L), sx, Vec::fmadd(Vec::cvt(s[i][v]), Vec::fload(S + v * L), acc[i][v]));
    }
  }
  for (int64_t i = 0; i < MR; ++i) {
    const F d = Vec::set1(a.d[(m0 + i) * a.ng + g]);
    for (int64_t v = 0; v < kVN; ++v) {
      float* c = C + (m0 + i) * kNT + c0 + v * L;
      Vec::fstore(c, Vec::fmadd(acc[i][v], d, Vec::fload(c)));
    }
  }
}

template <typename D>
void micro8_rows(const Tile8& t, const Acts8& a, int64_t m0, int64_t rows, int64_t k0, int64_t c0, float* C) {
  switch (rows) {
    case 6: micro8<D, 6>(t, a, m0, k0, c0, C); break;
    case 5: micro8<D, 5>(t, a, m0, k0, c0, C); break;
    case 4: micro8<D, 4>(t, a, m0, k0, c0, C); break;
    case 3: micro8<D, 3>(t, a, m0, k0, c0, C); break;
    case 2: micro8<D, 2>(t, a, m0, k0, c0, C); break;
    default: micro8<D, 1>(t, a, m0, k0, c0, C); break;
  }
}

// Threads take tiles from a shared counter, not fixed bands: on a shared machine a thread that
// loses its core for a while then holds up no more than its tile. A tile's result does not depend
// on which thread computes it.
template <typename D>
void gemm_impl(const uint8_t* w, int64_t N, int64_t K, const Acts& a, const float* bias, float* y) {
  const int64_t M = a.M, rb = K / D::kElems * D::kBytes, tiles = (N + kNT - 1) / kNT;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<Tile> tile_store(1);
    Tile& t = tile_store[0];
    std::vector<float> C(M * kNT);
    int64_t tile = next.fetch_add(1);
    if (tile < tiles) prefetch_chunk<D>(w, rb, N, tile * kNT, 0, std::min(kKC, K));
    while (tile < tiles) {
      const int64_t n0 = tile * kNT, following = next.fetch_add(1);
      std::fill(C.begin(), C.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        const int64_t kc = std::min(kKC, K - k0);
        if (k0 + kKC < K) prefetch_chunk<D>(w, rb, N, n0, k0 + kKC, std::min(kKC, K - k0 - kKC));
        else if (following < tiles) prefetch_chunk<D>(w, rb, N, following * kNT, 0, std::min(kKC, K));
        decode_tile<D>(w, rb, N, n0, k0, kc, t);
        for (int64_t m0 = 0; m0 < M; m0 += Vec::MR) {
          const int64_t rows = std::min(Vec::MR, M - m0);
          for (int64_t c0 = 0; c0 < kNT; c0 += kVN * Vec::L) micro_rows<D>(t, a, m0, rows, k0, kc, c0, C.data());
        }
      }
      const int64_t nn = std::min(kNT, N - n0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nn; ++j) {
          const float v = C[m * kNT + j];
          y[m * N + n0 + j] = bias ? v + bias[n0 + j] : v;
        }
      tile = following;
    }
  });
}

// gemm_impl for the int8 formats (Q4_K, Q6_K): chunks of one superblock, Tile8 and micro8.
template <typename D>
void gemm8_impl(const uint8_t* w, int64_t N, int64_t K, const Acts8& a, const float* bias, float* y) {
  const int64_t M = a.M, rb = K / D::kElems * D::kBytes, tiles = (N + kNT - 1) / kNT;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<Tile8> tile_store(1);
    Tile8& t = tile_store[0];
    std::vector<float> C(M * kNT);
    int64_t tile = next.fetch_add(1);
    if (tile < tiles) prefetch_chunk<D>(w, rb, N, tile * kNT, 0, kKC);
    while (tile < tiles) {
      const int64_t n0 = tile * kNT, following = next.fetch_add(1);
      std::fill(C.begin(), C.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        if (k0 + kKC < K) prefetch_chunk<D>(w, rb, N, n0, k0 + kKC, kKC);
        else if (following < tiles) prefetch_chunk<D>(w, rb, N, following * kNT, 0, kKC);
        decode_tile8<D>(w, rb, N, n0, k0, t);
        for (int64_t m0 = 0; m0 < M; m0 += Vec::MR) {
          const int64_t rows = std::min(Vec::MR, M - m0);
          for (int64_t c0 = 0; c0 < kNT; c0 += kVN * Vec::L) micro8_rows<D>(t, a, m0, rows, k0, c0, C.data());
        }
      }
      const int64_t nn = std::min(kNT, N - n0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nn; ++j) {
          const float v = C[m * kNT + j];
          y[m * N + n0 + j] = bias ? v + bias[n0 + j] : v;
        }
      tile = following;
    }
  });
}

at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t k,
                     const std::optional<at::Tensor>& bias) {
  const BlockSize bs = check_blocks("gguf_gemm", blocks, qtype, k);
  TORCH_CHECK(x.device().is_cpu(), "gguf_gemm: x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_gemm: x must be fp32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_gemm: x must be [M, k=", k, "], got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "gguf_gemm: x must be contiguous");
  const int64_t M = x.size(0), N = blocks.size(0);
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "gguf_gemm: bias must be contiguous fp32 [N=", N, "], got ", bias->scalar_type(), " ", bias->sizes());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  if (qtype == kQ4_K || qtype == kQ6_K) {  // int8 activations per superblock, as the GEMV (DQ4_K8)
    const Acts8 acts = quantize_acts8(x.const_data_ptr<float>(), M, k);
    if (qtype == kQ4_K) gemm8_impl<DQ4_K8>(w, N, k, acts, bp, yp);
    else gemm8_impl<DQ6_K8>(w, N, k, acts, bp, yp);
    return y;
  }
  const Acts acts = quantize_acts(x.const_data_ptr<float>(), M, k, bs.elems, /*natural=*/true);
  switch (qtype) {
    case kQ4_0: gemm_impl<DQ4_0>(w, N, k, acts, bp, yp); break;
    case kQ4_1: gemm_impl<DQ4_1>(w, N, k, acts, bp, yp); break;
    case kQ5_0: gemm_impl<DQ5<false>>(w, N, k, acts, bp, yp); break;
    case kQ5_1: gemm_impl<DQ5<true>>(w, N, k, acts, bp, yp); break;
    case kQ8_0: gemm_impl<DQ8_0>(w, N, k, acts, bp, yp); break;
    case kQ2_K: gemm_impl<DQ2_K>(w, N, k, acts, bp, yp); break;
    case kQ3_K: gemm_impl<DQ3_K>(w, N, k, acts, bp, yp); break;
    case kQ4_K: gemm_impl<DQ45_K<false>>(w, N, k, acts, bp, yp); break;
    case kQ5_K: gemm_impl<DQ45_K<true>>(w, N, k, acts, bp, yp); break;
    case kQ6_K: gemm_impl<DQ6_K>(w, N, k, acts, bp, yp); break;
    default: TORCH_CHECK(false, "gguf_gemm: unsupported qtype ", qtype);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("gguf_gemm(Tensor x, Tensor blocks, int qtype, int k, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) { m.impl("gguf_gemm", &gguf_gemm); }
