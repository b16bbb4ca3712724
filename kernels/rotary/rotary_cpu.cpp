// Rotary position embedding on CPU (NeoX / rotate-half pairs, optional partial rotary) in one pass
// over q or k, read in place from the fused qkv projection's output (any token and head stride).
// The torch path is a roll, a multiply and an addcmul over [T, H, R], plus a cat for partial
// rotary. The arithmetic is the reference's, operation for operation (x * cos, then the rolled x
// times the signed sin added by one fused multiply-add, as torch's addcmul does on CPU), so the
// result is bitwise the same.
//
// rotary_embedding(x [T, H, D], cos [T, R], sin [T, R]) -> [T, H, D] contiguous, fp32; R even,
// R <= D; x's last dim contiguous; cos and sin contiguous.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../cpu_vec.h"

namespace {

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_embedding: fp32 x, cos and sin expected");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x [T, H, D] with contiguous heads expected");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(-1), half = R / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && R % 2 == 0 && R <= D &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: cos, sin [T, R] contiguous, R even and <= D expected");
  const int64_t ts = x.stride(0), hs = x.stride(1);
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T * H, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / H, h = task % H;
      const float* src = xp + t * ts + h * hs;
      const float* c = cp + t * R;
      const float* s = sp + t * R;
      float* dst = op + task * D;
      // out[i] = x[i] c[i] - x[i + half] s[i] (first half); x[i] c[i] + x[i - half] s[i] (second)
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const Vec lo = vload(src + i), hi = vload(src + half + i);
        const Vec neg_s_lo = vmul(vload(s + i), vset1(-1.f));
        vstore(dst + i, vfma(hi, neg_s_lo, vmul(lo, vload(c + i))));
        vstore(dst + half + i, vfma(lo, vload(s + half + i), vmul(hi, vload(c + half + i))));
      }
      for (; i < half; ++i) {
        const float lo = src[i], hi = src[half + i];
        dst[i] = std::fma(hi, -s[i], lo * c[i]);
        dst[half + i] = std::fma(lo, s[half + i], hi * c[half + i]);
      }
      if (R < D) std::memcpy(dst + R, src + R, (D - R) * sizeof(float));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding);
}
