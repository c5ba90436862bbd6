// Quantized linears with 8-bit activations: integer dot products on the CPU (llama.cpp's way).
//
// The weights are cpu_quant.cpp's layouts (4-bit q with scale and zero a group of 32, or 8-bit q
// with a scale). Each row of x is quantized in groups of 32 to int8 over the group's own range
// [lo, hi] (lo = min(x, 0), hi = max(x, 0)): x = dx (xq + c), dx = (hi - lo) / 254, xq in
// -127..127 and an integer offset c (0 where the range is symmetric: dx = max|x| / 127). An
// asymmetric range (a group of mostly one sign, common after the MLP's gate) keeps up to twice
// the resolution of a symmetric one: on the demo's file the teacher-forced log-prob KL to the
// float product is less than half. A group's product is then one integer dot product:
//   4-bit: sum w x = d dx sum(q xq) + d dx c sum(q) + m dx sum(xq + c), with d = scale and
//          m = zero - 8 scale;
//   8-bit: sum w x = d dx sum(q xq) + d dx c sum(q).
// On AVX2 a group is two instructions (u8 x s8 pairs summed to int16, then to int32; one with
// AVX-512 VNNI), against the float path's conversion of every weight, plus the offset's share
// (sum(q) once a group for all rows, then one vpmaddwd a row; 4-bit on AVX2: q's pair sums once
// a group, times c by one vpmullw a row, added to the int16 pairs before their vpmaddwd). A row
// sums its groups in four sets of lanes (two for 2-4 rows) so the FMAs do not wait on each
// other, and reads a weight row's scales once for d dx and the zeros' share; the sums of each 8
// weight rows are folded into 8 outputs at once (no horizontal sum a row). A 4-bit weight at
// 1-4 rows takes eight weight rows a pass instead, a row in each 32-bit lane (rows_q4_lanes): no
// horizontal sums, one conversion and two FMAs (d dx's and the zeros') for eight rows' group.
// It is not the dequantized weight's product: each activation is rounded to 8 bits (as
// llama.cpp rounds them), so it is used only where asked (layers/quantized.py).
// With AVX-512 VNNI, a few rows of a 4-bit weight take four groups a vector, x quantized in
// blocks of four groups, 8-bit weights two (rows_i8_vnni); many rows take a tiled product
// (below) that reads a weight once for all.
// Registered as torch.ops.deja_cpu_attn.q4_linear_i8 and q8_linear_i8; same arguments as
// q4_linear and q8_linear.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 8;  // rows of x a pass over the weight serves

// x's rows quantized: xq int8 [M, K] (or in blocks), per group dx, dx sum(xq + c) and c
// [M, K / 32].
// The few-row product reads Int8Rows::c2: 4-bit groups on AVX2 without VNNI (group_dot).
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kReadsC2 = true;
#else
constexpr bool kReadsC2 = false;
#endif
#if defined(__AVX2__)
constexpr bool kReadsDd = true;  // (rows_i8's AVX2 path; the scalar one multiplies d dx as it goes)
#else
constexpr bool kReadsDd = false;
#endif

// 4-bit weights' few-row product with AVX-512 VNNI takes x in blocks of four groups
// (rows_i8_vnni): a block's 128 bytes hold its groups' first 16 values each, then their last 16.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kBlocks = true;
#else
constexpr bool kBlocks = false;
#endif

struct Int8Rows {
  std::vector<int8_t> q;  // a row is K bytes, or (in blocks) 128 a block of four groups
  std::vector<float> d, sum;
  std::vector<int32_t> c;
  std::vector<int32_t> c2;  // c in both int16 halves (where kReadsC2, else empty)
  std::vector<int8_t> cb;   // in blocks only: c as 16 bytes a group, 64 a block, zeros past K
};

inline int64_t blocks_of(int64_t K) { return (K / kGroup + 3) / 4; }

// One group of 32: x = dx (q + c) with q = round(v / dx) - c (to nearest even, clamped to
// -127..127), dx = (hi - lo) / 254 and c = round(lo / dx) + 127 (within -127..127 too, as
// lo <= 0 <= hi); writes q's first 16 at q and its last 16 at q2, and c; returns dx and sets
// `sum` to dx sum(q + c). (q stays within -127..127: the AVX2 8-bit product negates it, and its
// pairs of products fit int16.)
inline float quantize_group(const float* v, int8_t* q, int8_t* q2, float& sum, int32_t& c) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float lo = std::min(0.f, _mm512_reduce_min_ps(_mm512_min_ps(a, b)));
  const float hi = std::max(0.f, _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
#else
  float lo = 0.f, hi = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) lo = std::min(lo, v[j]), hi = std::max(hi, v[j]);
#endif
  const float range = hi - lo;
  float inv = range > 0.f ? 254.f / range : 0.f;
  if (!std::isfinite(inv)) inv = 0.f;  // (a finite range under ~1e-36: taken as zeros)
  c = inv > 0.f ? static_cast<int32_t>(std::nearbyint(lo * inv)) + 127 : 0;
  int total = 0;
#if defined(__AVX512F__)  // (the default rounding mode: to nearest even, as nearbyint)
  const __m512i off = _mm512_set1_epi32(c), low = _mm512_set1_epi32(-127),
                high = _mm512_set1_epi32(127);
  __m512i qa = _mm512_sub_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))), off);
  __m512i qb = _mm512_sub_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv))), off);
  qa = _mm512_min_epi32(_mm512_max_epi32(qa, low), high);
  qb = _mm512_min_epi32(_mm512_max_epi32(qb, low), high);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q2), _mm512_cvtepi32_epi8(qb));
  total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
  for (int64_t j = 0; j < kGroup; ++j) {
    const int32_t qj = std::clamp(static_cast<int32_t>(std::nearbyint(v[j] * inv)) - c, -127, 127);
    (j < 16 ? q[j] : q2[j - 16]) = static_cast<int8_t>(qj);
    total += qj;
  }
#endif
  // (an inf or NaN range keeps its dx: the products stay inf or NaN, as the float path's do)
  const float dx = inv > 0.f || !std::isfinite(range) ? range / 254.f : 0.f;
  sum = dx * static_cast<float>(total + kGroup * c);
  return dx;
}

// blocked: x's rows in blocks of four groups, and their c as bytes (Int8Rows).
Int8Rows quantize_rows(const at::Tensor& x, int64_t K, bool blocked) {
  const deja_cpu::FloatRows xf = deja_cpu::float_rows(x, K, false);
  const float* src = xf.x;
  const int64_t M = x.size(0), per_row = K / kGroup, groups = M * per_row;
  const int64_t blocks = blocks_of(K);
  Int8Rows r;
  r.q.resize(blocked ? M * blocks * 128 : M * K);
  r.cb.resize(blocked ? M * blocks * 64 : 0);
  r.d.resize(groups);
  r.sum.resize(groups);
  r.c.resize(groups);
  r.c2.resize(kReadsC2 ? groups : 0);
  // (a prefill's rows are worth a second thread; a decode step's few are not)
  at::parallel_for(0, groups, 2048, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (blocked) {  // (group k of block b of a row: b 128 bytes of x and 64 of c bytes)
        const int64_t b = (g / per_row) * blocks + (g % per_row) / 4, k = (g % per_row) % 4;
        int8_t* q = r.q.data() + b * 128 + 16 * k;
        r.d[g] = quantize_group(src + g * kGroup, q, q + 64, r.sum[g], r.c[g]);
        std::memset(r.cb.data() + b * 64 + 16 * k, r.c[g], 16);
      } else {
        int8_t* q = r.q.data() + g * kGroup;
        r.d[g] = quantize_group(src + g * kGroup, q, q + 16, r.sum[g], r.c[g]);
      }
      if constexpr (kReadsC2) {
        r.c2[g] = static_cast<int32_t>((static_cast<uint32_t>(r.c[g]) & 0xffffu) * 0x10001u);
      }
    }
  });
  return r;
}


#if defined(__AVX2__)
// acc + the sum over the 32 products of u8 a and s8 b, as 8 int32 lanes
inline __m256i dot_u8s8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#else
  const __m256i pairs = _mm256_maddubs_epi16(a, b);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// c times each int32 lane of `sums`, lanes and products within int16 / int32 (vpmaddwd: the
// lanes' high halves meet c's, which are 0)
inline __m256i times(__m256i sums, int32_t c) {
  return _mm256_madd_epi16(sums, _mm256_set1_epi32(c & 0xffff));
}

// One group's weights as 32 bytes in x's order: 4-bit as unsigned 0..15 (byte j of the group
// holds weights j and j + 16), 8-bit as they are.
inline __m256i q4_bytes(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
#endif

// A row's group scales d and (4-bit) m as float32, into d and m (m: w = q d + m).
template <bool kQ4, typename sc_t>
inline void row_scales(const sc_t* scale, const sc_t* zero, int64_t groups, float* d, float* m) {
  if constexpr (std::is_same_v<sc_t, float>) {
    for (int64_t g = 0; g < groups; ++g) d[g] = scale[g];
    if constexpr (kQ4) {
      for (int64_t g = 0; g < groups; ++g) m[g] = zero[g] - 8.f * scale[g];
    }
  } else {
    int64_t g = 0;
#if defined(__F16C__)
    for (; g + 8 <= groups; g += 8) {
      _mm256_storeu_ps(d + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g))));
      if constexpr (kQ4) {
        _mm256_storeu_ps(m + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zero + g))));
      }
    }
#endif
    for (; g < groups; ++g) {
      d[g] = static_cast<float>(scale[g]);
      if constexpr (kQ4) m[g] = static_cast<float>(zero[g]);
    }
  }
}

// sum over g of a[g] b[g] (the scalar build's zeros' share; vector builds sum it in lanes)
inline float dot(const float* a, const float* b, int64_t n) {
  float y = 0.f;
  for (int64_t i = 0; i < n; ++i) y += a[i] * b[i];
  return y;
}

#if defined(__AVX2__)
// acc[r] += group g's weights w (32 bytes, x's order) dotted with row r's quantized group plus
// its offset (sum q (xq + c), integer), times dd[r, g] (the weight's d times the row's dx).
// xc2: each group's c in both int16 halves of an int32 (one broadcast load gives 16 copies).
template <int kRows, bool kQ4>
inline void group_dot(__m256 (&acc)[kRows], __m256i w, const int8_t* xq, const int32_t* xc,
                      const int32_t* xc2, const float* dd, int64_t groups, int64_t g) {
  const __m256i wa = kQ4 ? w : _mm256_sign_epi8(w, w);  // |w| for 8-bit: unsigned operand
  const __m256i ones = _mm256_set1_epi8(1);
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
  if constexpr (kQ4) {
    // Without VNNI, in int16 pairs: q's pair sums times c (at most 30 x 127) plus the pairs of
    // q xq (at most 2 x 15 x 127) fit int16, so one vpmaddwd sums both.
    const __m256i qpairs = _mm256_maddubs_epi16(wa, ones);
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int r = 0; r < kRows; ++r) {
      const int64_t at_g = r * groups + g;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + at_g * kGroup));
      const __m256i c16 = _mm256_set1_epi32(xc2[at_g]);
      const __m256i pairs =
          _mm256_add_epi16(_mm256_maddubs_epi16(wa, xv), _mm256_mullo_epi16(qpairs, c16));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones16));
      acc[r] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(dd + at_g), acc[r]);
    }
    return;
  }
#endif
  const __m256i zero = _mm256_setzero_si256();
  const __m256i qsum = dot_u8s8(zero, wa, kQ4 ? ones : _mm256_sign_epi8(ones, w));  // sum(q)
  for (int r = 0; r < kRows; ++r) {
    const int64_t at_g = r * groups + g;
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + at_g * kGroup));
    if constexpr (!kQ4) xv = _mm256_sign_epi8(xv, w);  // x's sign times w's
    const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(times(qsum, xc[at_g]), wa, xv));
    acc[r] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(dd + at_g), acc[r]);
  }
}
#endif

// out[r, n] for weight rows n0..n1 and kRows rows of quantized x.
template <int kRows, bool kQ4, typename sc_t>
void rows_i8(const int8_t* xq, const float* xd, const float* xsum, const int32_t* xc,
             const int32_t* xc2, int64_t K,
             const void* qs, const sc_t* scale, const sc_t* zero, float* out, int64_t ldo,
             int64_t n0, int64_t n1) {
  const int64_t groups = K / kGroup;
  // a row's d and m; on AVX2 also dd = d dx a group and row
  std::vector<float> dm(2 * groups), dd(kReadsDd ? kRows * groups : 0);
  float* const d = dm.data();
  float* const m = d + groups;
#if defined(__AVX2__)
  deja_cpu::fold_rows<8, kRows>(out, ldo, n0, n1, [&](int64_t n, __m256 (&sums)[kRows]) {
    deja_cpu::prefetch_row(qs, kQ4 ? K / 2 : K, scale, kQ4 ? zero : nullptr, groups,
                           n + deja_cpu::kAhead, n1);
    float y[kRows] = {};
    // dd = d dx a group and row, and (4-bit) the zeros' share m dx sum(xq + c) summed in lanes
    // (mz) and past the last 8 groups (y), in one pass over the row's scales
    __m256 mz[kRows];
    for (auto& v : mz) v = _mm256_setzero_ps();
    {
      const sc_t* sc = scale + n * groups;
      const sc_t* zr = kQ4 ? zero + n * groups : nullptr;
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8) {
        __m256 dv, mv = _mm256_setzero_ps();
        if constexpr (std::is_same_v<sc_t, float>) {
          dv = _mm256_loadu_ps(sc + g);
          if constexpr (kQ4) mv = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), dv, _mm256_loadu_ps(zr + g));
        } else {
          dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g)));
          if constexpr (kQ4) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zr + g)));
        }
        for (int r = 0; r < kRows; ++r) {
          _mm256_storeu_ps(dd.data() + r * groups + g, _mm256_mul_ps(dv, _mm256_loadu_ps(xd + r * groups + g)));
          if constexpr (kQ4) mz[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * groups + g), mz[r]);
        }
      }
      if (g < groups) {
        row_scales<kQ4>(sc + g, kQ4 ? zr + g : nullptr, groups - g, d, m);
        for (int r = 0; r < kRows; ++r) {
          for (int64_t j = 0; g + j < groups; ++j) {
            dd[r * groups + g + j] = d[j] * xd[r * groups + g + j];
            if constexpr (kQ4) y[r] += m[j] * xsum[r * groups + g + j];
          }
        }
      }
    }
    // Sets of sums over groups g mod kSets where there are few rows: one set alone would wait
    // on its FMA's latency every group.
    constexpr int kSets = kRows == 1 ? 4 : kRows <= 4 ? 2 : 1;
    __m256 acc[kSets][kRows];
    for (auto& set : acc) {
      for (auto& a : set) a = _mm256_setzero_ps();
    }
    const float* const ddp = dd.data();
    // groups g and g + 1 into the sets `even` and `odd`
    auto pair = [&](int64_t g, __m256 (&even)[kRows], __m256 (&odd)[kRows]) {
      if constexpr (kQ4) {  // two groups a load: their 32 bytes of nibbles unpacked at once
        const uint8_t* row = static_cast<const uint8_t*>(qs) + n * groups * (kGroup / 2);
        const __m256i m15 = _mm256_set1_epi8(15);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 16));
        const __m256i lo = _mm256_and_si256(v, m15);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        group_dot<kRows, kQ4>(even, _mm256_permute2x128_si256(lo, hi, 0x20), xq, xc, xc2, ddp,
                              groups, g);
        group_dot<kRows, kQ4>(odd, _mm256_permute2x128_si256(lo, hi, 0x31), xq, xc, xc2, ddp,
                              groups, g + 1);
      } else {
        const int8_t* row = static_cast<const int8_t*>(qs) + n * groups * kGroup;
        const auto* p = reinterpret_cast<const __m256i*>(row + g * kGroup);
        group_dot<kRows, kQ4>(even, _mm256_loadu_si256(p), xq, xc, xc2, ddp, groups, g);
        group_dot<kRows, kQ4>(odd, _mm256_loadu_si256(p + 1), xq, xc, xc2, ddp, groups, g + 1);
      }
    };
    int64_t g = 0;
    if constexpr (kSets == 4) {
      for (; g + 4 <= groups; g += 4) {
        pair(g, acc[0], acc[1]);
        pair(g + 2, acc[2], acc[3]);
      }
    }
    for (; g + 2 <= groups; g += 2) pair(g, acc[0], acc[kSets - 1]);
    for (; g < groups; ++g) {
      __m256i w;
      if constexpr (kQ4) {
        w = q4_bytes(static_cast<const uint8_t*>(qs) + (n * groups + g) * (kGroup / 2));
      } else {
        w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(qs) + (n * groups + g) * kGroup));
      }
      group_dot<kRows, kQ4>(acc[0], w, xq, xc, xc2, ddp, groups, g);
    }
    for (int r = 0; r < kRows; ++r) {
      __m256 sum = acc[0][r];
      if constexpr (kSets == 4) {
        sum = _mm256_add_ps(_mm256_add_ps(sum, acc[1][r]), _mm256_add_ps(acc[2][r], acc[3][r]));
      } else if constexpr (kSets == 2) {
        sum = _mm256_add_ps(sum, acc[1][r]);
      }
      // (y[r], the groups past the last 8, in lane 0)
      sums[r] = _mm256_add_ps(_mm256_add_ps(sum, mz[r]), _mm256_setr_ps(y[r], 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f));
    }
  });
#else
  for (int64_t n = n0; n < n1; ++n) {
    deja_cpu::prefetch_row(qs, kQ4 ? K / 2 : K, scale, kQ4 ? zero : nullptr, groups,
                           n + deja_cpu::kAhead, n1);
    float y[kRows] = {};
    row_scales<kQ4>(scale + n * groups, kQ4 ? zero + n * groups : nullptr, groups, d, m);
    for (int64_t g = 0; g < groups; ++g) {
      for (int r = 0; r < kRows; ++r) {
        const int64_t at_g = r * groups + g;
        const int8_t* xg = xq + at_g * kGroup;
        int sum = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          int q;
          if constexpr (kQ4) {
            const uint8_t b = static_cast<const uint8_t*>(qs)[(n * groups + g) * 16 + (j & 15)];
            q = j < 16 ? (b & 15) : (b >> 4);
          } else {
            q = static_cast<const int8_t*>(qs)[(n * groups + g) * kGroup + j];
          }
          sum += q * (xg[j] + xc[at_g]);
        }
        y[r] += d[g] * xd[at_g] * static_cast<float>(sum);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      if constexpr (kQ4) y[r] += dot(m, xsum + r * groups, groups);  // + sum of m dx sum(xq + c)
    }
    for (int r = 0; r < kRows; ++r) out[r * ldo + n] = y[r];
  }
#endif
}

#if defined(__AVX2__) && defined(__F16C__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// 4-bit weights, 1-4 rows of x, without VNNI: eight weight rows a pass, weight row n0 + l in
// 32-bit lane l of every vector, so a group ends as one vector of eight rows' integer sums (one
// float conversion and two FMAs for eight rows, and no horizontal sum; rows_i8 takes those a row
// and group). Per group the eight rows' 16 bytes are transposed in registers (vector k, lane
// l: bytes 4k .. 4k + 3 of row l), split into nibbles (weights 4k .. 4k + 3 and 16 + 4k ..
// 16 + 4k + 3) and multiplied against broadcasts of x's 4 matching bytes; the 8 products of u8
// q and s8 xq a lane's int16 half sums stay within 8 x 2 x 15 x 127. The offset's share c sum(q)
// takes sum(q) from the same registers (a byte sums 8 nibbles: at most 120). The group's
// scales are read a block at a time as columns (8 x 8 transposes). Each group's integer sum is
// rows_i8's; the float sum's order differs.
constexpr int64_t kLaneBlock = 8;  // weight rows a pass (one a 32-bit lane)
constexpr int kLaneMaxRows = 4;    // rows of x it takes (more: rows_i8)

// Columns of an 8 x 8 block of floats: c[j] = (r[0][j], ..., r[7][j]).
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// d and m (w = q d + m) of weight rows n .. n + 7 as columns: d[g * 8 + l] of row n + l.
template <typename sc_t>
void scale_columns(const sc_t* scale, const sc_t* zero, int64_t n, int64_t groups, float* d,
                   float* m) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256 dv[8], mv[8];
    for (int l = 0; l < 8; ++l) {
      const int64_t at = (n + l) * groups + g;
      if constexpr (std::is_same_v<sc_t, float>) {
        dv[l] = _mm256_loadu_ps(scale + at);
        mv[l] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), dv[l], _mm256_loadu_ps(zero + at));
      } else {
        dv[l] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + at)));
        mv[l] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zero + at)));
      }
    }
    transpose8(dv);
    transpose8(mv);
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_ps(d + (g + j) * 8, dv[j]);
      _mm256_storeu_ps(m + (g + j) * 8, mv[j]);
    }
  }
  for (; g < groups; ++g) {
    for (int l = 0; l < 8; ++l) {
      row_scales<true>(scale + (n + l) * groups + g, zero + (n + l) * groups + g, 1, d + g * 8 + l,
                       m + g * 8 + l);
    }
  }
}

// out[r, n] for weight rows n0 .. n1 (a multiple of 8 of them) and kRows rows of quantized x
// (rows_i8's arguments but c2).
template <int kRows, typename sc_t>
void rows_q4_lanes(const int8_t* xq, const float* xd, const float* xsum, const int32_t* xc,
                   int64_t K, const uint8_t* qs, const sc_t* scale, const sc_t* zero, float* out,
                   int64_t ldo, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  const int64_t groups = K / kGroup, row_bytes = K / 2;
  std::vector<float> cols(2 * kLaneBlock * groups);
  float* const dcol = cols.data();
  float* const mcol = dcol + kLaneBlock * groups;
  const __m256i m15 = _mm256_set1_epi8(15), ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n += kLaneBlock) {
    // the block two ahead, asked for a group's share at a time (a burst of prefetches at the
    // block's start made a product streamed from memory ~1.7x slower on an AVX2 EPYC)
    const bool ahead = n + 3 * kLaneBlock <= n1;
    const int64_t next = ahead ? n + 2 * kLaneBlock : n;
    const char* wa = reinterpret_cast<const char*>(qs + next * row_bytes);
    const sc_t* sa = scale + next * groups;
    const sc_t* za = zero + next * groups;
    scale_columns(scale, zero, n, groups, dcol, mcol);
    __m256 acc[kRows], mz[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = mz[r] = _mm256_setzero_ps();
    const uint8_t* w = qs + n * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w + g * (kGroup / 2);
      if (ahead) {  // (a block is 128 bytes of weights a group, and 8 scales and zeros)
        _mm_prefetch(wa + g * 128, _MM_HINT_T0);
        _mm_prefetch(wa + g * 128 + 64, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sa + g * 8), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(za + g * 8), _MM_HINT_T0);
      }
      __m256i v[4];
      for (int l = 0; l < 4; ++l) {
        v[l] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + (l + 4) * row_bytes),
                                   reinterpret_cast<const __m128i*>(p + l * row_bytes));
      }
      const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
      const __m256i b[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
      __m256i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm256_and_si256(b[k], m15);
        hi[k] = _mm256_and_si256(_mm256_srli_epi16(b[k], 4), m15);
      }
      const __m256i qsum = _mm256_maddubs_epi16(  // sum(q) of each lane's row, in int16 halves
          _mm256_add_epi8(_mm256_add_epi8(_mm256_add_epi8(lo[0], lo[1]), _mm256_add_epi8(lo[2], lo[3])),
                          _mm256_add_epi8(_mm256_add_epi8(hi[0], hi[1]), _mm256_add_epi8(hi[2], hi[3]))),
          ones8);
      const __m256 dg = _mm256_loadu_ps(dcol + g * 8), mg = _mm256_loadu_ps(mcol + g * 8);
      for (int r = 0; r < kRows; ++r) {
        const int64_t at_g = r * groups + g;
        const int8_t* xg = xq + at_g * kGroup;
        auto x4 = [xg](int at) {
          return _mm256_set1_epi32(*reinterpret_cast<const deja_cpu::unaligned_i32*>(xg + at));
        };
        __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], x4(0)), _mm256_maddubs_epi16(lo[1], x4(4)));
        s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(lo[2], x4(8)),
                                                 _mm256_maddubs_epi16(lo[3], x4(12))));
        s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], x4(16)),
                                                 _mm256_maddubs_epi16(hi[1], x4(20))));
        s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(hi[2], x4(24)),
                                                 _mm256_maddubs_epi16(hi[3], x4(28))));
        const __m256i c = _mm256_set1_epi16(static_cast<int16_t>(xc[at_g]));
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(s, ones16), _mm256_madd_epi16(qsum, c));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                 _mm256_mul_ps(dg, _mm256_broadcast_ss(xd + at_g)), acc[r]);
        mz[r] = _mm256_fmadd_ps(mg, _mm256_broadcast_ss(xsum + at_g), mz[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(out + r * ldo + n, _mm256_add_ps(acc[r], mz[r]));
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 groups' scales (or zeros) from p as float32, ng <= 16 of them there (the rest 0); `more`:
// 16 may be read from p (the tensor goes on). Not a masked load: from weights streamed in from
// memory, masked loads made the product ~4x slower on Zen 5, and a partial copy stalled the load
// that follows it.
template <typename sc_t>
inline __m512 scales16(const sc_t* p, int64_t ng, bool more) {
  alignas(64) sc_t part[16];
  if (ng < 16 && !more) {
    std::memset(static_cast<void*>(part), 0, sizeof(part));
    std::memcpy(static_cast<void*>(part), p, ng * sizeof(sc_t));
    p = part;
  }
  const __mmask16 live = static_cast<__mmask16>(ng >= 16 ? 0xffff : (1u << ng) - 1);
  if constexpr (std::is_same_v<sc_t, float>) {
    return _mm512_maskz_mov_ps(live, _mm512_loadu_ps(p));
  } else {
    return _mm512_maskz_mov_ps(
        live, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
}

// rows_i8 on AVX-512 VNNI. Each 16 groups of a weight row: their d (and for 4-bit weights the
// zeros' share m dx sum(xq + c)) once for all rows; then, per step, a lane's share of
// sum(q (xq + c)) times its group's d dx (vpermps from the 16 groups' worth) goes to the row's
// float sums. Per row and group: the same integer sums as rows_i8; the float sum's order differs.
// - 8-bit weights, two groups a 512-bit vector (a weight row's 64 bytes, in x's order): the
//   weights are the s8 operand against x + 128 as u8, and one vpdpbusd a row gives the pair's 16
//   lanes, each started from its offset's share (c - 128) sum(q) (vpmaddwd of sum(q) against it,
//   as times()).
// - 4-bit weights, four groups a vector with no shuffle, x in blocks (quantize_rows): a weight
//   row's 64 bytes for four groups hold each group's 16 bytes, low nibbles q[0..15] and high
//   nibbles q[16..31]; ANDed with 15 (the high ones after a shift) they are the four groups'
//   first 16 weights in one vector and their last 16 in another, the order x's block has. A
//   row's lane (four a group) sums q xq over both by one vpdpbusd each, and c sum(q) by a third,
//   of (low + high) against the block's c bytes. A row's last block reads past the row's bytes
//   where the weight goes on (x's and c's zeros meet them); at the weight's end it loads only
//   the row's own.
template <int kRows, bool kQ4, typename sc_t>
void rows_i8_vnni(const Int8Rows& x, int64_t m0, int64_t K, const void* qs, const sc_t* scale,
                  const sc_t* zero, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t groups = K / kGroup, row_bytes = kQ4 ? K / 2 : K, blocks = blocks_of(K);
  const float* xd = x.d.data() + m0 * groups;
  const float* xsum = x.sum.data() + m0 * groups;
  const int32_t* xc = x.c.data() + m0 * groups;
  const int8_t* xq = x.q.data() + m0 * (kQ4 ? blocks * 128 : K);
  const int8_t* xcb = kQ4 ? x.cb.data() + m0 * blocks * 64 : nullptr;
  constexpr int kSets = kRows <= 2 ? 2 : 1;  // (one row alone would wait on its FMA's latency)
  constexpr int kStep = kQ4 ? 4 : 2;  // groups a step
  const __m512i m15 = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // a step's lanes: the index of their group among the step's
  const __m512i lanes = kQ4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  deja_cpu::fold_rows<16, kRows>(out, ldo, n0, n1, [&](int64_t n, __m512 (&sums)[kRows]) {
    deja_cpu::prefetch_row(qs, row_bytes, scale, kQ4 ? zero : nullptr, groups, n + deja_cpu::kAhead,
                           n1);
    const uint8_t* wrow = static_cast<const uint8_t*>(qs) + n * row_bytes;
    __m512 acc[kRows][kSets], mz[kRows];
    for (int r = 0; r < kRows; ++r) {
      mz[r] = _mm512_setzero_ps();
      for (auto& a : acc[r]) a = _mm512_setzero_ps();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t ng = std::min<int64_t>(16, groups - g0);
      const __mmask16 live = static_cast<__mmask16>(ng == 16 ? 0xffff : (1u << ng) - 1);
      const bool more = (ldo - n) * groups - g0 >= 16;  // (the scales hold ldo = N rows)
      const __m512 d = scales16(scale + n * groups + g0, ng, more);
      __m512 m = _mm512_setzero_ps();
      if constexpr (kQ4) {
        m = scales16(zero + n * groups + g0, ng, more);
        if constexpr (std::is_same_v<sc_t, float>) m = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), d, m);
      }
      __m512 dd[kRows];
      __m512i cv[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t at = r * groups + g0;
        dd[r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, xd + at));
        if constexpr (kQ4) {
          mz[r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(live, xsum + at), mz[r]);
        } else {
          cv[r] = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(live, xc + at), _mm512_set1_epi32(128));
          cv[r] = _mm512_and_si512(cv[r], _mm512_set1_epi32(0xffff));
        }
      }
      // step i of the 16 groups (kStep of them from g) into set `set` of each row's sums
      auto step = [&](int64_t i, auto set) {
        const int64_t g = g0 + kStep * i;
        const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(kStep * i)));
        __m512i s[kRows];
        if constexpr (kQ4) {
          const uint8_t* p = wrow + g * 16;
          const int64_t left = groups - g;
          const bool whole = (ldo - n) * row_bytes - g * 16 >= 64;  // (the weight: ldo = N rows)
          const __m512i v = whole || left >= 4
                                ? _mm512_loadu_si512(p)
                                : _mm512_maskz_loadu_epi8((__mmask64(1) << (16 * left)) - 1, p);
          const __m512i lo = _mm512_and_si512(v, m15);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
          const __m512i both = _mm512_add_epi8(lo, hi);
          const int64_t at = g / 4;  // (the block's index in a row of x)
          for (int r = 0; r < kRows; ++r) {
            const int8_t* xb = xq + (r * blocks + at) * 128;
            s[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xb));
            s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_loadu_si512(xb + 64));
            const __m512i c = _mm512_loadu_si512(xcb + (r * blocks + at) * 64);
            s[r] = _mm512_dpbusd_epi32(s[r], both, c);
          }
        } else {
          const bool both = g + 1 < g0 + ng;  // (else the row's last group, alone)
          const __mmask64 bytes = both ? ~__mmask64(0) : (__mmask64(1) << 32) - 1;
          // (not masked loads: see scales16)
          const __m512i w = both ? _mm512_loadu_si512(wrow + g * kGroup)
                                 : _mm512_zextsi256_si512(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(wrow + g * kGroup)));
          const __m512i qsum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w);
          for (int r = 0; r < kRows; ++r) {
            const int8_t* xg = xq + (r * groups + g) * kGroup;
            const __m512i xv = both ? _mm512_loadu_si512(xg) : _mm512_maskz_loadu_epi8(bytes, xg);
            const __m512i start = _mm512_madd_epi16(qsum, _mm512_permutexvar_epi32(idx, cv[r]));
            s[r] = _mm512_dpbusd_epi32(start, _mm512_xor_si512(xv, flip), w);
          }
        }
        for (int r = 0; r < kRows; ++r) {
          __m512& a = acc[r][set];
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_permutexvar_ps(idx, dd[r]), a);
        }
      };
      deja_cpu::in_turns<kSets - 1>((ng + kStep - 1) / kStep, step);
    }
    for (int r = 0; r < kRows; ++r) {
      sums[r] = mz[r];
      for (const auto& a : acc[r]) sums[r] = _mm512_add_ps(sums[r], a);
    }
  });
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Many rows of x against a weight: tiles of 16 outputs, one output a vector lane, each group's
// integer dot products by VNNI (vpdpbusd: four u8 times four s8 a lane), every tile's weights
// read once for all rows. A tile's weights are first transposed into that layout (16 bytes of
// each output's group loaded, then unpacked in 128-bit lanes), which pays from a few rows.
// 4-bit weights (0..15) are the u8 operand and x the s8 one; 8-bit weights are the s8 operand
// against x + 128 as u8. A row's integer sums start from its offset's share, (c - 128 for 8-bit)
// sum(q). Per row and output the float sum runs over the groups in order:
//   y = fma(float(sum(q (xq + c))), d dx, y); y = fma(m, dx sum(xq + c), y)   (m: 4-bit only)
// (the few-row kernel sums in lanes of partial products instead, so a row's last bits may
// differ between the two).
// Rows of x from which the tiles are faster than the few-row kernel: an 8-bit tile transposes
// twice the bytes a 4-bit one does.
constexpr int64_t kTileRows = 4, kTileRows8 = 16;

using deja_cpu::unaligned_i32;
// The 16 outputs from n0 of a weight as VNNI operands: w[8 g + c], lane l: the 4 weights of
// output n0 + l at inputs 32 g + 4 c .. 32 g + 4 c + 3; d[g], m[g] and qsum[g] = sum(q), lane
// l: that output's group (w = q d + m). Lanes past the last output: scales 0.
struct Tile {
  std::vector<int32_t> w, qsum;  // 16 lanes a vector
  std::vector<float> d, m, row;  // (row: one output's d and m while packing)
  explicit Tile(int64_t groups)
      : w(16 * 8 * groups), qsum(16 * groups), d(16 * groups), m(16 * groups), row(2 * groups) {}
  __m512i weights(int64_t i) const { return _mm512_loadu_si512(w.data() + 16 * i); }
  void set_weights(int64_t i, __m512i v) { _mm512_storeu_si512(w.data() + 16 * i, v); }
};

using deja_cpu::transpose16;

template <bool kQ4, typename sc_t>
void pack_tile(const void* qs, const sc_t* scale, const sc_t* zero, int64_t groups, int64_t live,
               Tile& t) {
  const int64_t row_bytes = kQ4 ? groups * kGroup / 2 : groups * kGroup;
  const uint8_t* rows[16];  // (a lane past the last output reads the first; its scales are 0)
  for (int l = 0; l < 16; ++l) {
    rows[l] = static_cast<const uint8_t*>(qs) + (l < live ? l : 0) * row_bytes;
  }
  const __m512i m15 = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i v[4];
    __m512i sum = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1);
    if constexpr (kQ4) {
      transpose16(rows, g * kGroup / 2, v);  // byte j of a group: weights j (low nibble), j + 16
      for (int i = 0; i < 4; ++i) {
        const __m512i low = _mm512_and_si512(v[i], m15);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(v[i], 4), m15);
        t.set_weights(8 * g + i, low);
        t.set_weights(8 * g + 4 + i, high);
        sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, low, ones), high, ones);
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        transpose16(rows, g * kGroup + 16 * half, v);
        for (int i = 0; i < 4; ++i) {
          t.set_weights(8 * g + 4 * half + i, v[i]);
          sum = _mm512_dpbusd_epi32(sum, ones, v[i]);
        }
      }
    }
    _mm512_storeu_si512(t.qsum.data() + 16 * g, sum);
  }
  // each output's d and m (row_scales: vector conversions of its groups), into the lanes
  float* d = t.d.data();
  float* m = t.m.data();
  for (int l = 0; l < 16; ++l) {
    float* rd = t.row.data();
    float* rm = rd + groups;
    if (l < live) row_scales<kQ4>(scale + l * groups, kQ4 ? zero + l * groups : nullptr, groups, rd, rm);
    for (int64_t g = 0; g < groups; ++g) {
      d[16 * g + l] = l < live ? rd[g] : 0.f;
      m[16 * g + l] = kQ4 && l < live ? rm[g] : 0.f;
    }
  }
}

// out[r, 0..16) (the lanes in mask) for kRows rows of quantized x against one tile.
template <int kRows, bool kQ4>
void tile_rows(const Tile& t, int64_t groups, const int8_t* xq, const float* xd,
               const float* xsum, const int32_t* xc, int64_t K, float* out, int64_t ldo,
               __mmask16 mask) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[kRows];
    const __m512i qsum = _mm512_loadu_si512(t.qsum.data() + 16 * g);
    for (int r = 0; r < kRows; ++r) {  // (vpmaddwd: c times each lane's sum(q), as times())
      const int32_t c = xc[r * groups + g] - (kQ4 ? 0 : 128);
      sum[r] = _mm512_madd_epi16(qsum, _mm512_set1_epi32(c & 0xffff));
    }
    for (int c = 0; c < 8; ++c) {
      const __m512i w = t.weights(8 * g + c);
      for (int r = 0; r < kRows; ++r) {
        const auto* four = reinterpret_cast<const unaligned_i32*>(xq + r * K + g * kGroup + 4 * c);
        if constexpr (kQ4) {
          // x's 4 bytes as vpdpbusd's broadcast memory operand (GCC does not fold a set1 there)
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum[r]) : "v"(w), "m"(*four));
        } else {  // xq: x + 128 as u8 here (tiled()), the u8 operand
          sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(*four), w);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 d = _mm512_loadu_ps(t.d.data() + 16 * g);
      const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), dd, acc[r]);
      if constexpr (kQ4) {
        const __m512 m = _mm512_loadu_ps(t.m.data() + 16 * g);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

template <bool kQ4, typename sc_t>
void tiled(const Int8Rows& x, int64_t M, int64_t K, const void* qs, const sc_t* scale,
           const sc_t* zero, float* out, int64_t N) {
  const int64_t groups = K / kGroup, tiles = (N + 15) / 16;
  std::vector<int8_t> flipped;  // 8-bit weights are the s8 operand: x + 128 as u8 (sign flipped)
  if constexpr (!kQ4) {
    flipped.resize(x.q.size());
    for (size_t i = 0; i < x.q.size(); ++i) flipped[i] = static_cast<int8_t>(x.q[i] ^ 0x80);
  }
  const int8_t* q = kQ4 ? x.q.data() : flipped.data();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    Tile t(groups);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = 16 * ti, live = std::min<int64_t>(16, N - n0);
      const int64_t at = n0 * groups;
      const auto* w = static_cast<const uint8_t*>(qs) + n0 * (kQ4 ? K / 2 : K);
      pack_tile<kQ4>(w, scale + at, kQ4 ? zero + at : nullptr, groups, live, t);
      const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int8_t* xq = q + m * K;
        const float* xd = x.d.data() + m * groups;
        const float* xs = x.sum.data() + m * groups;
        const int32_t* xc = x.c.data() + m * groups;
        float* o = out + m * N + n0;
        deja_cpu::with_rows<kMaxRows>(M - m, [&](auto rows) {
          tile_rows<decltype(rows)::value, kQ4>(t, groups, xq, xd, xs, xc, K, o, N, mask);
        });
      }
    }
  });
}
#else
constexpr int64_t kTileRows = 0, kTileRows8 = 0;  // (no tiles in this build)
#endif

// M rows of x take the tiled product (else the few-row kernels, whose 4-bit one takes x in
// blocks where VNNI is: quantize_rows).
template <bool kQ4>
constexpr bool takes_tiles(int64_t M) {
  return kTileRows > 0 && M >= (kQ4 ? kTileRows : kTileRows8);
}

template <bool kQ4, typename sc_t>
void product_i8(const Int8Rows& x, int64_t M, int64_t K, const void* qs, const sc_t* scale,
                const sc_t* zero, float* out, int64_t N) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (takes_tiles<kQ4>(M)) {
    tiled<kQ4>(x, M, K, qs, scale, zero, out, N);
    return;
  }
#endif
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      float* om = out + m * N;
      deja_cpu::with_rows<kMaxRows>(M - m, [&](auto rows) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        rows_i8_vnni<decltype(rows)::value, kQ4, sc_t>(x, m, K, qs, scale, zero, om, N, n0,
                                                       n1);
#else
        const int64_t groups = K / kGroup;
        const int8_t* xq = x.q.data() + m * K;
        const float* xd = x.d.data() + m * groups;
        const float* xs = x.sum.data() + m * groups;
        const int32_t* xc = x.c.data() + m * groups;
        const int32_t* xc2 = kReadsC2 ? x.c2.data() + m * groups : nullptr;
        constexpr int kRows = decltype(rows)::value;
        int64_t n = n0;
#if defined(__AVX2__) && defined(__F16C__)
        if constexpr (kQ4 && kRows <= kLaneMaxRows) {  // whole blocks of 8 weight rows
          n = n0 + (n1 - n0) / kLaneBlock * kLaneBlock;
          rows_q4_lanes<kRows>(xq, xd, xs, xc, K, static_cast<const uint8_t*>(qs), scale, zero,
                               om, N, n0, n);
        }
#endif
        if (n < n1) {
          rows_i8<kRows, kQ4, sc_t>(xq, xd, xs, xc, xc2, K, qs, scale, zero, om, N, n, n1);
        }
#endif
      });
    }
  });
}

template <bool kQ4>
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor* zero) {
  const auto [N, K] = deja_cpu::check_weight(qs, kQ4, scale, zero);
  const int64_t M = x.size(0);
  const Int8Rows rows = quantize_rows(x, K, kQ4 && kBlocks && !takes_tiles<kQ4>(M));
  deja_cpu::FloatOut out(x, M, N);
  deja_cpu::with_groups(scale, zero, [&](const auto* s, const auto* z) {
    product_i8<kQ4>(rows, M, K, qs.data_ptr(), s, z, out.dst, N);
  });
  return out.finish();
}

}  // namespace

namespace deja_cpu {

at::Tensor q4_linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                        const at::Tensor& zero) {
  return linear_i8<true>(x, qs, scale, &zero);
}

// A weight whose scales cover 16 weights each (Q6_K) takes the float product.
at::Tensor q8_linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  if (scale.dim() == 2 && qs.dim() == 2 && scale.size(1) * kGroup == 2 * qs.size(1)) {
    return q8_linear(x, qs, scale);
  }
  return linear_i8<false>(x, qs, scale, nullptr);
}

}  // namespace deja_cpu

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  // Rows of x from which q4_linear_i8 takes the tiled product (q8_linear_i8 with one scale a
  // group: from 16 rows); 0: this build has none.
  m.def("linear_i8_tile_rows", []() -> int64_t { return kTileRows; });
  m.def("q4_linear_i8", &deja_cpu::q4_linear_i8);
  m.def("q8_linear_i8", &deja_cpu::q8_linear_i8);
}
