// One decode step of a pre-norm attention + SwiGLU decoder layer on CPU, in one call.
//
// The same ops the layer's Python runs, in the same order and on the same arguments, called
// through the dispatcher from here: add + RMSNorm, the qkv GEMV, QK-norm + RoPE, the KV write,
// paged decode attention, the o GEMV, add + RMSNorm, the gate/up GEMV, SwiGLU, the down GEMV. The
// result is bitwise that of the Python path. Why: each GEMV streams its weights through L2 and
// evicts what the interpreter works with, so the Python between two GEMVs ran 3-5x slower inside a
// step than alone (0.6B fp32 on a 2-core Xeon: ~25 ms of a 165 ms token between the linears
// against ~9 ms with the GEMVs stubbed); here that work is a few hundred instructions.
//
// decode_layer(hidden [T, H], residual [T, H]?, norm weights [H] x2, q/k norm weights [D]? x2, eps, qk_eps,
//              cos, sin [T, R], k_cache, v_cache [N, block, Hkv, D], slots [T], block_tables [T, W],
//              context_lens [T], scale, heads [Hq, Hkv, D], linears, biases [P], weights [3P])
//              -> (hidden [T, H], residual [T, H])
// The four projections in order qkv, o, gate_up, down; each is one or more linears side by side
// (q, k and v kept in different formats are three: their outputs are concatenated). `linears` holds,
// per projection, its count of linears and then 5 fields (w_ptr, N, K, w_bytes, block) per linear;
// biases hold one entry per linear (P in all) and weights three (the tensors a format passes by
// value, None-padded), in the same order. Each linear is for a few-row kernel: block 0 =
// oneDNN-packed fp32 (`packed_fp32_gemv`), -2 = GGUF blocks (`gguf_gemv` over its first tensor,
// the GGML type in the w_bytes field), -3 = 4-bit groups (`int4_gemv` over nibbles, scale,
// zero * scale; the group in w_bytes), -4 = FP8 (`fp8_gemv` over the bytes and scale; the group
// in w_bytes), else oneDNN-packed bf16 with that block (`packed_bf16_gemv`). The by-value formats
// take fp32 activations; the packed ones are reached by address (w_ptr) and pass no tensors.
// With no residual (the first layer), the residual is the hidden input, as in the Python layer.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("layerzoo_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "layerzoo_cpu::add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, const OptTensor&, int64_t)> fp32_gemv =
      op<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, const OptTensor&, int64_t)>("layerzoo_cpu::packed_fp32_gemv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, const OptTensor&, int64_t, int64_t)> bf16_gemv =
      op<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, const OptTensor&, int64_t, int64_t)>(
          "layerzoo_cpu::packed_bf16_gemv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&)> gguf_gemv =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&)>("layerzoo_cpu::gguf_gemv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                      const OptTensor&)>
      int4_gemv = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)>(
          "layerzoo_cpu::int4_gemv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)> fp8_gemv =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)>("layerzoo_cpu::fp8_gemv");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                              const OptTensor&, double, const at::Tensor&, const at::Tensor&)>
      qk_norm_rotary = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                                             double, const at::Tensor&, const at::Tensor&)>("layerzoo_cpu::qk_norm_rotary");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)> kv_write =
      op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>("layerzoo_cpu::kv_cache_write");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double)>
      attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "layerzoo_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> silu_and_mul =
      op<at::Tensor(const at::Tensor&, const at::Tensor&)>("layerzoo_cpu::silu_and_mul");
};

const Ops& ops() {
  static const Ops table;  // looked up once, after every fragment of the library has registered
  return table;
}

constexpr int64_t kLinearFields = 5;  // w_ptr, N, K, w_bytes, block
constexpr int64_t kProjections = 4;  // qkv, o, gate_up, down

constexpr int64_t kTensors = 3;  // weights entries a linear: the tensors a by-value format passes, None-padded
// The block field of the by-value formats (w_bytes then holds the GGML type, or the group).
constexpr int64_t kGGUFBlock = -2, kInt4Block = -3, kFP8Block = -4;

const at::Tensor& tensor(const OptTensor* w, int64_t i, const char* what) {
  TORCH_CHECK(w[i], "decode_layer: ", what, " without its tensor ", i);
  return *w[i];
}

// w: this linear's kTensors entries of `weights`.
at::Tensor one_linear(const Ops& o, const at::Tensor& rows, const int64_t* f, const OptTensor& bias, const OptTensor* w) {
  switch (f[4]) {
    case kGGUFBlock:
      return o.gguf_gemv.call(rows, tensor(w, 0, "a GGUF linear"), f[3], f[2], bias);
    case kInt4Block:
      return o.int4_gemv.call(rows, tensor(w, 0, "a 4-bit linear"), tensor(w, 1, "a 4-bit linear"), tensor(w, 2, "a 4-bit linear"),
                              f[3], bias);
    case kFP8Block:
      return o.fp8_gemv.call(rows, tensor(w, 0, "an FP8 linear"), tensor(w, 1, "an FP8 linear"), f[3], bias);
    case 0:
      return o.fp32_gemv.call(rows, f[0], f[1], f[2], bias, f[3]);
    default:
      return o.bf16_gemv.call(rows, f[0], f[1], f[2], bias, f[3], f[4]);
  }
}

// Where each projection's linears start: in `linears` (its count) and in biases / weights.
struct Projection {
  int64_t field = 0, part = 0, count = 0;
};

std::vector<Projection> projections(c10::IntArrayRef linears, size_t parts) {
  std::vector<Projection> out;
  int64_t field = 0, part = 0;
  for (int64_t p = 0; p < kProjections; ++p) {
    TORCH_CHECK(field < int64_t(linears.size()) && linears[field] > 0, "decode_layer: projection ", p, " has no linears");
    const int64_t count = linears[field];
    out.push_back({field + 1, part, count});
    field += 1 + count * kLinearFields;
    part += count;
  }
  TORCH_CHECK(field == int64_t(linears.size()) && size_t(part) == parts, "decode_layer: linears holds ", linears.size(),
              " fields for ", parts, " linears (biases); expected per projection a count and 5 fields a linear");
  return out;
}

at::Tensor linear(const Ops& o, const at::Tensor& x, c10::IntArrayRef linears, const std::vector<OptTensor>& biases,
                  const std::vector<OptTensor>& weights, const Projection& p) {
  const at::Tensor rows = x.is_contiguous() ? x : x.contiguous();
  const int64_t* f = linears.data() + p.field;
  if (p.count == 1) return one_linear(o, rows, f, biases[p.part], weights.data() + p.part * kTensors);
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < p.count; ++i)
    outs.push_back(one_linear(o, rows, f + i * kLinearFields, biases[p.part + i], weights.data() + (p.part + i) * kTensors));
  return at::cat(outs, 1);
}

std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& input_norm,
                                                const at::Tensor& post_norm, const OptTensor& q_norm, const OptTensor& k_norm,
                                                double eps, double qk_eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                                at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                                                const at::Tensor& context_lens, double scale, c10::IntArrayRef heads,
                                                c10::IntArrayRef linears, const std::vector<OptTensor>& biases,
                                                const std::vector<OptTensor>& weights) {
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden [T, H] expected, got ", hidden.sizes());
  TORCH_CHECK(heads.size() == 3 && int64_t(weights.size()) == kTensors * int64_t(biases.size()),
              "decode_layer: heads [Hq, Hkv, D] and a bias and three weights entries a linear expected");
  const std::vector<Projection> proj = projections(linears, biases.size());
  const Ops& o = ops();
  const int64_t T = hidden.size(0), Hq = heads[0], Hkv = heads[1], D = heads[2];
  at::Tensor x, res;
  if (residual) {
    std::tie(x, res) = o.add_rms_norm.call(hidden, *residual, input_norm, eps);
  } else {
    x = o.rms_norm.call(hidden, input_norm, eps);
    res = hidden;
  }
  const at::Tensor qkv = linear(o, x, linears, biases, weights, proj[0]);
  const at::Tensor q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  const at::Tensor k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
  auto [qr, kr] = o.qk_norm_rotary.call(q, k, q_norm, k_norm, qk_eps, cos.contiguous(), sin.contiguous());
  o.kv_write.call(kr, v, k_cache, v_cache, slots);  // rows with a token stride, as the Python path passes them
  const at::Tensor attn = o.attention.call(qr, k_cache, v_cache, block_tables, context_lens, scale);
  const at::Tensor out = linear(o, attn.view({T, Hq * D}), linears, biases, weights, proj[1]);
  auto [y, res2] = o.add_rms_norm.call(out, res, post_norm, eps);
  const at::Tensor gate_up = linear(o, y, linears, biases, weights, proj[2]);
  const int64_t inner = gate_up.size(1) / 2;
  const at::Tensor act = o.silu_and_mul.call(gate_up.narrow(1, 0, inner), gate_up.narrow(1, inner, inner));
  return {linear(o, act, linears, biases, weights, proj[3]), res2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, Tensor? q_norm, Tensor? k_norm, "
      "float eps, float qk_eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, "
      "Tensor context_lens, float scale, int[] heads, int[] linears, Tensor?[] biases, Tensor?[] weights) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("decode_layer", &decode_layer);
}

// -- The MTP head's step (layerzoo.layers.fused_mtp) ------------------------------------------------
//
// mtp_head_step(ids [T], previous [T, H], embed [V, H], positions [T]?, enorm, hnorm, norm [H], head_eps,
//               carry_normed, head_linears, head_biases, head_weights, draft_rows [R],
//               <decode_layer's arguments from input_norm on, for all T rows>) -> (carry [R, H], tokens [R])
// One step of `MtpHead` and the shared LM head in one call: x = eh_proj(cat(enorm(embed[ids]) (rows at
// position 0 zeroed where positions is given), hnorm(previous))), the decoder block, norm(y + r), the
// LM head and its argmax, with the same ops in the same order as the Python path (`CausalLM.mtp_step`),
// so carry and tokens are bitwise its. Only the `draft_rows` need the block's output; the other rows
// (catch-up rows: the head's KV at positions a sequence reached while it did not draft, or the rows
// before a verify's last) run only the block's key/value part (norm, the qkv GEMV, QK-norm + RoPE, the
// KV write), which writes what the full block writes there. head_linears: eh_proj then the LM head,
// each a count of linears and 5 fields a linear, as decode_layer's `linears`.

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <utility>

namespace {

std::vector<Projection> head_projections(c10::IntArrayRef linears, size_t parts, int64_t count) {
  std::vector<Projection> out;
  int64_t field = 0, part = 0;
  for (int64_t p = 0; p < count; ++p) {
    TORCH_CHECK(field < int64_t(linears.size()) && linears[field] > 0, "mtp_head_step: projection ", p, " has no linears");
    out.push_back({field + 1, part, linears[field]});
    part += linears[field];
    field += 1 + linears[field] * kLinearFields;
  }
  TORCH_CHECK(field == int64_t(linears.size()) && size_t(part) == parts,
              "mtp_head_step: head_linears holds ", linears.size(), " fields for ", parts, " linears");
  return out;
}

// The block's key/value part for rows whose output nobody reads: what decode_layer writes to the cache.
void key_value_rows(const Ops& o, const at::Tensor& hidden, const at::Tensor& input_norm, const OptTensor& q_norm,
                    const OptTensor& k_norm, double eps, double qk_eps, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, c10::IntArrayRef heads,
                    c10::IntArrayRef linears, const std::vector<OptTensor>& biases, const std::vector<OptTensor>& weights) {
  const std::vector<Projection> proj = projections(linears, biases.size());
  const int64_t T = hidden.size(0), Hq = heads[0], Hkv = heads[1], D = heads[2];
  const at::Tensor x = o.rms_norm.call(hidden, input_norm, eps);
  const at::Tensor qkv = linear(o, x, linears, biases, weights, proj[0]);
  const at::Tensor q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  const at::Tensor k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
  auto [qr, kr] = o.qk_norm_rotary.call(q, k, q_norm, k_norm, qk_eps, cos.contiguous(), sin.contiguous());
  o.kv_write.call(kr, v, k_cache, v_cache, slots);
}

std::tuple<at::Tensor, at::Tensor> head_step(
    const at::Tensor& ids, const at::Tensor& previous, const at::Tensor& embed, const OptTensor& positions,
    const at::Tensor& enorm, const at::Tensor& hnorm, const at::Tensor& norm, double head_eps, bool carry_normed,
    c10::IntArrayRef head_linears, const std::vector<OptTensor>& head_biases, const std::vector<OptTensor>& head_weights,
    const at::Tensor& draft_rows, const at::Tensor& input_norm, const at::Tensor& post_norm, const OptTensor& q_norm,
    const OptTensor& k_norm, double eps, double qk_eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
    c10::IntArrayRef heads, c10::IntArrayRef linears, const std::vector<OptTensor>& biases, const std::vector<OptTensor>& weights) {
  const std::vector<Projection> head = head_projections(head_linears, head_biases.size(), 2);  // eh_proj, LM head
  const Ops& o = ops();
  const int64_t T = ids.size(0), R = draft_rows.size(0);
  at::Tensor emb = embed.index_select(0, ids);  // nn.Embedding's rows
  if (positions) emb = emb.masked_fill(positions->eq(0).unsqueeze(-1), 0.0);
  const at::Tensor e = o.rms_norm.call(emb, enorm, head_eps);
  const at::Tensor h = o.rms_norm.call(previous.is_contiguous() ? previous : previous.contiguous(), hnorm, head_eps);
  const at::Tensor x = linear(o, at::cat({e, h}, 1), head_linears, head_biases, head_weights, head[0]);

  // Rows past the draft rows write only their keys and values; before the draft rows attend.
  const int64_t* rows = draft_rows.const_data_ptr<int64_t>();
  std::vector<char> drafts(T, 0);
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(0 <= rows[i] && rows[i] < T, "mtp_head_step: draft row ", rows[i], " out of ", T, " rows");
    drafts[rows[i]] = 1;
  }
  std::vector<int64_t> rest;
  for (int64_t t = 0; t < T; ++t)
    if (!drafts[t]) rest.push_back(t);
  const bool all = int64_t(rest.size()) == 0 && R == T;
  if (!rest.empty()) {
    at::Tensor pick = at::empty({int64_t(rest.size())}, draft_rows.options());
    std::copy(rest.begin(), rest.end(), pick.mutable_data_ptr<int64_t>());
    key_value_rows(o, x.index_select(0, pick), input_norm, q_norm, k_norm, eps, qk_eps, cos.index_select(0, pick),
                   sin.index_select(0, pick), k_cache, v_cache, slots.index_select(0, pick), heads, linears, biases, weights);
  }
  if (R == 0) return {at::empty({0, previous.size(1)}, previous.options()), at::empty({0}, draft_rows.options())};
  auto only = [&](const at::Tensor& t) { return all ? t : t.index_select(0, draft_rows); };
  auto [y, res] = decode_layer(only(x), std::nullopt, input_norm, post_norm, q_norm, k_norm, eps, qk_eps, only(cos), only(sin),
                               k_cache, v_cache, only(slots), only(block_tables), only(context_lens), scale, heads, linears,
                               biases, weights);
  const at::Tensor summed = y.add(res);
  const at::Tensor normed = o.rms_norm.call(summed, norm, head_eps);
  const at::Tensor logits = linear(o, normed, head_linears, head_biases, head_weights, head[1]);
  return {carry_normed ? normed : summed, logits.to(at::kFloat).argmax(1)};
}


void check_head(const at::Tensor& ids, const at::Tensor& previous, const std::vector<OptTensor>& head_biases,
                const std::vector<OptTensor>& head_weights) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && previous.dim() == 2 && previous.size(0) == ids.size(0),
              "mtp_head_step: int64 ids [T] and previous [T, H] expected, got ", ids.sizes(), " and ", previous.sizes());
  TORCH_CHECK(int64_t(head_weights.size()) == kTensors * int64_t(head_biases.size()),
              "mtp_head_step: a bias and three weights entries a head linear expected");
}

std::tuple<at::Tensor, at::Tensor> mtp_head_step(
    const at::Tensor& ids, const at::Tensor& previous, const at::Tensor& embed, const OptTensor& positions,
    const at::Tensor& enorm, const at::Tensor& hnorm, const at::Tensor& norm, double head_eps, bool carry_normed,
    c10::IntArrayRef head_linears, const std::vector<OptTensor>& head_biases, const std::vector<OptTensor>& head_weights,
    const at::Tensor& draft_rows, const at::Tensor& input_norm, const at::Tensor& post_norm, const OptTensor& q_norm,
    const OptTensor& k_norm, double eps, double qk_eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
    c10::IntArrayRef heads, c10::IntArrayRef linears, const std::vector<OptTensor>& biases, const std::vector<OptTensor>& weights) {
  check_head(ids, previous, head_biases, head_weights);
  TORCH_CHECK(draft_rows.dim() == 1 && draft_rows.scalar_type() == at::kLong, "mtp_head_step: int64 draft_rows [R] expected");
  return head_step(ids, previous, embed, positions, enorm, hnorm, norm, head_eps, carry_normed, head_linears, head_biases,
                   head_weights, draft_rows, input_norm, post_norm, q_norm, k_norm, eps, qk_eps, cos, sin, k_cache, v_cache, slots,
                   block_tables, context_lens, scale, heads, linears, biases, weights);
}

// cos, sin [T, Rd] of the model's rotary at positions [T], as `layerzoo.kernels.rotary.reference.cos_sin` computes them.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq, double scaling,
                                                 at::ScalarType dtype) {
  const at::Tensor freqs = positions.unsqueeze(1).to(at::kFloat).mul(inv_freq.unsqueeze(0).to(at::kFloat));
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().mul(scaling).to(dtype), emb.sin().mul(scaling).to(dtype)};
}

// mtp_head_chain(tokens [R], carry [R, H], counts [R], ends [R], block_tables [R, W], block_size, inv_freq, rope_scaling,
//                <the head's and the block's arguments as mtp_head_step, without the step's>) -> drafts [R, S]
// The chained steps after a head step (S = max(counts) - 1): step s feeds row j its last draft and carry as a decode row
// at position ends[j] + s (its KV slot from its block table, cos and sin from the model's rotary) while j wants more than
// s + 1 drafts (counts[j]); drafts[j, s] is what it drafts there, -1 past its count. Each step is `mtp_head_step` over the
// rows still chaining, on what the Python loop (MtpDrafter._draft) builds for it, so the drafts are bitwise its.
at::Tensor mtp_head_chain(
    const at::Tensor& tokens, const at::Tensor& carry, const at::Tensor& counts, const at::Tensor& ends,
    const at::Tensor& block_tables, int64_t block_size, const at::Tensor& inv_freq, double rope_scaling, const at::Tensor& embed,
    bool mask_position0, const at::Tensor& enorm, const at::Tensor& hnorm, const at::Tensor& norm, double head_eps,
    bool carry_normed, c10::IntArrayRef head_linears, const std::vector<OptTensor>& head_biases,
    const std::vector<OptTensor>& head_weights, const at::Tensor& input_norm, const at::Tensor& post_norm, const OptTensor& q_norm,
    const OptTensor& k_norm, double eps, double qk_eps, at::Tensor& k_cache, at::Tensor& v_cache, double scale,
    c10::IntArrayRef heads, c10::IntArrayRef linears, const std::vector<OptTensor>& biases, const std::vector<OptTensor>& weights) {
  check_head(tokens, carry, head_biases, head_weights);
  const int64_t R = tokens.size(0);
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == R && counts.scalar_type() == at::kLong && ends.sizes() == counts.sizes() &&
                  ends.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == R &&
                  block_tables.scalar_type() == at::kLong && block_size > 0,
              "mtp_head_chain: int64 counts and ends [R], block_tables [R, W] expected");
  const at::Tensor tables = block_tables.contiguous();
  const int64_t W = tables.size(1);
  const int64_t* count = counts.const_data_ptr<int64_t>();
  const int64_t* end = ends.const_data_ptr<int64_t>();
  const int64_t* table = tables.const_data_ptr<int64_t>();
  int64_t S = 0;
  for (int64_t j = 0; j < R; ++j) {
    S = std::max(S, count[j] - 1);
    TORCH_CHECK(count[j] <= 1 || (end[j] + count[j] - 2) / block_size < W, "mtp_head_chain: row ", j, "'s block table ends before its drafts");
  }
  at::Tensor drafts = at::empty({R, S}, tokens.options()).fill_(-1);
  at::Tensor last = tokens.clone(), hidden = carry.clone();
  for (int64_t s = 0; s < S; ++s) {
    std::vector<int64_t> go;
    for (int64_t j = 0; j < R; ++j)
      if (count[j] > s + 1) go.push_back(j);
    const int64_t n = int64_t(go.size());
    at::Tensor pick = at::empty({n}, tokens.options()), pos = at::empty({n}, tokens.options()),
               slots = at::empty({n}, tokens.options());
    int64_t* p = pos.mutable_data_ptr<int64_t>();
    int64_t* slot = slots.mutable_data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = go[i];
      pick.mutable_data_ptr<int64_t>()[i] = j;
      p[i] = end[j] + s;
      slot[i] = table[j * W + p[i] / block_size] * block_size + p[i] % block_size;
    }
    const auto [cos, sin] = rotary_cos_sin(pos, inv_freq, rope_scaling, hidden.scalar_type());
    auto [out, drafted] = head_step(
        last.index_select(0, pick), hidden.index_select(0, pick), embed, mask_position0 ? OptTensor(pos) : std::nullopt, enorm,
        hnorm, norm, head_eps, carry_normed, head_linears, head_biases, head_weights, at::arange(n, tokens.options()), input_norm,
        post_norm, q_norm, k_norm, eps, qk_eps, cos, sin, k_cache, v_cache, slots, tables.index_select(0, pick), pos.add(1), scale,
        heads, linears, biases, weights);
    drafts.select(1, s).index_copy_(0, pick, drafted);
    last.index_copy_(0, pick, drafted);
    hidden.index_copy_(0, pick, out);
  }
  return drafts;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layerzoo_cpu, m) {
  m.def(
      "mtp_head_step(Tensor ids, Tensor previous, Tensor embed, Tensor? positions, Tensor enorm, Tensor hnorm, Tensor norm, "
      "float head_eps, bool carry_normed, int[] head_linears, Tensor?[] head_biases, Tensor?[] head_weights, Tensor draft_rows, "
      "Tensor input_norm, Tensor post_norm, Tensor? q_norm, Tensor? k_norm, float eps, float qk_eps, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, Tensor context_lens, float scale, int[] heads, "
      "int[] linears, Tensor?[] biases, Tensor?[] weights) -> (Tensor, Tensor)");
  m.def(
      "mtp_head_chain(Tensor tokens, Tensor carry, Tensor counts, Tensor ends, Tensor block_tables, int block_size, "
      "Tensor inv_freq, float rope_scaling, Tensor embed, bool mask_position0, Tensor enorm, Tensor hnorm, Tensor norm, float head_eps, "
      "bool carry_normed, int[] head_linears, Tensor?[] head_biases, Tensor?[] head_weights, Tensor input_norm, Tensor post_norm, "
      "Tensor? q_norm, Tensor? k_norm, float eps, float qk_eps, Tensor(a!) k_cache, Tensor(b!) v_cache, float scale, int[] heads, "
      "int[] linears, Tensor?[] biases, Tensor?[] weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(layerzoo_cpu, CPU, m) {
  m.impl("mtp_head_step", &mtp_head_step);
  m.impl("mtp_head_chain", &mtp_head_chain);
}
