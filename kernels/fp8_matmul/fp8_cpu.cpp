// Weight-only FP8 (e4m3) linear on CPU: y[M, N] = x[M, K] @ W^T (+ bias), W[n, k] = w[n, k] * scale[n, k / group].
//
// Layout (README.md): w [N, K] e4m3 bytes (as the checkpoint stores them), scale fp32 [N, K/group],
// group a multiple of 32 dividing K (per channel: group = K).
//
// e4m3 -> fp32 by bit manipulation: the byte's exponent and mantissa bits shifted into an fp16
// (s eeee mmm -> s 0eeee mmm0000000) is the value / 256 exactly, subnormals included (fp16's
// subnormals cover e4m3's), and F16C's vcvtph2ps widens 8 of them to fp32 in one instruction; the
// 256 is folded into the scale. (A 256-entry table needs a gather per 8 weights, slower on AVX2.)
//
//   fp8_gemv: few activation rows (decode). Each thread streams its band of weight rows once,
//             converting each run of 32 weights in registers and multiplying it by up to two
//             activation rows; per row and group: dot = sum w * x (four accumulators), acc += scale
//             * dot. A row's result does not depend on the rows beside it.
//   fp8_dequantize: W in fp32 into a caller's [N, K] buffer (bitwise w.float() * scale).
//
// Built by layerzoo.kernels.cpp_build with -march=native (AVX2 + FMA + F16C at least).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRun = 32;

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 8 e4m3 bytes (as the low bytes of 16-bit lanes, shifted up by 8) -> fp16 bits of value / 256.
inline __m128i e4m3_to_half(__m128i b8) {
  // b << 8 = s eeee mmm 00000000; >> 1 arithmetic = s s eeee mmm 0000000; clear bit 14.
  return _mm_and_si128(_mm_srai_epi16(b8, 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
}

// 32 weights as four vectors of 8, each value / 256.
inline void convert_run(const uint8_t* p, __m256 w[4]) {
  const __m128i zero = _mm_setzero_si128();
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  w[0] = _mm256_cvtph_ps(e4m3_to_half(_mm_unpacklo_epi8(zero, a)));
  w[1] = _mm256_cvtph_ps(e4m3_to_half(_mm_unpackhi_epi8(zero, a)));
  w[2] = _mm256_cvtph_ps(e4m3_to_half(_mm_unpacklo_epi8(zero, b)));
  w[3] = _mm256_cvtph_ps(e4m3_to_half(_mm_unpackhi_epi8(zero, b)));
}

template <int MT>
inline void row_tile(const uint8_t* wrow, const float* srow, const float* x, int64_t K, int64_t group, float* y, int64_t N,
                     float bias) {
  const int64_t G = K / group, runs = group / kRun;
  __m256 total[MT];
  for (int i = 0; i < MT; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MT][4];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t k = (g * runs + r) * kRun;
      __m256 w[4];
      convert_run(wrow + k, w);
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + i * K + k;
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[i][j]);
      }
    }
    const __m256 s = _mm256_set1_ps(srow[g] * 256.f);
    for (int i = 0; i < MT; ++i) {
      const __m256 dot = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
      total[i] = _mm256_fmadd_ps(s, dot, total[i]);
    }
  }
  for (int i = 0; i < MT; ++i) y[i * N] = hsum8(total[i]) + bias;
}

void check_weight(const at::Tensor& w, const at::Tensor& scale, int64_t group) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.element_size() == 1 && w.is_contiguous(),
              "fp8: w must be contiguous one-byte [N, K] on CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group > 0 && group % kRun == 0 && K % group == 0, "fp8: group ", group, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == K / group,
              "fp8: scale must be contiguous fp32 [N, K/group] = [", N, ", ", K / group, "], got ", scale.sizes());
}

at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t group,
                    const std::optional<at::Tensor>& bias) {
  check_weight(w, scale, group);
  const int64_t N = w.size(0), K = w.size(1), G = K / group;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "fp8_gemv: x must be contiguous fp32 [M, ", K, "], got ", x.sizes());
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "fp8_gemv: bias must be fp32 [N]");
  }
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const float* sp = scale.const_data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float b = bp ? bp[n] : 0.f;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) row_tile<2>(wp + n * K, sp + n * G, xp + m * K, K, group, yp + m * N + n, N, b);
      if (m < M) row_tile<1>(wp + n * K, sp + n * G, xp + m * K, K, group, yp + m * N + n, N, b);
    }
  });
  return y;
}

void fp8_dequantize(const at::Tensor& w, const at::Tensor& scale, int64_t group, const at::Tensor& out) {
  check_weight(w, scale, group);
  const int64_t N = w.size(0), K = w.size(1), G = K / group, runs = group / kRun;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == N * K,
              "fp8_dequantize: out must be contiguous fp32 with N*K elements");
  const uint8_t* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const float* sp = scale.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const __m256 k256 = _mm256_set1_ps(256.f);
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const __m256 s = _mm256_set1_ps(sp[n * G + g]);
        for (int64_t r = 0; r < runs; ++r) {
          const int64_t k = (g * runs + r) * kRun;
          __m256 v[4];
          convert_run(wp + n * K + k, v);
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(op + n * K + k + 8 * j, _mm256_mul_ps(_mm256_mul_ps(v[j], k256), s));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("fp8_gemv(Tensor x, Tensor w, Tensor scale, int group, Tensor? bias) -> Tensor");
  m.def("fp8_dequantize(Tensor w, Tensor scale, int group, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("fp8_gemv", &fp8_gemv);
  m.impl("fp8_dequantize", &fp8_dequantize);
}
