// bf16 carried as its raw 16 bits, for the native kernels (paged_decode.cpp, fused_ops.cpp,
// linear_small_m.cpp):
// bf16 -> float is exact; float -> bf16 rounds to nearest even, as torch does (NaN stays NaN).
#pragma once

// a function compiled for AVX512-BF16 (called only where cpu_has_avx512_bf16() says so)
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

#include <cmath>
#include <cstdint>
#include <cstring>

namespace raypd_bf16 {

inline float bf16_to_f(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += ((u >> 16) & 1u) + 0x7FFFu;   // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// whether this CPU runs AVX512-BF16 (vdpbf16ps), checked at run time (the kernels are built
// with -march=native, but their AVX512-BF16 paths are chosen here, so a portable path stays)
inline bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace raypd_bf16
