// The compact model's small per-layer operations, fused (one pass over the data, float32
// inside, one rounding at the end): a residual add with the RMSNorm after it, rotary
// embedding applied in place with the new K/V written into their pool slots, and SiLU-and-mul.
// bf16 only (a float32 model keeps torch's own ops, which match transformers bit for bit).
// bf16 is carried as its raw 16 bits; float -> bf16 rounds to nearest even, as torch does.
// Threads: OpenMP over tokens when there are many (a prefill chunk), `nthreads` of them.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

namespace {

inline float ld(const uint16_t* p, int64_t i) { return raypd_bf16::bf16_to_f(p[i]); }
inline uint16_t bf(float f) { return raypd_bf16::f_to_bf16(f); }

constexpr int64_t PARALLEL_MIN_TOKENS = 32;

}  // namespace

// h [T, D] (+= delta [T, D] when delta is not null, rounded to bf16 as torch's add does), then
// x [T, D] = h * rsqrt(mean(h^2) + eps) * weight, computed in float32, rounded once.
extern "C" void raypd_add_rms_norm(uint16_t* x, uint16_t* h, const uint16_t* delta,
                                   const uint16_t* weight, int64_t T, int64_t D, double eps,
                                   int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* hr = h + t * D;
    float row[8192];
    float ss = 0.f;
    if (delta != nullptr) {
      const uint16_t* dr = delta + t * D;
      for (int64_t d = 0; d < D; ++d) {
        const uint16_t r = bf(ld(hr, d) + ld(dr, d));
        hr[d] = r;
        row[d] = ld(&r, 0);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) row[d] = ld(hr, d);
    }
    for (int64_t d = 0; d < D; ++d) ss += row[d] * row[d];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
    uint16_t* xr = x + t * D;
    for (int64_t d = 0; d < D; ++d) xr[d] = bf(row[d] * inv * ld(weight, d));
  }
}

// qkv [T, H + 2 Hkv, D]: q and k heads rotated in place by each token's cos/sin [T, D]
// (x * cos + rotate_half(x) * sin, in float32, rounded once); then each token's k and v heads
// copied into the pool at its slot (k_cache, v_cache: [num_slots, Hkv, D]). Returns 1 (nothing
// done) when a slot is outside the pool.
extern "C" int raypd_rope_and_cache(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin,
                                    uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots,
                                    int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                    int64_t num_slots, int nthreads) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return 1;
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = qkv + t * width;
    const uint16_t* c = cos + t * D;
    const uint16_t* s = sin + t * D;
    for (int64_t hh = 0; hh < H + Hkv; ++hh) {
      uint16_t* x = row + hh * D;
      float a[512], b[512];
      for (int64_t d = 0; d < half; ++d) { a[d] = ld(x, d); b[d] = ld(x, d + half); }
      for (int64_t d = 0; d < half; ++d) {
        x[d] = bf(a[d] * ld(c, d) - b[d] * ld(s, d));
        x[d + half] = bf(b[d] * ld(c, d + half) + a[d] * ld(s, d + half));
      }
    }
    const int64_t slot = slots[t];
    std::memcpy(k_cache + slot * Hkv * D, row + H * D, Hkv * D * sizeof(uint16_t));
    std::memcpy(v_cache + slot * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(uint16_t));
  }
  return 0;
}

// out [T, I] = silu(gate) * up of gate_up [T, 2 I] (gate first), in float32, rounded once.
extern "C" void raypd_silu_mul(uint16_t* out, const uint16_t* gate_up, int64_t T, int64_t I,
                               int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && T >= PARALLEL_MIN_TOKENS)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = gate_up + t * 2 * I;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * I;
    for (int64_t i = 0; i < I; ++i) {
      const float x = ld(g, i);
      o[i] = bf(x / (1.f + std::exp(-x)) * ld(u, i));
    }
  }
}
