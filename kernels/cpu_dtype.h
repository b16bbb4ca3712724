// Element types of the C++ CPU kernels that run in fp32 or bf16 (see cpu_vec.h): a tensor's data
// as `float` or `bf16` bits, and a dispatch from its scalar type to a kernel templated on either.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "cpu_vec.h"

template <typename T>
const T* data_of(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.const_data_ptr<float>();
  else return reinterpret_cast<const bf16*>(t.const_data_ptr<at::BFloat16>());
}

template <typename T>
T* mutable_data_of(at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.mutable_data_ptr<float>();
  else return reinterpret_cast<bf16*>(t.mutable_data_ptr<at::BFloat16>());
}

// body(T{}) with T float for fp32 tensors, bf16 for bfloat16 ones; anything else is refused by name.
template <typename Body>
decltype(auto) float_or_bf16(at::ScalarType type, const char* op, Body&& body) {
  if (type == at::kFloat) return body(float{});
  TORCH_CHECK(type == at::kBFloat16, op, ": fp32 or bf16 tensors expected, got ", type);
  return body(bf16{});
}
