// A packed int4 weight expanded to a dense one, for the quantized linear's many-row path.
//
// Built into the same library as the paged-attention kernel (engine/worker/attention/cpu_kernel.py
// compiles every source); registered as torch.ops.deja_cpu_attn.int4_dequant_t, which writes the
// expanded weight transposed ([K, N]: the layout that lets it vectorize; x @ it is the product).
//
// torch's _weight_int4pack_mm_for_cpu costs time in proportion to the rows (3.4x a dense bf16
// linear from 32 rows on, on a 2-core EPYC); a dense product on the weight expanded once per call
// costs the expansion (one pass over the packed bytes) plus the dense product. layers/quantized.py
// takes this path above a row threshold and in float32 (where torch's int4 kernel is scalar).
//
// Layout read: the one _convert_weight_to_int4pack_for_cpu writes with blocks of B rows (64 on its
// AVX-512 build, 32 on AVX2): packed uint8 [N / B, K, B / 2], byte j of (block b, column k) holds
// row B b + j in its low nibble and row B b + j + B / 2 in its high nibble. layers/quantized.py
// finds B on a probe weight before use and keeps torch's kernel where neither fits.
// Each weight is (q - 8) * scale + zero with scales_and_zeros [K / group, N, 2].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

template <int kHalf, typename out_t, typename sz_t>
void dequant_columns(const uint8_t* packed, const sz_t* sz, out_t* out, int64_t N, int64_t K,
                     int64_t group, int64_t first_k, int64_t last_k) {
  // out is the transposed weight [K, N]: for one k every block's kHalf bytes expand into
  // 2 kHalf contiguous outputs (rows j and j + kHalf), scales read along N: all of it vectorizes.
  constexpr int64_t kBlockRows = 2 * kHalf;
  float lo[kHalf], hi[kHalf];
  for (int64_t k = first_k; k < last_k; ++k) {
    const sz_t* szg = sz + (k / group) * N * 2;
    out_t* o = out + k * N;
    for (int64_t b = 0; b < N / kBlockRows; ++b) {
      const uint8_t* bytes = packed + (b * K + k) * kHalf;
      for (int j = 0; j < kHalf; ++j) {
        lo[j] = static_cast<float>((bytes[j] & 15) - 8);
        hi[j] = static_cast<float>((bytes[j] >> 4) - 8);
      }
      const int64_t n0 = b * kBlockRows;
      for (int j = 0; j < kHalf; ++j) {
        const int64_t n = n0 + j;
        o[n] = static_cast<out_t>(lo[j] * static_cast<float>(szg[2 * n]) +
                                  static_cast<float>(szg[2 * n + 1]));
      }
      for (int j = 0; j < kHalf; ++j) {
        const int64_t n = n0 + kHalf + j;
        o[n] = static_cast<out_t>(hi[j] * static_cast<float>(szg[2 * n]) +
                                  static_cast<float>(szg[2 * n + 1]));
      }
    }
  }
}

at::Tensor int4_dequant_t(const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                          int64_t group, int64_t block_rows) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be a contiguous uint8 [N, K / 2]");
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.is_contiguous(),
              "scales_and_zeros must be a contiguous [K / group, N, 2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(block_rows == 32 || block_rows == 64, "block_rows must be 32 or 64");
  TORCH_CHECK(N % block_rows == 0, "N must be a multiple of ", block_rows, ", got ", N);
  TORCH_CHECK(group > 0 && K % group == 0, "K must be a multiple of the group");
  TORCH_CHECK(scales_and_zeros.size(0) == K / group && scales_and_zeros.size(1) == N &&
                  scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be [K / group, N, 2]");
  auto out = at::empty({K, N}, scales_and_zeros.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, scales_and_zeros.scalar_type(), "int4_dequant_t", [&] {
        const scalar_t* sz = scales_and_zeros.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        at::parallel_for(0, K, 16, [&](int64_t begin, int64_t end) {
          if (block_rows == 64) {
            dequant_columns<32, scalar_t, scalar_t>(p, sz, o, N, K, group, begin, end);
          } else {
            dequant_columns<16, scalar_t, scalar_t>(p, sz, o, N, K, group, begin, end);
          }
        });
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deja_cpu_attn, m) { m.def("int4_dequant_t", &int4_dequant_t); }
