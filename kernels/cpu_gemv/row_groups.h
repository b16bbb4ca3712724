// What the few-row kernels share: the pass over a chunk of weights for one group of activation
// rows (packed_fp32.cpp, packed_bf16.cpp) and the hint of their weight-stream prefetches (also
// gguf_matmul's).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <immintrin.h>

// The hint of the weight-stream prefetches. The weights are read once a step, so on an AMD Zen 5
// non-temporal prefetches (NTA) ran a decode step 1.02-1.16x as fast as into L1 (T0); on an Intel
// Xeon with AMX the same hint halved the stream (10 vs 22-26 GiB/s, 0.6B shapes at one row), and
// into L2 (T1) was the fastest there, 1.0-1.2x T0. cpp_build defines the macro on AMD CPUs.
#if defined(LAYERZOO_WEIGHT_PREFETCH_NTA)
#define LAYERZOO_WEIGHT_HINT _MM_HINT_NTA
#else
#define LAYERZOO_WEIGHT_HINT _MM_HINT_T1
#endif

// Rows per pass over a chunk: 4 accumulators each, so 24 and the four weight vectors fill the 32
// vector registers of AVX-512.
constexpr int64_t kRowsPerGroup = 6;

// pass(integral_constant<MT>, bool_constant<fetch>) for a group of MT = min(rows, kRowsPerGroup)
// rows: MT is a template argument so that the group's accumulators stay in registers.
template <typename Pass>
inline void group_pass(int64_t rows, bool fetch, const Pass& pass) {
  auto with_fetch = [&](auto mt) {
    fetch ? pass(mt, std::true_type{}) : pass(mt, std::false_type{});
  };
  switch (std::min(kRowsPerGroup, rows)) {
    case 1: with_fetch(std::integral_constant<int64_t, 1>{}); break;
    case 2: with_fetch(std::integral_constant<int64_t, 2>{}); break;
    case 3: with_fetch(std::integral_constant<int64_t, 3>{}); break;
    case 4: with_fetch(std::integral_constant<int64_t, 4>{}); break;
    case 5: with_fetch(std::integral_constant<int64_t, 5>{}); break;
    default: with_fetch(std::integral_constant<int64_t, 6>{}); break;
  }
}
