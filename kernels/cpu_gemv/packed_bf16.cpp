// Few-row bf16 products by a weight in oneDNN's packed layout: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// The bf16 sibling of packed_fp32.cpp. On a CPU with AVX-512 BF16, oneDNN packs a bf16 linear as
// AB16b64a2b (found by packing known values): blocks of 64 outputs, each a run of K/2 input pairs
// (K zero-padded to 32); per pair 64 outputs x 2 inputs, inputs fastest. Where the CPU has AMX it
// packs AB16b32a2b instead: the same with blocks of 32 outputs (``block``). One 32-lane vector of
// that is 16 outputs x 2 inputs: exactly the operand of vdpbf16ps, which adds both products of a
// pair to one fp32 lane. So per pair the kernel loads four (or two) weight vectors and multiplies
// each by the broadcast input pair of every activation row (no horizontal sums), six rows at a
// time (24 accumulators) over chunks of 32 pairs (8 KB, in L1). oneDNN's own bf16 GEMM reads the weights
// well below memory speed at one row: decode was no faster in bf16 than in fp32 (issue 15). Sums
// are fp32 and run in the same order whatever M is; the output is rounded to bf16 (nearest even)
// once, after the bias, as oneDNN's is.
//
// Built by layerzoo.kernels.cpp_build with -march=native; AVX-512 BF16 only (elsewhere oneDNN
// does not pack bf16 or lays it out otherwise, and the op refuses). Shapes: x [M, K] bf16, w_ptr
// the packed buffer's address, N, K; bias [N] bf16 or none, w_bytes the buffer's size (checked
// against the layout), block the layout's outputs per block (64 or 32) -> y [M, N] bf16.

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

constexpr int64_t kPad = 32;            // K is padded to whole 32s in the layout
constexpr int64_t kPairsPerChunk = 32;  // input pairs between loads and stores of the accumulators
constexpr int64_t kAhead = 8192;        // prefetch distance in the weight stream, bytes
constexpr int64_t kMaxRows = 32;        // accumulators of one block, in L1 (8 KB at most)

#if defined(__AVX512BF16__)
// acc[m, 0:kOut] += x[m, pair inputs] . weights for MT rows over ``pairs`` input pairs of one block
// (w at the chunk's first pair, 2 * kOut bf16 per pair); xp points at each row's first input of the
// chunk as 32-bit pairs, rows Kp / 2 pairs apart; acc rows kOut floats apart.
template <int64_t kOut, int64_t MT, bool kFetch>
inline void pair_rows(const uint16_t* w, const uint32_t* xp, int64_t row_pairs, float* acc, int64_t pairs) {
  constexpr int64_t V = kOut / 16;  // weight vectors per pair
  __m512 a[MT][V];
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t j = 0; j < V; ++j) a[m][j] = _mm512_loadu_ps(acc + m * kOut + j * 16);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row = w + p * 2 * kOut;
    if constexpr (kFetch) {  // this pair's lines, kAhead bytes on in the block's stream
      for (int64_t line = 0; line < 2 * kOut; line += 32)
        _mm_prefetch(reinterpret_cast<const char*>(row + line) + kAhead, LAYERZOO_WEIGHT_HINT);
    }
    __m512bh wv[V];
    for (int64_t j = 0; j < V; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(row + 32 * j);
    for (int64_t m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * row_pairs + p]));
      for (int64_t j = 0; j < V; ++j) a[m][j] = _mm512_dpbf16_ps(a[m][j], xv, wv[j]);
    }
  }
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t j = 0; j < V; ++j) _mm512_storeu_ps(acc + m * kOut + j * 16, a[m][j]);
}

// One block of kOut outputs for all M rows; each chunk comes from memory once and serves every
// group of rows from L1 (as in packed_fp32.cpp).
template <int64_t kOut>
inline void block_rows(const uint16_t* w, const uint32_t* xp, int64_t M, int64_t row_pairs, float* acc) {
  std::memset(acc, 0, M * kOut * sizeof(float));
  for (int64_t p = 0; p < row_pairs; p += kPairsPerChunk) {
    const uint16_t* chunk = w + p * 2 * kOut;
    const int64_t pairs = std::min(kPairsPerChunk, row_pairs - p);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerGroup) {
      const uint32_t* xr = xp + m0 * row_pairs + p;
      float* ar = acc + m0 * kOut;
      // The first group prefetches for all (see packed_fp32.cpp and row_groups.h).
      group_pass(M - m0, m0 == 0, [&](auto mt, auto fetch) {
        pair_rows<kOut, decltype(mt)::value, decltype(fetch)::value>(chunk, xr, row_pairs, ar, pairs);
      });
    }
  }
}

// dst[0:width] = bf16(src[0:width] + bias[0:width]), nearest even (bias may be null).
inline void store_row(uint16_t* dst, const float* src, const uint16_t* bias, int64_t width) {
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 lanes = width - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (width - j)) - 1);
    __m512 v = _mm512_loadu_ps(src + j);
    if (bias) {
      const __m256i b = _mm256_maskz_loadu_epi16(lanes, bias + j);
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    _mm256_mask_storeu_epi16(dst + j, lanes, (__m256i)_mm512_cvtneps_pbh(v));
  }
}
// Every block of kOut outputs of y [M, N], the blocks shared among threads.
template <int64_t kOut>
void all_blocks(const uint16_t* w, const uint32_t* xp, const uint16_t* b, uint16_t* yp, int64_t M, int64_t N, int64_t Kp) {
  const int64_t blocks = (N + kOut - 1) / kOut, row_pairs = Kp / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows * kOut];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kOut, width = std::min(kOut, N - n0);
      block_rows<kOut>(w + blk * Kp * kOut, xp, M, row_pairs, acc);
      for (int64_t m = 0; m < M; ++m) store_row(yp + m * N + n0, acc + m * kOut, b ? b + n0 : nullptr, width);
    }
  });
}

#endif

at::Tensor packed_bf16_gemv(const at::Tensor& x, int64_t w_ptr, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                            int64_t w_bytes, int64_t block) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "packed_bf16_gemv: built without AVX-512 BF16 (oneDNN's packed bf16 layout differs here)");
#else
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K && x.is_contiguous(),
              "packed_bf16_gemv: contiguous bf16 x [M, ", K, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w_ptr != 0 && N > 0 && K > 0, "packed_bf16_gemv: a packed weight expected");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "packed_bf16_gemv: bias must be contiguous bf16 [N]");
  }
  const int64_t M = x.size(0);
  TORCH_CHECK(M <= kMaxRows, "packed_bf16_gemv: at most ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(block == 64 || block == 32, "packed_bf16_gemv: block must be 64 (AB16b64a2b) or 32 (AB16b32a2b), got ", block);
  const int64_t Kp = (K + kPad - 1) / kPad * kPad, blocks = (N + block - 1) / block;
  TORCH_CHECK(w_bytes == Kp * blocks * block * 2, "packed_bf16_gemv: the packed buffer holds ", w_bytes, " bytes, not the ",
              Kp * blocks * block * 2, " of the AB16b", block, "a2b layout of [", N, ", ", K, "]");
  // Activations padded to whole pairs of the layout (the padded weights are zero; x past K must be too).
  at::Tensor xpad = Kp == K ? x : at::zeros({M, Kp}, x.options());
  if (Kp != K) xpad.narrow(1, 0, K).copy_(x);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xpad.const_data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_ptr);
  const uint16_t* b = bias ? reinterpret_cast<const uint16_t*>(bias->const_data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
  if (block == 64) {
    all_blocks<64>(w, xp, b, yp, M, N, Kp);
  } else {
    all_blocks<32>(w, xp, b, yp, M, N, Kp);
  }
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("packed_bf16_gemv(Tensor x, int w_ptr, int N, int K, Tensor? bias, int w_bytes, int block=64) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("packed_bf16_gemv", &packed_bf16_gemv);
}
