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

// grid: (num_tokens), block: (min(256, row_words) rounded up to a warp)
// k, v:        [num_tokens, row_words] words, token stride k_stride / v_stride (in words)
// k_cache, v_cache: [num_slots, row_words] words (the K and V halves of one layer)
// slot_mapping: [num_tokens] int64; a negative slot is padding and is skipped (so is a slot
//               >= num_slots, which would be out of bounds).
template <typename W>
__global__ void reshape_and_cache_kernel(const W* __restrict__ k, const W* __restrict__ v,
                                         W* __restrict__ k_cache, W* __restrict__ v_cache,
                                         const long long* __restrict__ slot_mapping,
                                         long long num_slots, int row_words, long long k_stride,
                                         long long v_stride) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const W* k_row = k + token * k_stride;
  const W* v_row = v + token * v_stride;
  W* k_dst = k_cache + slot * row_words;
  W* v_dst = v_cache + slot * row_words;
  for (int i = threadIdx.x; i < row_words; i += blockDim.x) {
    k_dst[i] = k_row[i];
    v_dst[i] = v_row[i];
  }
}

// The fp8 cache's write: each element becomes float_to_fp8_e4m3(x * inv_scale) (K and V with
// their own layer scale), one byte per element.
// grid: (num_tokens), block: (min(256, row_elems) rounded up to a warp)
// k, v:        [num_tokens, row_elems] of T, token stride k_stride / v_stride (in elements)
// k_cache, v_cache: [num_slots, row_elems] bytes (the K and V halves of one layer)
template <typename T>
__global__ void reshape_and_cache_fp8_kernel(const T* __restrict__ k, const T* __restrict__ v,
                                             fp8e4m3* __restrict__ k_cache,
                                             fp8e4m3* __restrict__ v_cache,
                                             const long long* __restrict__ slot_mapping,
                                             long long num_slots, int row_elems, long long k_stride,
                                             long long v_stride, float k_inv_scale,
                                             float v_inv_scale) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const T* k_row = k + token * k_stride;
  const T* v_row = v + token * v_stride;
  fp8e4m3* k_dst = k_cache + slot * row_elems;
  fp8e4m3* v_dst = v_cache + slot * row_elems;
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
    k_dst[i].bits = float_to_fp8_e4m3(to_float(k_row[i]) * k_inv_scale);
    v_dst[i].bits = float_to_fp8_e4m3(to_float(v_row[i]) * v_inv_scale);
  }
}

}  // namespace deja
