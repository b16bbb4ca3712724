// Few-row products by a row-major weight, for decode on CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Decode multiplies one to a few activation rows by every weight, so it is bound by reading the
// weights once, if the multiply keeps up. Each thread streams its own band of weight rows once,
// row after row (one contiguous stream, prefetched ahead), and multiplies each piece by all
// activation rows while it is in registers. Tiles of four rows read side by side (four streams
// K bytes apart) streamed 1.15-1.4x slower (Zen 5, 2 threads, 0.6 GB of int8 weights: 28-29 vs
// 31-38 GB/s at one and two rows).
//
//   int8_gemv: W is int8 with one fp32 scale per row (w = q * scale[n]). Each activation row is
//              quantized to int8 with its own scale (max|x| / 127; rows never share one, so a row
//              does not depend on its batch) and the products are summed exactly in int32:
//              AVX-512 VNNI vpdpbusd (64 products per instruction; x is offset to unsigned and the
//              offset's share, 128 * sum(w), taken off), else AVX2 vpmaddubsw on |w| and sign(x, w)
//              (pairs of products stay below int16's limit since |w|, |x| <= 127). Widening int8
//              weights to fp32 instead is compute-bound below memory speed.
//
// Built by layerzoo.kernels.cpp_build with -march=native; the instructions are chosen at compile
// time. Shapes: x [M, K] fp32, q [N, K], scale [N], bias [N] or none -> y [M, N] fp32.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_groups.h"

namespace {

constexpr int64_t kRows = 1;  // weight rows per tile: one contiguous stream per thread (see the header)
#ifndef LAYERZOO_GEMV_PREFETCH
#define LAYERZOO_GEMV_PREFETCH 1024
#endif
constexpr int64_t kPrefetch = LAYERZOO_GEMV_PREFETCH;  // bytes ahead in each weight row

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// Runs tile(n, R) over rows [0, N) in tiles of kRows (the last rows one by one), split over
// torch's threads in bands of at least ~64 KB of weights.
template <typename Tile>
void over_rows(int64_t N, int64_t row_bytes, const Tile& tile) {
  const int64_t tiles = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, kRows * row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kRows;
      if (n + kRows <= N) {
        tile(n, std::integral_constant<int64_t, kRows>{});
      } else {
        for (int64_t r = n; r < N; ++r) tile(r, std::integral_constant<int64_t, 1>{});
      }
    }
  });
}

// Calls body(m, mt, integral_constant<MT>) for activation rows in chunks of up to 4.
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

// -- int8 weights, int8 activations ------------------------------------------------------------

// Activation row m quantized: xq[m * Kp + k] = round(x[m, k] * 127 / max|x[m]|), zero beyond K
// (Kp = K rounded up to the block); returns the row scales max|x[m]| / 127.
std::vector<float> quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* xq) {
  std::vector<float> sx(M);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* out = xq + m * Kp;
    sx[m] = quantize_row(x + m * K, K, [&](int64_t k, int v) { out[k] = static_cast<int8_t>(v); });
    std::memset(out + K, 0, Kp - K);
  }
  return sx;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kBlock = 64;
using IVec = __m512i;
// x is stored offset to unsigned (xq + 128): vpdpbusd multiplies unsigned by signed bytes.
constexpr bool kOffsetX = true;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec wload(const int8_t* p, int64_t left) {
  if (left >= kBlock) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((__mmask64)((~0ULL) >> (kBlock - left)), p);
}
inline IVec xload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec dot_add(IVec acc, IVec xu, IVec w) { return _mm512_dpbusd_epi32(acc, xu, w); }
inline int32_t isum(IVec v) { return _mm512_reduce_add_epi32(v); }
#else
constexpr int64_t kBlock = 32;
using IVec = __m256i;
constexpr bool kOffsetX = false;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec wload(const int8_t* p, int64_t left) {
  if (left >= kBlock) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) int8_t tail[kBlock] = {};
  std::memcpy(tail, p, left);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}
inline IVec xload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// |w| * sign(x, w): unsigned times signed bytes, each pair sum <= 2 * 127 * 127 < 2^15.
inline IVec dot_add(IVec acc, IVec x, IVec w) {
  const IVec p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
inline int32_t isum(IVec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

// dots[r][m] = q[r, :] . xq[m, :] in int32, exact.
template <int64_t R, int64_t MT>
inline void int8_tile(const int8_t* q, const uint8_t* xq, int64_t K, int64_t Kp, int32_t* dots) {
  IVec acc[R][MT];
  IVec offset[R];  // kOffsetX: 128 * sum(q[r]), to take off
  for (int64_t r = 0; r < R; ++r) {
    offset[r] = izero();
    for (int64_t m = 0; m < MT; ++m) acc[r][m] = izero();
  }
  for (int64_t k = 0; k < K; k += kBlock) {
    IVec xs[MT];
    for (int64_t m = 0; m < MT; ++m) xs[m] = xload(xq + m * Kp + k);
    for (int64_t r = 0; r < R; ++r) {
      prefetch(q + r * K + k + kPrefetch);
      const IVec wv = wload(q + r * K + k, K - k);
      for (int64_t m = 0; m < MT; ++m) acc[r][m] = dot_add(acc[r][m], xs[m], wv);
      if constexpr (kOffsetX) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        offset[r] = dot_add(offset[r], _mm512_set1_epi8(static_cast<char>(128)), wv);
#endif
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int32_t off = kOffsetX ? isum(offset[r]) : 0;
    for (int64_t m = 0; m < MT; ++m) dots[r * MT + m] = isum(acc[r][m]) - off;
  }
}

void int8_gemv_impl(const int8_t* q, const float* x, int64_t M, int64_t N, int64_t K, const float* scale,
                    const float* bias, float* y) {
  const int64_t Kp = (K + kBlock - 1) / kBlock * kBlock;
  std::vector<int8_t> xq(M * Kp);
  const std::vector<float> sx = quantize_rows(x, M, K, Kp, xq.data());
  if (kOffsetX) {
    for (auto& v : xq) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);  // + 128, as unsigned
  }
  const uint8_t* xu = reinterpret_cast<const uint8_t*>(xq.data());
  over_rows(N, K, [&](int64_t n, auto R_) {
    constexpr int64_t R = decltype(R_)::value;
    over_chunks(M, [&](int64_t m, auto MT_) {
      constexpr int64_t MT = decltype(MT_)::value;
      int32_t dots[R * MT];
      int8_tile<R, MT>(q + n * K, xu + m * Kp, K, Kp, dots);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < MT; ++i)
          y[(m + i) * N + n + r] = float(dots[r * MT + i]) * (sx[m + i] * scale[n + r]) + (bias ? bias[n + r] : 0.f);
    });
  });
}

// -- ops ------------------------------------------------------------------------------------------

void check(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cpu_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "cpu_gemv: x [M, K] and w [N, K] expected, got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "cpu_gemv: x must be contiguous fp32");
  TORCH_CHECK(w.is_contiguous(), "cpu_gemv: w must be contiguous");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "cpu_gemv: bias must be contiguous fp32 [N]");
  }
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  check(x, q, bias);
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_gemv: q must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == q.size(0),
              "int8_gemv: scale must be contiguous fp32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  int8_gemv_impl(q.const_data_ptr<int8_t>(), x.const_data_ptr<float>(), M, N, K, scale.const_data_ptr<float>(),
                 bias ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
