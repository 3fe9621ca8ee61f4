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
  silu_mul(out, gate_up, T, I, nthreads);
}
void raypd_silu_mul_f32(float* out, const float* gate_up, int64_t T, int64_t I, int nthreads) {
  silu_mul(out, gate_up, T, I, nthreads);
}

}  // extern "C"
