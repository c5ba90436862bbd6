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
constexpr int kMaxRows = 4;

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

template <typename sc_t>
inline float as_float(sc_t v) {
  return static_cast<float>(v);
}

// A 4-bit group's m (w = q d + m): zero - 8 scale for float32 (w = (q - 8) scale + zero); the
// stored m itself for the file's float16 pair.
inline float fp16_pair_m(float scale, float zero) { return zero - 8.f * scale; }
inline float fp16_pair_m(c10::Half, c10::Half m) { return static_cast<float>(m); }

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

// out[r, n] for weight rows n0..n1 and kRows rows of quantized x.
template <int kRows, bool kQ4, typename sc_t>
void rows_i8(const int8_t* xq, const float* xd, const float* xds, int64_t K, const void* qs,
             const sc_t* scale, const sc_t* zero, float* out, int64_t ldo, int64_t n0,
             int64_t n1) {
  const int64_t groups = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const sc_t* s = scale + n * groups;
    const sc_t* z = kQ4 ? zero + n * groups : nullptr;
    float y[kRows] = {};
#if defined(__AVX2__)
    __m256 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i w;
      if constexpr (kQ4) {
        w = q4_bytes(static_cast<const uint8_t*>(qs) + (n * groups + g) * (kGroup / 2));
      } else {
        w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(qs) + (n * groups + g) * kGroup));
      }
      const float d = as_float(s[g]);
      float m = 0.f;
      if constexpr (kQ4) m = fp16_pair_m(s[g], z[g]);
      const __m256i wa = kQ4 ? w : _mm256_sign_epi8(w, w);  // |w| for 8-bit: unsigned operand
      for (int r = 0; r < kRows; ++r) {
        const int64_t at_g = r * groups + g;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + at_g * kGroup));
        if constexpr (!kQ4) xv = _mm256_sign_epi8(xv, w);  // x's sign times w's
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wa, xv));
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * xd[at_g]), acc[r]);
        if constexpr (kQ4) y[r] += m * xds[at_g];
      }
    }
    for (int r = 0; r < kRows; ++r) out[r * ldo + n] = hsum(acc[r]) + y[r];
#else
    for (int64_t g = 0; g < groups; ++g) {
      const float d = as_float(s[g]);
      float m = 0.f;
      if constexpr (kQ4) m = fp16_pair_m(s[g], z[g]);
      for (int r = 0; r < kRows; ++r) {
        const int64_t at_g = r * groups + g;
        const int8_t* xg = xq + at_g * kGroup;
        int dot = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          int q;
          if constexpr (kQ4) {
            const uint8_t b = static_cast<const uint8_t*>(qs)[(n * groups + g) * 16 + (j & 15)];
            q = j < 16 ? (b & 15) : (b >> 4);
          } else {
            q = static_cast<const int8_t*>(qs)[(n * groups + g) * kGroup + j];
          }
          dot += q * xg[j];
        }
        y[r] += d * xd[at_g] * static_cast<float>(dot) + m * xds[at_g];
      }
    }
    for (int r = 0; r < kRows; ++r) out[r * ldo + n] = y[r];
#endif
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
        default: rows_i8<4, kQ4, sc_t>(xq, xd, xs, K, qs, scale, zero, om, N, n0, n1); break;
      }
    }
  });
}

template <bool kQ4>
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor* zero, int64_t N, int64_t K) {
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / kGroup &&
                  scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale must be a contiguous float32 or float16 [N, K / 32]");
  if (zero != nullptr) {
    TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == scale.scalar_type() &&
                    zero->is_contiguous(),
                "zero must be like scale");
  }
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
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "qs must be a contiguous uint8 [N, K / 2]");
  return linear_i8<true>(x, qs, scale, &zero, qs.size(0), qs.size(1) * 2);
}

at::Tensor q8_linear_i8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "qs must be a contiguous int8 [N, K]");
  return linear_i8<false>(x, qs, scale, nullptr, qs.size(0), qs.size(1));
}

}  // namespace deja_cpu

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  m.def("q4_linear_i8", &deja_cpu::q4_linear_i8);
  m.def("q8_linear_i8", &deja_cpu::q8_linear_i8);
}
