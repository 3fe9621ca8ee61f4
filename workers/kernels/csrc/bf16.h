// bf16 carried as its raw 16 bits, for the native kernels (paged_decode.cpp, fused_ops.cpp,
// linear_small_m.cpp, linear_amx.cpp):
// bf16 -> float is exact; float -> bf16 rounds to nearest even, as torch does (NaN stays NaN).
#pragma once

// a function compiled for AVX512-BF16 (called only where cpu_has_avx512_bf16() says so)
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

#include <immintrin.h>

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

// M rows of 16 float32 sums (row m at sums + m * stride) + bias [n0, n0 + 16) -> bf16 columns
// [n0, min(N, n0 + 16)) of out [M, N], each rounded once to nearest even (the linears' stores)
AVX512_BF16 inline void store_sums(uint16_t* out, const float* sums, int64_t stride,
                                   const uint16_t* bias, int64_t M, int64_t N, int64_t n0) {
  const __mmask16 mask = N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + m * stride), b);
    _mm256_mask_storeu_epi16(out + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

}  // namespace raypd_bf16
