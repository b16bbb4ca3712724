// Rotary position embedding on CPU (NeoX / rotate-half pairs, optional partial rotary) in one pass
// over q or k, read in place from the fused qkv projection's output (any token and head stride).
// The torch path is a roll, a multiply and an addcmul over [T, H, R], plus a cat for partial
// rotary. The arithmetic is the reference's, operation for operation (x * cos, then the rolled x
// times the signed sin added by one fused multiply-add, as torch's addcmul does on CPU), so the
// result is bitwise the same.
//
// rotary_embedding(x [T, H, D], cos [T, R], sin [T, R]) -> [T, H, D] contiguous, fp32 or bf16 (one
// dtype, computed in fp32, rounded where the reference rounds); R even, R <= D; x's last dim
// contiguous; cos and sin contiguous.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../cpu_dtype.h"
#include "rotate_half.h"

namespace {

template <typename T>
void rotate(const T* xp, const T* cp, const T* sp, T* op, int64_t T_, int64_t H, int64_t D, int64_t R, int64_t ts, int64_t hs) {
  at::parallel_for(0, T_ * H, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / H, h = task % H;
      const T* src = xp + t * ts + h * hs;
      T* dst = op + task * D;
      rotate_half_row(src, cp + t * R, sp + t * R, dst, R);
      if (R < D) std::memcpy(dst + R, src + R, (D - R) * sizeof(T));
    }
  });
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "rotary_embedding: x, cos and sin of one dtype expected");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x [T, H, D] with contiguous heads expected");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && R % 2 == 0 && R <= D &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: cos, sin [T, R] contiguous, R even and <= D expected");
  at::Tensor out = at::empty({T, H, D}, x.options());
  float_or_bf16(x.scalar_type(), "rotary_embedding", [&](auto zero) {
    using E = decltype(zero);
    rotate(data_of<E>(x), data_of<E>(cos), data_of<E>(sin), mutable_data_of<E>(out), T, H, D, R, x.stride(0), x.stride(1));
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
