// A step's keys and values into their paged-cache slots on CPU, both in one call: one row copy per
// token and cache. The torch path is two index_copy_ calls (~8 us each in a decode step, for a
// few KB), each a dispatch and a TensorIterator over the rows.
//
// kv_cache_write(k [T, Hkv, D], v [T, Hkv, D], k_cache [N, block_size, Hkv, D] (mutated),
//                v_cache (mutated, same shape), slots [T] int64) -> ()
// Token t's rows go to slot slots[t] = block * block_size + offset. k and v of the caches' dtype
// (any), each token's [Hkv, D] contiguous (any token stride: v may be a slice of the fused qkv).

#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include <cstring>

namespace {

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "kv_cache_write: ", name, " of the cache's dtype expected, got ",
              x.scalar_type(), " and ", cache.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(2) && x.size(2) == cache.size(3) && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "kv_cache_write: ", name, " [T, Hkv, D] with contiguous tokens expected, got ", x.sizes());
}

void kv_cache_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "kv_cache_write: contiguous caches [N, block_size, Hkv, D] of one shape and dtype expected");
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) && v.size(0) == k.size(0),
              "kv_cache_write: int64 slots [T] for T rows of k and v expected");
  const at::Tensor s = slots.contiguous();
  const int64_t T = k.size(0), capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slot = s.const_data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  char* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "kv_cache_write: slot ", slot[t], " outside the cache's ", capacity);
    std::memcpy(kc + slot[t] * row_bytes, kp + t * k_step, row_bytes);
    std::memcpy(vc + slot[t] * row_bytes, vp + t * v_step, row_bytes);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("kv_cache_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("kv_cache_write", &kv_cache_write);
}
