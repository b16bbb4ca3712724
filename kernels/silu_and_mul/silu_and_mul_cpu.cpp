// SwiGLU on CPU in one pass: silu(gate) * up, with gate and up read where the fused gate_up
// projection left them (two halves of each row, a row stride apart) and exp by polynomial
// (cpu_vec.h). The torch path is two ops, silu into a fresh tensor and an in-place multiply, after
// the halves are made contiguous.
//
// silu_and_mul(gate [T, I], up [T, I]) -> [T, I], fp32 or bf16 (computed in fp32); each row of
// gate and up contiguous (any row stride).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <type_traits>

#include "../cpu_dtype.h"

namespace {

// bf16 rounds silu(gate) to bf16 before the multiply, as the reference's two ops do.
template <typename T>
void silu_rows(const T* g, const T* u, T* o, int64_t T_, int64_t I, int64_t gs, int64_t us) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  // Grains of whole rows, about 16k elements each.
  at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, I)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gr = g + t * gs;
      const T* ur = u + t * us;
      T* orow = o + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec x = vload(gr + i);
        const Vec sig = vdiv(vset1(1.f), vadd(vset1(1.f), vexp(vmul(x, vset1(-1.f)))));
        Vec silu = vmul(x, sig);
        if constexpr (kBf16) silu = vround_bf16(silu);
        vstore(orow + i, vmul(silu, vload(ur + i)));
      }
      for (; i < I; ++i) {
        const float x = load1(gr + i);
        float silu = x / (1.f + std::exp(-x));
        if constexpr (kBf16) silu = round1_bf16(silu);
        store1(orow + i, silu * load1(ur + i));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "silu_and_mul: gate and up of one dtype expected");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_and_mul: gate and up [T, I] with contiguous rows expected");
  at::Tensor out = at::empty({gate.size(0), gate.size(1)}, gate.options());
  float_or_bf16(gate.scalar_type(), "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    silu_rows(data_of<T>(gate), data_of<T>(up), mutable_data_of<T>(out), gate.size(0), gate.size(1), gate.stride(0), up.stride(0));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
}
