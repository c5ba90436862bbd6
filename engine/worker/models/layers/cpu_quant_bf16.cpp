// Many-row products of a kept weight with bfloat16 activations, on CPUs with bfloat16 dot
// products: q4_linear_bf16 and q8_linear_bf16, same arguments as q4_linear and q8_linear, x
// bfloat16. layers/quantized.py takes them instead of expanding the whole weight for a dense
// product where linear_bf16_rows() says this build and this CPU have them.
//
// The weight is read once a call in its 4- or 8-bit form and never written out whole: every 32
// outputs (a slab, one thread's at a time) are expanded to bfloat16, with q4_dequant /
// q8_dequant's values, straight into a pair layout in the thread's buffer (a group's 32 inputs x
// 16 outputs as 16 rows of 16 (input 2i, input 2i + 1) pairs: AMX's B tile, and one
// vdpbf16ps operand a row). Then, against the slab, K in steps of 32:
// - with Intel AMX (Sapphire Rapids and later; the kernel's permission asked), every 32 rows of
//   x take 2 x 2 tiles of 16 x 16 float32 sums (tdpbf16ps; A: 16 rows of x by a group's 32
//   inputs, B: a packed group);
// - else (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake; or AMX refused), every 8 rows
//   of x take 8 x 2 vectors of 16 float32 sums, each pair of x's inputs broadcast against a
//   packed row (vdpbf16ps).
// The sums are left rounded to bfloat16. So the products are the expanded weight's with x in
// bfloat16, up to the float32 summation order, as a dense bfloat16 product is.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DEJA_BF16_SLABS 1
#endif
#if defined(DEJA_BF16_SLABS) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define DEJA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kSlab = 32;  // outputs a thread expands at a time (two B tiles)
// Rows of x from which the slabs beat the few-row product and the dense one (layers/quantized.py):
// on AMX, and with vdpbf16ps (a 3072 x 576 4-bit weight on a 2-core Zen 5 EPYC, ms at 2 / 8 / 16 /
// 48 rows: 0.080 / 0.089 / 0.116 / 0.235, against the few-row product's 0.107 / 0.146 / 0.285 and
// the expanded weight's dense product's 0.23 / 0.34 at 16 / 48). An 8-bit slab packs twice the
// bytes: with vdpbf16ps it takes 8-bit weights from 8 rows (the tied 49152 x 576 Q8_0 head at 4 /
// 8 rows: 1.68 / 1.76 ms against 1.41 / 2.18 on the groups), the few-row product below.
constexpr int64_t kRowsFrom = 9, kDotRowsFrom = 2, kDotRowsFrom8 = 8;
constexpr int kDotRows = 8;  // rows of x a pass of vdpbf16ps serves

using deja_cpu::unaligned_i32;

#ifdef DEJA_BF16_SLABS

#ifdef DEJA_AMX

// Linux hands a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: tmm0-3 the 2 x 2 float32 sums, tmm4-5 x's two 16-row halves
// (32 bfloat16 inputs a row), tmm6-7 the two 16-output halves of a packed group.
void configure_tiles() {
  // NOTE: GCC's tile intrinsics are asm that names no memory; these barriers keep the compiler
  // from reordering or dropping the stores the tiles then read (config, packed weights).
  asm volatile("" ::: "memory");
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}
#endif

// The slab's scales (and zeros) group-major, S[j * 32 + n] for output n0 + n's scale j, as
// float32 the way the other kernels read them (row_groups); outputs past the weight's: 0.
// `row`: 2 per_row floats of scratch.
template <typename sc_t>
void slab_scales(const sc_t* scale, const sc_t* zero, int64_t n0, int64_t width, int64_t per_row,
                 float* row, float* S, float* Z) {
  std::fill(S, S + per_row * kSlab, 0.f);
  std::fill(Z, Z + per_row * kSlab, 0.f);
  for (int64_t n = 0; n < width; ++n) {
    const deja_cpu::RowGroups rg = deja_cpu::row_groups(scale, zero, n0 + n, per_row, row);
    for (int64_t j = 0; j < per_row; ++j) {
      S[j * kSlab + n] = rg.scale[j];
      if (rg.zero != nullptr) Z[j * kSlab + n] = rg.zero[j];
    }
  }
}

// One row of a packed group: lane n the bfloat16 pair (e[n], o[n]), rounded to nearest even.
inline void store_pairs(uint8_t* dst, __m512 e, __m512 o) {
  alignas(64) static const int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                      6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                      12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(o, e);  // e in the low 256 bits
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), halves));
}

// The slab's weights expanded to bfloat16 (q4_dequant / q8_dequant's values: (q - 8) s + z, or
// q s) straight into the tiles' pair layout: packed[g][half][i] = 64 bytes, lane n the pair
// (2i, 2i + 1) of group g's inputs of output 16 half + n. rows[n]: output n's qs (a row of
// zeros past the weight's last output).
template <bool kQ4, int kSub>
void pack_slab(const uint8_t* const rows[kSlab], int64_t K, const float* S, const float* Z,
               uint8_t* packed) {
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                                      2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    for (int half = 0; half < 2; ++half) {
      uint8_t* dst = packed + (g * 2 + half) * 1024;
      const uint8_t* const* hr = rows + half * 16;
      if constexpr (kQ4) {  // byte j: weight j in its low nibble, weight j + 16 in its high one
        __m512i v[4];
        deja_cpu::transpose16(hr, g * 16, v);
        const __m512 sv = _mm512_loadu_ps(S + g * kSlab + half * 16);
        const __m512 zv = _mm512_loadu_ps(Z + g * kSlab + half * 16);
        for (int c = 0; c < 4; ++c) {
          for (int i = 0; i < 4; ++i) {  // pairs 2c, 2c + 1 (low nibbles), 8 + 2c, 9 + 2c
            const int shift = 16 * (i & 1) + 4 * (i >> 1);
            const __m512i even = _mm512_srli_epi32(v[c], shift);
            const __m512i odd = _mm512_srli_epi32(v[c], shift + 8);
            const __m512 e = _mm512_fmadd_ps(_mm512_permutexvar_ps(even, table), sv, zv);
            const __m512 o = _mm512_fmadd_ps(_mm512_permutexvar_ps(odd, table), sv, zv);
            store_pairs(dst + (8 * (i >> 1) + 2 * c + (i & 1)) * 64, e, o);
          }
        }
      } else {
        __m512i v[8];
        deja_cpu::transpose16(hr, g * 32, v);
        deja_cpu::transpose16(hr, g * 32 + 16, v + 4);
        for (int c = 0; c < 8; ++c) {
          const int j = kSub == 2 ? g * 2 + c / 4 : g;  // a scale every 16 weights (Q6_K)
          const __m512 sv = _mm512_loadu_ps(S + j * kSlab + half * 16);
          for (int i = 0; i < 2; ++i) {  // pair 2c + i: bytes 2i, 2i + 1, sign-extended
            const __m512i e = _mm512_srai_epi32(_mm512_slli_epi32(v[c], 24 - 16 * i), 24);
            const __m512i o = _mm512_srai_epi32(_mm512_slli_epi32(v[c], 16 - 16 * i), 24);
            store_pairs(dst + (2 * c + i) * 64, _mm512_mul_ps(_mm512_cvtepi32_ps(e), sv),
                        _mm512_mul_ps(_mm512_cvtepi32_ps(o), sv));
          }
        }
      }
    }
  }
}

// A row y of the slab's outputs [n0, n0 + width) from its float32 sums (lo: the first 16)
inline void store_row(__m512 lo, __m512 hi, c10::BFloat16* y, int64_t width) {
  const __mmask32 keep = width >= 32 ? ~__mmask32(0) : (__mmask32(1) << width) - 1;
  _mm512_mask_storeu_epi16(y, keep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

#ifdef DEJA_AMX
// y rows [m0, m0 + 16 * halves) x the slab's outputs [n0, n0 + width): x padded to whole tiles.
void tile_rows(const c10::BFloat16* x, int64_t K, const uint8_t* packed, int64_t m0, int halves,
               int64_t M, c10::BFloat16* y, int64_t N, int64_t n0, int64_t width, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = K * 2;
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* b = packed + g * 2 * 1024;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 1024, 64);
    _tile_loadd(4, x + m0 * K + g * kGroup, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (halves == 2) {
      _tile_loadd(5, x + (m0 + 16) * K + g * kGroup, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 128);  // sums [32 rows][32 outputs] float32
  _tile_stored(1, sums + 16, 128);
  if (halves == 2) {
    _tile_stored(2, sums + 16 * 32, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
  }
  for (int64_t r = 0; r < 16 * halves && m0 + r < M; ++r) {
    const float* s = sums + r * 32;
    store_row(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16), y + (m0 + r) * N + n0, width);
  }
}
#endif

// y rows [m0, m0 + kRows) x the slab's outputs [n0, n0 + width): each pair of a row's inputs
// broadcast against a packed row of pairs, 16 outputs a vector.
template <int kRows>
void dot_rows(const c10::BFloat16* x, int64_t K, const uint8_t* packed, int64_t m0,
              c10::BFloat16* y, int64_t N, int64_t n0, int64_t width) {
  __m512 lo[kRows], hi[kRows];  // outputs n0..n0 + 16, n0 + 16..n0 + 32
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* b = packed + g * 2 * 1024;
    const c10::BFloat16* xg = x + m0 * K + g * kGroup;
    for (int i = 0; i < 16; ++i) {
      const __m512i w0 = _mm512_loadu_si512(b + i * 64);
      const __m512i w1 = _mm512_loadu_si512(b + 1024 + i * 64);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const auto* pair = reinterpret_cast<const unaligned_i32*>(xg + r * K + 2 * i);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(*pair);
        lo[r] = _mm512_dpbf16_ps(lo[r], (__m512bh)w0, xb);
        hi[r] = _mm512_dpbf16_ps(hi[r], (__m512bh)w1, xb);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) store_row(lo[r], hi[r], y + (m0 + r) * N + n0, width);
}

bool use_amx() {
#ifdef DEJA_AMX
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor linear_slabs(const at::Tensor& x, const at::Tensor& qs, bool q4,
                        const at::Tensor& scale, const at::Tensor* zero) {
  const auto [N, K] = deja_cpu::check_weight(qs, q4, scale, zero);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K,
              "x must be bfloat16 [..., ", K, "]");
  const bool amx = use_amx();
  const int64_t M = x.numel() / K;
  auto shape = x.sizes().vec();
  shape.back() = N;
  if (!amx && !q4 && M < kDotRowsFrom8) {
    return deja_cpu::q8_linear(x.reshape({M, K}), qs, scale).view(shape);
  }
  const int64_t Mp = amx ? (M + 15) / 16 * 16 : M;
  at::Tensor xs = x.reshape({M, K});
  if (Mp != M || !xs.is_contiguous()) {  // (AMX: whole tiles of rows, the rest zeros)
    at::Tensor padded = at::zeros({Mp, K}, x.options());
    padded.narrow(0, 0, M).copy_(xs);
    xs = padded;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = xs.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t slabs = (N + kSlab - 1) / kSlab;
  const int64_t per_row = scale.size(1), row_bytes = q4 ? K / 2 : K;
  const bool sixteens = !q4 && per_row * kGroup == 2 * K;
  const auto* q = static_cast<const uint8_t*>(qs.data_ptr());
  deja_cpu::with_groups(scale, zero, [&](const auto* sc, const auto* zr) {
    at::parallel_for(0, slabs, 1, [&](int64_t s0, int64_t s1) {
#ifdef DEJA_AMX
      if (amx) configure_tiles();
#endif
      std::vector<uint8_t> packed(kSlab * K * 2), none(row_bytes, 0);
      std::vector<float> S(per_row * kSlab), Z(per_row * kSlab), row(2 * per_row);
#ifdef DEJA_AMX
      alignas(64) float sums[32 * 32];  // (a tile pass's, for rounding to bfloat16)
#endif
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t n0 = s * kSlab, width = std::min(kSlab, N - n0);
        const uint8_t* rows[kSlab];
        for (int64_t n = 0; n < kSlab; ++n) {
          rows[n] = n < width ? q + (n0 + n) * row_bytes : none.data();
        }
        slab_scales(sc, zr, n0, width, per_row, row.data(), S.data(), Z.data());
        if (q4) {
          pack_slab<true, 1>(rows, K, S.data(), Z.data(), packed.data());
        } else if (sixteens) {
          pack_slab<false, 2>(rows, K, S.data(), Z.data(), packed.data());
        } else {
          pack_slab<false, 1>(rows, K, S.data(), Z.data(), packed.data());
        }
        asm volatile("" ::: "memory");  // (see configure_tiles)
        if (amx) {
#ifdef DEJA_AMX
          for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            const int halves = Mp - m0 >= 32 ? 2 : 1;
            tile_rows(xp, K, packed.data(), m0, halves, M, yp, N, n0, width, sums);
          }
#endif
        } else {
          for (int64_t m0 = 0; m0 < M; m0 += kDotRows) {
            deja_cpu::with_rows<kDotRows>(M - m0, [&](auto rows) {
              dot_rows<decltype(rows)::value>(xp, K, packed.data(), m0, yp, N, n0, width);
            });
          }
        }
      }
#ifdef DEJA_AMX
      if (amx) _tile_release();
#endif
    });
  });
  return y.view(shape);
}

int64_t amx_rows() { return use_amx() ? kRowsFrom : 0; }
int64_t slab_rows() { return use_amx() ? kRowsFrom : kDotRowsFrom; }

#else

at::Tensor linear_slabs(const at::Tensor&, const at::Tensor&, bool, const at::Tensor&,
                        const at::Tensor*) {
  TORCH_CHECK(false, "this build has no bfloat16 dot products (linear_bf16_rows() is 0)");
  return at::Tensor();
}

int64_t amx_rows() { return 0; }
int64_t slab_rows() { return 0; }

#endif

}  // namespace

namespace deja_cpu {

at::Tensor q4_linear_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                          const at::Tensor& zero) {
  return linear_slabs(x, qs, true, scale, &zero);
}

at::Tensor q8_linear_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  return linear_slabs(x, qs, false, scale, nullptr);
}

}  // namespace deja_cpu

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) {
  // Rows of bfloat16 x from which layers/quantized.py takes q4_linear_bf16 / q8_linear_bf16; 0:
  // not on this build or CPU. linear_amx_rows: the same where they run on AMX tiles, else 0.
  m.def("linear_bf16_rows", []() -> int64_t { return slab_rows(); });
  m.def("linear_amx_rows", []() -> int64_t { return amx_rows(); });
  m.def("q4_linear_bf16", &deja_cpu::q4_linear_bf16);
  m.def("q8_linear_bf16", &deja_cpu::q8_linear_bf16);
}
