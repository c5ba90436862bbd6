// Paged prefill attention over a varlen batch: the new tokens of each sequence attend causally to
// the sequence's cached prefix and to each other. Their own K/V must already be in the cache
// (reshape_and_cache runs first), so every key is read through the block table.
//
// Shapes (elements of T unless noted):
//   q:               [num_tokens, num_heads, head_dim], token stride q_stride
//   k/v cache:       [num_blocks, block_size, num_kv_heads, head_dim] (K and V halves of a layer)
//   block_tables:    [num_seqs, max_blocks_per_seq] int32
//   seq_lens:        [num_seqs] int32, context + new tokens
//   query_start_loc: [num_seqs + 1] int32; sequence s owns tokens [qsl[s], qsl[s + 1])
//   out:             [num_tokens, num_heads, head_dim], token stride out_stride
// New token t of sequence s (0-based among its new tokens) sits at position ctx_len + t, with
// ctx_len = seq_len - query_len, and sees keys [0, ctx_len + t].
// Options (0 = off): sliding_window W: token at position p sees keys (p - W, p] only, and a tile
// starts reading at the window of its first token (blocks before it are never read: their table
// entries may be placeholders for released blocks). soft_cap_log2 = softcap * log2(e): scores
// become softcap * tanh(score / softcap) (Gemma 2), applied in the log2 domain.
//
// Grouped-query packing: the G = num_heads / num_kv_heads query heads of one KV head are packed
// into the rows of one tile, row = t * G + head_in_group, so a K/V tile loaded once serves all of
// them. Grid: (ceil(max_query_len * G / BM), num_seqs, num_kv_heads); tiles past a sequence's
// rows exit at once.
//
// Each CTA (128 threads) walks its keys in tiles of BN (flash-attention style): S = Q K^T on CUDA
// cores with a 16 x 8 thread grid (thread (tr, tc) owns rows tr + 16 i and key columns tc + 8 j),
// online softmax per row, P through shared memory, O += P V with the same thread owning rows
// tr + 16 i and dimension pairs 2 (tc + 8 j), 2 (tc + 8 j) + 1.
#include "deja_common.cuh"

namespace deja {

constexpr int PREFILL_THREADS = 128;

// Tile sizes: 64 rows x 32 keys for 16-bit types; fp32 halves both to stay within 48 KB of
// static shared memory (head_dim 128: 42 KB for 16-bit, 35 KB for fp32).
template <typename T>
struct PrefillTile {
  static constexpr int M = 64;
  static constexpr int N = 32;
};
template <>
struct PrefillTile<float> {
  static constexpr int M = 32;
  static constexpr int N = 16;
};

// C: the cache element type, T or fp8e4m3 (staged in shared memory as T, exactly; then
// scale_log2 includes the layer's K scale and v_scale is its V scale; 1 otherwise). With the K
// scale in scale_log2, the soft cap sees q . k_true * softmax_scale * log2(e), as for a T cache.
template <typename T, typename C, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(PREFILL_THREADS)
    paged_prefill_kernel(T* __restrict__ out, const T* __restrict__ q,
                         const C* __restrict__ k_cache, const C* __restrict__ v_cache,
                         const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                         const int* __restrict__ query_start_loc, long long q_stride,
                         long long out_stride, int num_heads, int num_kv_heads,
                         int max_blocks_per_seq, float scale_log2, int sliding_window,
                         float soft_cap_log2, float v_scale) {
  constexpr int BM = PrefillTile<T>::M;
  constexpr int BN = PrefillTile<T>::N;
  constexpr int RM = BM / 16;             // rows per thread
  constexpr int RN = BN / 8;              // key columns per thread
  constexpr int DP = HEAD_DIM / 16;       // output dimension pairs per thread
  constexpr int VEC = Vec16Traits<T>::N;  // elements per 16-byte load
  constexpr int VPR = HEAD_DIM / VEC;     // 16-byte vectors per head_dim row
  // Row stride in shared memory: keeps rows 16-byte aligned and shifts consecutive rows by 4
  // banks, so the 8 rows read together by a warp hit distinct banks.
  constexpr int LD = HEAD_DIM + VEC;
  static_assert(HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16");

  __shared__ __align__(16) T q_s[BM][LD];
  __shared__ __align__(16) T k_s[BN][LD];
  __shared__ __align__(16) T v_s[BN][LD];
  __shared__ float p_s[BM][BN + 1];

  const int seq = blockIdx.y;
  const int kv_head = blockIdx.z;
  const int group_size = num_heads / num_kv_heads;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int row0 = blockIdx.x * BM;  // first packed row of this tile
  if (row0 >= q_len * group_size) return;  // uniform across the CTA
  const int ctx_len = seq_lens[seq] - q_len;
  const int last_tok = min(q_len - 1, (row0 + BM - 1) / group_size);
  const int kv_end = ctx_len + last_tok + 1;  // keys [kv_begin, kv_end) are visible to some row
  const int first_tok = row0 / group_size;
  const int kv_begin = sliding_window > 0 ? max(0, ctx_len + first_tok - sliding_window + 1) : 0;

  const int tid = threadIdx.x;
  const int tr = tid / 8;  // row group: rows tr + 16 i
  const int tc = tid % 8;  // column group: keys tc + 8 j, dimension pairs tc + 8 j

  // Q tile: packed row r -> token (row0 + r) / G of the sequence, head kv_head * G + (row0 + r) % G.
  for (int i = tid; i < BM * VPR; i += PREFILL_THREADS) {
    const int r = i / VPR, c = (i % VPR) * VEC;
    const int packed = row0 + r;
    const int tok = packed / group_size;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (tok < q_len) {
      const int head = kv_head * group_size + packed % group_size;
      val = load_vec16(q + (long long)(q_start + tok) * q_stride + (long long)head * HEAD_DIM + c);
    }
    store_vec16(&q_s[r][c], val);
  }

  // Position of each owned row's token; -1 masks every key for rows past the sequence's tokens.
  // row_low: the row sees keys > row_low (its window; -1 without one).
  int row_pos[RM], row_low[RM];
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int tok = (row0 + tr + 16 * i) / group_size;
    row_pos[i] = tok < q_len ? ctx_len + tok : -1;
    row_low[i] = sliding_window > 0 ? row_pos[i] - sliding_window : -1;
  }
  // Running max (log2 domain), this thread's partial row sum (over its own columns; summed over
  // the 8 column threads at the end) and the unnormalized output.
  float m[RM], l[RM], acc[RM][DP][2];
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    m[i] = neg_inf();
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < DP; ++j) acc[i][j][0] = acc[i][j][1] = 0.f;
  }

  const int* table = block_tables + (long long)seq * max_blocks_per_seq;
  for (int n0 = kv_begin; n0 < kv_end; n0 += BN) {
    __syncthreads();  // q_s is written / the previous tile's k_s, v_s, p_s are consumed

    // K/V tile: key n0 + r lives in block table[key / BLOCK_SIZE] at offset key % BLOCK_SIZE.
    // Keys at or past kv_end are zero-filled (their slots may hold NaN bit patterns).
    for (int i = tid; i < BN * VPR; i += PREFILL_THREADS) {
      const int r = i / VPR, c = (i % VPR) * VEC;
      const int key = n0 + r;
      uint4 kval = make_uint4(0u, 0u, 0u, 0u), vval = kval;
      if (key < kv_end) {
        const long long block_id = table[key / BLOCK_SIZE];
        const long long elem =
            ((block_id * BLOCK_SIZE + key % BLOCK_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + c;
        kval = KVLoad<T, C>::to_vec16(KVLoad<T, C>::load(k_cache + elem));
        vval = KVLoad<T, C>::to_vec16(KVLoad<T, C>::load(v_cache + elem));
      }
      store_vec16(&k_s[r][c], kval);
      store_vec16(&v_s[r][c], vval);
    }
    __syncthreads();

    // S = Q K^T for this thread's RM x RN entries.
    float s[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) s[i][j] = 0.f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += 2) {
      float2 qf[RM], kf[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) qf[i] = load_pair(&q_s[tr + 16 * i][d]);
#pragma unroll
      for (int j = 0; j < RN; ++j) kf[j] = load_pair(&k_s[tc + 8 * j][d]);
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) s[i][j] = fmaf(qf[i].x, kf[j].x, fmaf(qf[i].y, kf[j].y, s[i][j]));
    }

    // Causal (and window) mask + online softmax; the 8 threads sharing a row are 8 consecutive lanes.
#pragma unroll
    for (int i = 0; i < RM; ++i) {
      float tile_max = neg_inf();
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const int key = n0 + tc + 8 * j;
        float x = s[i][j] * scale_log2;
        if (soft_cap_log2 > 0.f) x = soft_cap_log2 * tanhf(x / soft_cap_log2);
        s[i][j] = key <= row_pos[i] && key > row_low[i] ? x : neg_inf();
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      tile_max = group_max<8>(tile_max);
      const float m_new = fmaxf(m[i], tile_max);
      const float m_ref = m_new == neg_inf() ? 0.f : m_new;  // all masked so far: p = 0, no NaN
      const float alpha = exp2f(m[i] - m_ref);
      m[i] = m_new;
      l[i] *= alpha;
#pragma unroll
      for (int j = 0; j < DP; ++j) {
        acc[i][j][0] *= alpha;
        acc[i][j][1] *= alpha;
      }
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const float p = exp2f(s[i][j] - m_ref);
        l[i] += p;
        p_s[tr + 16 * i][tc + 8 * j] = p;
      }
    }
    __syncthreads();

    // O += P V over the tile's keys.
#pragma unroll 4
    for (int c = 0; c < BN; ++c) {
      float p[RM];
#pragma unroll
      for (int i = 0; i < RM; ++i) p[i] = p_s[tr + 16 * i][c];
#pragma unroll
      for (int j = 0; j < DP; ++j) {
        const float2 vf = load_pair(&v_s[c][2 * (tc + 8 * j)]);
#pragma unroll
        for (int i = 0; i < RM; ++i) {
          acc[i][j][0] = fmaf(p[i], vf.x, acc[i][j][0]);
          acc[i][j][1] = fmaf(p[i], vf.y, acc[i][j][1]);
        }
      }
    }
  }

  // Normalize and store the rows that belong to real tokens.
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const float row_sum = group_sum<8>(l[i]);  // all lanes take part before any `continue`
    const int packed = row0 + tr + 16 * i;
    const int tok = packed / group_size;
    if (tok >= q_len) continue;
    const int head = kv_head * group_size + packed % group_size;
    const float inv = v_scale / row_sum;
    T* dst = out + (long long)(q_start + tok) * out_stride + (long long)head * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < DP; ++j)
      store_pair(dst + 2 * (tc + 8 * j), acc[i][j][0] * inv, acc[i][j][1] * inv);
  }
}

}  // namespace deja
