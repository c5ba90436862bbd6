// Shared device helpers for deja's kernels. Header-free on purpose: NVRTC (CuPy) and nvcc both
// compile it without cuda_fp16.h / cuda_bf16.h, so the kernels need no CUDA include directory at
// run time. The Python loaders paste this file in place of its #include line before compiling,
// so CuPy's kernel cache key covers it.
#pragma once

namespace deja {

// 16-bit storage types. Kernels only load, convert to fp32, compute in fp32, and convert back.
struct f16 {
  unsigned short bits;
};
struct bf16 {
  unsigned short bits;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- scalar conversions -------------------------------------------------------------------
// DEJA_HOST_EMULATION: the CPU test harness (tests/cuda_emu) supplies host versions.
#ifndef DEJA_HOST_EMULATION
__device__ __forceinline__ float f16_bits_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short float_to_f16_bits(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif

__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) {
  return __uint_as_float(static_cast<unsigned int>(b) << 16);
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) { return f16_bits_to_float(x.bits); }
__device__ __forceinline__ float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float x) {
  return f16{float_to_f16_bits(x)};
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  return bf16{float_to_bf16_bits(x)};
}

// ---- 16-byte vectors ----------------------------------------------------------------------
// A Vec16 holds 16 bytes: 8 elements of a 16-bit type or 4 floats. Pointers passed to load/store
// must be 16-byte aligned (the loaders check base pointers and strides).
template <typename T>
struct Vec16Traits {
  static constexpr int N = 16 / sizeof(T);
};

__device__ __forceinline__ uint4 load_vec16(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void store_vec16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Unpacks one 32-bit word holding two elements (element 2i in the low half) into two floats.
template <typename T>
__device__ __forceinline__ float2 unpack_word(unsigned int w);
template <>
__device__ __forceinline__ float2 unpack_word<bf16>(unsigned int w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 unpack_word<f16>(unsigned int w) {
  return make_float2(f16_bits_to_float(static_cast<unsigned short>(w & 0xffffu)),
                     f16_bits_to_float(static_cast<unsigned short>(w >> 16)));
}

// Converts a Vec16 of T into N floats.
template <typename T>
__device__ __forceinline__ void vec16_to_float(uint4 v, float* out);
template <>
__device__ __forceinline__ void vec16_to_float<float>(uint4 v, float* out) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}
template <typename T>
__device__ __forceinline__ void vec16_to_float(uint4 v, float* out) {
  float2 a = unpack_word<T>(v.x), b = unpack_word<T>(v.y);
  float2 c = unpack_word<T>(v.z), d = unpack_word<T>(v.w);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
  out[4] = c.x, out[5] = c.y, out[6] = d.x, out[7] = d.y;
}

// Loads elements p[0], p[1] (p must be 4-byte aligned for 16-bit T, 8-byte for float).
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* p) {
  return unpack_word<T>(*reinterpret_cast<const unsigned int*>(p));
}
template <>
__device__ __forceinline__ float2 load_pair<float>(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// Stores two floats as elements p[0], p[1].
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float a, float b) {
  unsigned int lo = from_float<T>(a).bits, hi = from_float<T>(b).bits;
  *reinterpret_cast<unsigned int*>(p) = lo | (hi << 16);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}

// ---- fp8 (e4m3) KV cache ------------------------------------------------------------------
// A cache element of an fp8 cache: float8_e4m3fn bits (1 sign, 4 exponent with bias 7, 3
// mantissa; no infinities, 0x7f / 0xff are NaN, largest finite 448). The cache holds x / scale;
// the kernels fold the K scale into the softmax scale and apply the V scale to the output, so
// they only convert codes to floats.
struct fp8e4m3 {
  unsigned char bits;
};

// e4m3's sign, exponent and mantissa placed in a float's bits read as value * 2^-120, exactly,
// subnormals included (float keeps denormals: no -ftz).
__device__ __forceinline__ float fp8_e4m3_to_float(unsigned int b) {
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 1.329227995784916e36f;
}

// Round to nearest even and saturate to +-448, as torch's clamp + cast; NaN becomes 448.
__device__ __forceinline__ unsigned char float_to_fp8_e4m3(float x) {
  const unsigned int sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fabsf(x);
  if (!(a < 448.f)) return static_cast<unsigned char>(sign | 0x7eu);
  if (a < 0.015625f) {  // subnormal: multiples of 2^-9 (8 * 2^-9 is the smallest normal, 0x08)
    return static_cast<unsigned char>(sign | static_cast<unsigned int>(rintf(a * 512.f)));
  }
  unsigned int u = __float_as_uint(a);
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
  const unsigned int exp = (u >> 23) - 120u;  // rebias 127 -> 7; in [1, 15] as 2^-6 <= a < 448
  return static_cast<unsigned char>(sign | (exp << 3) | ((u >> 20) & 7u));
}

// How the attention kernels read a lane's N = Vec16Traits<T>::N consecutive cache elements of
// type C (C == T: one 16-byte vector; fp8: N bytes) into floats (`to_float`) or into T's 16-byte
// vector (`to_vec16`, for tiles staged in shared memory as T).
template <typename T, typename C>
struct KVLoad;
template <typename T>
struct KVLoad<T, T> {
  __device__ __forceinline__ static uint4 load(const T* p) { return load_vec16(p); }
  __device__ __forceinline__ static void to_float(uint4 raw, float* out) {
    vec16_to_float<T>(raw, out);
  }
  __device__ __forceinline__ static uint4 to_vec16(uint4 raw) { return raw; }
};
template <typename T>
struct KVLoad<T, fp8e4m3> {
  static constexpr int N = Vec16Traits<T>::N;  // 8 (16-bit T) or 4 (float) bytes
  __device__ __forceinline__ static uint4 load(const fp8e4m3* p) {
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if constexpr (N == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(p);
      raw.x = w.x;
      raw.y = w.y;
    } else {
      raw.x = *reinterpret_cast<const unsigned int*>(p);
    }
    return raw;
  }
  __device__ __forceinline__ static void to_float(uint4 raw, float* out) {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = fp8_e4m3_to_float(((e < 4 ? raw.x : raw.y) >> (8 * (e % 4))) & 0xffu);
  }
  __device__ __forceinline__ static uint4 to_vec16(uint4 raw) {
    float f[N];
    to_float(raw, f);
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (N == 4) {
        w[i] = __float_as_uint(f[i]);
      } else {  // fp8 -> a 16-bit type is exact: e4m3 fits both
        w[i] = static_cast<unsigned int>(from_float<T>(f[2 * i]).bits) |
               (static_cast<unsigned int>(from_float<T>(f[2 * i + 1]).bits) << 16);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// ---- warp reductions ----------------------------------------------------------------------
// Butterfly over the WIDTH consecutive lanes that share lane / WIDTH; every lane gets the result.
// All 32 lanes of the warp must call it (full mask).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__host__ __device__ constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

}  // namespace deja
