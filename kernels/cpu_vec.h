// fp32 vectors of the widest kind this build has (AVX-512, else AVX2 + FMA), shared by the C++ CPU
// kernels: Vec, kLanes, vzero, vload, vstore, vset1, vadd, vmul, vdiv, vfma, vmin, vmax, vsum, vmaxall, vexp, vsum_lanes,
// dot, axpy, axpy4. bf16 data (`bf16`, its bits) loads into and stores from the same fp32 vectors
// (`vload`, `vstore`, `load1`, `store1`, `vround_bf16`), so a kernel templated on its element type
// computes in fp32 either way; stores round to nearest even, as torch's conversion does.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

using bf16 = uint16_t;  // a bfloat16's bits

inline float load1(const float* p) { return *p; }
inline float load1(const bf16* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  *p = v != v ? bf16(0x7fc0) : bf16((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest even; NaN stays NaN
}
// v rounded to bf16 and back.
inline float round1_bf16(float v) {
  bf16 b;
  store1(&b, v);
  return load1(&b);
}

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline float vmaxall(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec vround(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// fp32 bits rounded to bf16's (nearest even) in the top half; NaN stays a quiet NaN.
inline __m512i vbf16_bits(Vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}
inline Vec vload(const bf16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void vstore(bf16* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(vbf16_bits(v), 16)));
}
// v rounded to bf16 and back (what storing and loading it would give).
inline Vec vround_bf16(Vec v) { return _mm512_castsi512_ps(_mm512_and_si512(vbf16_bits(v), _mm512_set1_epi32(-65536))); }
// The sums of kLanes vectors, lane by lane: out[j] = sum over i of a[j][i] (a transpose and add).
inline Vec vsum_lanes(const Vec* a) {
  Vec c[8], e[4];
  for (int j = 0; j < 8; ++j) c[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(c[2 * j]), _mm512_castps_pd(c[2 * j + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(c[2 * j]), _mm512_castps_pd(c[2 * j + 1]));
    e[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // per 128-bit lane: rows 4j..4j+3
  }
  const Vec f0 = _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
  const Vec f1 = _mm512_add_ps(_mm512_shuffle_f32x4(e[2], e[3], 0x88), _mm512_shuffle_f32x4(e[2], e[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline float vmaxall(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec p, Vec n) {  // p * 2^n, n an integer in [-126, 127]
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// fp32 bits rounded to bf16's (nearest even) in the top half; NaN stays a quiet NaN.
inline __m256i vbf16_bits(Vec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}
inline Vec vload(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void vstore(bf16* p, Vec v) {
  const __m256i h = _mm256_srli_epi32(vbf16_bits(v), 16);  // each fits 16 bits: packus keeps it
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// v rounded to bf16 and back (what storing and loading it would give).
inline Vec vround_bf16(Vec v) { return _mm256_castsi256_ps(_mm256_and_si256(vbf16_bits(v), _mm256_set1_epi32(-65536))); }
// The sums of kLanes vectors, lane by lane: out[j] = sum over i of a[j][i] (a transpose and add).
inline Vec vsum_lanes(const Vec* a) {
  Vec c[4], e[2];
  for (int j = 0; j < 4; ++j) c[j] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm256_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {
    const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(c[2 * j]), _mm256_castps_pd(c[2 * j + 1]));
    const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(c[2 * j]), _mm256_castps_pd(c[2 * j + 1]));
    e[j] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));  // per 128-bit half: rows 4j..4j+3
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(e[0], e[1], 0x20), _mm256_permute2f128_ps(e[0], e[1], 0x31));
}
#else
#error "the C++ kernels need AVX2 and FMA (layerzoo.kernels.cpp_build does not build them elsewhere)"
#endif

// exp(x) for x <= 88.37 (larger: inf is not reached, the result saturates at exp(88.37)); below
// -87.33 it returns exp(-87.33) ~ 1e-38 instead of a denormal or 0 (a softmax weight that small is
// nothing beside the row's maximum, which weighs 1). exp(x) = 2^n e^r with n = round(x / ln 2),
// r = x - n ln 2 in [-ln2 / 2, ln2 / 2] (ln 2 in two parts, so r is exact) and e^r by Cephes'
// degree-7 polynomial: about 1 ulp from the rounded exact value, against the scalar libm call's
// ~20 ns per element that dominated the softmax.
inline Vec vexp(Vec x) {
  x = vmin(vmax(x, vset1(-87.33654f)), vset1(88.37626f));
  const Vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  Vec r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(vmul(p, r), r, r), vset1(1.f));  // 1 + r + p r^2
  return vscale2(p, n);
}

// Dot product of a and b over n elements (fp32 or bf16), summed in fp32.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += load1(a + i) * load1(b + i);
  return s;
}

// y += a * x over n floats (x fp32 or bf16).
template <typename X>
inline void axpy(float* y, float a, const X* x, int64_t n) {
  const Vec av = vset1(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vfma(av, vload(x + i), vload(y + i)));
  for (; i < n; ++i) y[i] += a * load1(x + i);
}

// y += a[0] x0 + a[1] x1 + a[2] x2 + a[3] x3 over n floats (y loaded and stored once; x fp32 or bf16).
template <typename X>
inline void axpy4(float* y, const float* a, const X* x0, const X* x1, const X* x2, const X* x3, int64_t n) {
  const Vec a0 = vset1(a[0]), a1 = vset1(a[1]), a2 = vset1(a[2]), a3 = vset1(a[3]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec acc = vfma(a0, vload(x0 + i), vload(y + i));
    acc = vfma(a1, vload(x1 + i), acc);
    acc = vfma(a2, vload(x2 + i), acc);
    vstore(y + i, vfma(a3, vload(x3 + i), acc));
  }
  for (; i < n; ++i) y[i] += a[0] * load1(x0 + i) + a[1] * load1(x1 + i) + a[2] * load1(x2 + i) + a[3] * load1(x3 + i);
}
