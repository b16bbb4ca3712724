// Few-row int8 products by a weight in a blocked layout: y[M, N] = x[M, K] @ (q[N, K] * scale[n])^T (+ bias).
//
// The row-major int8 GEMV (gemv.cpp) sums each weight row into one vector and reduces it
// horizontally: a chain of dependent vpdpbusd per row plus two reductions, and it streamed 31-38
// GB/s where the fp32 kernel over oneDNN's blocked layout streams 47 (Zen 5, 2 threads). This one
// reads the weights blocked as the fp32 and bf16 kernels do (`block_int8` in cpu.py lays them out
// once, at load): blocks of 64 outputs, each a run of K/4 input quads (K zero-padded to 4); per
// quad 64 outputs x 4 inputs, inputs fastest. One 64-byte vector of that is 16 outputs x 4 inputs,
// the operand of vpdpbusd, which adds the four products of a quad to one int32 lane: per quad four
// weight vectors times the broadcast quad of every activation row, six rows at a time (24
// accumulators), over chunks of 16 quads, no horizontal sums.
//
// Arithmetic as gemv.cpp's, so the results are bitwise the same: each activation row quantized to
// int8 with its own scale (max|x| / 127, nearest even), offset to unsigned (+128) for vpdpbusd; the
// offset's share, 128 * sum(q[n]), precomputed per output at load (`colsum`), taken off the exact
// int32 sums; y = float(dot) * (sx[m] * scale[n]) + bias[n].
//
// Built by layerzoo.kernels.cpp_build with -march=native; AVX-512 VNNI only (the op refuses
// elsewhere; gemv.cpp serves those CPUs). Shapes: x [M, K] fp32; w [N64 / 64, K4 / 4, 64, 4] int8
// (N64, K4: N, K rounded up to 64, 4); colsum [N64] int32; scale [N] fp32; bias [N] fp32 or none
// -> y [M, N] fp32.

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

constexpr int64_t kOut = 64;            // outputs per block (four vectors of 16)
constexpr int64_t kQuadsPerChunk = 16;  // input quads between loads and stores of the accumulators
constexpr int64_t kAhead = 4096;        // prefetch distance in the weight stream, bytes
constexpr int64_t kMaxRows = 32;        // accumulators of one block (8 KB)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// acc[m, 0:64] += xu[m, quad inputs] . w for MT rows over ``quads`` quads of one block (w at the
// chunk's first quad, 256 bytes per quad); xq points at each row's first quad of the chunk as
// 32-bit words, rows row_quads apart.
template <int64_t MT, bool kFetch>
inline void quad_rows(const int8_t* w, const uint32_t* xq, int64_t row_quads, int32_t* acc, int64_t quads) {
  __m512i a[MT][4];
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t j = 0; j < 4; ++j) a[m][j] = _mm512_loadu_si512(acc + m * kOut + j * 16);
  for (int64_t p = 0; p < quads; ++p) {
    const int8_t* row = w + p * 4 * kOut;
    if constexpr (kFetch) {
      for (int64_t line = 0; line < 4 * kOut; line += 64) _mm_prefetch(reinterpret_cast<const char*>(row + line) + kAhead, LAYERZOO_WEIGHT_HINT);
    }
    const __m512i w0 = _mm512_loadu_si512(row), w1 = _mm512_loadu_si512(row + 64);
    const __m512i w2 = _mm512_loadu_si512(row + 128), w3 = _mm512_loadu_si512(row + 192);
    for (int64_t m = 0; m < MT; ++m) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xq[m * row_quads + p]));
      a[m][0] = _mm512_dpbusd_epi32(a[m][0], xv, w0);
      a[m][1] = _mm512_dpbusd_epi32(a[m][1], xv, w1);
      a[m][2] = _mm512_dpbusd_epi32(a[m][2], xv, w2);
      a[m][3] = _mm512_dpbusd_epi32(a[m][3], xv, w3);
    }
  }
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t j = 0; j < 4; ++j) _mm512_storeu_si512(acc + m * kOut + j * 16, a[m][j]);
}

// One block of 64 outputs for all M rows: each chunk comes from memory once and serves every
// group of rows from L1 (as in packed_fp32.cpp).
inline void block_rows(const int8_t* w, const uint32_t* xq, int64_t M, int64_t row_quads, int32_t* acc) {
  std::memset(acc, 0, M * kOut * sizeof(int32_t));
  for (int64_t p = 0; p < row_quads; p += kQuadsPerChunk) {
    const int8_t* chunk = w + p * 4 * kOut;
    const int64_t quads = std::min(kQuadsPerChunk, row_quads - p);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerGroup) {
      const uint32_t* xr = xq + m0 * row_quads + p;
      int32_t* ar = acc + m0 * kOut;
      // the first group prefetches for all (see packed_fp32.cpp and row_groups.h); at one row the
      // 0.6B decode step is ~2% shorter with it on a Zen 5 (in turns), the GEMV alone no faster
      group_pass(M - m0, m0 == 0, [&](auto mt, auto fetch) {
        quad_rows<decltype(mt)::value, decltype(fetch)::value>(chunk, xr, row_quads, ar, quads);
      });
    }
  }
}
#endif

at::Tensor blocked_int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& colsum, const at::Tensor& scale,
                             const std::optional<at::Tensor>& bias) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  TORCH_CHECK(false, "blocked_int8_gemv: built without AVX-512 VNNI");
#else
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "blocked_int8_gemv: contiguous fp32 x [M, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.size(2) == kOut && w.size(3) == 4 && w.is_contiguous(),
              "blocked_int8_gemv: int8 w [blocks, K4 / 4, 64, 4] expected, got ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel(), blocks = w.size(0), row_quads = w.size(1);
  const int64_t Kp = row_quads * 4;
  TORCH_CHECK(Kp == (K + 3) / 4 * 4 && blocks == (N + kOut - 1) / kOut, "blocked_int8_gemv: w ", w.sizes(),
              " is not the blocked layout of [", N, ", ", K, "]");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == blocks * kOut,
              "blocked_int8_gemv: int32 colsum [", blocks * kOut, "] expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "blocked_int8_gemv: scale must be contiguous fp32 [N]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "blocked_int8_gemv: bias must be contiguous fp32 [N]");
  }
  TORCH_CHECK(M <= kMaxRows, "blocked_int8_gemv: at most ", kMaxRows, " rows, got ", M);
  // Each activation row quantized with its own scale, + 128 as unsigned, zero-padded to whole quads
  // (a pad byte of 128 meets a zero weight).
  std::vector<uint8_t> xu(M * Kp, 128);
  std::vector<float> sx(M);
  const float* xp = x.const_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* out = xu.data() + m * Kp;
    sx[m] = quantize_row(xp + m * K, K, [&](int64_t k, int v) { out[k] = static_cast<uint8_t>(v + 128); });
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const int32_t* cs = colsum.const_data_ptr<int32_t>();
  const float* sc = scale.const_data_ptr<float>();
  const float* b = bias ? bias->const_data_ptr<float>() : nullptr;
  const uint32_t* xq = reinterpret_cast<const uint32_t*>(xu.data());
  float* yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kMaxRows * kOut];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kOut, width = std::min(kOut, N - n0);
      block_rows(wp + blk * Kp * kOut, xq, M, row_quads, acc);
      for (int64_t m = 0; m < M; ++m) {
        float* dst = yp + m * N + n0;
        const int32_t* src = acc + m * kOut;
        for (int64_t j = 0; j < width; ++j) {
          const int32_t dot = src[j] - 128 * cs[n0 + j];
          dst[j] = float(dot) * (sx[m] * sc[n0 + j]) + (b ? b[n0 + j] : 0.f);
        }
      }
    }
  });
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("blocked_int8_gemv(Tensor x, Tensor w, Tensor colsum, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("blocked_int8_gemv", &blocked_int8_gemv);
}
