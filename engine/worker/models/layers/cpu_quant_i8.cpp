// Quantized linears with 8-bit activations: integer dot products on the CPU (llama.cpp's way).
//
// The weights are cpu_quant.cpp's layouts (4-bit q with scale and zero a group of 32, or 8-bit q
// with a scale). Each row of x is quantized in groups of 32 to int8 with its own scale
// dx = max|x| / 127 (q = round(x / dx)); a group's product is then one integer dot product:
//   4-bit: sum w x = d dx sum(q xq) + m dx sum(xq), with d = scale and m = zero - 8 scale;
//   8-bit: sum w x = d dx sum(q xq).
// On AVX2 a group is two instructions (u8 x s8 pairs summed to int16, then to int32; one with
// AVX-512 VNNI), against the float path's conversion of every weight: about half the
// instructions a weight. It is not the dequantized weight's product: each activation is rounded
// to 8 bits (as llama.cpp rounds them), so it is used only where asked (layers/quantized.py).
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
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 8;  // rows of x a pass over the weight serves

// x's rows quantized: xq int8 [M, K], per group dx and dx * sum(xq) [M, K / 32].
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
};

Int8Rows quantize_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* src = xf.data_ptr<float>();
  const int64_t M = x.size(0), groups = M * (K / kGroup);
  Int8Rows r;
  r.q.resize(M * K);
  r.d.resize(groups);
  r.dsum.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const float* v = src + g * kGroup;
    float amax = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * inv));
      r.q[g * kGroup + j] = static_cast<int8_t>(q);
      sum += q;
    }
    r.d[g] = d;
    r.dsum[g] = d * static_cast<float>(sum);
  }
  return r;
}


#if defined(__AVX2__)
// sum over the 32 products of u8 a and s8 b, as 8 int32 lanes
inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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

// sum over g of a[g] b[g]
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float y = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  y = hsum(acc);
#endif
  for (; i < n; ++i) y += a[i] * b[i];
  return y;
}

#if defined(__AVX2__)
// acc[r] += group g's weights w (32 bytes, x's order) dotted with row r's quantized group,
// times dd[r, g] (the weight's d times the row's dx).
template <int kRows, bool kQ4>
inline void group_dot(__m256 (&acc)[kRows], __m256i w, const int8_t* xq, const float* dd,
                      int64_t groups, int64_t g) {
  const __m256i wa = kQ4 ? w : _mm256_sign_epi8(w, w);  // |w| for 8-bit: unsigned operand
  for (int r = 0; r < kRows; ++r) {
    const int64_t at_g = r * groups + g;
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + at_g * kGroup));
    if constexpr (!kQ4) xv = _mm256_sign_epi8(xv, w);  // x's sign times w's
    const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wa, xv));
    acc[r] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(dd + at_g), acc[r]);
  }
}
#endif

// out[r, n] for weight rows n0..n1 and kRows rows of quantized x.
template <int kRows, bool kQ4, typename sc_t>
void rows_i8(const int8_t* xq, const float* xd, const float* xds, int64_t K, const void* qs,
             const sc_t* scale, const sc_t* zero, float* out, int64_t ldo, int64_t n0,
             int64_t n1) {
  const int64_t groups = K / kGroup;
  std::vector<float> dm(2 * groups), dd(kRows * groups);
  float* const d = dm.data();
  float* const m = d + groups;
  for (int64_t n = n0; n < n1; ++n) {
    row_scales<kQ4>(scale + n * groups, kQ4 ? zero + n * groups : nullptr, groups, d, m);
    for (int r = 0; r < kRows; ++r) {
      for (int64_t g = 0; g < groups; ++g) dd[r * groups + g] = d[g] * xd[r * groups + g];
    }
    float y[kRows] = {};
#if defined(__AVX2__)
    // Two sets of sums (even and odd groups) where there are few rows: one set alone would
    // wait on its FMA's latency every group.
    constexpr bool kTwo = kRows <= 4;
    __m256 acc[kRows], acc2[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
    auto& odd = kTwo ? acc2 : acc;
    int64_t g = 0;
    if constexpr (kQ4) {  // two groups a load: their 32 bytes of nibbles unpacked at once
      const uint8_t* row = static_cast<const uint8_t*>(qs) + n * groups * (kGroup / 2);
      const __m256i m15 = _mm256_set1_epi8(15);
      for (; g + 2 <= groups; g += 2) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 16));
        const __m256i lo = _mm256_and_si256(v, m15);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        group_dot<kRows, kQ4>(acc, _mm256_permute2x128_si256(lo, hi, 0x20), xq, dd.data(), groups, g);
        group_dot<kRows, kQ4>(odd, _mm256_permute2x128_si256(lo, hi, 0x31), xq, dd.data(), groups,
                              g + 1);
      }
    } else {
      const int8_t* row = static_cast<const int8_t*>(qs) + n * groups * kGroup;
      for (; g + 2 <= groups; g += 2) {
        const auto* p = reinterpret_cast<const __m256i*>(row + g * kGroup);
        group_dot<kRows, kQ4>(acc, _mm256_loadu_si256(p), xq, dd.data(), groups, g);
        group_dot<kRows, kQ4>(odd, _mm256_loadu_si256(p + 1), xq, dd.data(), groups, g + 1);
      }
    }
    for (; g < groups; ++g) {
      __m256i w;
      if constexpr (kQ4) {
        w = q4_bytes(static_cast<const uint8_t*>(qs) + (n * groups + g) * (kGroup / 2));
      } else {
        w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(qs) + (n * groups + g) * kGroup));
      }
      group_dot<kRows, kQ4>(acc, w, xq, dd.data(), groups, g);
    }
    for (int r = 0; r < kRows; ++r) y[r] = hsum(kTwo ? _mm256_add_ps(acc[r], acc2[r]) : acc[r]);
#else
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
          sum += q * xg[j];
        }
        y[r] += d[g] * xd[at_g] * static_cast<float>(sum);
      }
    }
#endif
    for (int r = 0; r < kRows; ++r) {
      if constexpr (kQ4) y[r] += dot(m, xds + r * groups, groups);  // + sum of m dx sum(xq)
      out[r * ldo + n] = y[r];
    }
  }
}

template <bool kQ4, typename sc_t>
void product_i8(const Int8Rows& x, int64_t M, int64_t K, const void* qs, const sc_t* scale,
                const sc_t* zero, float* out, int64_t N) {
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  const int64_t groups = K / kGroup;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int8_t* xq = x.q.data() + m * K;
      const float* xd = x.d.data() + m * groups;
      const float* xs = x.dsum.data() + m * groups;
      float* om = out + m * N;
      switch (std::min<int64_t>(kMaxRows, M - m)) {
        case 1: rows_i8<1, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        case 2: rows_i8<2, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        case 3: rows_i8<3, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        case 4: rows_i8<4, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        case 5: rows_i8<5, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        case 6: rows_i8<6, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        case 7: rows_i8<7, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
        default: rows_i8<8, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
      }
    }
  });
}

template <bool kQ4>
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor* zero) {
  const auto [N, K] = deja_cpu::check_weight(qs, kQ4, scale, zero);
  const Int8Rows rows = quantize_rows(x, K);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  if (scale.scalar_type() == at::kHalf) {
    product_i8<kQ4, c10::Half>(rows, M, K, qs.data_ptr(), scale.data_ptr<c10::Half>(),
                               zero == nullptr ? nullptr : zero->data_ptr<c10::Half>(), dst, N);
  } else {
    product_i8<kQ4, float>(rows, M, K, qs.data_ptr(), scale.data_ptr<float>(),
                           zero == nullptr ? nullptr : zero->data_ptr<float>(), dst, N);
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
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
  m.def("q4_linear_i8", &deja_cpu::q4_linear_i8);
  m.def("q8_linear_i8", &deja_cpu::q8_linear_i8);
}
