// Paged attention on the CPU, reading K/V in place from the paged cache (deja's CPU fast path).
//
// Cache layout (one layer): kv_cache [2, NB, BS, Hkv, D], index 0 = K, 1 = V; slot s lives at
// block s / BS, offset s % BS. Dtypes: float32 or bfloat16 queries over a cache of the same dtype,
// or over a float8_e4m3fn cache (K / k_scale, V / v_scale, one scale per layer).
//
// Flat batch: sequence i owns query tokens [qsl[i], qsl[i + 1]); its new tokens sit at positions
// [ctx_i, seq_len_i), ctx_i = seq_len_i - query_len_i. Query at position p sees keys k <= p (and
// k > p - window with a sliding window). Keys before the first query's window are never read.
//
// Work item: (sequence, KV head, a chunk of queries, a range of key blocks). The G query heads of
// the KV head and the chunk's queries form R = chunk * G rows that share every K/V block read.
// Per block: each K row is converted to float once and dotted with the R rows (scores R x BS),
// an online softmax (float32) rescales the accumulators, each V row is converted once and added
// to them, weighted. Nothing is copied out of the cache beyond one row at a time (the vector path,
// attend_item_v: one block's rows, converted to float). Few long items (batch-1 decode) are split
// over key-block ranges (flash-decoding) and the partial (max, sum, acc) are merged afterwards.
// OpenMP over items, torch's thread count.
#include "../models/layers/cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlockSize = 64;
constexpr int64_t kRowsPerItem = 48;  // query rows (queries x G) one item aims for
static_assert(kRowsPerItem % 16 == 0, "attend_item_lanes pads an item's rows to whole vectors");
constexpr int64_t kMinBlocksPerPart = 8;  // a split part reads at least this many blocks

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      value[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

// Row of D elements -> float (fp8: the stored code's value, before its layer scale).
inline void load_row(const float* src, float* dst, int64_t d, const float*) {
  std::memcpy(dst, src, d * sizeof(float));
}
inline void load_row(const at::BFloat16* src, float* dst, int64_t d, const float*) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    uint32_t w = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &w, sizeof(f));
    dst[i] = f;
  }
}
inline void load_row(const uint8_t* src, float* dst, int64_t d, const float* lut) {
  for (int64_t i = 0; i < d; ++i) dst[i] = lut[src[i]];
}

inline void store_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }
inline void store_row(const float* src, at::BFloat16* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = at::BFloat16(src[i]);
}

struct Item {
  int64_t seq, head, q0, q1;  // queries [q0, q1) of the sequence (0 = its first new token)
  int64_t b0, b1;             // key blocks [b0, b1) this item reads
  int64_t part;               // index into the partial buffers; -1: writes the output directly
};

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks_cache;
  int64_t max_blocks;  // row stride of block_tables
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t window;  // 0: none
  float scale, soft_cap, k_scale, v_scale;  // soft_cap 0: none; scales 1 unless fp8
  const int32_t* block_tables;
  const int32_t* qsl;
  const int32_t* seq_lens;
};

// An item's geometry: its rows (queries x G), its sequence's context and where its key blocks
// are. Rows r = (query j - q0) * G + g.
struct Span {
  int64_t G, R, qstart, ctx, last_key;  // keys [.., last_key) can be visible
  int64_t tok_stride, v_offset;         // a token's stride in a block of one head; V's offset
  const int32_t* table;
  Span(const Problem& p, const Item& it, int64_t D)
      : G(p.group),
        R((it.q1 - it.q0) * p.group),
        qstart(p.qsl[it.seq]),
        ctx(p.seq_lens[it.seq] - (p.qsl[it.seq + 1] - p.qsl[it.seq])),
        last_key(std::min<int64_t>(p.seq_lens[it.seq], ctx + it.q1)),
        tok_stride(p.num_kv_heads * D),
        v_offset(p.num_blocks_cache * p.block_size * tok_stride),
        table(p.block_tables + it.seq * p.max_blocks) {}
  // block b's keys the item may see (<= 0: past its last)
  int64_t keys(const Problem& p, int64_t b) const {
    return std::min(p.block_size, last_key - b * p.block_size);
  }
  // block b's K row of the item's head for its first key (V: + v_offset)
  template <typename cache_t>
  const cache_t* k_rows(const Problem& p, const Item& it, const cache_t* cache, int64_t b,
                        int64_t D) const {
    return cache + (static_cast<int64_t>(table[b]) * p.block_size) * tok_stride + it.head * D;
  }
  // Row r's visible keys [lo, hi) of the nk keys from key0, their scores s soft-capped; false
  // (s all 0) where it sees none of them.
  bool row_keys(const Problem& p, const Item& it, int64_t r, int64_t key0, int64_t nk, float* s,
                int64_t& lo, int64_t& hi) const {
    const int64_t pos = ctx + it.q0 + r / G;
    hi = std::min(nk, pos - key0 + 1);
    lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - key0) : 0;
    if (hi <= lo) {
      std::fill(s, s + nk, 0.0f);
      return false;
    }
    if (p.soft_cap > 0.0f) {
      for (int64_t t = lo; t < hi; ++t) s[t] = p.soft_cap * std::tanh(s[t] / p.soft_cap);
    }
    return true;
  }
};

// The item's R query rows into qrows [R, D] as float, times scale * k_scale (the true scores);
// acc, m and l reset.
template <typename scalar_t>
void start_item(const Problem& p, const Item& it, const Span& sp, const scalar_t* q, int64_t D,
                float* qrows, float* acc, float* m, float* l) {
  const float qmul = p.scale * p.k_scale;
  for (int64_t j = it.q0; j < it.q1; ++j) {
    for (int64_t g = 0; g < sp.G; ++g) {
      const scalar_t* src = q + (sp.qstart + j) * p.q_stride_t + (it.head * sp.G + g) * p.q_stride_h;
      float* dst = qrows + ((j - it.q0) * sp.G + g) * D;
      load_row(src, dst, D, nullptr);
      for (int64_t d = 0; d < D; ++d) dst[d] *= qmul;
    }
  }
  for (int64_t r = 0; r < sp.R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
  }
  std::fill(acc, acc + sp.R * D, 0.0f);
}

// Online softmax of a block's scores [R, BS] for every row: row_max(s, lo, hi) gives the max of
// a row's visible scores, row_exp(s, lo, hi, m_new) writes e^(s - m_new) over the row's nk keys (0
// where hidden) and returns their sum; m, l and the row's acc are brought up to date. Returns
// whether any row sees a key of the block.
template <typename MaxFn, typename ExpFn>
bool softmax_block(const Problem& p, const Item& it, const Span& sp, int64_t key0, int64_t nk,
                   float* scores, int64_t D, float* acc, float* m, float* l, MaxFn row_max,
                   ExpFn row_exp) {
  bool any = false;
  for (int64_t r = 0; r < sp.R; ++r) {
    float* s = scores + r * p.block_size;
    int64_t lo, hi;
    if (!sp.row_keys(p, it, r, key0, nk, s, lo, hi)) continue;
    any = true;
    const float m_new = std::max(m[r], row_max(s, lo, hi));
    const float alpha = std::exp(m[r] - m_new);  // 0 when m[r] is -inf
    l[r] = l[r] * alpha + row_exp(s, lo, hi, m_new);
    m[r] = m_new;
    if (alpha != 1.0f) {
      float* a = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    }
  }
  return any;
}

// Attends one item's rows over its key blocks; leaves unnormalised acc, running max m, sum l.
// kD: the head dim as a compile-time constant (64, 128), or 0 for any (p.head_dim).
template <int64_t kD, typename scalar_t, typename cache_t>
void attend_item(const Problem& p, const Item& it, const scalar_t* q, const cache_t* cache,
                 float* acc, float* m, float* l) {
  const int64_t D = kD > 0 ? kD : p.head_dim;
  const int64_t BS = p.block_size;
  const Span sp(p, it, D);
  const int64_t R = sp.R, tok_stride = sp.tok_stride;
  const float* lut = fp8_table().value;
  alignas(64) float qrows[kRowsPerItem * kMaxHeadDim];  // [R, D], R <= kRowsPerItem
  start_item(p, it, sp, q, D, qrows, acc, m, l);

  alignas(64) float row[kMaxHeadDim];
  alignas(64) float scores[kRowsPerItem * kMaxBlockSize];  // [R, BS]
  for (int64_t b = it.b0; b < it.b1; ++b) {
    const int64_t key0 = b * BS, nk = sp.keys(p, b);
    if (nk <= 0) break;
    const cache_t* kblk = sp.k_rows(p, it, cache, b, D);
    const cache_t* vblk = kblk + sp.v_offset;
    // scores[r][t] = q_r . k_t: each K row is converted once and dotted with every row
    for (int64_t t = 0; t < nk; ++t) {
      load_row(kblk + t * tok_stride, row, D, lut);
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qrows + r * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * row[d];
        scores[r * BS + t] = dot;
      }
    }
    // online softmax per row; probabilities left in scores, 0 outside the row's visible keys
    const bool any = softmax_block(
        p, it, sp, key0, nk, scores, D, acc, m, l,
        [](const float* s, int64_t lo, int64_t hi) {
          float mx = kNegInf;
          for (int64_t t = lo; t < hi; ++t) mx = std::max(mx, s[t]);
          return mx;
        },
        [nk](float* s, int64_t lo, int64_t hi, float m_new) {
          float sum = 0.0f;
          for (int64_t t = 0; t < nk; ++t) {
            const float e = (t >= lo && t < hi) ? std::exp(s[t] - m_new) : 0.0f;
            s[t] = e;
            sum += e;
          }
          return sum;
        });
    if (!any) continue;
    // acc[r] += p[r][t] * v_t: each V row is converted once and added to every row
    for (int64_t t = 0; t < nk; ++t) {
      load_row(vblk + t * tok_stride, row, D, lut);
      for (int64_t r = 0; r < R; ++r) {
        const float pt = scores[r * BS + t];
        float* a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += pt * row[d];
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The same item in vectors, for a float32 or bfloat16 cache and a head dim of 64 or 128: a K / V
// block is converted to float once (a float32 cache is read in place), the scores of W keys at a
// time are W vectors of partial sums reduced together (a transpose of their lanes), the softmax
// runs W keys a vector (Lanes::exp_neg), and a row's accumulator stays in registers across a
// block's V rows. The next block's K and V rows are asked for ahead. Summation order differs
// from attend_item's; exp_neg is within ~2 ulp of std::exp.

// e^r for |r| <= ln 2 / 2 (and a little beyond): its Taylor polynomial of degree 7, the
// remainder under 6e-9 relative; then 2^n times it (Lanes::exp_neg).
template <typename L>
inline typename L::F exp_poly(typename L::F r) {
  typename L::F p = L::set1(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = L::fma(p, r, L::set1(c));
  }
  return p;
}
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts

// The vector lanes attend_item_v runs on: AVX-512 (16 floats a vector) or AVX2 (8); an op whose
// intrinsics differ only in their prefix is written once (DEJA_PS).
#if defined(__AVX512F__)
#define DEJA_PS(op) _mm512_##op##_ps
#else
#define DEJA_PS(op) _mm256_##op##_ps
#endif
struct Lanes {
#if defined(__AVX512F__)
  static constexpr int W = 16;
  using F = __m512;
  using Mask = __mmask16;
#else
  static constexpr int W = 8;
  using F = __m256;
  using Mask = __m256;  // (all ones in the lanes it holds)
#endif
  static F zero() { return DEJA_PS(setzero)(); }
  static F set1(float v) { return DEJA_PS(set1)(v); }
  static F load(const float* p) { return DEJA_PS(loadu)(p); }
  static void store(float* p, F v) { DEJA_PS(storeu)(p, v); }
  static F add(F a, F b) { return DEJA_PS(add)(a, b); }
  static F sub(F a, F b) { return DEJA_PS(sub)(a, b); }
  static F mul(F a, F b) { return DEJA_PS(mul)(a, b); }
  static F top(F a, F b) { return DEJA_PS(max)(a, b); }
  static F fma(F a, F b, F c) { return DEJA_PS(fmadd)(a, b, c); }
  static F fnma(F a, F b, F c) { return DEJA_PS(fnmadd)(a, b, c); }  // c - a b
  // v's lanes combined by `both` (4 lanes with 4)
  template <typename Op>
  static float fold_lanes(F v, Op both) {
#if defined(__AVX512F__)
    __m128 s = both(both(_mm512_castps512_ps128(v), _mm512_extractf32x4_ps(v, 1)),
                    both(_mm512_extractf32x4_ps(v, 2), _mm512_extractf32x4_ps(v, 3)));
#else
    __m128 s = both(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
#endif
    s = both(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(both(s, _mm_movehdup_ps(s)));
  }
  static float sum(F v) { return fold_lanes(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }); }
  static float max(F v) { return fold_lanes(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }); }
  // lanes i with lo <= t0 + i < hi
  static Mask within(int64_t t0, int64_t lo, int64_t hi) {
    const auto at = [](int64_t v) { return static_cast<int32_t>(v); };
#if defined(__AVX512F__)
    const __m512i t = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                       _mm512_set1_epi32(at(t0)));
    return _mm512_cmpge_epi32_mask(t, _mm512_set1_epi32(at(lo))) &
           _mm512_cmplt_epi32_mask(t, _mm512_set1_epi32(at(hi)));
#else
    const __m256i t = _mm256_add_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(at(t0)));
    const __m256i above = _mm256_cmpgt_epi32(t, _mm256_set1_epi32(at(lo - 1)));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(at(hi)), t);
    return _mm256_castsi256_ps(_mm256_and_si256(above, below));
#endif
  }
  // lanes where a <= b (a > b), and both masks
#if defined(__AVX512F__)
  static Mask le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static Mask gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask both(Mask a, Mask b) { return a & b; }
#else
  static Mask le(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  static Mask gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
#endif
  // v where m holds, else other
  static F keep(Mask m, F v, F other) {
#if defined(__AVX512F__)
    return _mm512_mask_mov_ps(other, m, v);
#else
    return _mm256_blendv_ps(other, v, m);
#endif
  }
  // lanes [0, n) to p
  static void store_first(float* p, F v, int64_t n) {
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, static_cast<Mask>(n >= W ? 0xffff : (1u << n) - 1), v);
#else
    if (n >= W) return store(p, v);
    alignas(32) float lanes[W];  // (not a masked store: slow on AMD)
    store(lanes, v);
    std::memcpy(p, lanes, n * sizeof(float));
#endif
  }
  // W bfloat16 as float
  static F bf16(const at::BFloat16* p) {
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#endif
  }
  // e^x for x <= 0: 2^n e^r with n = round(x log2 e), r = x - n ln 2 (exp_poly). Below the
  // floor, 0 or a denormal (AVX-512: scalef), or 2^-126 e^r, ~1e-38 (AVX2, the exponent's bits):
  // the callers' hidden lanes are set to 0 after.
  static F exp_neg(F x) {
#if defined(__AVX512F__)
    constexpr float kFloor = -104.0f;
#else
    constexpr float kFloor = -87.0f;
#endif
    x = top(x, set1(kFloor));
#if defined(__AVX512F__)
    const F n = _mm512_roundscale_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const F n = _mm256_round_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const F r = fnma(n, set1(kLn2Lo), fnma(n, set1(kLn2Hi), x));
#if defined(__AVX512F__)
    return _mm512_scalef_ps(exp_poly<Lanes>(r), n);
#else
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return mul(exp_poly<Lanes>(r), _mm256_castsi256_ps(e));
#endif
  }
  // W vectors of partial sums -> one vector of their W totals: lane i holds the total of the p[j]
  // with kFold[j] == i (a caller that puts key kFold[j] in p[j] gets key i's score in lane i).
#if defined(__AVX512F__)
  static constexpr const int (&kFold)[16] = deja_cpu::kFold16;
  static F fold(const F (&p)[16]) { return deja_cpu::fold16(p); }
#else
  static constexpr int kFold[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  static F fold(const F (&p)[8]) {
    F a[4], b[2];
    for (int i = 0; i < 4; ++i) {  // low half: p[2i]'s halves summed; high half: p[2i + 1]'s
      a[i] = add(_mm256_permute2f128_ps(p[2 * i], p[2 * i + 1], 0x20),
                 _mm256_permute2f128_ps(p[2 * i], p[2 * i + 1], 0x31));
    }
    for (int i = 0; i < 2; ++i) b[i] = add(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    return add(_mm256_shuffle_ps(b[0], b[1], 0x44), _mm256_shuffle_ps(b[0], b[1], 0xEE));
  }
#endif
};
#undef DEJA_PS

// Rows [0, n) of a K or V block as float [n, kD] rows `stride` apart: a float32 cache's own
// memory, a bfloat16 one converted into buf.
template <int64_t kD>
inline const float* block_rows(const float* src, int64_t, int64_t tok_stride, float*, int64_t& stride) {
  stride = tok_stride;
  return src;
}
template <int64_t kD>
inline const float* block_rows(const at::BFloat16* src, int64_t n, int64_t tok_stride, float* buf,
                               int64_t& stride) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < kD; c += Lanes::W) Lanes::store(buf + t * kD + c, Lanes::bf16(src + t * tok_stride + c));
  }
  stride = kD;
  return buf;
}

// Every cache line of rows [0, n) of a block of one head (`bytes` each, tok_stride apart).
template <typename cache_t>
inline void prefetch_block(const cache_t* src, int64_t n, int64_t tok_stride, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(src + t * tok_stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// Every cache line of block b's K and V rows of the item's head, ahead of their use.
// NOTE: one build of this as a plain `inline` helper ran decode attention 1.7x slower (48
// sequences x 192 tokens, 30 layers: ~18.5 against ~11 ms a step, on Zen 5) though no call was
// left in its code; this one measured level with the loops written out. Time the decode
// attention after changing the block loops.
template <typename cache_t>
__attribute__((always_inline)) inline void prefetch_kv(const Problem& p, const Item& it,
                                                       const Span& sp, const cache_t* cache,
                                                       int64_t b, int64_t D, int64_t row_bytes) {
  const cache_t* k = sp.k_rows(p, it, cache, b, D);
  prefetch_block(k, sp.keys(p, b), sp.tok_stride, row_bytes);
  prefetch_block(k + sp.v_offset, sp.keys(p, b), sp.tok_stride, row_bytes);
}

template <int64_t kD, typename scalar_t, typename cache_t>
void attend_item_v(const Problem& p, const Item& it, const scalar_t* q, const cache_t* cache,
                   float* acc, float* m, float* l) {
  using L = Lanes;
  using F = L::F;
  constexpr int W = L::W;
  constexpr int64_t kC = kD / W;                    // vectors a row
  constexpr int64_t kCV = kC < 8 ? kC : 8;          // of them a V pass keeps in registers
  const int64_t BS = p.block_size;
  const Span sp(p, it, kD);
  const int64_t R = sp.R, tok_stride = sp.tok_stride;
  const int64_t row_bytes = kD * static_cast<int64_t>(sizeof(cache_t));
  alignas(64) float qrows[kRowsPerItem * kD];
  start_item(p, it, sp, q, kD, qrows, acc, m, l);

  alignas(64) float kbuf[kMaxBlockSize * kD], vbuf[kMaxBlockSize * kD];
  alignas(64) float zeros[kD] = {};
  alignas(64) float scores[kRowsPerItem * kMaxBlockSize + W];  // [R, BS] (+ a vector's reach)
  for (int64_t b = it.b0; b < it.b1; ++b) {
    const int64_t key0 = b * BS, nk = sp.keys(p, b);
    if (nk <= 0) break;
    const cache_t* kblk = sp.k_rows(p, it, cache, b, kD);
    const cache_t* vblk = kblk + sp.v_offset;
    if (b + 1 < it.b1) prefetch_kv(p, it, sp, cache, b + 1, kD, row_bytes);
    int64_t ks = 0, vs = 0;
    const float* krows = block_rows<kD>(kblk, nk, tok_stride, kbuf, ks);
    // scores[r][t] = q_r . k_t, W keys a pass (keys past nk: a row of zeros)
    for (int64_t t0 = 0; t0 < nk; t0 += W) {
      const float* kp[W];
      for (int j = 0; j < W; ++j) {
        const int64_t t = t0 + L::kFold[j];
        kp[j] = t < nk ? krows + t * ks : zeros;
      }
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qrows + r * kD;
        F part[W];
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) part[j] = L::mul(L::load(qr), L::load(kp[j]));
#pragma GCC unroll 16
        for (int64_t c = 1; c < kC; ++c) {
          const F qv = L::load(qr + W * c);
#pragma GCC unroll 16
          for (int j = 0; j < W; ++j) part[j] = L::fma(qv, L::load(kp[j] + W * c), part[j]);
        }
        L::store_first(scores + r * BS + t0, L::fold(part), nk - t0);
      }
    }
    // online softmax per row, W keys a vector; probabilities left in scores (0 where hidden); a
    // vector may reach past the row's nk keys: those lanes are hidden, never stored
    const F hidden = L::set1(kNegInf);
    const bool any = softmax_block(
        p, it, sp, key0, nk, scores, kD, acc, m, l,
        [nk, hidden](const float* s, int64_t lo, int64_t hi) {
          F top = hidden;
          for (int64_t t0 = 0; t0 < nk; t0 += W) {
            top = L::top(top, L::keep(L::within(t0, lo, hi), L::load(s + t0), hidden));
          }
          return L::max(top);
        },
        [nk, hidden](float* s, int64_t lo, int64_t hi, float m_new) {
          const F mv = L::set1(m_new);
          F total = L::zero();
          for (int64_t t0 = 0; t0 < nk; t0 += W) {
            const L::Mask seen = L::within(t0, lo, hi);
            const F x = L::keep(seen, L::load(s + t0), hidden);
            const F e = L::keep(seen, L::exp_neg(L::sub(x, mv)), L::zero());
            L::store_first(s + t0, e, nk - t0);
            total = L::add(total, e);
          }
          return L::sum(total);
        });
    if (!any) continue;
    // acc[r] += p[r][t] v_t, kCV vectors of the row's accumulator in registers over the block
    const float* vrows = block_rows<kD>(vblk, nk, tok_stride, vbuf, vs);
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = scores + r * BS;
      for (int64_t c0 = 0; c0 < kC; c0 += kCV) {
        float* a = acc + r * kD + W * c0;
        F av[kCV];
#pragma GCC unroll 16
        for (int64_t c = 0; c < kCV; ++c) av[c] = L::load(a + W * c);
        for (int64_t t = 0; t < nk; ++t) {
          const F pt = L::set1(pr[t]);
          const float* v = vrows + t * vs + W * c0;
#pragma GCC unroll 16
          for (int64_t c = 0; c < kCV; ++c) av[c] = L::fma(pt, L::load(v + W * c), av[c]);
        }
#pragma GCC unroll 16
        for (int64_t c = 0; c < kCV; ++c) L::store(a + W * c, av[c]);
      }
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Rows of an item from which attend_item_lanes takes it: prefill chunks (and the decode rows of
// a KV head with W or more query heads); fewer stay with attend_item_v.
constexpr int64_t kLaneRows = Lanes::W;
constexpr int64_t kLaneGroups = (kRowsPerItem + Lanes::W - 1) / Lanes::W;  // W-row groups at most

// acc[r] += sum over t < nk of p[t][r] v_t for kRows rows from r0 (p: [nk, ldp] key-major;
// v_t = v + t vs; acc: [.., kD]), the rows' accumulators in registers over the block, each V
// vector read once for them.
template <int64_t kD, int kRows>
inline void add_values(const float* p, int64_t ldp, const float* v, int64_t vs, int64_t nk,
                       float* acc) {
  using L = Lanes;
  using F = L::F;
  constexpr int W = L::W;
  constexpr int64_t kC = kD / W;
  constexpr int64_t kV = kC < 4 ? kC : 4;  // vectors of a row a pass keeps (kRows x kV sums)
  for (int64_t c0 = 0; c0 < kC; c0 += kV) {
    F av[kRows][kV];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < kV; ++c) av[r][c] = L::load(acc + r * kD + W * (c0 + c));
    }
    for (int64_t t = 0; t < nk; ++t) {
      F vt[kV];
#pragma GCC unroll 8
      for (int64_t c = 0; c < kV; ++c) vt[c] = L::load(v + t * vs + W * (c0 + c));
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const F pt = L::set1(p[t * ldp + r]);
#pragma GCC unroll 8
        for (int64_t c = 0; c < kV; ++c) av[r][c] = L::fma(pt, vt[c], av[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < kV; ++c) L::store(acc + r * kD + W * (c0 + c), av[r][c]);
    }
  }
}

// One W-row group's scores for keys [t0, t0 + kKeys) of a block: s[t] = the group's rows' dot
// products with key t (a vector of W rows), from qt [kD, W] (the rows transposed) and the keys'
// float rows; kKeys independent FMA chains over d.
template <int64_t kD, int kKeys>
inline void group_scores(const float* qt, const float* krows, int64_t ks, int64_t t0, float* s) {
  using L = Lanes;
  using F = L::F;
  F acc[kKeys];
#pragma GCC unroll 8
  for (int j = 0; j < kKeys; ++j) acc[j] = L::zero();
  for (int64_t d = 0; d < kD; ++d) {
    const F qv = L::load(qt + d * L::W);
#pragma GCC unroll 8
    for (int j = 0; j < kKeys; ++j) acc[j] = L::fma(qv, L::set1(krows[(t0 + j) * ks + d]), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < kKeys; ++j) L::store(s + (t0 + j) * L::W, acc[j]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBf16Dots = true;  // a bfloat16 cache's scores by vdpbf16ps (group_scores_bf16)
#else
constexpr bool kBf16Dots = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// group_scores for bfloat16 rows and keys: qt2 [kD / 2, 16] holds the rows' pairs of values
// (d, d + 1) as 32-bit lanes; a key's pairs are read from its cache row (`k`, `ks` apart) and
// broadcast; each vdpbf16ps adds two exact products into float32 sums, which are then scaled by
// `mul` (the softmax scale: the rows stay as stored).
template <int64_t kD, int kKeys>
inline void group_scores_bf16(const uint32_t* qt2, const at::BFloat16* k, int64_t ks, int64_t t0,
                              float mul, float* s) {
  __m512 acc[kKeys];
#pragma GCC unroll 8
  for (int j = 0; j < kKeys; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kD; d += 2) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt2 + (d / 2) * 16);
#pragma GCC unroll 8
    for (int j = 0; j < kKeys; ++j) {
      const auto* pair = reinterpret_cast<const deja_cpu::unaligned_i32*>(k + (t0 + j) * ks + d);
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_set1_epi32(*pair));
    }
  }
  const __m512 scale = _mm512_set1_ps(mul);
#pragma GCC unroll 8
  for (int j = 0; j < kKeys; ++j) _mm512_storeu_ps(s + (t0 + j) * 16, _mm512_mul_ps(acc[j], scale));
}

// A block's nk V rows (`stride` apart) as pairs of keys for vdpbf16ps: vp[t / 2][d], a 32-bit
// lane holding (v_t[d], v_t+1[d]) (a missing last key: 0).
template <int64_t kD>
inline void pair_values(const at::BFloat16* v, int64_t nk, int64_t stride, uint32_t* vp) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < nk; t += 2) {
    for (int64_t c = 0; c < kD; c += 32) {
      const __m512i a = _mm512_loadu_si512(v + t * stride + c);
      const __m512i b = t + 1 < nk ? _mm512_loadu_si512(v + (t + 1) * stride + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (t / 2) * kD + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + (t / 2) * kD + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Each row's probabilities of two keys as one bf16 pair: pp[lane] = (e0[lane], e1[lane]), rounded
// to nearest even (as torch's flash attention rounds its probabilities for a bf16 V product).
inline __m512i prob_pairs(__m512 e0, __m512 e1) {
  const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
  const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
  return _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
}

// add_values with bf16 pairs: acc[r] += sum over key pairs of pp[t / 2][r] . vp[t / 2] for kRows
// rows (pp: [pairs, ldp] from prob_pairs; vp from pair_values; acc: [.., kD] float32).
template <int64_t kD, int kRows>
inline void add_values_bf16(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t pairs,
                            float* acc) {
  constexpr int64_t kC = kD / 16, kV = kC < 4 ? kC : 4;
  for (int64_t c0 = 0; c0 < kC; c0 += kV) {
    __m512 av[kRows][kV];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < kV; ++c) av[r][c] = _mm512_loadu_ps(acc + r * kD + 16 * (c0 + c));
    }
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh vt[kV];
#pragma GCC unroll 8
      for (int64_t c = 0; c < kV; ++c) vt[c] = (__m512bh)_mm512_loadu_si512(vp + t * kD + 16 * (c0 + c));
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[t * ldp + r]));
#pragma GCC unroll 8
        for (int64_t c = 0; c < kV; ++c) av[r][c] = _mm512_dpbf16_ps(av[r][c], pr, vt[c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < kV; ++c) _mm512_storeu_ps(acc + r * kD + 16 * (c0 + c), av[r][c]);
    }
  }
}
#endif

// The same item with its query rows in the vector lanes, W rows a vector, for items of many rows
// (prefill chunks; no soft cap): the rows are transposed once; a key's scores for W rows are one
// vector (FMAs over d, the key's values broadcast); the online softmax runs W rows at once,
// without horizontal sums; the probabilities are stored key-major for the V pass (add_values).
// Summation order differs from attend_item_v's; exp_neg is within ~2 ulp of std::exp.
template <int64_t kD, typename scalar_t, typename cache_t>
void attend_item_lanes(const Problem& p, const Item& it, const scalar_t* q, const cache_t* cache,
                       float* acc, float* m, float* l) {
  using L = Lanes;
  using F = L::F;
  constexpr int W = L::W;
  const int64_t BS = p.block_size;
  const Span sp(p, it, kD);
  const int64_t R = sp.R, groups = (R + W - 1) / W, Rp = groups * W;
  const int64_t tok_stride = sp.tok_stride;
  const int64_t row_bytes = kD * static_cast<int64_t>(sizeof(cache_t));
  // With bf16 dot products (a bfloat16 cache and queries): qt2[g][d / 2][lane], a row's pair of
  // values (d, d + 1) as stored, and the K and V rows read as stored; otherwise qt[g][d][lane],
  // row g W + lane's d-th value times the scale (start_item's qrows). Rows past R: 0. pos: a
  // row's position (past R: -1, sees no key; exact as a float below 2^24). m, l past R: scratch
  // (the callers' arrays hold kRowsPerItem rows). The buffers a path does not use take 1 float.
  constexpr bool kDots =
      kBf16Dots && std::is_same_v<cache_t, at::BFloat16> && std::is_same_v<scalar_t, at::BFloat16>;
  constexpr int64_t kFloats = kDots ? 1 : 0;  // (0: full size)
  alignas(64) float qrows[kFloats ? kFloats : kRowsPerItem * kD];
  if constexpr (kDots) {
    std::fill(acc, acc + R * kD, 0.0f);
  } else {
    start_item(p, it, sp, q, kD, qrows, acc, m, l);
  }
  alignas(64) float qt[kFloats ? kFloats : kLaneGroups * kD * W];
  alignas(64) uint32_t qt2[kDots ? kLaneGroups * kD / 2 * W : 1];
  alignas(64) float pos[kLaneGroups * W];
  for (int64_t r = 0; r < Rp; ++r) {
    if constexpr (kDots) {
      const deja_cpu::unaligned_i32* row = nullptr;
      if (r < R) {
        row = reinterpret_cast<const deja_cpu::unaligned_i32*>(
            q + (sp.qstart + it.q0 + r / sp.G) * p.q_stride_t + (it.head * sp.G + r % sp.G) * p.q_stride_h);
      }
      for (int64_t d = 0; d < kD; d += 2) {
        qt2[((r / W) * kD / 2 + d / 2) * W + r % W] = r < R ? static_cast<uint32_t>(row[d / 2]) : 0u;
      }
    } else {
      for (int64_t d = 0; d < kD; ++d) qt[((r / W) * kD + d) * W + r % W] = r < R ? qrows[r * kD + d] : 0.0f;
    }
    pos[r] = r < R ? static_cast<float>(sp.ctx + it.q0 + r / sp.G) : -1.0f;
    m[r] = kNegInf;
    l[r] = 0.0f;
  }
  alignas(64) float kbuf[kFloats ? kFloats : kMaxBlockSize * kD];
  alignas(64) float vbuf[kFloats ? kFloats : kMaxBlockSize * kD];
  alignas(64) float s[kMaxBlockSize * W];  // one group's scores [t, W]
  alignas(64) float probs[kFloats ? kFloats : kMaxBlockSize * kRowsPerItem];  // [t, Rp]
  alignas(64) uint32_t pp[kDots ? kMaxBlockSize / 2 * kRowsPerItem : 1];  // bf16 pairs [t / 2, Rp]
  alignas(64) uint32_t vp[kDots ? kMaxBlockSize / 2 * kD : 1];            // pair_values
  alignas(64) float alpha[kRowsPerItem];
  const F hidden = L::set1(kNegInf);
  const F window = L::set1(static_cast<float>(p.window));
  for (int64_t b = it.b0; b < it.b1; ++b) {
    const int64_t key0 = b * BS, nk = sp.keys(p, b);
    if (nk <= 0) break;
    const cache_t* kblk = sp.k_rows(p, it, cache, b, kD);
    const cache_t* vblk = kblk + sp.v_offset;
    if (b + 1 < it.b1) prefetch_kv(p, it, sp, cache, b + 1, kD, row_bytes);
    int64_t ks = 0, vs = 0;
    const float* krows = kDots ? nullptr : block_rows<kD>(kblk, nk, tok_stride, kbuf, ks);
    bool any = false;
    for (int64_t g = 0; g < groups; ++g) {
      int64_t t0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      if constexpr (kDots) {
        const float mul = p.scale * p.k_scale;
        const uint32_t* qg = qt2 + g * kD / 2 * W;
        for (; t0 + 8 <= nk; t0 += 8) group_scores_bf16<kD, 8>(qg, kblk, tok_stride, t0, mul, s);
        for (; t0 < nk; ++t0) group_scores_bf16<kD, 1>(qg, kblk, tok_stride, t0, mul, s);
      }
#endif
      for (; t0 + 8 <= nk; t0 += 8) group_scores<kD, 8>(qt + g * kD * W, krows, ks, t0, s);
      for (; t0 < nk; ++t0) group_scores<kD, 1>(qt + g * kD * W, krows, ks, t0, s);
      // key key0 + t is visible to a row at pos where key <= pos (and pos - window < key)
      const F at = L::load(pos + g * W);
      const auto visible = [&](int64_t t) {
        const F key = L::set1(static_cast<float>(key0 + t));
        const L::Mask causal = L::le(key, at);
        return p.window > 0 ? L::both(causal, L::gt(key, L::sub(at, window))) : causal;
      };
      F top = hidden;
      for (int64_t t = 0; t < nk; ++t) top = L::top(top, L::keep(visible(t), L::load(s + t * W), hidden));
      const F m_old = L::load(m + g * W);
      const F m_new = L::top(m_old, top);
      const F base = L::keep(L::gt(m_new, hidden), m_new, L::zero());  // (-inf: no key yet)
      const F a = L::keep(L::gt(m_old, hidden), L::exp_neg(L::sub(m_old, base)), L::zero());
      F total = L::zero();
      const auto prob = [&](int64_t t) {
        return L::keep(visible(t), L::exp_neg(L::sub(L::load(s + t * W), base)), L::zero());
      };
      if constexpr (kDots) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        for (int64_t t = 0; t < nk; t += 2) {
          const F e0 = prob(t), e1 = t + 1 < nk ? prob(t + 1) : L::zero();
          _mm512_storeu_si512(pp + (t / 2) * Rp + g * W, prob_pairs(e0, e1));
          total = L::add(total, L::add(e0, e1));
        }
#endif
      } else {
        for (int64_t t = 0; t < nk; ++t) {
          const F e = prob(t);
          L::store(probs + t * Rp + g * W, e);
          total = L::add(total, e);
        }
      }
      any = any || L::max(top) > kNegInf;
      L::store(l + g * W, L::fma(L::load(l + g * W), a, total));
      L::store(m + g * W, m_new);
      L::store(alpha + g * W, a);
    }
    for (int64_t r = 0; r < R; ++r) {  // the rows' accumulators rescaled to their new max
      if (alpha[r] == 1.0f) continue;
      const F a = L::set1(alpha[r]);
      for (int64_t c = 0; c < kD; c += W) L::store(acc + r * kD + c, L::mul(L::load(acc + r * kD + c), a));
    }
    if (!any) continue;
    constexpr int kPV = kD / W >= 8 ? 2 : 4;  // rows a V pass takes (registers: kPV x 4 sums)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if constexpr (kDots) {
      pair_values<kD>(vblk, nk, tok_stride, vp);
      for (int64_t r0 = 0; r0 < R; r0 += kPV) {
        deja_cpu::with_rows<kPV>(R - r0, [&](auto rows) {
          add_values_bf16<kD, decltype(rows)::value>(pp + r0, Rp, vp, (nk + 1) / 2, acc + r0 * kD);
        });
      }
      continue;
    }
#endif
    const float* vrows = block_rows<kD>(vblk, nk, tok_stride, vbuf, vs);
    for (int64_t r0 = 0; r0 < R; r0 += kPV) {
      deja_cpu::with_rows<kPV>(R - r0, [&](auto rows) {
        add_values<kD, decltype(rows)::value>(probs + r0, Rp, vrows, vs, nk, acc + r0 * kD);
      });
    }
  }
}
#endif

template <typename scalar_t, typename cache_t>
void attend_any(const Problem& p, const Item& it, const scalar_t* q, const cache_t* cache,
                float* acc, float* m, float* l) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (!std::is_same_v<cache_t, uint8_t>) {
    if ((it.q1 - it.q0) * p.group >= kLaneRows && p.soft_cap == 0.0f) {
      if (p.head_dim == 64) return attend_item_lanes<64>(p, it, q, cache, acc, m, l);
      if (p.head_dim == 128) return attend_item_lanes<128>(p, it, q, cache, acc, m, l);
    }
    if (p.head_dim == 64) return attend_item_v<64>(p, it, q, cache, acc, m, l);
    if (p.head_dim == 128) return attend_item_v<128>(p, it, q, cache, acc, m, l);
  }
#endif
  if (p.head_dim == 64) attend_item<64>(p, it, q, cache, acc, m, l);
  else if (p.head_dim == 128) attend_item<128>(p, it, q, cache, acc, m, l);
  else attend_item<0>(p, it, q, cache, acc, m, l);
}

// out rows of one item (or of a merged split item): acc / l * v_scale, in the output dtype.
template <typename scalar_t>
void write_rows(const Problem& p, const Item& it, const float* acc, const float* l, scalar_t* out) {
  const int64_t D = p.head_dim, G = p.group;
  const int64_t qstart = p.qsl[it.seq];
  alignas(64) float row[kMaxHeadDim];
  for (int64_t j = it.q0; j < it.q1; ++j) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (j - it.q0) * G + g;
      const float inv = l[r] > 0.0f ? p.v_scale / l[r] : 0.0f;
      for (int64_t d = 0; d < D; ++d) row[d] = acc[r * D + d] * inv;
      store_row(row, out + (qstart + j) * p.out_stride_t + (it.head * G + g) * p.out_stride_h, D);
    }
  }
}

template <typename scalar_t, typename cache_t>
void run(const Problem& p, const std::vector<Item>& items, int64_t num_parts,
         const std::vector<std::vector<int64_t>>& merges, const scalar_t* q, const cache_t* cache,
         scalar_t* out) {
  const int64_t D = p.head_dim;
  const int64_t max_rows = kRowsPerItem;
  std::vector<float> part_acc(num_parts * max_rows * D), part_ml(num_parts * max_rows * 2);
  const int threads = std::max(1, at::get_num_threads());
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> acc(max_rows * D), m(max_rows), l(max_rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Item& it = items[i];
      if (it.part < 0) {
        attend_any(p, it, q, cache, acc.data(), m.data(), l.data());
        write_rows(p, it, acc.data(), l.data(), out);
      } else {
        float* ml = part_ml.data() + it.part * max_rows * 2;
        attend_any(p, it, q, cache, part_acc.data() + it.part * max_rows * D, ml, ml + max_rows);
      }
    }
    // merge split items: parts of one (seq, head, queries) in merges[k]
    const int64_t nm = static_cast<int64_t>(merges.size());
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < nm; ++k) {
      const Item& first = items[merges[k][0]];
      const int64_t R = (first.q1 - first.q0) * p.group;
      for (int64_t r = 0; r < R; ++r) {
        float mx = kNegInf;
        for (int64_t idx : merges[k]) mx = std::max(mx, part_ml[items[idx].part * max_rows * 2 + r]);
        float sum = 0.0f;
        float* a = acc.data() + r * D;
        std::fill(a, a + D, 0.0f);
        for (int64_t idx : merges[k]) {
          const int64_t pi = items[idx].part;
          const float pm = part_ml[pi * max_rows * 2 + r];
          if (pm == kNegInf) continue;
          const float w = std::exp(pm - mx);
          sum += w * part_ml[pi * max_rows * 2 + max_rows + r];
          const float* pa = part_acc.data() + (pi * max_rows + r) * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * pa[d];
        }
        l[r] = sum;
      }
      write_rows(p, first, acc.data(), l.data(), out);
    }
  }
}

// Work items of the batch, splitting long ones over key blocks when there are too few items.
void plan_items(const Problem& p, const std::vector<int64_t>& seqs, std::vector<Item>& items,
                int64_t& num_parts, std::vector<std::vector<int64_t>>& merges) {
  const int64_t chunk = std::max<int64_t>(1, kRowsPerItem / p.group);
  struct Chunk { int64_t seq, q0, q1, b0, b1; };
  std::vector<Chunk> spans;
  for (int64_t s : seqs) {
    const int64_t qlen = p.qsl[s + 1] - p.qsl[s];
    const int64_t ctx = p.seq_lens[s] - qlen;
    for (int64_t q0 = 0; q0 < qlen; q0 += chunk) {
      const int64_t q1 = std::min(qlen, q0 + chunk);
      const int64_t first_key = p.window > 0 ? std::max<int64_t>(0, ctx + q0 - p.window + 1) : 0;
      const int64_t end_key = std::min<int64_t>(p.seq_lens[s], ctx + q1);
      spans.push_back({s, q0, q1, first_key / p.block_size,
                       (end_key + p.block_size - 1) / p.block_size});
    }
  }
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t base = static_cast<int64_t>(spans.size()) * p.num_kv_heads;
  num_parts = 0;
  for (const Chunk& sp : spans) {
    const int64_t nb = sp.b1 - sp.b0;
    int64_t parts = 1;
    if (base < 2 * threads) {
      parts = std::min<int64_t>((2 * threads + base - 1) / base, nb / kMinBlocksPerPart);
      parts = std::max<int64_t>(parts, 1);
    }
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      if (parts == 1) {
        items.push_back({sp.seq, h, sp.q0, sp.q1, sp.b0, sp.b1, -1});
        continue;
      }
      std::vector<int64_t> group;
      for (int64_t k = 0; k < parts; ++k) {
        group.push_back(static_cast<int64_t>(items.size()));
        items.push_back({sp.seq, h, sp.q0, sp.q1, sp.b0 + nb * k / parts,
                         sp.b0 + nb * (k + 1) / parts, num_parts++});
      }
      merges.push_back(std::move(group));
    }
  }
}

}  // namespace

// out: [T, Hq, D] (rows past the last sequence's queries are left as they are);
// q: [T, Hq, D]; kv_cache: [2, NB, BS, Hkv, D]; block_tables [S, MB], query_start_loc [S + 1],
// seq_lens [S]: int32, CPU; seq_index [S'] int64: the sequences to attend (empty: all; the
// others' rows are left as they are). window 0: none; soft_cap 0: none; k/v scales: fp8, else 1.
void deja_cpu::paged_attention(at::Tensor out, at::Tensor q, at::Tensor kv_cache,
                               at::Tensor block_tables, at::Tensor query_start_loc,
                               at::Tensor seq_lens, at::Tensor seq_index, double scale,
                               int64_t window, double soft_cap, double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, Hq, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out rows must be dense");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, NB, BS, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out dtypes differ");
  const auto qt = q.scalar_type(), ct = kv_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(ct == qt || ct == at::kFloat8_e4m3fn, "kv_cache must be q's dtype or float8_e4m3fn");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1 && t->device().is_cpu(),
                "metadata tensors must be int32 CPU tensors with dense rows");
  }
  TORCH_CHECK(block_tables.dim() == 2 && query_start_loc.dim() == 1 && seq_lens.dim() == 1);
  Problem p;
  p.num_heads = q.size(1);
  p.num_kv_heads = kv_cache.size(3);
  p.head_dim = q.size(2);
  TORCH_CHECK(p.num_heads % p.num_kv_heads == 0 && kv_cache.size(4) == p.head_dim, "head shapes");
  TORCH_CHECK(p.head_dim <= kMaxHeadDim, "head_dim > ", kMaxHeadDim);
  p.group = p.num_heads / p.num_kv_heads;
  TORCH_CHECK(p.group <= kRowsPerItem, "more than ", kRowsPerItem, " query heads per KV head");
  p.block_size = kv_cache.size(2);
  TORCH_CHECK(p.block_size <= kMaxBlockSize, "block_size > ", kMaxBlockSize);
  p.num_blocks_cache = kv_cache.size(1);
  p.max_blocks = block_tables.stride(0);
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.out_stride_t = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.qsl = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) >= num_seqs);
  TORCH_CHECK(p.qsl[num_seqs] <= q.size(0), "query_start_loc runs past q");

  std::vector<Item> items;
  std::vector<std::vector<int64_t>> merges;
  int64_t num_parts = 0;
  std::vector<int64_t> seqs;
  if (seq_index.numel() == 0) {
    for (int64_t i = 0; i < num_seqs; ++i) seqs.push_back(i);
  } else {
    TORCH_CHECK(seq_index.scalar_type() == at::kLong && seq_index.is_contiguous(), "seq_index");
    const int64_t* idx = seq_index.data_ptr<int64_t>();
    for (int64_t i = 0; i < seq_index.numel(); ++i) {
      TORCH_CHECK(idx[i] >= 0 && idx[i] < num_seqs, "seq_index out of range");
      seqs.push_back(idx[i]);
    }
  }
  plan_items(p, seqs, items, num_parts, merges);
  const bool fp8 = ct == at::kFloat8_e4m3fn;
  if (qt == at::kFloat) {
    const float* qd = q.data_ptr<float>();
    float* od = out.data_ptr<float>();
    if (fp8) run(p, items, num_parts, merges, qd, static_cast<const uint8_t*>(kv_cache.data_ptr()), od);
    else run(p, items, num_parts, merges, qd, kv_cache.data_ptr<float>(), od);
  } else {
    const at::BFloat16* qd = q.data_ptr<at::BFloat16>();
    at::BFloat16* od = out.data_ptr<at::BFloat16>();
    if (fp8) run(p, items, num_parts, merges, qd, static_cast<const uint8_t*>(kv_cache.data_ptr()), od);
    else run(p, items, num_parts, merges, qd, kv_cache.data_ptr<at::BFloat16>(), od);
  }
}

TORCH_LIBRARY(deja_cpu_attn, m) {
  m.def("paged_attention", &deja_cpu::paged_attention);
}
