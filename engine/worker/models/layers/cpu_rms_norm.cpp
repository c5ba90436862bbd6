// RMSNorm on the CPU in one call, and its fused residual-add form (vLLM's fused_add_rms_norm).
//
// Built into the same library as the paged-attention kernel (engine/worker/attention/cpu_kernel.py
// compiles both); registered as torch.ops.deja_cpu_attn.rms_norm / add_rms_norm.
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
}
