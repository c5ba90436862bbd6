// Whole-block copies across every layer in one launch.
//
// The model's cache is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
// viewed as words W it is [num_layers * 2, num_blocks, block_words] with
// block_words = block_size * num_kv_heads * head_dim * sizeof(T) / sizeof(W).
// "plane" below is one (layer, K-or-V) pair: plane = layer * 2 + kv, in [0, num_planes).
//
// The copies are dtype-agnostic; the loader picks the widest W dividing block_words' byte size.
#include "deja_common.cuh"

namespace deja {

// copy_blocks: cache[plane, dst[i]] = cache[plane, src[i]] for every plane and pair i.
// grid: (num_pairs, num_planes), block: 256 threads striding over the block's words.
// NOTE: a block id must not be both a source and a destination in one launch, and destinations
// must be distinct (copy-on-write and swap plans satisfy this); the order of copies is undefined.
// Pairs with an id outside [0, num_blocks) are skipped.
template <typename W>
__global__ void copy_blocks_kernel(W* __restrict__ cache, const long long* __restrict__ src,
                                   const long long* __restrict__ dst, long long num_blocks,
                                   long long block_words) {
  const long long pair = blockIdx.x;
  const long long plane = blockIdx.y;
  if (src[pair] < 0 || src[pair] >= num_blocks || dst[pair] < 0 || dst[pair] >= num_blocks) return;
  // Word offset of block b in plane p: (p * num_blocks + b) * block_words.
  const W* from = cache + (plane * num_blocks + src[pair]) * block_words;
  W* to = cache + (plane * num_blocks + dst[pair]) * block_words;
  for (long long i = threadIdx.x; i < block_words; i += blockDim.x) to[i] = from[i];
}

// gather_blocks / scatter_blocks between the cache and a contiguous staging buffer laid out like
// torch's `cache[:, :, ids]`: [num_layers, 2, num_ids, block_size, num_kv_heads, head_dim], i.e.
// words [num_planes, num_ids, block_words].
//   gather  (SCATTER = false): staging[plane, i] = cache[plane, ids[i]]
//   scatter (SCATTER = true):  cache[plane, ids[i]] = staging[plane, i]
// grid: (num_ids, num_planes), block: 256 threads.
template <typename W, bool SCATTER>
__global__ void gather_scatter_blocks_kernel(W* __restrict__ cache, W* __restrict__ staging,
                                             const long long* __restrict__ ids,
                                             long long num_blocks, long long num_ids,
                                             long long block_words) {
  const long long i = blockIdx.x;
  const long long plane = blockIdx.y;
  if (ids[i] < 0 || ids[i] >= num_blocks) return;  // out-of-range ids are skipped, never followed
  W* cache_block = cache + (plane * num_blocks + ids[i]) * block_words;
  W* staging_block = staging + (plane * num_ids + i) * block_words;
  for (long long w = threadIdx.x; w < block_words; w += blockDim.x) {
    if (SCATTER)
      cache_block[w] = staging_block[w];
    else
      staging_block[w] = cache_block[w];
  }
}

}  // namespace deja
