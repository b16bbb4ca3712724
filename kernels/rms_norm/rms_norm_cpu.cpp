// RMSNorm on CPU in one pass per row, with the residual add fused: the torch path on CPU is six
// ops (pow, mean, add, rsqrt, mul, mul), each a dispatch and a pass over the row, which in a decode
// step costs more than the arithmetic.
//
// rms_norm(x [T, D], w [D], eps) -> y [T, D]
// add_rms_norm(x [T, D], residual [T, D], w [D], eps) -> (y [T, D], x + residual [T, D])
// fp32, contiguous rows; y = w * s / sqrt(mean(s^2) + eps) with s the (summed) row, as the reference.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <tuple>

#include "../cpu_vec.h"

namespace {

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: fp32 x and weight expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.numel() == x.size(1),
              "rms_norm: contiguous x [T, D] and weight [D] expected");
}

void norm_rows(const float* src, const float* w, float* y, int64_t T, int64_t D, float eps) {
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* s = src + t * D;
      const float inv = 1.f / std::sqrt(dot(s, s, D) / float(D) + eps);
      float* out = y + t * D;
      const Vec iv = vset1(inv);
      int64_t i = 0;
      for (; i + kLanes <= D; i += kLanes) vstore(out + i, vmul(vmul(vload(s + i), iv), vload(w + i)));
      for (; i < D; ++i) out[i] = (s[i] * inv) * w[i];
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  at::Tensor y = at::empty_like(x);
  norm_rows(x.const_data_ptr<float>(), w.const_data_ptr<float>(), y.mutable_data_ptr<float>(), x.size(0), x.size(1),
            static_cast<float>(eps));
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "rms_norm: residual must be contiguous fp32 shaped like x");
  const int64_t T = x.size(0), D = x.size(1);
  at::Tensor summed = at::empty_like(x);
  const float* a = x.const_data_ptr<float>();
  const float* r = residual.const_data_ptr<float>();
  float* s = summed.mutable_data_ptr<float>();
  at::parallel_for(0, T * D, 65536, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) s[i] = a[i] + r[i];
  });
  at::Tensor y = at::empty_like(x);
  norm_rows(s, w.const_data_ptr<float>(), y.mutable_data_ptr<float>(), T, D, static_cast<float>(eps));
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
