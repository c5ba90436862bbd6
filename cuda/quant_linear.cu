// Products with weights kept in groups of 32 inputs (engine/worker/models/layers/quantized.py:
// GGUF Q4_0 / Q4_1 / Q4_K / Q8_0, AWQ, GPTQ, load-time int4 / int8), the CUDA side of
// engine/worker/models/layers/cpu_quant.cpp:
// - q4: 16 bytes a group, byte j holding weights j (low nibble) and j + 16 (high nibble);
//       w = (q - 8) * scale + zero with float scale and zero a group, or q * d + m with the
//       file's float16 pair (d, m) a group (S = f16: scale holds d, zero holds m; taken as
//       scale = d, zero = m + 8d in float32, as the CPU kernel does);
// - q8: 32 int8 a group, w = q * scale (float or float16 scale), one scale a group or one every
//       16 weights (sub = 2: GGUF's Q6_K).
// Two kernels a kind:
// - gemv (decode, up to GEMV_MAX_ROWS rows of x): one warp an output feature, each lane a group
//   at a time; every weight byte is read once for all rows, nothing is expanded; float32 sums,
//   a warp's partial sums added by shuffles;
// - dequant (prefill): the weight expanded to T, one thread a group, for a dense GEMM after it.
// The expansion gives the CPU kernel's bits (one fma a weight); the products are the dequantized
// weight's up to the float32 summation order.
#include "deja_common.cuh"

namespace deja {

constexpr int QUANT_GROUP = 32;
constexpr int GEMV_WARPS = 4;  // output features a CTA
constexpr int GEMV_MAX_ROWS = 8;
constexpr int DEQUANT_THREADS = 256;

// A 4-bit group's float32 (scale, zero): as stored (S = float), or d and m + 8d (S = f16).
__device__ __forceinline__ float2 q4_scale_zero(float scale, float zero) {
  return make_float2(scale, zero);
}
__device__ __forceinline__ float2 q4_scale_zero(f16 d, f16 m) {
  return make_float2(to_float(d), to_float(m) + 8.f * to_float(d));
}

// The 32 weights of a 4-bit group as q - 8 (q[j] for input j of the group).
__device__ __forceinline__ void unpack_q4(uint4 packed, float* q) {
  const unsigned int words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int b = 0; b < 16; ++b) {
    const unsigned int byte = (words[b / 4] >> (8 * (b % 4))) & 0xffu;
    q[b] = static_cast<float>(static_cast<int>(byte & 15u) - 8);
    q[b + 16] = static_cast<float>(static_cast<int>(byte >> 4) - 8);
  }
}

// The 32 weights of an 8-bit group.
__device__ __forceinline__ void unpack_q8(uint4 lo, uint4 hi, float* q) {
  const unsigned int words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int b = 0; b < 32; ++b) {
    const int byte = static_cast<int>((words[b / 4] >> (8 * (b % 4))) & 0xffu);
    q[b] = static_cast<float>(byte >= 128 ? byte - 256 : byte);
  }
}

// acc[m] += sum_j (q[j] * s + z) * x[m][j] over kLen weights, for rows m < rows.
template <int kLen, typename T>
__device__ __forceinline__ void group_dot(float* acc, const float* q, float s, float z,
                                          const T* x, long long x_stride, int rows) {
#pragma unroll
  for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
    if (m < rows) {
      const T* xm = x + m * x_stride;
      float qx = 0.f, sx = 0.f;
#pragma unroll
      for (int j = 0; j < kLen; ++j) {
        const float v = to_float(xm[j]);
        qx += q[j] * v;
        sx += v;
      }
      acc[m] += s * qx + z * sx;
    }
  }
}

// Sums acc over the warp; lane 0 writes out[m * out_features + n] where n is an output feature
// (a CTA's last warps may have none: they take part in the shuffles and write nothing).
template <typename T>
__device__ __forceinline__ void write_rows(T* out, float* acc, int rows, int n, int out_features) {
#pragma unroll
  for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
    if (m >= rows) break;  // (rows is the same for every lane: the warp leaves together)
    float v = acc[m];
    for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
    if (n < out_features && threadIdx.x % 32 == 0) {
      out[static_cast<long long>(m) * out_features + n] = from_float<T>(v);
    }
  }
}

// grid: (ceil(out_features / GEMV_WARPS)), block: (GEMV_WARPS * 32)
// out: [rows, out_features] contiguous; x: [rows, in_features] rows of T (row stride x_stride);
// qs: [out_features, in_features / 2] bytes; scale, zero: [out_features, in_features / 32] of S.
template <typename T, typename S>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    q4_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ qs,
                   const S* __restrict__ scale, const S* __restrict__ zero, int rows,
                   int out_features, int in_features, long long x_stride) {
  const int n = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int groups = in_features / QUANT_GROUP;
  float acc[GEMV_MAX_ROWS] = {};
  if (n < out_features) {  // (no early return: every lane takes part in write_rows' shuffles)
    const long long row = static_cast<long long>(n) * groups;
    for (int g = lane; g < groups; g += 32) {
      float q[QUANT_GROUP];
      unpack_q4(load_vec16(qs + (row + g) * (QUANT_GROUP / 2)), q);
      const float2 sz = q4_scale_zero(scale[row + g], zero[row + g]);
      group_dot<QUANT_GROUP>(acc, q, sz.x, sz.y, x + g * QUANT_GROUP, x_stride, rows);
    }
  }
  write_rows(out, acc, rows, n, out_features);
}

// The same for an 8-bit weight: qs [out_features, in_features] int8, scale [.., groups * sub]
// of S (sub 1 or 2 scales a group).
template <typename T, typename S>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    q8_gemv_kernel(T* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ qs,
                   const S* __restrict__ scale, int sub, int rows, int out_features,
                   int in_features, long long x_stride) {
  const int n = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int groups = in_features / QUANT_GROUP;
  float acc[GEMV_MAX_ROWS] = {};
  if (n < out_features) {
    const long long row = static_cast<long long>(n) * groups;
    for (int g = lane; g < groups; g += 32) {
      float q[QUANT_GROUP];
      const unsigned char* p = qs + (row + g) * QUANT_GROUP;
      unpack_q8(load_vec16(p), load_vec16(p + 16), q);
      const T* xg = x + g * QUANT_GROUP;
      if (sub == 2) {
        const S* s = scale + (row + g) * 2;
        group_dot<QUANT_GROUP / 2>(acc, q, to_float(s[0]), 0.f, xg, x_stride, rows);
        group_dot<QUANT_GROUP / 2>(acc, q + 16, to_float(s[1]), 0.f, xg + 16, x_stride, rows);
      } else {
        group_dot<QUANT_GROUP>(acc, q, to_float(scale[row + g]), 0.f, xg, x_stride, rows);
      }
    }
  }
  write_rows(out, acc, rows, n, out_features);
}

// grid: (ceil(out_features * groups / DEQUANT_THREADS)), block: (DEQUANT_THREADS)
// w: [out_features, in_features] contiguous T, each weight rounded once from float32.
template <typename T, typename S>
__global__ void __launch_bounds__(DEQUANT_THREADS)
    q4_dequant_kernel(T* __restrict__ w, const unsigned char* __restrict__ qs,
                      const S* __restrict__ scale, const S* __restrict__ zero, long long num_groups) {
  const long long g = static_cast<long long>(blockIdx.x) * DEQUANT_THREADS + threadIdx.x;
  if (g >= num_groups) return;
  float q[QUANT_GROUP];
  unpack_q4(load_vec16(qs + g * (QUANT_GROUP / 2)), q);
  const float2 sz = q4_scale_zero(scale[g], zero[g]);
  T* dst = w + g * QUANT_GROUP;
#pragma unroll
  for (int j = 0; j < QUANT_GROUP; ++j) dst[j] = from_float<T>(fmaf(q[j], sz.x, sz.y));
}

template <typename T, typename S>
__global__ void __launch_bounds__(DEQUANT_THREADS)
    q8_dequant_kernel(T* __restrict__ w, const unsigned char* __restrict__ qs,
                      const S* __restrict__ scale, int sub, long long num_groups) {
  const long long g = static_cast<long long>(blockIdx.x) * DEQUANT_THREADS + threadIdx.x;
  if (g >= num_groups) return;
  float q[QUANT_GROUP];
  const unsigned char* p = qs + g * QUANT_GROUP;
  unpack_q8(load_vec16(p), load_vec16(p + 16), q);
  const S* s = scale + g * sub;
  T* dst = w + g * QUANT_GROUP;
#pragma unroll
  for (int j = 0; j < QUANT_GROUP; ++j) dst[j] = from_float<T>(q[j] * to_float(s[j * sub / QUANT_GROUP]));
}

}  // namespace deja
