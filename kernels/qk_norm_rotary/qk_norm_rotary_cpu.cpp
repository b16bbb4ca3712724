// Attention's per-head QK-norm and RoPE on CPU in one pass: every head row of q and k is
// RMS-normalised (when a weight is given) and rotated (NeoX / rotate-half pairs, optional partial
// rotary) without leaving L1, read in place from the fused qkv projection's output. Separately it
// is four ops a layer (two norms, two rotaries, each a dispatch, a fresh tensor and, for the norm,
// a copy of the strided slice): ~30 us of a decode step's layer on the 0.6B model.
//
// qk_norm_rotary(q [T, Hq, D], k [T, Hkv, D], q_weight [D]?, k_weight [D]?, eps, cos [T, R], sin [T, R])
//   -> (q [T, Hq, D], k [T, Hkv, D]) contiguous; fp32 or bf16 (one dtype, computed in fp32);
// q and k with contiguous heads (any token and head stride), R even, R <= D. The arithmetic is that
// of rms_norm_cpu.cpp then rotary_cpu.cpp, operation for operation, with the norm's output rounded
// to the element type where the separate ops store it: the result is bitwise theirs.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../cpu_dtype.h"
#include "../rms_norm/norm_row.h"
#include "../rotary/rotate_half.h"

namespace {

template <typename T>
struct Heads {
  const T* src;
  const T* weight;  // null: no norm
  T* dst;
  int64_t heads, token_stride, head_stride;
};

// buf[0:D] = the row as the norm stores it (norm_row.h), or as it is without a weight.
template <typename T>
void norm_row(const T* x, const T* w, float eps, int64_t D, float* buf) {
  if (w == nullptr) {
    for (int64_t i = 0; i < D; ++i) buf[i] = load1(x + i);
    return;
  }
  rms_norm_row(x, w, eps, D, buf);
}

// dst = buf rotated on its first R features (rotary_cpu.cpp's arithmetic), the rest copied.
template <typename T>
void rotate_row(const float* buf, const T* c, const T* s, T* dst, int64_t D, int64_t R) {
  rotate_half_row(buf, c, s, dst, R);
  for (int64_t i = R; i < D; ++i) store1(dst + i, buf[i]);
}

template <typename T>
void norm_rotate(const Heads<T>& q, const Heads<T>& k, float eps, const T* cp, const T* sp, int64_t T_, int64_t D, int64_t R) {
  const int64_t H = q.heads + k.heads;
  at::parallel_for(0, T_ * H, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / H, h = task % H;
      const Heads<T>& side = h < q.heads ? q : k;
      const int64_t hh = h < q.heads ? h : h - q.heads;
      norm_row(side.src + t * side.token_stride + hh * side.head_stride, side.weight, eps, D, buf.data());
      rotate_row(buf.data(), cp + t * R, sp + t * R, side.dst + (t * side.heads + hh) * D, D, R);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rotary(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& q_weight,
                                                  const std::optional<at::Tensor>& k_weight, double eps, const at::Tensor& cos,
                                                  const at::Tensor& sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "qk_norm_rotary: q, k, cos and sin of one dtype expected");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "qk_norm_rotary: q [T, Hq, D] and k [T, Hkv, D] with contiguous heads expected");
  const int64_t T = q.size(0), D = q.size(2), R = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && R % 2 == 0 && R <= D && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "qk_norm_rotary: cos, sin [T, R] contiguous, R even and <= D expected");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "qk_norm_rotary: both norm weights or neither expected");
  for (const auto& w : {q_weight, k_weight})
    if (w) TORCH_CHECK(w->scalar_type() == dtype && w->is_contiguous() && w->numel() == D, "qk_norm_rotary: norm weights [D] of q's dtype expected");
  at::Tensor q_out = at::empty({T, q.size(1), D}, q.options());
  at::Tensor k_out = at::empty({T, k.size(1), D}, k.options());
  float_or_bf16(dtype, "qk_norm_rotary", [&](auto zero) {
    using E = decltype(zero);
    const Heads<E> qh{data_of<E>(q), q_weight ? data_of<E>(*q_weight) : nullptr, mutable_data_of<E>(q_out), q.size(1), q.stride(0), q.stride(1)};
    const Heads<E> kh{data_of<E>(k), k_weight ? data_of<E>(*k_weight) : nullptr, mutable_data_of<E>(k_out), k.size(1), k.stride(0), k.stride(1)};
    norm_rotate(qh, kh, static_cast<float>(eps), data_of<E>(cos), data_of<E>(sin), T, D, R);
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("qk_norm_rotary(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, float eps, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("qk_norm_rotary", &qk_norm_rotary);
}
