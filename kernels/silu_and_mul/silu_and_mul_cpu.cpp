// SwiGLU on CPU in one pass: silu(gate) * up, with gate and up read where the fused gate_up
// projection left them (two halves of each row, a row stride apart) and exp by polynomial
// (cpu_vec.h). The torch path is two ops, silu into a fresh tensor and an in-place multiply, after
// the halves are made contiguous.
//
// silu_and_mul(gate [T, I], up [T, I]) -> [T, I], fp32; each row of gate and up contiguous (any
// row stride).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "../cpu_vec.h"

namespace {

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat, "silu_and_mul: fp32 gate and up expected");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_and_mul: gate and up [T, I] with contiguous rows expected");
  const int64_t T = gate.size(0), I = gate.size(1);
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::Tensor out = at::empty({T, I}, gate.options());
  const float* g = gate.const_data_ptr<float>();
  const float* u = up.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  // Grains of whole rows, about 16k elements each.
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, I)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gr = g + t * gs;
      const float* ur = u + t * us;
      float* orow = o + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec x = vload(gr + i);
        const Vec sig = vdiv(vset1(1.f), vadd(vset1(1.f), vexp(vmul(x, vset1(-1.f)))));
        vstore(orow + i, vmul(vmul(x, sig), vload(ur + i)));
      }
      for (; i < I; ++i) orow[i] = gr[i] / (1.f + std::exp(-gr[i])) * ur[i];
    }
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
