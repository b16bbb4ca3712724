// MXFP4 weights on CPU (README.md): W[n, k] = E2M1(code) * 2^(scale[n, k / 32] - 127), packed [.., N, K/2]
// uint8 (column 2i in the low nibble of byte i, 2i + 1 in the high one), scale [.., N, K/32] uint8 (E8M0).
//
// E2M1 codes become numbers by a 16-entry table lookup in registers: twice the value is an integer
// (0, 1, 2, 3, 4, 6, 8, 12 and their negatives), so one pshufb maps 16 nibbles to int8s at once; they
// widen to fp32 and the group's 2^(s - 128) (the half folded in) scales their dot. Every weight is exact.
//
//   mxfp4_gemv: few activation rows (decode), each row times its own expert (experts [M], or one
//               weight [N, K/2]). Rows are ordered by expert and tiled up to 4 rows of one expert,
//               so that a weight row streams once per tile. The activations are reordered once per
//               call, per 32-block, to evens then odds: the low nibbles of a block's 16 bytes then
//               multiply its first 16 and the high nibbles its last 16. Per row and group: dot =
//               sum w * x in fp32 (one vector), acc += scale * dot (two accumulators, even and odd
//               groups). A row's result does not depend on the rows beside it.
//   mxfp4_dequantize: one weight in fp32 into a caller's [N, K] buffer (bitwise the reference).
//
// AVX2 (pshufb + widening) where the build has it, else the same arithmetic in scalar code.
// Built by layerzoo.kernels.cpp_build with -march=native.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MXFP4_AVX2 1
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // weights per scale: 16 bytes of codes
constexpr int kMaxTile = 4;     // activation rows of one expert per pass over its weight rows

// Twice the E2M1 value of each code (exact in int8).
constexpr int8_t kTwiceE2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(s - 128) for every E8M0 byte s: the group scale with E2M1's half folded in (255 gives inf,
// as the reference's exp2(128) does). Filled when the library loads.
struct HalfScales {
  float value[256];
  HalfScales() {
    for (int s = 0; s < 256; ++s) value[s] = std::ldexp(1.0f, s - 128);
  }
};
const HalfScales kHalfScales;
inline const float* half_scales() { return kHalfScales.value; }

// x [M, K] with each 32-block reordered to its 16 even columns, then its 16 odd ones.
std::vector<float> evens_then_odds(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K; b += kGroup) {
      const float* src = x + m * K + b;
      float* dst = out.data() + m * K + b;
      for (int i = 0; i < 16; ++i) {
        dst[i] = src[2 * i];
        dst[16 + i] = src[2 * i + 1];
      }
    }
  }
  return out;
}

#if MXFP4_AVX2
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The 16 codes bytes of a group as twice their values: low nibbles (even columns) and high ones (odd).
inline void lookup_group(const uint8_t* p, __m128i& lo, __m128i& hi) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kTwiceE2M1));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, mask));
  hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

inline __m256 widen_low8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m256 widen_high8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))); }

// Group g of a weight row times MT reordered activation rows: acc[i] += scale * dot.
template <int MT>
inline void group_step(const uint8_t* wrow, const uint8_t* srow, const float* const* xs, int64_t g, __m256* acc) {
  __m128i lo, hi;
  lookup_group(wrow + g * 16, lo, hi);
  const __m256 w0 = widen_low8(lo), w1 = widen_high8(lo), w2 = widen_low8(hi), w3 = widen_high8(hi);
  const __m256 s = _mm256_set1_ps(half_scales()[srow[g]]);
  for (int i = 0; i < MT; ++i) {
    const float* xr = xs[i] + g * kGroup;
    const __m256 a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xr)));
    const __m256 b = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(xr + 16)));
    acc[i] = _mm256_fmadd_ps(s, _mm256_add_ps(a, b), acc[i]);
  }
}

// Weight row (codes wrow, scales srow) times MT reordered activation rows xs[i]: *y[i] = result.
// Even and odd groups accumulate apart (two independent FMA chains).
template <int MT>
inline void row_tile(const uint8_t* wrow, const uint8_t* srow, const float* const* xs, int64_t K, float* const* y) {
  const int64_t G = K / kGroup;
  __m256 even[MT], odd[MT];
  for (int i = 0; i < MT; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    group_step<MT>(wrow, srow, xs, g, even);
    group_step<MT>(wrow, srow, xs, g + 1, odd);
  }
  if (g < G) group_step<MT>(wrow, srow, xs, g, even);
  for (int i = 0; i < MT; ++i) *y[i] = hsum8(_mm256_add_ps(even[i], odd[i]));
}

void dequantize_row(const uint8_t* wrow, const uint8_t* srow, int64_t K, float* out) {
  const float* scales = half_scales();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m128i lo, hi;
    lookup_group(wrow + g * 16, lo, hi);
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // columns 0-15, 16-31
    const __m256 s = _mm256_set1_ps(scales[srow[g]]);
    float* o = out + g * kGroup;
    _mm256_storeu_ps(o, _mm256_mul_ps(widen_low8(first), s));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(widen_high8(first), s));
    _mm256_storeu_ps(o + 16, _mm256_mul_ps(widen_low8(second), s));
    _mm256_storeu_ps(o + 24, _mm256_mul_ps(widen_high8(second), s));
  }
}
#else
// The same arithmetic one lane at a time: per group eight partial sums as the vector path's lanes.
template <int MT>
inline void row_tile(const uint8_t* wrow, const uint8_t* srow, const float* const* xs, int64_t K, float* const* y) {
  const float* scales = half_scales();
  float total[MT][2][8] = {};
  for (int64_t g = 0; g < K / kGroup; ++g) {
    float w[32];  // reordered: evens then odds
    for (int b = 0; b < 16; ++b) {
      const uint8_t byte = wrow[g * 16 + b];
      w[b] = kTwiceE2M1[byte & 0xF];
      w[16 + b] = kTwiceE2M1[byte >> 4];
    }
    const float s = scales[srow[g]];
    for (int i = 0; i < MT; ++i) {
      const float* xr = xs[i] + g * kGroup;
      for (int l = 0; l < 8; ++l) {
        const float a = w[l] * xr[l] + w[8 + l] * xr[8 + l], b = w[16 + l] * xr[16 + l] + w[24 + l] * xr[24 + l];
        total[i][g & 1][l] += s * (a + b);
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    float sum = 0.f;
    for (int l = 0; l < 8; ++l) sum += total[i][0][l] + total[i][1][l];
    *y[i] = sum;
  }
}

void dequantize_row(const uint8_t* wrow, const uint8_t* srow, int64_t K, float* out) {
  const float* scales = half_scales();
  for (int64_t k = 0; k < K; k += 2) {
    const uint8_t byte = wrow[k / 2];
    const float s = scales[srow[k / kGroup]];
    out[k] = kTwiceE2M1[byte & 0xF] * s;
    out[k + 1] = kTwiceE2M1[byte >> 4] * s;
  }
}
#endif

// A weight [E, N, K/2] / [E, N, K/32] or [N, K/2] / [N, K/32]: (E, N, K).
void check_weight(const at::Tensor& packed, const at::Tensor& scale, int64_t& E, int64_t& N, int64_t& K) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.dim() == 2 || packed.dim() == 3),
              "mxfp4: packed must be contiguous uint8 [E, N, K/2] or [N, K/2] on CPU, got ", packed.sizes());
  E = packed.dim() == 3 ? packed.size(0) : 1;
  N = packed.size(-2);
  K = packed.size(-1) * 2;
  TORCH_CHECK(K > 0 && K % kGroup == 0, "mxfp4: K=", K, " must be a positive multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kByte && scale.is_contiguous() && scale.dim() == packed.dim() &&
                  scale.size(-2) == N && scale.size(-1) == K / kGroup && (packed.dim() == 2 || scale.size(0) == E),
              "mxfp4: scale must be contiguous uint8 shaped like packed with K/32 = ", K / kGroup, " columns, got ",
              scale.sizes());
}

at::Tensor mxfp4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const std::optional<at::Tensor>& experts) {
  int64_t E, N, K;
  check_weight(packed, scale, E, N, K);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "mxfp4_gemv: x must be contiguous fp32 [M, ", K, "], got ", x.sizes());
  const int64_t M = x.size(0);
  TORCH_CHECK(experts.has_value() == (packed.dim() == 3), "mxfp4_gemv: experts [M] goes with a stacked [E, N, K/2] weight");
  std::vector<int64_t> expert_of(M, 0);
  if (experts) {
    TORCH_CHECK(experts->scalar_type() == at::kLong && experts->is_contiguous() && experts->numel() == M,
                "mxfp4_gemv: experts must be contiguous int64 [M=", M, "]");
    const int64_t* e = experts->const_data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(e[m] >= 0 && e[m] < E, "mxfp4_gemv: expert ", e[m], " of row ", m, " is not in [0, ", E, ")");
      expert_of[m] = e[m];
    }
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const std::vector<float> xr = evens_then_odds(x.const_data_ptr<float>(), M, K);
  std::vector<int64_t> order(M);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return expert_of[a] < expert_of[b]; });
  std::vector<int64_t> tile_start;  // tiles: up to kMaxTile consecutive ordered rows of one expert
  for (int64_t j = 0; j < M; ++j) {
    if (tile_start.empty() || expert_of[order[j]] != expert_of[order[tile_start.back()]] || j - tile_start.back() == kMaxTile)
      tile_start.push_back(j);
  }
  const int64_t tiles = static_cast<int64_t>(tile_start.size());
  tile_start.push_back(M);

  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint8_t* sp = scale.const_data_ptr<uint8_t>();
  float* yp = y.mutable_data_ptr<float>();
  // Work units: (tile, band of weight rows), a band about 32 KiB of codes.
  const int64_t band = std::max<int64_t>(1, (32 * 1024) / (K / 2));
  const int64_t bands = (N + band - 1) / band;
  at::parallel_for(0, tiles * bands, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = u / bands, n0 = (u % bands) * band, n1 = std::min(N, n0 + band);
      const int64_t first = tile_start[t], rows = tile_start[t + 1] - first, e = expert_of[order[first]];
      const float* xs[kMaxTile];
      float* ys[kMaxTile];
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wrow = wp + (e * N + n) * (K / 2);
        const uint8_t* srow = sp + (e * N + n) * (K / kGroup);
        for (int64_t i = 0; i < rows; ++i) {
          xs[i] = xr.data() + order[first + i] * K;
          ys[i] = yp + order[first + i] * N + n;
        }
        switch (rows) {
          case 4: row_tile<4>(wrow, srow, xs, K, ys); break;
          case 3: row_tile<3>(wrow, srow, xs, K, ys); break;
          case 2: row_tile<2>(wrow, srow, xs, K, ys); break;
          default: row_tile<1>(wrow, srow, xs, K, ys); break;
        }
      }
    }
  });
  return y;
}

void mxfp4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& out) {
  int64_t E, N, K;
  check_weight(packed, scale, E, N, K);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == E * N * K,
              "mxfp4_dequantize: out must be contiguous fp32 with ", E * N * K, " elements");
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint8_t* sp = scale.const_data_ptr<uint8_t>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K / 2));
  at::parallel_for(0, E * N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row(wp + r * (K / 2), sp + r * (K / kGroup), K, op + r * K);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("mxfp4_gemv(Tensor x, Tensor packed, Tensor scale, Tensor? experts) -> Tensor");
  m.def("mxfp4_dequantize(Tensor packed, Tensor scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("mxfp4_gemv", &mxfp4_gemv);
  m.impl("mxfp4_dequantize", &mxfp4_dequantize);
}
