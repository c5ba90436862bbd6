// The CPU kernels' entry points, declared for one another: cpu_decoder.cpp runs a decoder's
// layer stack over them in one call. Each is also a torch op (torch.ops.deja_cpu_attn.<name>);
// the .cpp files that define them document their layouts.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <tuple>
#include <utility>

namespace deja_cpu {

// Weight rows a product asks the memory for ahead of the row it multiplies: a row is a few
// cache lines, and the hardware prefetchers alone left a 2-core Xeon (Sapphire Rapids-class, in
// a VM) streaming weights at a third of its read rate.
constexpr int64_t kAhead = 8;

// Row n of a kept weight (`bytes` of qs a row; every cache line it touches) and the first line
// of its `per_row` scales (and zeros), if n < end (the rows a caller owns).
template <typename sc_t>
inline void prefetch_row(const void* qs, int64_t bytes, const sc_t* scale, const sc_t* zero,
                         int64_t per_row, int64_t n, int64_t end) {
  if (n >= end) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(qs) + n * bytes;
  for (uintptr_t line = first & ~uintptr_t(63); line < first + bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(scale + n * per_row), _MM_HINT_T0);
  if (zero != nullptr) _mm_prefetch(reinterpret_cast<const char*>(zero + n * per_row), _MM_HINT_T0);
}

// f(const sc_t* scale, const sc_t* zero) with a kept weight's group scales' storage type, float
// or c10::Half (zero null where absent: 8-bit weights).
template <typename F>
void with_groups(const at::Tensor& scale, const at::Tensor* zero, F f) {
  if (scale.scalar_type() == at::kHalf) {
    f(scale.data_ptr<c10::Half>(), zero == nullptr ? nullptr : zero->data_ptr<c10::Half>());
  } else {
    f(scale.data_ptr<float>(), zero == nullptr ? nullptr : zero->data_ptr<float>());
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h,
                                                const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// A kept weight's (N, K), after checking its qs (4-bit: contiguous uint8 [N, K / 2]; 8-bit:
// contiguous int8 [N, K]; K a multiple of 32) and its group scales and zeros (each a contiguous
// [N, K / 32], float32 or float16, both of one dtype; zero null for 8-bit, whose scales may cover
// 16 weights each instead: [N, K / 16]).
std::pair<int64_t, int64_t> check_weight(const at::Tensor& qs, bool q4, const at::Tensor& scale,
                                         const at::Tensor* zero);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& zero);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale);
at::Tensor q4_linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                        const at::Tensor& zero);
at::Tensor q8_linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor seq_index,
                     double scale, int64_t window, double soft_cap, double k_scale,
                     double v_scale);

}  // namespace deja_cpu
