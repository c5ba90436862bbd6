// The CPU kernels' entry points, declared for one another: cpu_decoder.cpp runs a decoder's
// layer stack over them in one call. Each is also a torch op (torch.ops.deja_cpu_attn.<name>);
// the .cpp files that define them document their layouts.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

namespace deja_cpu {

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
