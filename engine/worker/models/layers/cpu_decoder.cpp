// A Llama-shaped decoder's layer stack in one call on the CPU, for decode steps (and short chunks):
// the same kernels and torch ops, in the same order, as the Python forward of models/base.py
// (DecoderLayer over Attention, GatedMLP, RMSNorm and the quantized linears), so every output
// is the same bits; what goes is the Python between them, ~40 small calls a layer that cost
// more than the layer's arithmetic on a small model.
//
// Registered as the class torch.classes.deja_cpu_attn.DecoderStack; layers/compiled.py builds it
// from a loaded model (and says which models it takes) and calls `run` once a step.
//
// Per layer, with x the residual stream [T, hidden]:
//   a = rms_norm(x); qkv = qkv_proj(a); q, k = rope(qkv's q and k heads); v = qkv's v heads
//   K, V written to the layer's cache at the step's slots (row copies: the bytes index_copy_ writes)
//   o = o_proj(paged_attention(q)); x, n = add_rms_norm(x, o)
//   g, u = gate_up_proj(n); x = x + down_proj(silu(g) * u)
// and after the last layer the final norm. A linear is 4-bit (uint8 qs, scale, zero) or 8-bit
// (int8 qs, scale) groups of 32 inputs (cpu_quant.cpp), with an optional bias.
#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A quantized linear: qs, scale, zero (4-bit only) and bias; an absent one is an empty tensor.
// int8: the product on int8-quantized activations (cpu_quant_i8.cpp); slab_from: rows of
// bfloat16 x from which the slab product takes them instead (cpu_quant_bf16.cpp; 0: never).
struct Linear {
  at::Tensor qs, scale, zero, bias;
  bool int8 = false;
  int64_t slab_from = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    const bool q4 = qs.scalar_type() == at::kByte;
    if (slab_from > 0 && x.scalar_type() == at::kBFloat16 && x.size(0) >= slab_from) {
      y = q4 ? deja_cpu::q4_linear_bf16(x, qs, scale, zero)
             : deja_cpu::q8_linear_bf16(x, qs, scale);
    } else if (q4) {
      y = int8 ? deja_cpu::q4_linear_i8(x, qs, scale, zero) : deja_cpu::q4_linear(x, qs, scale, zero);
    } else {
      y = int8 ? deja_cpu::q8_linear_i8(x, qs, scale) : deja_cpu::q8_linear(x, qs, scale);
    }
    return bias.defined() ? y + bias : y;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

constexpr int64_t kPerLayer = 18;  // 2 norms and 4 linears of 4 tensors

at::Tensor present(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }

Linear linear_at(const std::vector<at::Tensor>& w, int64_t i, bool int8, int64_t slab_from) {
  const Linear l{w[i], w[i + 1], present(w[i + 2]), present(w[i + 3]), int8, slab_from};
  TORCH_CHECK(l.qs.dim() == 2 && l.qs.is_contiguous() &&
                  (l.qs.scalar_type() == at::kChar ||
                   (l.qs.scalar_type() == at::kByte && l.zero.defined())),
              "a linear must be int8 qs, or uint8 qs with zeros");
  return l;
}

// The step's new K (rotated's heads from Hq) and V (qkv's columns from v_at) rows into a layer's
// cache [2, NB, BS, Hkv, D] at `slots`: row copies, the bytes index_copy_ would write.
void write_kv(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rotated,
              int64_t Hq, const at::Tensor& qkv, int64_t v_at) {
  const int64_t T = slots.numel(), width = cache.size(-2) * cache.size(-1);
  const int64_t rows = cache.numel() / (2 * width), el = cache.element_size(), bytes = width * el;
  TORCH_CHECK(cache.is_contiguous() && rotated.is_contiguous() && qkv.is_contiguous() &&
                  slots.is_contiguous() && rotated.scalar_type() == cache.scalar_type() &&
                  qkv.scalar_type() == cache.scalar_type(),
              "the cache, rotated q / k, qkv and slots must be contiguous, the first three of one "
              "dtype");
  TORCH_CHECK(rotated.dim() == 3 && rotated.size(0) == T && qkv.dim() == 2 && qkv.size(0) == T &&
                  (rotated.size(1) - Hq) * rotated.size(2) == width && v_at + width == qkv.size(1),
              "the cache's rows do not match the step's K and V rows");
  auto* base = static_cast<char*>(cache.data_ptr());
  const auto* k = static_cast<const char*>(rotated.data_ptr());
  const auto* v = static_cast<const char*>(qkv.data_ptr());
  const int64_t k_row = rotated.size(1) * rotated.size(2), v_row = qkv.size(1);
  const int64_t* at = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // (every slot checked before any row is written)
    TORCH_CHECK(at[t] >= 0 && at[t] < rows, "slot ", at[t], " is outside the cache (", rows, " rows)");
  }
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(base + at[t] * bytes, k + (t * k_row + Hq * rotated.size(2)) * el, bytes);
    std::memcpy(base + (rows + at[t]) * bytes, v + (t * v_row + v_at) * el, bytes);
  }
}

class DecoderStack : public torch::CustomClassHolder {
 public:
  // weights: per layer input norm, (qs, scale, zero, bias) of qkv, o, gate_up and down, post
  // norm (18 tensors; empty for an absent zero or bias), then the final norm's weight.
  // int8_activations: every linear multiplies int8-quantized activations. slab_from: each
  // linear's (4 a layer, in that order) Linear::slab_from.
  DecoderStack(std::vector<at::Tensor> weights, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale, bool int8_activations,
               std::vector<int64_t> slab_from)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale) {
    TORCH_CHECK(weights.size() % kPerLayer == 1, "weights: 18 a layer and the final norm");
    TORCH_CHECK(slab_from.size() * kPerLayer == 4 * (weights.size() - 1), "slab_from: 4 a layer");
    for (size_t i = 0, l = 0; i + 1 < weights.size(); i += kPerLayer, l += 4) {
      const bool int8 = int8_activations;
      const int64_t* from = slab_from.data() + l;
      layers_.push_back({weights[i], weights[i + 17], linear_at(weights, i + 1, int8, from[0]),
                         linear_at(weights, i + 5, int8, from[1]),
                         linear_at(weights, i + 9, int8, from[2]),
                         linear_at(weights, i + 13, int8, from[3])});
    }
    final_norm_ = weights.back();
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h: [T, hidden] embedded tokens; cos, sin: [T, 1, R / 2]; kv_cache: [L, 2, NB, BS, Hkv, D];
  // block_tables, query_start_loc, seq_lens: the step's attention metadata (every token attended
  // by the kernel, none padding); slots: [T] int64 -> the final-norm hidden states [T, hidden].
  at::Tensor run(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& kv_cache, const at::Tensor& block_tables,
                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                 const at::Tensor& slots) const {
    TORCH_CHECK(h.dim() == 2 && kv_cache.dim() == 6 && kv_cache.size(0) == num_layers(),
                "h must be [T, hidden] and kv_cache [layers, 2, NB, BS, Hkv, D]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == h.size(0), "slots: [T]");
    const int64_t T = h.size(0), D = head_dim_, Hq = num_heads_, Hkv = num_kv_heads_;
    const int64_t q_size = Hq * D, kv_size = Hkv * D;
    const at::Tensor all = at::empty({0}, slots.options());  // attend every sequence
    at::Tensor x = h;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& l = layers_[i];
      const at::Tensor qkv = l.qkv(deja_cpu::rms_norm(x, l.input_norm, eps_));
      const auto qk_v = qkv.split({q_size + kv_size, kv_size}, -1);
      const at::Tensor rotated = deja_cpu::rope(qk_v[0].view({T, Hq + Hkv, D}), cos, sin);
      const auto q_k = rotated.split({Hq, Hkv}, 1);
      const at::Tensor cache = kv_cache[i];
      write_kv(cache, slots, rotated, Hq, qkv, q_size + kv_size);
      at::Tensor attn = at::empty_like(q_k[0]);
      deja_cpu::paged_attention(attn, q_k[0], cache, block_tables, query_start_loc, seq_lens, all,
                                scale_, 0, 0.0, 1.0, 1.0);
      const at::Tensor o = l.o(attn.reshape({T, q_size}));
      const auto [sum, normed] = deja_cpu::add_rms_norm(x, o, l.post_norm, eps_);
      const auto gate_up = l.gate_up(normed).chunk(2, -1);
      x = sum + l.down(at::silu(gate_up[0]) * gate_up[1]);
    }
    return deja_cpu::rms_norm(x, final_norm_, eps_);
  }

 private:
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double, bool,
                       std::vector<int64_t>>())
      .def("num_layers", &DecoderStack::num_layers)
      .def("run", &DecoderStack::run);
}
