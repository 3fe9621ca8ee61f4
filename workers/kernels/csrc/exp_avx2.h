// AVX2 + FMA helpers shared by the native kernels (paged_decode.cpp, linear_w16.cpp,
// attention_f32.cpp): the target attribute, the run-time check, e^x for a softmax.
#pragma once

#include <immintrin.h>

// a function compiled for AVX2 + FMA (called only where cpu_has_avx2_fma() says so)
#define AVX2_FMA __attribute__((target("avx2,fma")))

namespace raypd_simd {

inline bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// e^x for x <= 0 on 8 lanes (as exp_avx512.h: 2^n e^(f ln 2), Taylor to the 7th power, relative
// error below 2e-7); x below -87 gives e^-87, not 0 (callers mask what must be 0)
AVX2_FMA inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 y = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));   // 2^n: n >= -126 after the clamp
}

}  // namespace raypd_simd
