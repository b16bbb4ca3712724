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
