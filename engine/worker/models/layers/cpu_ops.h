// The CPU kernels' entry points, declared for one another: cpu_decoder.cpp runs a decoder's
// layer stack over them in one call. Each is also a torch op (torch.ops.deja_cpu_attn.<name>);
// the .cpp files that define them document their layouts.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace deja_cpu {

// Weight rows a product asks the memory for ahead of the row it multiplies: a row is a few
// cache lines, and the hardware prefetchers alone left a 2-core Xeon (Sapphire Rapids-class, in
// a VM) streaming weights at a third of its read rate.
constexpr int64_t kAhead = 8;

// Row n of a kept weight (`bytes` of qs a row; every cache line it touches) and the first line
// of its `per_row` scales (and zeros), if n < end (the rows a caller owns).
template <typename sc_t>
inline void prefetch_row(const void* qs, int64_t bytes, const sc_t* scale, const sc_t* zero,
                         int64_t per_row, int64_t n, int64_t end) {
  if (n >= end) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(qs) + n * bytes;
  for (uintptr_t line = first & ~uintptr_t(63); line < first + bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(scale + n * per_row), _MM_HINT_T0);
  if (zero != nullptr) _mm_prefetch(reinterpret_cast<const char*>(zero + n * per_row), _MM_HINT_T0);
}

// An int32 read from any address (x's 4 bytes or 2 bfloat16 as a broadcast operand).
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));

// f(std::integral_constant<int, R>) with R = min(rows, kMax), rows >= 1, kMax <= 8: a kernel's
// row count as a template argument (counts past kMax are not instantiated).
template <int kMax, typename F>
void with_rows(int64_t rows, F f) {
  static_assert(kMax >= 1 && kMax <= 8, "kernels take 1 to 8 rows a pass");
  switch (std::min<int64_t>(kMax, rows)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (kMax >= 2) f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (kMax >= 3) f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (kMax >= 4) f(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (kMax >= 5) f(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (kMax >= 6) f(std::integral_constant<int, 6>{}); break;
    case 7: if constexpr (kMax >= 7) f(std::integral_constant<int, 7>{}); break;
    case 8: if constexpr (kMax >= 8) f(std::integral_constant<int, 8>{}); break;
    default: break;
  }
}

// f(const sc_t* scale, const sc_t* zero) with a kept weight's group scales' storage type, float
// or c10::Half (zero null where absent: 8-bit weights).
template <typename F>
void with_groups(const at::Tensor& scale, const at::Tensor* zero, F f) {
  if (scale.scalar_type() == at::kHalf) {
    f(scale.data_ptr<c10::Half>(), zero == nullptr ? nullptr : zero->data_ptr<c10::Half>());
  } else {
    f(scale.data_ptr<float>(), zero == nullptr ? nullptr : zero->data_ptr<float>());
  }
}

// A row's group scales (and zeros) as float32: `scale`'s own memory when float32, else the fp16
// pairs (d, m) converted into `buf` as scale = d, zero = m + 8d.
struct RowGroups {
  const float* scale;
  const float* zero;
};

inline void halves_to_float(const c10::Half* h, float* f, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
#endif
  for (; i < n; ++i) f[i] = static_cast<float>(h[i]);
}

template <typename sc_t>
inline RowGroups row_groups(const sc_t* scale, const sc_t* zero, int64_t n, int64_t groups,
                            float* buf) {
  if constexpr (std::is_same_v<sc_t, float>) {
    return {scale + n * groups, zero == nullptr ? nullptr : zero + n * groups};
  } else {
    float* s = buf;
    halves_to_float(scale + n * groups, s, groups);
    if (zero == nullptr) return {s, nullptr};
    float* z = buf + groups;
    halves_to_float(zero + n * groups, z, groups);
    for (int64_t g = 0; g < groups; ++g) z[g] += 8.f * s[g];  // m + 8d, exact 8d
    return {s, z};
  }
}

#if defined(__AVX512F__)
// 16 bytes at each of 16 places as 4 vectors, vector i lane l holding bytes 4 i .. 4 i + 3
// from place l: four places to a vector (places j, j + 4, j + 8, j + 12 in 128-bit lanes), then
// a 4 x 4 transpose of 32-bit words within each 128-bit lane.
inline void transpose16(const uint8_t* const* at, int64_t offset, __m512i out[4]) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    auto row = [&](int k) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at[j + 4 * k] + offset));
    };
    z[j] = _mm512_castsi128_si512(row(0));
    z[j] = _mm512_inserti32x4(z[j], row(1), 1);
    z[j] = _mm512_inserti32x4(z[j], row(2), 2);
    z[j] = _mm512_inserti32x4(z[j], row(3), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}
#endif

// f(i, set) for i in [0, n), consecutive i taking turns between sets 0 and kLast (two sets of sums,
// so one's FMAs need not wait on the other's); an odd n's last i goes to set 0. `set` is a
// std::integral_constant, so a set's sums stay in registers.
template <int kLast, typename F>
inline void in_turns(int64_t n, F&& f) {
  using first = std::integral_constant<int, 0>;
  using last = std::integral_constant<int, kLast>;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    f(i, first{});
    f(i + 1, last{});
  }
  if (i < n) f(i, first{});
}

#if defined(__AVX512F__)
// 16 vectors of partial sums -> one vector of their 16 totals: p[j]'s total lands in lane
// kFold16[j] (kFold16 is its own inverse: for row i's total in lane i, put row i in p[kFold16[i]]).
inline constexpr int kFold16[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline __m512 fold16(const __m512 (&p)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // quarters 0, 1: p[2i]'s halves summed; 2, 3: p[2i + 1]'s
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarter k: one vector's four partials
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]),
                         _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
}
#endif

// How fold_rows folds vectors of kWidth floats (V): kWidth of them into one vector of their
// totals, row i's sums go in slot(i) for its total to land in lane i, and store writes the first
// `live` lanes.
template <int kWidth>
struct Folding;
#if defined(__AVX512F__)
template <>
struct Folding<16> {
  using V = __m512;
  static int slot(int i) { return kFold16[i]; }
  static __m512 fold(const __m512 (&p)[16]) { return fold16(p); }
  static void store(float* o, __m512 v, int64_t live) {
    _mm512_mask_storeu_ps(o, static_cast<__mmask16>(live == 16 ? 0xffff : (1u << live) - 1), v);
  }
};
#endif
#if defined(__AVX2__)
template <>
struct Folding<8> {
  using V = __m256;
  static int slot(int i) { return i; }
  static __m256 fold(const __m256 (&p)[8]) {  // (p[i]'s total in lane i)
    const __m256 a0 = _mm256_hadd_ps(p[0], p[1]), a1 = _mm256_hadd_ps(p[2], p[3]);
    const __m256 a2 = _mm256_hadd_ps(p[4], p[5]), a3 = _mm256_hadd_ps(p[6], p[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // halves' sums
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  }
  static void store(float* o, __m256 v, int64_t live) {
    if (live == 8) {
      _mm256_storeu_ps(o, v);
    } else {  // (a copy: masked stores are slow on AMD)
      alignas(32) float part[8];
      _mm256_store_ps(part, v);
      std::memcpy(o, part, live * sizeof(float));
    }
  }
};
#endif

// out[r * ldo + n] for kRows rows r and the weight rows n in [n0, n1): row(n, sums) sets sums[r]
// to a vector of kWidth floats whose lanes add up to that output; each block of kWidth weight rows
// is folded into one vector a row and stored at once, instead of a horizontal sum an output
// (whose latency the next row would wait behind).
template <int kWidth, int kRows, typename Row>
inline void fold_rows(float* out, int64_t ldo, int64_t n0, int64_t n1, Row&& row) {
  using F = Folding<kWidth>;
  using V = typename F::V;
  V part[kRows][kWidth];
  for (int64_t b0 = n0; b0 < n1; b0 += kWidth) {
    const int64_t live = std::min<int64_t>(kWidth, n1 - b0);
    for (int i = 0; i < kWidth; ++i) {
      V sums[kRows];
      if (i < live) {
        row(b0 + i, sums);
      } else {
        for (auto& v : sums) v = V{};
      }
      for (int r = 0; r < kRows; ++r) part[r][F::slot(i)] = sums[r];
    }
    for (int r = 0; r < kRows; ++r) F::store(out + r * ldo + b0, F::fold(part[r]), live);
  }
}

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
at::Tensor q4_linear_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                          const at::Tensor& zero);
at::Tensor q8_linear_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor seq_index,
                     double scale, int64_t window, double soft_cap, double k_scale,
                     double v_scale);

constexpr int64_t kSumGroup = 32;  // (the kept weights' group of inputs)

// x's rows as float32 (a copy unless x is contiguous float32) and, with `sums`, each group of
// kSumGroup's sum of them; a few small rows a call: plain loops, no torch op (each costs
// microseconds).
struct FloatRows {
  std::vector<float> copy, sums;
  at::Tensor converted;  // (many rows: torch's conversion, whose dispatch they pay for)
  const float* x = nullptr;
};

inline FloatRows float_rows(const at::Tensor& x, int64_t K, bool sums) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  FloatRows r;
  const int64_t M = x.size(0);
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) {
    r.x = x.data_ptr<float>();
  } else if (M * K > 16384) {
    r.converted = x.to(at::kFloat).contiguous();
    r.x = r.converted.data_ptr<float>();
  } else {
    const at::Tensor xc = x.contiguous();
    r.copy.resize(M * K);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "float_rows", [&] {
      const scalar_t* src = xc.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M * K; ++i) r.copy[i] = static_cast<float>(src[i]);
    });
    r.x = r.copy.data();
  }
  if (sums) {
    r.sums.resize(M * (K / kSumGroup));
    for (int64_t g = 0; g < M * (K / kSumGroup); ++g) {
      float t = 0.f;
      for (int64_t j = 0; j < kSumGroup; ++j) t += r.x[g * kSumGroup + j];
      r.sums[g] = t;
    }
  }
  return r;
}

// y[0, n) rounded to bfloat16 into o as c10::BFloat16 rounds (to nearest even; a NaN: 0x7FC0),
// 16 at a time; returns how many it wrote (a multiple of 16; the caller does the rest). Other
// output types: none.
template <typename T>
inline size_t to_bf16(const float*, T*, size_t) {
  return 0;
}
inline size_t to_bf16(const float* y, at::BFloat16* o, size_t n) {
  size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m256i nan = _mm256_set1_epi16(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(y + i);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m256i r = _mm512_cvtepi32_epi16(
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, round)), 16));
    const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_mask_mov_epi16(r, isnan, nan));
  }
#endif
  return i;
}

// A product's out [M, N] in x's dtype and where its float32 sums go (dst): out itself for float32
// x, else a buffer that finish() converts into out.
struct FloatOut {
  at::Tensor out;
  std::vector<float> y;
  float* dst;
  FloatOut(const at::Tensor& x, int64_t M, int64_t N)
      : out(at::empty({M, N}, x.options())),
        y(x.scalar_type() == at::kFloat ? 0 : M * N),
        dst(x.scalar_type() == at::kFloat ? out.data_ptr<float>() : y.data()) {}
  at::Tensor finish() {
    if (out.scalar_type() == at::kFloat) return out;
    if (y.size() > 4096) {  // many values: torch's vectorized conversion pays for its dispatch
      out.copy_(at::from_blob(y.data(), out.sizes(), at::TensorOptions().dtype(at::kFloat)));
      return out;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "finish", [&] {
      scalar_t* o = out.data_ptr<scalar_t>();
      for (size_t i = to_bf16(y.data(), o, y.size()); i < y.size(); ++i) o[i] = static_cast<scalar_t>(y[i]);
    });
    return out;
  }
};

}  // namespace deja_cpu
