// Paged decode attention: one new query token per sequence attends over its whole context through
// its block table. fp32 accumulation, online softmax in the log2 domain (exp2).
//
// Shapes (elements of T unless noted):
//   q:            [num_seqs, num_heads, head_dim], token stride q_stride
//   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim] (the K and V halves of a layer)
//   block_tables: [num_seqs, max_blocks_per_seq] int32
//   seq_lens:     [num_seqs] int32 (>= 1; includes the new token, whose K/V is already cached)
//   out:          [num_seqs, num_heads, head_dim], token stride out_stride
// Options (0 = off): sliding_window W: the query (at position seq_len - 1) sees only positions
// >= win_start = max(0, seq_len - W); blocks wholly before it are never read (their table entries
// may be placeholders for released blocks). soft_cap_log2 = softcap * log2(e): scores become
// softcap * tanh(score / softcap) (Gemma 2), applied in the log2 domain as
// soft_cap_log2 * tanh(s2 / soft_cap_log2), which is the same.
// Element offset of (slot, kv_head, d) in a K/V half: (slot * num_kv_heads + kv_head) * head_dim + d,
// with slot = block_id * block_size + offset.
//
// Grid: (num_kv_heads * chunks, num_seqs, num_partitions) with chunks = (num_heads / num_kv_heads) /
// QH. One CTA serves QH query heads that share one KV head (grouped-query attention), so each K/V
// byte is read once for all of them. With num_partitions == 1 the CTA covers the whole context and
// writes `out`; otherwise CTA z covers tokens [base + z * partition_size, base + (z + 1) *
// partition_size) and writes unnormalized partial results that paged_decode_reduce_kernel combines
// (split-K). base = 0, or with a window the start of win_start's block (window_base).
//
// Inside a CTA: each warp takes whole cache blocks (warp w: blocks w, w + 4, ...). A warp is split
// into GPW lane groups of TG lanes; a group handles one token at a time, each lane one 16-byte
// slice of head_dim (TG = head_dim / VEC rounded up to a power of two; the extra lanes of
// head_dim 96 idle). Every group keeps its own running max / sum / accumulator; the groups are
// merged through shared memory at the end.
#include "deja_common.cuh"

namespace deja {

constexpr int DECODE_THREADS = 128;
constexpr int DECODE_WARPS = DECODE_THREADS / 32;

// First position the query of a sequence of seq_len tokens sees (0 without a window).
__device__ __forceinline__ int window_start(int seq_len, int sliding_window) {
  return sliding_window > 0 ? max(0, seq_len - sliding_window) : 0;
}

// Where partition 0 starts: the block holding window_start (partitions are block-aligned).
__device__ __forceinline__ int window_base(int seq_len, int sliding_window, int block_size) {
  return window_start(seq_len, sliding_window) / block_size * block_size;
}

// Soft-capped score in the log2 domain (soft_cap_log2 == 0: unchanged).
__device__ __forceinline__ float soft_cap_score(float s, float soft_cap_log2) {
  return soft_cap_log2 > 0.f ? soft_cap_log2 * tanhf(s / soft_cap_log2) : s;
}

// C: the cache element type, T or fp8e4m3 (then scale_log2 includes the layer's K scale and
// v_scale is its V scale; 1 otherwise). The K scale sits in the query's pre-scale, so a score is
// q . k_true * softmax_scale * log2(e) before the soft cap, as for a cache in T.
template <typename T, typename C, int HEAD_DIM, int BLOCK_SIZE, int QH>
__global__ void __launch_bounds__(DECODE_THREADS)
    paged_decode_kernel(T* __restrict__ out, float* __restrict__ part_out,
                        float* __restrict__ part_max, float* __restrict__ part_sum,
                        const T* __restrict__ q, const C* __restrict__ k_cache,
                        const C* __restrict__ v_cache, const int* __restrict__ block_tables,
                        const int* __restrict__ seq_lens, long long q_stride, long long out_stride,
                        int num_heads, int num_kv_heads, int max_blocks_per_seq,
                        int partition_size, float scale_log2, int sliding_window,
                        float soft_cap_log2, float v_scale) {
  constexpr int VEC = Vec16Traits<T>::N;          // elements per 16-byte load
  constexpr int TG = next_pow2(HEAD_DIM / VEC);   // lanes per token
  constexpr int GPW = 32 / TG;                    // tokens a warp reads at once (lane groups)
  constexpr int TPG = BLOCK_SIZE / GPW;           // tokens of one cache block per lane group
  // Tokens per unrolled chunk (K/V loads in flight per lane); fewer for 8 heads to bound registers.
  constexpr int U_MAX = QH >= 8 ? 2 : 4;
  constexpr int U = TPG < U_MAX ? TPG : U_MAX;
  constexpr int NG = DECODE_WARPS * GPW;          // lane groups per CTA
  static_assert(HEAD_DIM % VEC == 0 && TG <= 32, "unsupported head_dim");
  static_assert(BLOCK_SIZE % GPW == 0 && TPG % U == 0, "unsupported block_size");

  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int group_size = num_heads / num_kv_heads;  // query heads per KV head
  const int chunks = group_size / QH;
  const int kv_head = blockIdx.x / chunks;
  const int head0 = kv_head * group_size + (blockIdx.x % chunks) * QH;

  const int seq_len = seq_lens[seq];
  const int win_start = window_start(seq_len, sliding_window);
  // partition_size is a multiple of BLOCK_SIZE, so a partition starts on a block boundary.
  // Partition 0 holds win_start (base <= win_start < base + BLOCK_SIZE), so every partition
  // that runs sees at least one visible token.
  const int start = window_base(seq_len, sliding_window, BLOCK_SIZE) + part * partition_size;
  if (start >= seq_len) return;  // uniform across the CTA; the reducer skips this partition
  const int end = min(seq_len, start + partition_size);
  const int first_block = start / BLOCK_SIZE;
  const int end_block = (end + BLOCK_SIZE - 1) / BLOCK_SIZE;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / TG;        // token slot of this lane within the warp
  const int dim0 = (lane % TG) * VEC;  // first element of this lane's head_dim slice
  const bool active = dim0 < HEAD_DIM;

  // This lane's slice of the QH query vectors, pre-scaled by softmax_scale * log2(e).
  float qv[QH][VEC];
#pragma unroll
  for (int h = 0; h < QH; ++h) {
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (active) raw = load_vec16(q + seq * q_stride + (long long)(head0 + h) * HEAD_DIM + dim0);
    vec16_to_float<T>(raw, qv[h]);
#pragma unroll
    for (int e = 0; e < VEC; ++e) qv[h][e] *= scale_log2;
  }

  // Running softmax state of this lane group: max and sum are identical across its lanes; acc
  // holds this lane's slice of the unnormalized output.
  float m[QH], l[QH], acc[QH][VEC];
#pragma unroll
  for (int h = 0; h < QH; ++h) {
    m[h] = neg_inf();
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[h][e] = 0.f;
  }

  const int* table = block_tables + (long long)seq * max_blocks_per_seq;
  // The next block id is fetched one iteration ahead, so its latency overlaps this block's work.
  long long next_block_id = first_block + warp < end_block ? table[first_block + warp] : 0;
  for (int b = first_block + warp; b < end_block; b += DECODE_WARPS) {
    const long long block_id = next_block_id;
    if (b + DECODE_WARPS < end_block) next_block_id = table[b + DECODE_WARPS];
#pragma unroll
    for (int j0 = 0; j0 < TPG; j0 += U) {
      // Issue all K and V loads of the chunk first; V arrives while the scores are computed.
      uint4 kraw[U], vraw[U];
      bool valid[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int offset = group + GPW * (j0 + u);  // position within the cache block
        const int pos = b * BLOCK_SIZE + offset;
        valid[u] = pos < end && pos >= win_start;
        kraw[u] = vraw[u] = make_uint4(0u, 0u, 0u, 0u);
        // NOTE: slots past the end are never read: they may hold stale or NaN bit patterns.
        if (active && valid[u]) {
          const long long elem =
              ((block_id * BLOCK_SIZE + offset) * num_kv_heads + kv_head) * HEAD_DIM + dim0;
          kraw[u] = KVLoad<T, C>::load(k_cache + elem);
          vraw[u] = KVLoad<T, C>::load(v_cache + elem);
        }
      }

      // s[u][h] = q_h . k_u (log2 domain), summed over the TG lanes of the group.
      float s[U][QH];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float kf[VEC];
        KVLoad<T, C>::to_float(kraw[u], kf);
#pragma unroll
        for (int h = 0; h < QH; ++h) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot = fmaf(qv[h][e], kf[e], dot);
          dot = soft_cap_score(group_sum<TG>(dot), soft_cap_log2);
          s[u][h] = valid[u] ? dot : neg_inf();
        }
      }

      // Online softmax update with the chunk's max; m_ref guards the all-masked case (-inf - -inf).
      float m_ref[QH];
#pragma unroll
      for (int h = 0; h < QH; ++h) {
        float chunk_max = s[0][h];
#pragma unroll
        for (int u = 1; u < U; ++u) chunk_max = fmaxf(chunk_max, s[u][h]);
        const float m_new = fmaxf(m[h], chunk_max);
        m_ref[h] = m_new == neg_inf() ? 0.f : m_new;
        const float alpha = exp2f(m[h] - m_ref[h]);
        m[h] = m_new;
        l[h] *= alpha;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[h][e] *= alpha;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float vf[VEC];
        KVLoad<T, C>::to_float(vraw[u], vf);
#pragma unroll
        for (int h = 0; h < QH; ++h) {
          const float p = exp2f(s[u][h] - m_ref[h]);
          l[h] += p;
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[h][e] = fmaf(p, vf[e], acc[h][e]);
        }
      }
    }
  }

  // Merge the NG lane groups: rescale each to the CTA-wide max, then sum.
  __shared__ float group_max_s[NG][QH];
  __shared__ float group_sum_s[NG][QH];
  __shared__ float cta_max_s[QH];
  __shared__ float cta_sum_s[QH];
  __shared__ float acc_s[NG][QH][HEAD_DIM];
  const int g = warp * GPW + group;
  if (lane % TG == 0) {
#pragma unroll
    for (int h = 0; h < QH; ++h) {
      group_max_s[g][h] = m[h];
      group_sum_s[g][h] = l[h];
    }
  }
  __syncthreads();
  if (threadIdx.x < QH) {
    const int h = threadIdx.x;
    float mx = neg_inf();
    for (int i = 0; i < NG; ++i) mx = fmaxf(mx, group_max_s[i][h]);
    // mx is finite: the partition holds at least one token.
    float sum = 0.f;
    for (int i = 0; i < NG; ++i) sum += group_sum_s[i][h] * exp2f(group_max_s[i][h] - mx);
    cta_max_s[h] = mx;
    cta_sum_s[h] = sum;
  }
  __syncthreads();
  if (active) {
#pragma unroll
    for (int h = 0; h < QH; ++h) {
      const float f = exp2f(m[h] - cta_max_s[h]);  // 0 for a group that saw no token
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc_s[g][h][dim0 + e] = acc[h][e] * f;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < QH * HEAD_DIM; i += DECODE_THREADS) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NG; ++j) sum += acc_s[j][h][d];
    sum *= v_scale;
    if (num_parts == 1) {
      out[seq * out_stride + (long long)(head0 + h) * HEAD_DIM + d] = from_float<T>(sum / cta_sum_s[h]);
    } else {
      // part_*: [num_seqs, num_heads, num_parts(, HEAD_DIM)]
      const long long row = ((long long)seq * num_heads + head0 + h) * num_parts + part;
      part_out[row * HEAD_DIM + d] = sum;
      if (d == 0) {
        part_max[row] = cta_max_s[h];
        part_sum[row] = cta_sum_s[h];
      }
    }
  }
}

// Block-wide reduction over DECODE_THREADS threads; `scratch` holds one float per warp.
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
  x = IS_MAX ? group_max<32>(x) : group_sum<32>(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < DECODE_WARPS; ++w) r = IS_MAX ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

// Combines the split-K partials of paged_decode_kernel:
//   out = sum_p part_out[p] * 2^(part_max[p] - M) / sum_p part_sum[p] * 2^(part_max[p] - M)
// over the partitions p < ceil((seq_len - base) / partition_size), M = max_p part_max[p], base as in
// paged_decode_kernel (window_base).
// Grid: (num_heads, num_seqs), block: DECODE_THREADS.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(DECODE_THREADS)
    paged_decode_reduce_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                               const float* __restrict__ part_max,
                               const float* __restrict__ part_sum,
                               const int* __restrict__ seq_lens, long long out_stride,
                               int num_heads, int num_parts, int partition_size,
                               int sliding_window, int block_size) {
  __shared__ float max_scratch[DECODE_WARPS];
  __shared__ float sum_scratch[DECODE_WARPS];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = seq_lens[seq];
  const int span = seq_len - window_base(seq_len, sliding_window, block_size);
  const int used = (span + partition_size - 1) / partition_size;
  const long long row0 = ((long long)seq * num_heads + head) * num_parts;
  T* dst = out + seq * out_stride + (long long)head * HEAD_DIM;

  float mx = neg_inf();
  for (int p = threadIdx.x; p < used; p += DECODE_THREADS) mx = fmaxf(mx, part_max[row0 + p]);
  mx = block_reduce<true>(mx, max_scratch);
  float sum = 0.f;
  for (int p = threadIdx.x; p < used; p += DECODE_THREADS)
    sum += part_sum[row0 + p] * exp2f(part_max[row0 + p] - mx);
  sum = block_reduce<false>(sum, sum_scratch);
  const float inv = used > 0 ? 1.f / sum : 0.f;

  for (int d = threadIdx.x; d < HEAD_DIM; d += DECODE_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < used; ++p)
      acc = fmaf(part_out[(row0 + p) * HEAD_DIM + d], exp2f(part_max[row0 + p] - mx), acc);
    dst[d] = from_float<T>(acc * inv);
  }
}

}  // namespace deja
