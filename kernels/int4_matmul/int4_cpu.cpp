// Weight-only 4-bit linear on CPU: y[M, N] = x[M, K] @ W^T (+ bias), W[n, k] = q * scale[n, g] - zs[n, g].
//
// Layout (README.md): q [N, K/2] uint8, each run of 32 weights of a row in 16 bytes (byte i: weight i
// in the low nibble, weight i + 16 in the high one): each half of a run widened to 32-bit lanes once
// gives two vectors of 8 consecutive weights by a mask and a shift; scale, zs fp32 [N, K/group], group
// a multiple of 32.
//
//   int4_gemv: few activation rows (decode). Each thread streams its band of weight rows once and
//              unpacks every run in registers (nibble -> int32 -> fp32), multiplying it by up to two
//              activation rows at a time. Per row and group: dot = sum q * x in fp32 (four
//              accumulators), then acc += scale * dot; the zero-point term is sum_g zs * sum_{k in g} x
//              (the group sums of x taken once per call). Every activation row goes through the same
//              operations in the same order whatever its batch, so a row's result does not depend on
//              the rows beside it.
//   int4_dequantize: W in fp32 into a caller's [N, K] buffer (more rows: the caller multiplies it).
//
// Built by layerzoo.kernels.cpp_build with -march=native (AVX2 + FMA + F16C at least).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRun = 32;  // weights per 16-byte run

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 32 weights of one run as four vectors of 8 (0-7, 8-15, 16-23, 24-31), values 0..15 in fp32.
inline void unpack_run(const uint8_t* p, __m256 w[4]) {
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));      // bytes 0-7
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));  // bytes 8-15
  const __m256i mask = _mm256_set1_epi32(0x0F);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

// Group sums of each activation row: xsum[m * G + g] = sum_{k in g} x[m, k] (fixed order per row).
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t group) {
  const int64_t G = K / group;
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + m * K + g * group;
      __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) {
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + k));
        b = _mm256_add_ps(b, _mm256_loadu_ps(p + k + 8));
      }
      xsum[m * G + g] = hsum8(_mm256_add_ps(a, b));
    }
  }
  return xsum;
}

// Weight row n times activation rows [m, m + MT): y[(m + i) * N + n].
template <int MT>
inline void row_tile(const uint8_t* qrow, const float* srow, const float* zrow, const float* x, int64_t K, int64_t group,
                     const float* xsum, float* y, int64_t N, float bias) {
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
      unpack_run(qrow + k / 2, w);
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + i * K + k;
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[i][j]);
      }
    }
    const __m256 s = _mm256_set1_ps(srow[g]);
    for (int i = 0; i < MT; ++i) {
      const __m256 dot = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
      total[i] = _mm256_fmadd_ps(s, dot, total[i]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    float z = 0.f;
    const float* xs = xsum + i * G;
    for (int64_t g = 0; g < G; ++g) z += zrow[g] * xs[g];
    y[i * N] = (hsum8(total[i]) - z) + bias;
  }
}

void int4_gemv_impl(const float* x, const uint8_t* q, const float* scale, const float* zs, int64_t group,
                    const float* bias, int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t G = K / group;
  const std::vector<float> xsum = group_sums(x, M, K, group);
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, K / 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* qrow = q + n * (K / 2);
      const float b = bias ? bias[n] : 0.f;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        row_tile<2>(qrow, scale + n * G, zs + n * G, x + m * K, K, group, xsum.data() + m * G, y + m * N + n, N, b);
      if (m < M)
        row_tile<1>(qrow, scale + n * G, zs + n * G, x + m * K, K, group, xsum.data() + m * G, y + m * N + n, N, b);
    }
  });
}

void check_weight(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zs, int64_t group) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(),
              "int4: q must be contiguous uint8 [N, K/2] on CPU");
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(group > 0 && group % kRun == 0 && K % group == 0, "int4: group ", group, " must be a multiple of 32 dividing K=", K);
  for (const at::Tensor* t : {&scale, &zs}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / group,
                "int4: scale and zs must be contiguous fp32 [N, K/group] = [", N, ", ", K / group, "], got ", t->sizes());
  }
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zs, int64_t group,
                     const std::optional<at::Tensor>& bias) {
  check_weight(q, scale, zs, group);
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_gemv: x must be contiguous fp32 [M, ", K, "], got ", x.sizes());
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "int4_gemv: bias must be fp32 [N]");
  }
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  int4_gemv_impl(x.const_data_ptr<float>(), q.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(),
                 zs.const_data_ptr<float>(), group, bias ? bias->const_data_ptr<float>() : nullptr, M, N, K,
                 y.mutable_data_ptr<float>());
  return y;
}

void int4_dequantize(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zs, int64_t group, const at::Tensor& out) {
  check_weight(q, scale, zs, group);
  const int64_t N = q.size(0), K = q.size(1) * 2, G = K / group, runs = group / kRun;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == N * K,
              "int4_dequantize: out must be contiguous fp32 with N*K elements");
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const float* sp = scale.const_data_ptr<float>();
  const float* zp = zs.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, K / 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const __m256 s = _mm256_set1_ps(sp[n * G + g]), z = _mm256_set1_ps(zp[n * G + g]);
        for (int64_t r = 0; r < runs; ++r) {
          const int64_t k = (g * runs + r) * kRun;
          __m256 w[4];
          unpack_run(qp + n * (K / 2) + k / 2, w);
          float* o = op + n * K + k;
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_sub_ps(_mm256_mul_ps(w[j], s), z));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor q, Tensor scale, Tensor zs, int group, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scale, Tensor zs, int group, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_dequantize", &int4_dequantize);
}
