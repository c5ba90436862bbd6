// The small per-layer ops of the decoder around the GEMMs, one launch each (vLLM's
// fused_add_rms_norm, rotary_embedding and silu_and_mul): torch runs RMSNorm as ~8 kernels, the
// rotate-half RoPE as ~7 and SiLU-and-multiply as 2, each a launch of host time and a few
// microseconds of GPU time on a decode batch.
//
// Each op rounds where torch's composite rounds, so the results are torch's bit for bit but for
// the float32 sum of squares' order (RMSNorm) and expf's last bit (SiLU):
// - rms_norm:      out = w * T(x * rsqrt(mean(x^2) + eps)), mean in float32 (transformers' Llama
//                  RMSNorm: normalized in float32, cast back, then scaled in T);
// - add_rms_norm:  x' = T(x + h) (torch's residual add), then rms_norm(x'); returns both;
// - rope:          rotate-half on the first R dims of each head: o1 = T(T(x1 c) - T(x2 s)),
//                  o2 = T(T(x2 c) + T(x1 s)); the dims past R are copied;
// - silu_and_mul:  out = T(T(silu(g)) * u) over [g | u] rows.
// Products and sums use the _rn intrinsics so the compiler fuses none into an FMA (torch's
// separate kernels round each).
#include "deja_common.cuh"

namespace deja {

#ifndef DEJA_HOST_EMULATION
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
#else
inline float mul_rn(float a, float b) { return a * b; }
inline float add_rn(float a, float b) { return a + b; }
inline float sub_rn(float a, float b) { return a - b; }
#endif

// x rounded to T and back (the value torch holds after an op whose output dtype is T).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

constexpr int LAYER_THREADS = 256;

// Sum of v over the CTA (blockDim.x == LAYER_THREADS); every thread gets it.
__device__ __forceinline__ float cta_sum(float v) {
  __shared__ float partial[LAYER_THREADS / 32];
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < LAYER_THREADS / 32; ++w) total += partial[w];
  __syncthreads();  // partial is reused by the next call
  return total;
}

// grid: (num_tokens), block: (LAYER_THREADS)
// x, h, residual_out, out: [num_tokens, hidden] rows of T, row strides in elements (out and
// residual_out contiguous); w: [hidden]. With h == nullptr: out = rms_norm(x) and residual_out is
// not written; else residual_out = T(x + h), out = rms_norm(residual_out).
template <typename T>
__global__ void __launch_bounds__(LAYER_THREADS)
    rms_norm_kernel(T* __restrict__ out, T* __restrict__ residual_out, const T* __restrict__ x,
                    const T* __restrict__ h, const T* __restrict__ w, int hidden,
                    long long x_stride, long long h_stride, float eps) {
  const long long token = blockIdx.x;
  const T* x_row = x + token * x_stride;
  const T* h_row = h == nullptr ? nullptr : h + token * h_stride;
  float squares = 0.f;
  for (int i = threadIdx.x; i < hidden; i += LAYER_THREADS) {
    float v = to_float(x_row[i]);
    if (h_row != nullptr) {
      v = round_to<T>(add_rn(v, to_float(h_row[i])));
      residual_out[token * hidden + i] = from_float<T>(v);
    }
    squares += v * v;
  }
  // torch's mean: the sum times 1 / n
  const float mean = mul_rn(cta_sum(squares), 1.f / static_cast<float>(hidden));
  const float r = rsqrtf(mean + eps);
  for (int i = threadIdx.x; i < hidden; i += LAYER_THREADS) {
    float v = to_float(x_row[i]);
    if (h_row != nullptr) v = round_to<T>(add_rn(v, to_float(h_row[i])));
    out[token * hidden + i] = from_float<T>(mul_rn(to_float(w[i]), round_to<T>(mul_rn(v, r))));
  }
}

// grid: (num_tokens), block: (LAYER_THREADS)
// x, out: [num_tokens, num_heads, head_dim] of T, x's token stride x_stride (heads dense), out
// contiguous; cos, sin: [num_tokens, half] of T with token stride cs_stride (dense rows);
// rotate-half over the first 2 * half dims of each head, the rest copied.
template <typename T>
__global__ void __launch_bounds__(LAYER_THREADS)
    rope_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ cos,
                const T* __restrict__ sin, int num_heads, int head_dim, int half,
                long long x_stride, long long cs_stride) {
  const long long token = blockIdx.x;
  const T* x_tok = x + token * x_stride;
  T* out_tok = out + token * static_cast<long long>(num_heads) * head_dim;
  const T* c_row = cos + token * cs_stride;
  const T* s_row = sin + token * cs_stride;
  const int rot = 2 * half;
  for (int i = threadIdx.x; i < num_heads * head_dim; i += LAYER_THREADS) {
    const int head = i / head_dim, d = i % head_dim;
    const T* xh = x_tok + head * head_dim;
    float o;
    if (d < half) {  // x1 c - x2 s
      const float x1 = to_float(xh[d]), x2 = to_float(xh[d + half]);
      const float c = to_float(c_row[d]), s = to_float(s_row[d]);
      o = sub_rn(round_to<T>(mul_rn(x1, c)), round_to<T>(mul_rn(x2, s)));
    } else if (d < rot) {  // x2 c + x1 s
      const int j = d - half;
      const float x1 = to_float(xh[j]), x2 = to_float(xh[d]);
      const float c = to_float(c_row[j]), s = to_float(s_row[j]);
      o = add_rn(round_to<T>(mul_rn(x2, c)), round_to<T>(mul_rn(x1, s)));
    } else {
      o = to_float(xh[d]);
    }
    out_tok[i] = from_float<T>(o);
  }
}

// grid: (num_tokens), block: (LAYER_THREADS)
// gate_up: [num_tokens, 2 * inter] rows of T ([gate | up]), token stride gu_stride; out:
// [num_tokens, inter] contiguous.
template <typename T>
__global__ void __launch_bounds__(LAYER_THREADS)
    silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int inter,
                        long long gu_stride) {
  const long long token = blockIdx.x;
  const T* row = gate_up + token * gu_stride;
  for (int i = threadIdx.x; i < inter; i += LAYER_THREADS) {
    const float g = to_float(row[i]), u = to_float(row[inter + i]);
    const float silu = round_to<T>(g / add_rn(1.f, expf(-g)));
    out[token * inter + i] = from_float<T>(mul_rn(silu, u));
  }
}

}  // namespace deja
