// RMSNorm's arithmetic on one row: the one place it is written, for rms_norm_cpu.cpp and
// qk_norm_rotary_cpu.cpp, so that the fused kernel stays bitwise the separate norm.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../cpu_vec.h"

// out[0:D] = w * (x / rms(x)), sums in fp32; x and w of T (fp32 or bf16). bf16 rounds x / rms(x)
// to bf16 before the weight multiply, as the reference (and Hugging Face's) does. Out is T, or
// float for a caller that works on in L1: then each value is rounded to what storing it as T gives.
template <typename T, typename Out>
inline void rms_norm_row(const T* x, const T* w, float eps, int64_t D, Out* out) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  constexpr bool kRoundOut = kBf16 && std::is_same_v<Out, float>;
  const float inv = 1.f / std::sqrt(dot(x, x, D) / float(D) + eps);
  const Vec iv = vset1(inv);
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) {
    Vec normed = vmul(vload(x + i), iv);
    if constexpr (kBf16) normed = vround_bf16(normed);
    Vec y = vmul(normed, vload(w + i));
    if constexpr (kRoundOut) y = vround_bf16(y);
    vstore(out + i, y);
  }
  for (; i < D; ++i) {
    float normed = load1(x + i) * inv;
    if constexpr (kBf16) normed = round1_bf16(normed);
    float y = normed * load1(w + i);
    if constexpr (kRoundOut) y = round1_bf16(y);
    store1(out + i, y);
  }
}
