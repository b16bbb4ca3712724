// Paged decode attention on CPU: one query per sequence over its cached context, read in place
// from the paged cache (the torch path first gathers every sequence's keys and values into a copy).
//
// q [B, Hq, D], k_cache / v_cache [N, block_size, Hkv, D] (fp32, contiguous), block_tables [B, W]
// int64, context_lens [B] int64 -> out [B, Hq, D]. Hq is a multiple of Hkv (GQA): the Hq / Hkv
// query heads of a KV head share each key and value row while it is in cache. One task per
// (sequence, run of adjacent KV heads): scores for the whole context, softmax in fp32, then the
// weighted values. A token's keys for a run of heads are contiguous in the cache, so a task that
// takes every head streams each block's rows in order; one task per single head read 512 bytes
// every 4 KB (Hkv 8, D 128): a new page per row, out of the prefetchers' reach, ~2x slower on the
// 0.6B bench model. Runs are as long as still gives every thread two tasks (a batch of 8 takes
// all heads at once; one sequence splits its heads).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../cpu_vec.h"

namespace {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: fp32 q and caches expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: q [B, Hq, D] and caches [N, block_size, Hkv, D] expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: contiguous q and caches expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 block_tables and context_lens expected");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "paged_decode_attention: head sizes do not match");
  const int64_t group = Hq / Hkv;
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t W = tables.size(1);
  const int64_t* table = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k_cache.const_data_ptr<float>();
  const float* vp = v_cache.const_data_ptr<float>();
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  float* op = out.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // Heads per task: the most (a divisor of Hkv) that still leaves two tasks per thread.
  const int64_t want = 2 * at::get_num_threads();
  int64_t runs = 1;
  while (runs < Hkv && B * runs < want) {
    ++runs;
    while (Hkv % runs) ++runs;
  }
  const int64_t run = Hkv / runs;
  const int64_t row = Hkv * D;  // floats between one token's rows

  at::parallel_for(0, B * runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / runs, h0 = (task % runs) * run;
      const int64_t L = len[b];
      TORCH_CHECK(L <= W * block_size, "paged_decode_attention: context longer than the block table");
      const int64_t nq = run * group;  // query heads of this task, adjacent in q and out
      float* o = op + (b * Hq + h0 * group) * D;
      std::fill(o, o + nq * D, 0.f);
      if (L <= 0) continue;
      scores.resize(nq * L);
      const float* qh = qp + (b * Hq + h0 * group) * D;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = table[b * W + t / block_size];
        const float* k = kp + (block * block_size + t % block_size) * row + h0 * D;
        for (int64_t h = 0; h < run; ++h)
          for (int64_t g = 0; g < group; ++g)
            scores[(h * group + g) * L + t] = dot(qh + (h * group + g) * D, k + h * D, D) * sc;
      }
      for (int64_t r = 0; r < nq; ++r) {
        float* s = scores.data() + r * L;
        const float top = *std::max_element(s, s + L);
        float total = 0.f;
        for (int64_t t = 0; t < L; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = table[b * W + t / block_size];
        const float* v = vp + (block * block_size + t % block_size) * row + h0 * D;
        for (int64_t h = 0; h < run; ++h)
          for (int64_t g = 0; g < group; ++g) axpy(o + (h * group + g) * D, scores[(h * group + g) * L + t], v + h * D, D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
