// Writes the K/V of new tokens into their paged-cache slots.
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

}  // namespace deja
