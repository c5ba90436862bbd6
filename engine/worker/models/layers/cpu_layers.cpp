// The decoder layer's small ops in one call each, on the CPU: RMSNorm, its fused residual-add form
// (vLLM's fused_add_rms_norm) and rotate-half RoPE.
//
// Built into the same library as the paged-attention kernel (engine/worker/attention/cpu_kernel.py
// compiles both); registered as torch.ops.deja_cpu_attn.rms_norm / add_rms_norm / rope.
//
// NOTE: no floating-point contraction in this file (the pragma below): RoPE's x1 * cos - x2 * sin
// must round each product, then the difference, as torch's separate ops do, so that it gives the
// same bits; an FMA would round once.
//
// NOTE: on the CPU torch's rms_norm is a composite of ~8 small ops (pow, mean, add, rsqrt, mul,
// casts): 10-25 us a call whatever the size, 5 calls a step on a 2-layer model, 61 on the demo
// model. This is one pass per row, one thread for small batches (no OpenMP team to wake).
//
// Each row computes what transformers' LlamaRMSNorm computes:
//   h = float32(x); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)
// (the product with the weight in the input dtype, as torch's bf16 mul rounds it). The sum of
// squares is accumulated in float32 in another order than torch's mean, so a row may differ from
// torch's in the last bit; greedy parity with transformers is the tests' check.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const T h = static_cast<T>(static_cast<float>(x[i]) * inv);  // cast back to the input dtype
    out[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(h));
  }
}

// rows per task: enough work that a second thread pays for itself
int64_t grain(int64_t H) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)); }

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous CPU tensor [..., H]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1),
              "weight must be a contiguous [H] matching x's last dim");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: float32 or bfloat16 only");
}

}  // namespace

namespace deja_cpu {

// x: [..., H], weight: [H] -> [..., H]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* wd = weight.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        norm_row(xd + t * H, wd, od + t * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// (x + h, rms_norm(x + h)): the residual sum in the input dtype (as torch's add rounds it), then
// its norm; x, h: [..., H]. Neither input is modified.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type() && h.is_contiguous(),
              "h must be a contiguous tensor like x");
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* hd = h.data_ptr<scalar_t>();
    const scalar_t* wd = weight.data_ptr<scalar_t>();
    scalar_t* sd = sum.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* s = sd + t * H;
        for (int64_t i = 0; i < H; ++i)
          s[i] = static_cast<scalar_t>(static_cast<float>(xd[t * H + i]) +
                                       static_cast<float>(hd[t * H + i]));
        norm_row(s, wd, od + t * H, H, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// Rotate-half RoPE as transformers applies it, on the first R = 2 * half dims of every head
// (the rest pass through): out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin, each product
// and sum rounded to the input dtype as torch's ops round them.
// x: [T, H, D] (any strides but a dense last dim); cos, sin: [T, 1, half] (dense last dim)
// -> a new contiguous [T, H, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(),
              "x must be a CPU [T, H, D] with a dense last dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rope: float32 or bfloat16 only");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = cos.size(-1);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == 1 && t->stride(2) == 1 &&
                    t->scalar_type() == x.scalar_type(),
                "cos and sin must be [T, 1, half] in x's dtype with a dense last dim");
  }
  TORCH_CHECK(sin.size(2) == half && 2 * half <= D, "rotary dims must fit the head");
  at::Tensor out = at::empty({T, H, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope", [&] {
    using st = scalar_t;
    const st* xd = x.data_ptr<st>();
    const st* cd = cos.data_ptr<st>();
    const st* sd = sin.data_ptr<st>();
    st* od = out.data_ptr<st>();
    const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
    auto r = [](float v) { return static_cast<float>(static_cast<st>(v)); };  // round to st
    at::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const st* c = cd + t * cs0;
        const st* s = sd + t * ss0;
        for (int64_t h = 0; h < H; ++h) {
          const st* in = xd + t * xs0 + h * xs1;
          st* o = od + (t * H + h) * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(in[i]), x2 = static_cast<float>(in[half + i]);
            const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
            o[i] = static_cast<st>(r(x1 * ci) - r(x2 * si));
            o[half + i] = static_cast<st>(r(x2 * ci) + r(x1 * si));
          }
          for (int64_t i = 2 * half; i < D; ++i) o[i] = in[i];
        }
      }
    });
  });
  return out;
}

}  // namespace deja_cpu

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  m.def("rms_norm", &deja_cpu::rms_norm);
  m.def("add_rms_norm", &deja_cpu::add_rms_norm);
  m.def("rope", &deja_cpu::rope);
}
