// e^x on AVX512 registers, for the native kernels' softmaxes (paged_decode.cpp,
// attention_bf16.cpp).
#pragma once

#include <immintrin.h>

#include "bf16.h"

namespace raypd_simd {

// e^x for x <= 0 (a softmax's shifted scores): 2^n * e^(f ln 2), |f| <= 1/2, Taylor to the
// 7th power (relative error below 2e-7); very negative x gives 0
AVX512_BF16 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace raypd_simd
