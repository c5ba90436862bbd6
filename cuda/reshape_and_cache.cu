// Writes the K/V of new tokens into their paged-cache slots (an fp8 cache: quantized, below).
//
// Cache layout of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
// Within the K (or V) half, slot s = block * block_size + offset starts at element
// s * num_kv_heads * head_dim, so the block size drops out: a token's whole [num_kv_heads, head_dim]
// row is one contiguous run at slot * row_words words.
//
// The copy is dtype-agnostic: it moves machine words W (16, 8, 4 or 2 bytes). The loader picks the
// widest W that divides the row size, the token strides and the base addresses.
#include "deja_common.cuh"

namespace deja {

// The write of one token (the thread block's): `store(k_dst, v_dst, k_src, v_src)` for each of
// the row's `row` elements, from the token's K and V rows into its slot's; nothing for a negative
// slot (padding) or a slot >= num_slots (which would be out of bounds).
// k, v:        [num_tokens, row] of S, token stride k_stride / v_stride (in elements of S)
// k_cache, v_cache: [num_slots, row] of D (the K and V halves of one layer)
// slot_mapping: [num_tokens] int64
template <typename S, typename D, typename Store>
__device__ __forceinline__ void write_token_rows(const S* __restrict__ k, const S* __restrict__ v,
                                                 D* __restrict__ k_cache, D* __restrict__ v_cache,
                                                 const long long* __restrict__ slot_mapping,
                                                 long long num_slots, int row, long long k_stride,
                                                 long long v_stride, Store store) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const S* k_row = k + token * k_stride;
  const S* v_row = v + token * v_stride;
  D* k_dst = k_cache + slot * row;
  D* v_dst = v_cache + slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) store(k_dst[i], v_dst[i], k_row[i], v_row[i]);
}

// grid: (num_tokens), block: (min(256, row_words) rounded up to a warp)
// k, v:        [num_tokens, row_words] words, token stride k_stride / v_stride (in words)
// k_cache, v_cache: [num_slots, row_words] words
template <typename W>
__global__ void reshape_and_cache_kernel(const W* __restrict__ k, const W* __restrict__ v,
                                         W* __restrict__ k_cache, W* __restrict__ v_cache,
                                         const long long* __restrict__ slot_mapping,
                                         long long num_slots, int row_words, long long k_stride,
                                         long long v_stride) {
  write_token_rows(k, v, k_cache, v_cache, slot_mapping, num_slots, row_words, k_stride, v_stride,
                   [](W& k_dst, W& v_dst, W k_src, W v_src) {
                     k_dst = k_src;
                     v_dst = v_src;
                   });
}

// The fp8 cache's write: each element becomes float_to_fp8_e4m3(x * inv_scale) (K and V with
// their own layer scale), one byte per element.
// grid: (num_tokens), block: (min(256, row_elems) rounded up to a warp)
// k, v:        [num_tokens, row_elems] of T, token stride k_stride / v_stride (in elements)
// k_cache, v_cache: [num_slots, row_elems] bytes
template <typename T>
__global__ void reshape_and_cache_fp8_kernel(const T* __restrict__ k, const T* __restrict__ v,
                                             fp8e4m3* __restrict__ k_cache,
                                             fp8e4m3* __restrict__ v_cache,
                                             const long long* __restrict__ slot_mapping,
                                             long long num_slots, int row_elems, long long k_stride,
                                             long long v_stride, float k_inv_scale,
                                             float v_inv_scale) {
  write_token_rows(k, v, k_cache, v_cache, slot_mapping, num_slots, row_elems, k_stride, v_stride,
                   [=](fp8e4m3& k_dst, fp8e4m3& v_dst, T k_src, T v_src) {
                     k_dst.bits = float_to_fp8_e4m3(to_float(k_src) * k_inv_scale);
                     v_dst.bits = float_to_fp8_e4m3(to_float(v_src) * v_inv_scale);
                   });
}

}  // namespace deja
