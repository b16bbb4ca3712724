// RoPE's rotate-half (NeoX) arithmetic on one head row: the one place it is written, for
// rotary_cpu.cpp and qk_norm_rotary_cpu.cpp, so that both give the reference's result bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../cpu_vec.h"

// dst[0:R] = src[0:R] rotated by cos c and sin s: out[i] = x[i] c[i] - x[i + R/2] s[i] (first half),
// x[i] c[i] + x[i - R/2] s[i] (second). src is fp32 or T. x * cos rounds to T before the fused
// multiply-add, as the reference's mul then addcmul do; features past R are the caller's.
template <typename S, typename T>
inline void rotate_half_row(const S* src, const T* c, const T* s, T* dst, int64_t R) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  auto round = [](Vec v) { if constexpr (kBf16) return vround_bf16(v); else return v; };
  auto round1 = [](float v) { if constexpr (kBf16) return round1_bf16(v); else return v; };
  const int64_t half = R / 2;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const Vec lo = vload(src + i), hi = vload(src + half + i);
    const Vec neg_s_lo = vmul(vload(s + i), vset1(-1.f));
    vstore(dst + i, vfma(hi, neg_s_lo, round(vmul(lo, vload(c + i)))));
    vstore(dst + half + i, vfma(lo, vload(s + half + i), round(vmul(hi, vload(c + half + i)))));
  }
  for (; i < half; ++i) {
    const float lo = load1(src + i), hi = load1(src + half + i);
    store1(dst + i, std::fma(hi, -load1(s + i), round1(lo * load1(c + i))));
    store1(dst + half + i, std::fma(lo, load1(s + half + i), round1(hi * load1(c + half + i))));
  }
}
