// Quantized linears on the CPU: a weight kept in 4-bit or 8-bit groups of 32 inputs, multiplied
// without a dense copy for a few rows (decode) and expanded once per call for many (prefill).
//
// Built into the same library as the paged-attention kernel (engine/worker/attention/cpu_kernel.py
// compiles every source with -march=native); registered as torch.ops.deja_cpu_attn.q4_linear,
// q8_linear, q4_dequant and q8_dequant. layers/quantized.py owns the layouts:
// - 4-bit: qs uint8 [N, K / 2], 16 bytes a group; byte j of a group holds weight j in its low
//   nibble and weight j + 16 in its high one (GGUF's Q4_0 / Q4_1 block order); with scale and
//   zero float32 [N, K / 32], a weight is (q - 8) * scale + zero. Where the file's own fp16 pair
//   is exact, scale and zero are float16 d and m instead, and a weight is q * d + m: each row's
//   pairs become scale = d, zero = m + 8d in float32 as the row is read (the same bits as that
//   sum made at load), for 20 bytes a group instead of 24.
// - 8-bit: qs int8 [N, K], scale float32 or float16 [N, K / 32]; a weight is q * scale (GGUF's
//   Q8_0). A scale may instead cover 16 weights ([N, K / 16]: GGUF's Q6_K, whose sub-blocks of
//   16 each have their own; q is the 6-bit value minus 32).
//
// The few-row product reads each weight byte once for all rows (at most 8 at a time with
// AVX-512, 4 with AVX2). A 4-bit weight on AVX-512 is dequantized a group at a time in registers
// (rows_q4_table: the dequantized weight's own bits); otherwise per group and row it sums
// (q - 8) x (or q x) in float32 vectors, then adds that times the scale, and the zero times the
// group's sum of x (computed once per call). Integers below 2^24 convert exactly, so either is
// the dequantized weight's product up to summation order.
// Activations of any floating type are read as float32; the output takes their type.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;  // 8 rows' sums and a group's 2 vectors fit 32 registers
constexpr bool kQ4Table = true;  // (rows_q4_table)
#else
constexpr int kMaxRows = 4;
constexpr bool kQ4Table = false;
#endif

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vset(float v) { return _mm512_set1_ps(v); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vfirst(float v) { return _mm512_maskz_mov_ps(1, _mm512_set1_ps(v)); }  // (v, 0, ...)
// One group's 32 weights as two vectors of 16, minus 8 (4-bit) or as they are (8-bit). A 4-bit
// value picks its float from a 16-entry table (a permute reads the low 4 bits of each lane).
inline void q4_group(const uint8_t* p, vec w[2]) {
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                                      2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w[0] = _mm512_permutexvar_ps(bytes, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
inline void store(float* o, vec v) { _mm512_storeu_ps(o, v); }
// bfloat16 rounded to nearest even, as c10::BFloat16 rounds a finite float
inline void store(c10::BFloat16* o, vec v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
inline void q8_group(const int8_t* p, vec w[2]) {
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  w[1] = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vset(float v) { return _mm256_set1_ps(v); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vfirst(float v) { return _mm256_setr_ps(v, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f); }
inline vec cvt8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
inline void q4_group(const uint8_t* p, vec w[4]) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m), eight);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m), eight);
  w[0] = cvt8(lo);
  w[1] = cvt8(_mm_srli_si128(lo, 8));
  w[2] = cvt8(hi);
  w[3] = cvt8(_mm_srli_si128(hi, 8));
}
inline void store(float* o, vec v) { _mm256_storeu_ps(o, v); }
inline void store(c10::BFloat16* o, vec v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
}
inline void q8_group(const int8_t* p, vec w[4]) {
  for (int i = 0; i < 4; ++i) {
    w[i] = cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
  }
}
#else
#define DEJA_SCALAR_QUANT 1
#endif

using deja_cpu::row_groups;
using deja_cpu::RowGroups;

#ifndef DEJA_SCALAR_QUANT
constexpr int kVecs = kGroup / kLanes;

// out[m, n] for rows n0..n1 of the weight and kRows rows of x (x: float32 [rows, K]; xsum:
// float32 [rows, K / 32], only read with zeros).
// kSub: scales a group of 32 has (1; 2 for an 8-bit weight with 16-weight scales). One or two
// rows alternate groups between two sets of sums, so their FMAs do not wait on each other.
template <int kRows, bool kQ4, int kSub, typename sc_t>
void rows_product(const float* x, const float* xsum, int64_t K, const void* qs, const sc_t* scale,
                  const sc_t* zero, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  static_assert(kSub == 1 || (!kQ4 && kSub == 2 && kVecs % 2 == 0));
  const int64_t groups = K / kGroup;
  constexpr int kSets = kRows <= 2 ? 2 : 1;
  std::vector<float> buf(std::is_same_v<sc_t, float> ? 0 : 2 * groups * kSub);
  deja_cpu::fold_rows<kLanes, kRows>(out, ldo, n0, n1, [&](int64_t n, vec (&sums)[kRows]) {
    deja_cpu::prefetch_row(qs, kQ4 ? K / 2 : K, scale, zero, groups * kSub, n + deja_cpu::kAhead,
                           n1);
    const RowGroups rg = row_groups(scale, zero, n, groups * kSub, buf.data());
    const float* s = rg.scale;
    vec acc[kSets][kRows];
    for (auto& set : acc) {
      for (auto& a : set) a = vzero();
    }
    auto group = [&](int64_t g, auto set) {
      vec w[kVecs];
      if constexpr (kQ4) {
        q4_group(static_cast<const uint8_t*>(qs) + (n * groups + g) * (kGroup / 2), w);
      } else {
        q8_group(static_cast<const int8_t*>(qs) + (n * groups + g) * kGroup, w);
      }
      constexpr int kPart = kVecs / kSub;  // vectors under one scale
      for (int h = 0; h < kSub; ++h) {
        const vec sg = vset(s[g * kSub + h]);
        for (int r = 0; r < kRows; ++r) {
          const float* xg = x + r * K + g * kGroup + h * kPart * kLanes;
          vec t = vmul(w[h * kPart], vload(xg));
          for (int i = 1; i < kPart; ++i) t = vfma(w[h * kPart + i], vload(xg + i * kLanes), t);
          acc[set][r] = vfma(t, sg, acc[set][r]);
        }
      }
    };
    deja_cpu::in_turns<kSets - 1>(groups, group);
    for (int r = 0; r < kRows; ++r) {
      vec sum = acc[0][r];
      if constexpr (kSets == 2) sum = vadd(sum, acc[1][r]);
      if (rg.zero != nullptr) {  // + sum over groups of zero x sum(x): in vectors too
        const float* z = rg.zero;
        const float* xs = xsum + r * groups;
        int64_t g = 0;
        for (; g + kLanes <= groups; g += kLanes) sum = vfma(vload(z + g), vload(xs + g), sum);
        float y = 0.f;
        for (; g < groups; ++g) y += z[g] * xs[g];
        sum = vadd(sum, vfirst(y));
      }
      sums[r] = sum;
    }
  });
}
#if defined(__AVX512F__)
// rows_product for a 4-bit weight on AVX-512: a group's 16 possible weights, fma(q - 8, s, z)
// (the bits expand() and q4_dequant give), are a table from which each nibble picks its weight
// (a permute reads the low 4 bits of a lane), so a row's sums take the dequantized weights as
// they are: two FMAs a group and row, no zero term. One or two rows alternate groups between two
// sets of sums, so their FMAs do not wait on each other. Each block of 16 weight rows' sums is
// folded into one vector of 16 outputs (fold_rows). ldo: the weight's N (out is [M, N]; the
// scales hold N rows).
template <int kRows, typename sc_t>
void rows_q4_table(const float* x, int64_t K, const uint8_t* qs, const sc_t* scale,
                   const sc_t* zero, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t groups = K / kGroup, padded = (groups + 15) / 16 * 16;
  constexpr int kSets = kRows <= 2 ? 2 : 1;
  const __m512 iota = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                                     2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  std::vector<float> buf(std::is_same_v<sc_t, float> ? 0 : 2 * padded);
  // weight row n's scales and zeros as float32 (float16 d and m: d and m + 8d, exact 8d)
  auto row_scales = [&](int64_t n) -> std::pair<const float*, const float*> {
    if constexpr (std::is_same_v<sc_t, float>) {
      return {scale + n * groups, zero + n * groups};
    } else {
      float* s = buf.data();
      float* z = s + padded;
      for (int64_t g = 0; g < groups; g += 16) {
        const int64_t at = n * groups + g;
        if ((ldo - n) * groups - g < 16) {  // (the tensor's last 16: no reading past its end)
          for (int64_t i = g; i < groups; ++i) {
            s[i] = static_cast<float>(scale[at + i - g]);
            z[i] = static_cast<float>(zero[at + i - g]) + 8.f * s[i];
          }
          break;
        }
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(zero + at)));
        _mm512_storeu_ps(s + g, sv);
        _mm512_storeu_ps(z + g, _mm512_fmadd_ps(_mm512_set1_ps(8.f), sv, mv));
      }
      return {s, z};
    }
  };
  deja_cpu::fold_rows<16, kRows>(out, ldo, n0, n1, [&](int64_t n, __m512 (&sums)[kRows]) {
    deja_cpu::prefetch_row(qs, K / 2, scale, zero, groups, n + deja_cpu::kAhead, n1);
    const auto [s, z] = row_scales(n);
    const uint8_t* wrow = qs + n * (K / 2);
    __m512 acc[kRows][2 * kSets];
    for (auto& row : acc) {
      for (auto& a : row) a = _mm512_setzero_ps();
    }
    auto group = [&](int64_t g, auto set) {
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[g]), _mm512_set1_ps(z[g]));
      const __m512i bytes =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + g * 16)));
      const __m512 w0 = _mm512_permutexvar_ps(bytes, table);
      const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
      for (int r = 0; r < kRows; ++r) {
        const float* xg = x + r * K + g * kGroup;
        __m512* a = acc[r] + 2 * set;
        a[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), a[0]);
        a[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + kLanes), a[1]);
      }
    };
    deja_cpu::in_turns<kSets - 1>(groups, group);
    for (int r = 0; r < kRows; ++r) {
      sums[r] = acc[r][0];
      for (int k = 1; k < 2 * kSets; ++k) sums[r] = _mm512_add_ps(sums[r], acc[r][k]);
    }
  });
}
#endif
#else
template <int kRows, bool kQ4, int kSub, typename sc_t>
void rows_product(const float* x, const float* xsum, int64_t K, const void* qs, const sc_t* scale,
                  const sc_t* zero, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t groups = K / kGroup;
  std::vector<float> buf(std::is_same_v<sc_t, float> ? 0 : 2 * groups * kSub);
  for (int64_t n = n0; n < n1; ++n) {
    const RowGroups rg = row_groups(scale, zero, n, groups * kSub, buf.data());
    for (int r = 0; r < kRows; ++r) {
      float y = 0.f;
      for (int64_t g = 0; g < groups * kSub; ++g) {  // each scale's weights
        float t = 0.f;
        for (int64_t j = 0; j < kGroup / kSub; ++j) {
          int q;
          if constexpr (kQ4) {
            const uint8_t b = static_cast<const uint8_t*>(qs)[(n * groups + g) * 16 + (j & 15)];
            q = (j < 16 ? (b & 15) : (b >> 4)) - 8;
          } else {
            q = static_cast<const int8_t*>(qs)[n * K + g * (kGroup / kSub) + j];
          }
          t += static_cast<float>(q) * x[r * K + g * (kGroup / kSub) + j];
        }
        y += t * rg.scale[g];
        if (rg.zero != nullptr) y += rg.zero[g] * xsum[r * groups + g];
      }
      out[r * ldo + n] = y;
    }
  }
}
#endif

template <bool kQ4, int kSub, typename sc_t>
void product(const float* x, const float* xsum, int64_t M, int64_t K, const void* qs,
             const sc_t* scale, const sc_t* zero, float* out, int64_t N) {
  // Each thread takes a contiguous range of weight rows and streams it once per kMaxRows input
  // rows.
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const float* xm = x + m * K;
      const float* sm = xsum == nullptr ? nullptr : xsum + m * (K / kGroup);
      float* om = out + m * N;
      deja_cpu::with_rows<kMaxRows>(M - m, [&](auto rows) {
        constexpr int kRows = decltype(rows)::value;
#if defined(__AVX512F__)
        if constexpr (kQ4) {
          rows_q4_table<kRows>(xm, K, static_cast<const uint8_t*>(qs), scale, zero, om, N, n0, n1);
        } else
#endif
        {
          rows_product<kRows, kQ4, kSub, sc_t>(xm, sm, K, qs, scale, zero, om, N, n0, n1);
        }
      });
    }
  });
}

void check_groups(const at::Tensor& t, int64_t N, int64_t K, bool sixteens, const char* what) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) &&
                  t.is_contiguous() && t.dim() == 2 && t.size(0) == N &&
                  (t.size(1) == K / kGroup || (sixteens && t.size(1) == K / 16)),
              what, sixteens ? " must be a contiguous float32 or float16 [N, K / 32] or [N, K / 16]"
                             : " must be a contiguous float32 or float16 [N, K / 32]");
}

// A weight's group scales and (4-bit) zeros: each [N, K / 32], both of one dtype; an 8-bit
// weight's scales may cover 16 weights each ([N, K / 16]).
void check_scales(const at::Tensor& scale, const at::Tensor* zero, int64_t N, int64_t K) {
  check_groups(scale, N, K, zero == nullptr, "scale");
  if (zero == nullptr) return;
  check_groups(*zero, N, K, false, "zero");
  TORCH_CHECK(scale.scalar_type() == zero->scalar_type(), "scale and zero dtypes differ");
}

template <bool kQ4>
at::Tensor linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  const at::Tensor* zero) {
  const auto [N, K] = deja_cpu::check_weight(qs, kQ4, scale, zero);
  const deja_cpu::FloatRows rows = deja_cpu::float_rows(x, K, kQ4 && !kQ4Table);
  const int64_t M = x.size(0);
  deja_cpu::FloatOut out(x, M, N);
  float* dst = out.dst;
  deja_cpu::with_groups(scale, zero, [&](auto* s, auto* z) {
    if constexpr (kQ4) {
      product<true, 1>(rows.x, rows.sums.data(), M, K, qs.data_ptr(), s, z, dst, N);
    } else if (scale.size(1) * kGroup == 2 * K) {
      product<false, 2>(rows.x, nullptr, M, K, qs.data_ptr(), s, z, dst, N);
    } else {
      product<false, 1>(rows.x, nullptr, M, K, qs.data_ptr(), s, z, dst, N);
    }
  });
  return out.finish();
}

}  // namespace

namespace deja_cpu {

std::pair<int64_t, int64_t> check_weight(const at::Tensor& qs, bool q4, const at::Tensor& scale,
                                         const at::Tensor* zero) {
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.scalar_type() == (q4 ? at::kByte : at::kChar),
              q4 ? "qs must be a contiguous uint8 [N, K / 2]" : "qs must be a contiguous int8 [N, K]");
  const int64_t N = qs.size(0), K = qs.size(1) * (q4 ? 2 : 1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32, got ", K);
  check_scales(scale, zero, N, K);
  return {N, K};
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& zero) {
  return linear<true>(x, qs, scale, &zero);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  return linear<false>(x, qs, scale, nullptr);
}

}  // namespace deja_cpu

namespace {

// The dense weight [N, K] in `dtype`, for many-row products.
template <bool kQ4, int kSub, typename out_t, typename sc_t>
void expand(const void* qs, const sc_t* scale, const sc_t* zero, out_t* out, int64_t N,
            int64_t K) {
  const int64_t groups = K / kGroup;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(std::is_same_v<sc_t, float> ? 0 : 2 * groups * kSub);
    for (int64_t n = n0; n < n1; ++n) {
      const RowGroups rg = row_groups(scale, zero, n, groups * kSub, buf.data());
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at_g = n * groups + g;
        const float* sg = rg.scale + g * kSub;  // the group's scale, or its two 16-weight ones
        const float s = sg[0], z = rg.zero == nullptr ? 0.f : rg.zero[g];
        out_t* o = out + n * K + g * kGroup;
#ifndef DEJA_SCALAR_QUANT
        if constexpr (std::is_same_v<out_t, float> || std::is_same_v<out_t, c10::BFloat16>) {
          vec w[kVecs];
          if constexpr (kQ4) {
            q4_group(static_cast<const uint8_t*>(qs) + at_g * 16, w);
          } else {
            q8_group(static_cast<const int8_t*>(qs) + at_g * kGroup, w);
          }
          const vec zv = vset(z);
          for (int i = 0; i < kVecs; ++i) {
            const vec sv = vset(sg[i * kSub / kVecs]);
            store(o + i * kLanes, kQ4 ? vfma(w[i], sv, zv) : vmul(w[i], sv));
          }
          continue;
        }
#endif
        if constexpr (kQ4) {
          const uint8_t* b = static_cast<const uint8_t*>(qs) + at_g * 16;
          for (int j = 0; j < 16; ++j) {
            o[j] = static_cast<out_t>(static_cast<float>((b[j] & 15) - 8) * s + z);
            o[j + 16] = static_cast<out_t>(static_cast<float>((b[j] >> 4) - 8) * s + z);
          }
        } else {
          const int8_t* q = static_cast<const int8_t*>(qs) + at_g * kGroup;
          for (int j = 0; j < kGroup; ++j) {
            o[j] = static_cast<out_t>(static_cast<float>(q[j]) * sg[j * kSub / kGroup]);
          }
        }
      }
    }
  });
}

template <bool kQ4>
at::Tensor dequant(const at::Tensor& qs, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                   at::ScalarType dtype) {
  const auto [N, K] = deja_cpu::check_weight(qs, kQ4, scale, zero.has_value() ? &*zero : nullptr);
  at::Tensor out = at::empty({N, K}, qs.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_dequant", [&] {
    deja_cpu::with_groups(scale, zero.has_value() ? &*zero : nullptr, [&](auto* s, auto* z) {
      if constexpr (kQ4) {
        expand<true, 1, scalar_t>(qs.data_ptr(), s, z, out.data_ptr<scalar_t>(), N, K);
      } else if (scale.size(1) * kGroup == 2 * K) {
        expand<false, 2, scalar_t>(qs.data_ptr(), s, z, out.data_ptr<scalar_t>(), N, K);
      } else {
        expand<false, 1, scalar_t>(qs.data_ptr(), s, z, out.data_ptr<scalar_t>(), N, K);
      }
    });
  });
  return out;
}

at::Tensor q4_dequant(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& zero,
                      at::ScalarType dtype) {
  return dequant<true>(qs, scale, zero, dtype);
}

at::Tensor q8_dequant(const at::Tensor& qs, const at::Tensor& scale, at::ScalarType dtype) {
  return dequant<false>(qs, scale, c10::nullopt, dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  m.def("q4_linear", &deja_cpu::q4_linear);
  m.def("q8_linear", &deja_cpu::q8_linear);
  m.def("q4_dequant", &q4_dequant);
  m.def("q8_dequant", &q8_dequant);
}
