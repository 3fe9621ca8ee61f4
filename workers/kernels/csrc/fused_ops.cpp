// The compact model's small per-layer operations, fused (one pass over the data, float32
// inside, one rounding at the end): a residual add with the RMSNorm after it, rotary
// embedding applied in place with the new K/V written into their pool slots, and SiLU-and-mul.
// bf16 (carried as its raw 16 bits; float -> bf16 rounds to nearest even, as torch does) and
// float32 (`_f32`): float32 outputs are torch's up to the order of the RMSNorm's sum, the
// contraction of a*b +- c*d into one FMA and the exp's last bit (a few float32 ulps).
// Threads: OpenMP over tokens when there are many (a prefill chunk), `nthreads` of them.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "exp_avx512.h"

namespace {

inline float ld(const uint16_t* p, int64_t i) { return raypd_bf16::bf16_to_f(p[i]); }
inline float ld(const float* p, int64_t i) { return p[i]; }
inline void st(uint16_t* p, int64_t i, float f) { p[i] = raypd_bf16::f_to_bf16(f); }
inline void st(float* p, int64_t i, float f) { p[i] = f; }

constexpr int64_t PARALLEL_MIN_TOKENS = 32;

// h [T, D] (+= delta [T, D] when delta is not null, rounded to S as torch's add does), then
// x [T, D] = h * rsqrt(mean(h^2) + eps) * weight, computed in float32, rounded once.
template <typename S>
void add_rms_norm(S* x, S* h, const S* delta, const S* weight, int64_t T, int64_t D,
                  double eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    S* hr = h + t * D;
    float row[8192];
    float ss = 0.f;
    if (delta != nullptr) {
      const S* dr = delta + t * D;
      for (int64_t d = 0; d < D; ++d) {
        st(hr, d, ld(hr, d) + ld(dr, d));
        row[d] = ld(hr, d);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) row[d] = ld(hr, d);
    }
    for (int64_t d = 0; d < D; ++d) ss += row[d] * row[d];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
    S* xr = x + t * D;
    for (int64_t d = 0; d < D; ++d) st(xr, d, ld(weight, d) * (row[d] * inv));
  }
}

// qkv [T, H + 2 Hkv, D]: q and k heads rotated in place by each token's cos/sin [T, D]
// (x * cos + rotate_half(x) * sin, in float32, rounded once); then each token's k and v heads
// copied into the pool at its slot (k_cache, v_cache: [num_slots, Hkv, D]). Returns 1 (nothing
// done) when a slot is outside the pool.
template <typename S>
int rope_and_cache(S* qkv, const S* cos, const S* sin, S* k_cache, S* v_cache,
                   const int64_t* slots, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                   int64_t num_slots, int nthreads) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return 1;
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    S* row = qkv + t * width;
    const S* c = cos + t * D;
    const S* s = sin + t * D;
    for (int64_t hh = 0; hh < H + Hkv; ++hh) {
      S* x = row + hh * D;
      float a[512], b[512];
      for (int64_t d = 0; d < half; ++d) { a[d] = ld(x, d); b[d] = ld(x, d + half); }
      for (int64_t d = 0; d < half; ++d) {
        st(x, d, a[d] * ld(c, d) - b[d] * ld(s, d));
        st(x, d + half, b[d] * ld(c, d + half) + a[d] * ld(s, d + half));
      }
    }
    const int64_t slot = slots[t];
    std::memcpy(k_cache + slot * Hkv * D, row + H * D, Hkv * D * sizeof(S));
    std::memcpy(v_cache + slot * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(S));
  }
  return 0;
}

// out [T, I] = silu(gate) * up of gate_up [T, 2 I] (gate first), in float32, rounded once.
template <typename S>
void silu_mul(S* out, const S* gate_up, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    const S* g = gate_up + t * 2 * I;
    const S* u = g + I;
    S* o = out + t * I;
    for (int64_t i = 0; i < I; ++i) {
      const float x = ld(g, i);
      st(o, i, x / (1.f + std::exp(-x)) * ld(u, i));
    }
  }
}

// The bf16 SiLU-and-mul on AVX512 (where cpu_has_avx512_bf16()): 16 values a step, silu(x) =
// x / (1 + e^-x) as x e / (1 + e) for x < 0 and x / (1 + e) else, e = e^-|x| (the softmaxes'
// exp, 2e-7 relative), the reciprocal by rcp14 and a Newton step; rounded once to bf16. (The
// scalar loop called glibc's vector expf and divided: ~1.5 G values/s on 2 cores, where a
// 2,048-token prefill spends 2 ms a layer.)
// (a function, not a lambda: a lambda does not inherit its caller's target attribute, so on a
// CPU without AVX-512 (-march=native lacking it) its intrinsics would not compile)
AVX512_BF16 static inline __m512 load_bf16_avx512(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

AVX512_BF16 void silu_mul_bf16_avx512(uint16_t* out, const uint16_t* gate_up, int64_t T,
                                      int64_t I, int nthreads) {
  const auto load = load_bf16_avx512;
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = gate_up + t * 2 * I;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 k = I - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (I - i)) - 1);
      const __m512 x = load(g + i, k);
      const __m512 e = raypd_simd::exp_nonpositive(
          _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __m512 d = _mm512_add_ps(one, e);
      __m512 r = _mm512_rcp14_ps(d);
      r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));
      const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sig = _mm512_mask_mul_ps(r, neg, r, e);   // 1 / (1 + e), or e / (1 + e)
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(x, sig), load(u + i, k));
      _mm256_mask_storeu_epi16(o + i, k, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

}  // namespace

extern "C" {

void raypd_add_rms_norm(uint16_t* x, uint16_t* h, const uint16_t* delta, const uint16_t* weight,
                        int64_t T, int64_t D, double eps, int nthreads) {
  add_rms_norm(x, h, delta, weight, T, D, eps, nthreads);
}
void raypd_add_rms_norm_f32(float* x, float* h, const float* delta, const float* weight,
                            int64_t T, int64_t D, double eps, int nthreads) {
  add_rms_norm(x, h, delta, weight, T, D, eps, nthreads);
}

int raypd_rope_and_cache(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin,
                         uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots, int64_t T,
                         int64_t H, int64_t Hkv, int64_t D, int64_t num_slots, int nthreads) {
  return rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, T, H, Hkv, D, num_slots,
                        nthreads);
}
int raypd_rope_and_cache_f32(float* qkv, const float* cos, const float* sin, float* k_cache,
                             float* v_cache, const int64_t* slots, int64_t T, int64_t H,
                             int64_t Hkv, int64_t D, int64_t num_slots, int nthreads) {
  return rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, T, H, Hkv, D, num_slots,
                        nthreads);
}

void raypd_silu_mul(uint16_t* out, const uint16_t* gate_up, int64_t T, int64_t I, int nthreads) {
  static const bool avx512 = raypd_bf16::cpu_has_avx512_bf16();
  if (avx512) silu_mul_bf16_avx512(out, gate_up, T, I, nthreads);
  else silu_mul(out, gate_up, T, I, nthreads);
}
void raypd_silu_mul_f32(float* out, const float* gate_up, int64_t T, int64_t I, int nthreads) {
  silu_mul(out, gate_up, T, I, nthreads);
}

}  // extern "C"
