// Runs deja's CUDA kernels on the CPU, for tests on machines without a GPU.
//
// Each CUDA thread of a CTA is one std::thread; CTAs run one after another, so a kernel's
// __shared__ arrays become function-local statics shared by the CTA's threads. __syncthreads is a
// barrier over the CTA, __shfl_xor_sync exchanges values through a per-warp buffer between two
// barrier phases over the warp. This checks index arithmetic, masking, synchronization structure
// and numerics; it says nothing about speed, memory coalescing or real-hardware races.
#pragma once

#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define DEJA_HOST_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 {
  unsigned x, y, z;
};
inline thread_local emu_dim3 threadIdx{0, 0, 0};
inline thread_local emu_dim3 blockIdx{0, 0, 0};
inline emu_dim3 blockDim{1, 1, 1};
inline emu_dim3 gridDim{1, 1, 1};

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float expf(float x) { return std::exp(x); }
inline int max(int a, int b) { return a > b ? a : b; }

inline float f16_bits_to_float(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
inline unsigned short float_to_f16_bits(float f) {
  _Float16 x = static_cast<_Float16>(f);  // round to nearest even, like cvt.rn.f16.f32
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}

// ---- CTA-wide state of the emulated launch --------------------------------------------------
inline std::barrier<>* emu_cta_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
inline std::vector<unsigned long long> emu_shfl_buffer;  // [warps * 32]

inline void __syncthreads() { emu_cta_barrier->arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned long long bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  emu_shfl_buffer[warp * 32 + lane] = bits;
  emu_warp_barriers[warp]->arrive_and_wait();
  bits = emu_shfl_buffer[warp * 32 + (lane ^ static_cast<unsigned>(lane_mask))];
  emu_warp_barriers[warp]->arrive_and_wait();
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// ---- launching --------------------------------------------------------------------------------
// args[i] points to the i-th kernel argument, as with cuLaunchKernel.
template <typename... A, std::size_t... I>
inline void emu_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
inline void emu_launch(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned gz,
                       unsigned threads, void** args) {
  gridDim = {gx, gy, gz};
  blockDim = {threads, 1, 1};
  const unsigned warps = (threads + 31) / 32;
  std::barrier<> cta(threads);
  emu_cta_barrier = &cta;
  emu_warp_barriers.clear();
  for (unsigned w = 0; w < warps; ++w) {
    const unsigned lanes = (w + 1) * 32 <= threads ? 32 : threads - w * 32;
    emu_warp_barriers.push_back(std::make_unique<std::barrier<>>(lanes));
  }
  emu_shfl_buffer.assign(warps * 32, 0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([=, &cta] {
      threadIdx = {t, 0, 0};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            emu_call(kernel, args, std::index_sequence_for<A...>{});
            cta.arrive_and_wait();  // the next CTA reuses the __shared__ statics
          }
    });
  }
  for (auto& th : pool) th.join();
}

// Comma-separated byte sizes of a kernel's parameters, to check the caller's argument list.
template <typename... A>
inline const char* emu_signature(void (*)(A...)) {
  static const std::string sig = [] {
    std::string s;
    ((s += std::to_string(sizeof(A)) + ","), ...);
    return s;
  }();
  return sig.c_str();
}

// EMU_EXPORT(symbol, kernel<...>) defines symbol(gx, gy, gz, threads, args) and symbol_sig().
#define EMU_EXPORT(SYM, ...)                                                                  \
  extern "C" void SYM(unsigned gx, unsigned gy, unsigned gz, unsigned threads, void** args) { \
    emu_launch(&__VA_ARGS__, gx, gy, gz, threads, args);                                      \
  }                                                                                           \
  extern "C" const char* SYM##_sig() { return emu_signature(&__VA_ARGS__); }
