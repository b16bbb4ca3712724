// fp32 vectors of the widest kind this build has (AVX-512, else AVX2 + FMA), shared by the C++ CPU
// kernels: Vec, kLanes, vzero, vload, vstore, vset1, vmul, vfma, vsum, dot, axpy.
#pragma once

#include <immintrin.h>
#include <cstdint>

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#error "the C++ kernels need AVX2 and FMA (layerzoo.kernels.cpp_build does not build them elsewhere)"
#endif

// Dot product of a and b over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x over n floats.
inline void axpy(float* y, float a, const float* x, int64_t n) {
  const Vec av = vset1(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vfma(av, vload(x + i), vload(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}
