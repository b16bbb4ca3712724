// Paged decode attention on CPU: one query per sequence over its cached context, read in place
// from the paged cache (the torch path first gathers every sequence's keys and values into a copy).
//
// q [B, Hq, D], k_cache / v_cache [N, block_size, Hkv, D] (fp32 or bf16, one dtype, contiguous;
// computed in fp32), block_tables [B, W]
// int64, context_lens [B] int64 -> out [B, Hq, D]. Hq is a multiple of Hkv (GQA): the Hq / Hkv
// query heads of a KV head share each key and value row while it is in cache. One task per
// (sequence, run of adjacent KV heads): scores for the whole context, softmax in fp32, then the
// weighted values. A token's keys for a run of heads are contiguous in the cache, so a task that
// takes every head streams each block's rows in order; one task per single head read 512 bytes
// every 4 KB (Hkv 8, D 128): a new page per row, out of the prefetchers' reach, ~2x slower on the
// 0.6B bench model. Runs are as long as still gives every thread two tasks (a batch of 8 takes
// all heads at once; one sequence splits its heads).
//
// Scores come a vector of tokens at a time (kLanes dot products summed lane by lane), the softmax
// takes exp by polynomial over whole vectors (cpu_vec.h), and the values are summed four tokens
// per pass over the output row. Against one horizontal sum per token and head, a libm exp per
// weight and one pass per token, this is ~2.5-3x faster (Zen 5, 2 threads: 6 sequences of 250
// tokens, Hq 4 / Hkv 2 / D 64: 52 -> 18 us; 8 of 160, Hq 16 / Hkv 8 / D 128: 229 -> 92 us).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <type_traits>
#include <vector>

#include "../cpu_dtype.h"

namespace {

template <typename E>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale, at::Tensor& out);

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and caches of one dtype expected, got ", q.scalar_type(), " and ",
              k_cache.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: q [B, Hq, D] and caches [N, block_size, Hkv, D] expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: contiguous q and caches expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 block_tables and context_lens expected");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "paged_decode_attention: head sizes do not match");
  at::Tensor out = at::empty(q.sizes(), q.options());
  float_or_bf16(q.scalar_type(), "paged_decode_attention", [&](auto zero) {
    decode<decltype(zero)>(q, k_cache, v_cache, block_tables, context_lens, scale, out);
  });
  return out;
}

// Scores, softmax and the weighted sum in fp32 whatever E is; a bf16 output is rounded once.
// Row queries of one sequence (a verify's rows, a short prompt chunk's) come as consecutive rows
// with the same block table and context lengths L, L + 1, ...: a task takes up to kGroupRows of
// them, so each block of keys and values is read once, into L1, for all of them, instead of once
// per row from L2. Each row's sums run exactly as they would alone (the same lanes, blocks and
// order), so a row's output does not depend on the rows beside it.
constexpr int64_t kGroupRows = 8;

// [first row, rows) of each group: consecutive rows that share a block table and whose lengths
// grow by one, at most kGroupRows.
std::vector<std::pair<int64_t, int64_t>> row_groups(const int64_t* table, const int64_t* len, int64_t B, int64_t W) {
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t b = 0; b < B;) {
    int64_t n = 1;
    while (b + n < B && n < kGroupRows && len[b + n] == len[b] + n &&
           std::equal(table + b * W, table + (b + 1) * W, table + (b + n) * W))
      ++n;
    groups.emplace_back(b, n);
    b += n;
  }
  return groups;
}

template <typename E>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t group = Hq / Hkv;
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t W = tables.size(1);
  const int64_t* table = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  const E* qp = data_of<E>(q);
  const E* kp = data_of<E>(k_cache);
  const E* vp = data_of<E>(v_cache);
  E* op = mutable_data_of<E>(out);
  constexpr bool kFloat = std::is_same_v<E, float>;
  const float sc = static_cast<float>(scale);
  const auto groups = row_groups(table, len, B, W);
  const int64_t G = static_cast<int64_t>(groups.size());

  // Heads per task: the most (a divisor of Hkv) that still leaves two tasks per thread.
  const int64_t want = 2 * at::get_num_threads();
  int64_t runs = 1;
  while (runs < Hkv && G * runs < want) {
    ++runs;
    while (Hkv % runs) ++runs;
  }
  const int64_t run = Hkv / runs;
  const int64_t row = Hkv * D;  // floats between one token's rows

  // Scores kLanes tokens at a time (one vector of dot products, `vsum_lanes`) when D is whole
  // vectors; a scalar horizontal sum per token and head took most of the kernel's time.
  const bool lanes = D % kLanes == 0;
  at::parallel_for(0, G * runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, sums;  // sums: a bf16 task's fp32 outputs (fp32 sums into out itself)
    for (int64_t task = begin; task < end; ++task) {
      const auto [b0, R] = groups[task / runs];
      const int64_t h0 = (task % runs) * run;
      const int64_t nq = run * group;  // query heads of this task, adjacent in q and out
      const int64_t Lmax = len[b0 + R - 1];  // the group's last row sees the most keys
      TORCH_CHECK(Lmax <= W * block_size, "paged_decode_attention: context longer than the block table");
      const int64_t Lp = (std::max<int64_t>(Lmax, 0) + kLanes - 1) / kLanes * kLanes;  // scores padded to whole vectors
      const int64_t* tb = table + b0 * W;  // the group's one block table
      // Row i of the group: its query heads, output and scores; it sees L(i) keys.
      auto L = [&](int64_t i) { return len[b0 + i]; };
      auto query = [&](int64_t i) { return qp + ((b0 + i) * Hq + h0 * group) * D; };
      auto dst = [&](int64_t i) { return op + ((b0 + i) * Hq + h0 * group) * D; };
      if constexpr (!kFloat) sums.resize(R * nq * D);
      // Row i's fp32 sums: in the output itself for fp32, in `sums` for bf16 (rounded once at the end).
      auto o = [&](int64_t i) -> float* {
        if constexpr (kFloat) {
          return dst(i);
        } else {
          return sums.data() + i * nq * D;
        }
      };
      for (int64_t i = 0; i < R; ++i) std::fill(o(i), o(i) + nq * D, 0.f);
      scores.resize(R * nq * Lp);
      auto score = [&](int64_t i, int64_t r) { return scores.data() + (i * nq + r) * Lp; };
      // Offset of token t's rows for this task's heads, the same in the key and the value cache.
      auto at = [&](int64_t t) { return (tb[t / block_size] * block_size + t % block_size) * row + h0 * D; };
      auto key = [&](int64_t t) { return kp + at(t); };
      auto value = [&](int64_t t) { return vp + at(t); };
      for (int64_t t0 = 0; t0 < Lmax; t0 += kLanes) {
        const int64_t n = std::min(kLanes, Lmax - t0);
        if (!lanes) {
          for (int64_t i = 0; i < R; ++i) {
            const E* qh = query(i);
            for (int64_t t = t0; t < std::min(t0 + n, L(i)); ++t)
              for (int64_t r = 0; r < nq; ++r) score(i, r)[t] = dot(qh + r * D, key(t) + (r / group) * D, D) * sc;
          }
          continue;
        }
        // Lanes past a row's L hold scores of later rows' keys (or repeats past Lmax): never read.
        const E* k[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) k[j] = key(t0 + std::min(j, n - 1));
        for (int64_t i = 0; i < R; ++i) {
          if (t0 >= L(i)) continue;  // lengths grow along the group: the rows that need this block are its last
          const E* qh = query(i);
          for (int64_t r = 0; r < nq; ++r) {
            const E* qr = qh + r * D;
            const int64_t off = (r / group) * D;
            Vec acc[kLanes];
            for (int64_t j = 0; j < kLanes; ++j) acc[j] = vzero();
            for (int64_t d = 0; d < D; d += kLanes) {
              const Vec qv = vload(qr + d);
              for (int64_t j = 0; j < kLanes; ++j) acc[j] = vfma(qv, vload(k[j] + off + d), acc[j]);
            }
            vstore(score(i, r) + t0, vmul(vsum_lanes(acc), vset1(sc)));
          }
        }
      }
      for (int64_t i = 0; i < R; ++i) {
        const int64_t Li = L(i);
        for (int64_t r = 0; r < nq && Li > 0; ++r) {
          float* s = score(i, r);
          Vec m = vset1(-std::numeric_limits<float>::infinity());
          int64_t t = 0;
          for (; t + kLanes <= Li; t += kLanes) m = vmax(m, vload(s + t));
          float top = vmaxall(m);
          for (; t < Li; ++t) top = std::max(top, s[t]);
          const Vec vneg_top = vset1(-top);
          Vec sum = vzero();
          for (t = 0; t + kLanes <= Li; t += kLanes) {
            const Vec e = vexp(vadd(vload(s + t), vneg_top));
            vstore(s + t, e);
            sum = vadd(sum, e);
          }
          float total = vsum(sum);
          for (; t < Li; ++t) total += (s[t] = std::exp(s[t] - top));
          const float inv = 1.f / total;
          for (t = 0; t < Li; ++t) s[t] *= inv;
        }
      }
      // Four tokens per pass over a head's output row: it is loaded and stored once for four
      // tokens. A row takes the passes that fit its L, then its last tokens one by one.
      for (int64_t t = 0; t + 4 <= Lmax; t += 4) {
        const E* v[4] = {value(t), value(t + 1), value(t + 2), value(t + 3)};
        for (int64_t i = 0; i < R; ++i) {
          if (t + 4 > L(i)) continue;
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t off = (r / group) * D;
            axpy4(o(i) + r * D, score(i, r) + t, v[0] + off, v[1] + off, v[2] + off, v[3] + off, D);
          }
        }
      }
      for (int64_t i = 0; i < R; ++i) {
        for (int64_t t = std::max<int64_t>(L(i), 0) / 4 * 4; t < L(i); ++t) {
          const E* v = value(t);
          for (int64_t r = 0; r < nq; ++r) axpy(o(i) + r * D, score(i, r)[t], v + (r / group) * D, D);
        }
        if constexpr (!kFloat) {
          E* d = dst(i);
          const float* src = o(i);
          int64_t j = 0;
          for (; j + kLanes <= nq * D; j += kLanes) vstore(d + j, vload(src + j));
          for (; j < nq * D; ++j) store1(d + j, src[j]);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
