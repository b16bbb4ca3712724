// RMSNorm on CPU in one pass per row, with the residual add fused: the torch path on CPU is six
// ops (pow, mean, add, rsqrt, mul, mul), each a dispatch and a pass over the row, which in a decode
// step costs more than the arithmetic.
//
// rms_norm(x [..., D], w [D], eps) -> y [..., D]
// add_rms_norm(x [..., D], residual [..., D], w [D], eps) -> (y [..., D], x + residual [..., D])
// fp32 or bf16 (x, residual and w of one dtype; sums in fp32), contiguous rows;
// y = w * s / sqrt(mean(s^2) + eps) with s the (summed) row, rounded where the reference rounds.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#include "../cpu_dtype.h"
#include "norm_row.h"

namespace {

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight of one dtype expected, got ", x.scalar_type(),
              " and ", w.scalar_type());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() >= 1 && w.numel() == x.size(-1),
              "rms_norm: contiguous x [..., D] and weight [D] expected");
}

// y = w * (s / rms(s)) per row (norm_row.h).
template <typename T>
void norm_rows(const T* src, const T* w, T* y, int64_t T_, int64_t D, float eps) {
  at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(src + t * D, w, eps, D, y + t * D);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  at::Tensor y = at::empty_like(x);
  float_or_bf16(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    norm_rows(data_of<T>(x), data_of<T>(w), mutable_data_of<T>(y), x.numel() / x.size(-1), x.size(-1), static_cast<float>(eps));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "rms_norm: residual must be contiguous, shaped and typed like x");
  const int64_t D = x.size(-1), T_ = x.numel() / D;
  at::Tensor summed = at::empty_like(x);
  at::Tensor y = at::empty_like(x);
  float_or_bf16(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const T* a = data_of<T>(x);
    const T* r = data_of<T>(residual);
    T* s = mutable_data_of<T>(summed);
    at::parallel_for(0, T_ * D, 65536, [&](int64_t begin, int64_t end) {
      int64_t i = begin;
      for (; i + kLanes <= end; i += kLanes) vstore(s + i, vadd(vload(a + i), vload(r + i)));
      for (; i < end; ++i) store1(s + i, load1(a + i) + load1(r + i));
    });
    norm_rows(s, data_of<T>(w), mutable_data_of<T>(y), T_, D, static_cast<float>(eps));
  });
  return {y, summed};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
