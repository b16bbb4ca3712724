// Few-row fp32 products by a weight in oneDNN's packed layout: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// layerzoo packs every CPU fp32 linear for oneDNN at load (one copy of the weight). On AVX-512
// oneDNN lays it out as AB16b64a: blocks of 64 outputs, each a run of K/16 tiles of 16 inputs x 64
// outputs (outputs fastest), zero-padded to whole tiles. Its own GEMM reads that below memory
// speed at the few rows of a decode step. This kernel reads the same buffer (the caller checks the
// layout once per layer, see layerzoo.layers.linear): each thread streams its own run of output
// blocks once; per input row of a tile, the 64 weights are four vectors, multiplied by each
// activation row's broadcast input (no horizontal sums), six rows at a time (24 accumulators and
// the four weight vectors fill the 32 registers) over a chunk of four tiles (16 KB, in L1) before
// the accumulators go back to memory; the first group prefetches the stream ahead (non-temporal on
// AMD, into L2 elsewhere: row_groups.h).
// On a Zen 5 (2 threads) it streams 1 GB of weights 1.0-1.15x as fast as oneDNN at 1-32 rows, and
// runs the embedded model's cache-resident layers 1.2-2.5x as fast (oneDNN's per-call cost
// dominates there); the engine sends it at most `FP32_GEMV_ROWS` rows. Each row's sums run in the same order whatever M is, so
// a row's result does not depend on its batch.
//
// Built by layerzoo.kernels.cpp_build with -march=native; AVX-512 only (elsewhere oneDNN's layout
// differs and the op refuses). Shapes: x [M, K] fp32, w_ptr the packed buffer's address, N, K;
// bias [N] or none, w_bytes the buffer's size (checked against the layout) -> y [M, N] fp32.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "row_groups.h"

namespace {

constexpr int64_t kIn = 16;    // inputs per tile
constexpr int64_t kOut = 64;   // outputs per block (four vectors of 16)
constexpr int64_t kTilesPerChunk = 4;  // tiles between loads and stores of the accumulators
#ifndef LAYERZOO_PACKED_AHEAD
#define LAYERZOO_PACKED_AHEAD 16384
#endif
constexpr int64_t kAhead = LAYERZOO_PACKED_AHEAD;  // prefetch distance in the weight stream, bytes
constexpr int64_t kMaxRows = 32;  // accumulators of one block, in L1 (8 KB)

#if defined(__AVX512F__)
// acc[m, 0:64] += x[m, i0 : i0+inputs] . tiles for MT activation rows, over ``inputs`` (whole
// tiles, adjacent in the block) from the tiles' first input i0 (xp rows Kp floats apart, at i0);
// acc rows are kOut floats apart, in L1.
template <int64_t MT, bool kFetch>
inline void tile_rows(const float* tile, const float* xp, int64_t Kp, float* acc, int64_t inputs) {
  __m512 a[MT][4];
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t j = 0; j < 4; ++j) a[m][j] = _mm512_loadu_ps(acc + m * kOut + j * 16);
  for (int64_t i = 0; i < inputs; ++i) {
    const float* row = tile + i * kOut;
    if constexpr (kFetch) {  // this row's four lines, kAhead bytes on in the block's stream
      for (int64_t line = 0; line < kOut; line += 16)
        _mm_prefetch(reinterpret_cast<const char*>(row + line) + kAhead, LAYERZOO_WEIGHT_HINT);
    }
    const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
    const __m512 w2 = _mm512_loadu_ps(row + 32), w3 = _mm512_loadu_ps(row + 48);
    for (int64_t m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(xp[m * Kp + i]);
      a[m][0] = _mm512_fmadd_ps(xv, w0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(xv, w1, a[m][1]);
      a[m][2] = _mm512_fmadd_ps(xv, w2, a[m][2]);
      a[m][3] = _mm512_fmadd_ps(xv, w3, a[m][3]);
    }
  }
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(acc + m * kOut + j * 16, a[m][j]);
}

// One block of 64 outputs for all M rows: each chunk of tiles comes from memory once and serves
// every group of rows from L1 (a group per pass over the block would stream it from L2, stalling the
// memory stream, for rows past the first group).
inline void block_rows(const float* w, const float* xp, int64_t M, int64_t Kp, float* acc) {
  std::memset(acc, 0, M * kOut * sizeof(float));
  const int64_t tiles = Kp / kIn;
  for (int64_t t = 0; t < tiles; t += kTilesPerChunk) {
    const float* tile = w + t * kIn * kOut;
    const int64_t inputs = std::min(kTilesPerChunk, tiles - t) * kIn;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerGroup) {
      const float* xr = xp + m0 * Kp + t * kIn;
      float* ar = acc + m0 * kOut;
      // The first group prefetches for all: computing more rows (or the later groups) leaves the
      // stream idle otherwise (1 GB of weights, in turns: 4 rows 33.0 -> 35.7 GB/s in bf16, 6 rows
      // 31.1 -> 38.9). On a Zen 5 the hint is non-temporal: each weight line is read once per
      // step, and so it does not evict what the rest of the step works on. With T0 the hint did
      // nothing at one row there; NTA streams the 0.6B model's decode weights (one row, in turns,
      // medians of 20-40 passes) 1.05-1.10x as fast in fp32 and 1.00-1.09x in bf16, 1.01-1.04x at
      // 2-8 rows, and its whole decode step runs 1.08x (fp32) and 1.16x (bf16) as fast: the ops
      // between the GEMVs find more of what they touch still in cache. On an Intel Xeon NTA
      // halves the stream and L2 is the target (LAYERZOO_WEIGHT_HINT, row_groups.h).
      group_pass(M - m0, m0 == 0, [&](auto mt, auto fetch) {
        tile_rows<decltype(mt)::value, decltype(fetch)::value>(tile, xr, Kp, ar, inputs);
      });
    }
  }
}
#endif

at::Tensor packed_fp32_gemv(const at::Tensor& x, int64_t w_ptr, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                            int64_t w_bytes) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "packed_fp32_gemv: built without AVX-512 (oneDNN's packed layout differs here)");
#else
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K && x.is_contiguous(),
              "packed_fp32_gemv: contiguous fp32 x [M, ", K, "] expected, got ", x.sizes());
  TORCH_CHECK(w_ptr != 0 && N > 0 && K > 0, "packed_fp32_gemv: a packed weight expected");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "packed_fp32_gemv: bias must be contiguous fp32 [N]");
  }
  const int64_t M = x.size(0);
  const int64_t Kp = (K + kIn - 1) / kIn * kIn, blocks = (N + kOut - 1) / kOut;
  // oneDNN keeps some shapes in another layout (a [1, 1] weight stays 4 plain bytes): reading it as
  // AB16b64a would run past the buffer.
  TORCH_CHECK(w_bytes == Kp * blocks * kOut * static_cast<int64_t>(sizeof(float)),
              "packed_fp32_gemv: the packed buffer holds ", w_bytes, " bytes, not the ", Kp * blocks * kOut * sizeof(float),
              " of the AB16b64a layout of [", N, ", ", K, "]");
  // Activations padded to whole tiles (the padded weights are zero; x past K must be too).
  at::Tensor xpad = Kp == K ? x : at::zeros({M, Kp}, x.options());
  if (Kp != K) xpad.narrow(1, 0, K).copy_(x);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xpad.const_data_ptr<float>();
  const float* w = reinterpret_cast<const float*>(w_ptr);
  const float* b = bias ? bias->const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  TORCH_CHECK(M <= kMaxRows, "packed_fp32_gemv: at most ", kMaxRows, " rows, got ", M);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows * kOut];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kOut, width = std::min(kOut, N - n0);
      block_rows(w + blk * Kp * kOut, xp, M, Kp, acc);
      for (int64_t m = 0; m < M; ++m) {
        float* dst = yp + m * N + n0;
        const float* src = acc + m * kOut;
        if (b) {
          for (int64_t j = 0; j < width; ++j) dst[j] = src[j] + b[n0 + j];
        } else {
          std::memcpy(dst, src, width * sizeof(float));
        }
      }
    }
  });
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("packed_fp32_gemv(Tensor x, int w_ptr, int N, int K, Tensor? bias, int w_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("packed_fp32_gemv", &packed_fp32_gemv);
}
