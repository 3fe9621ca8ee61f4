// A float32 linear layer for few rows (decode steps) whose weights are bf16 values: out [M, N] =
// x [M, K] @ W [N, K]^T (+ bias [N]), x, out and bias float32, W stored as bf16, AVX2 + FMA.
//
// A float32 model loaded from a bf16 checkpoint (SmolLM2's) holds weights that are bf16 values
// widened; stored as bf16 they lose nothing (bf16 -> float32 is exact), so every product and
// every float32 sum is what the float32 GEMM computes, only in another order. At a few rows a
// linear only streams its weights, so reading half the bytes is up to twice as fast: the case
// of a CPU without native bf16 (AVX2 only, such as AMD Zen 3), where the model runs in float32.
//
// Each thread walks a contiguous range of W's rows (one stream the hardware prefetcher follows),
// ROWS rows at a time against every x row (x stays in L1): 8 bf16 of a row are widened to 8
// floats (zero-extend, shift left 16) once per x chunk of MC rows and multiplied into MC x ROWS
// accumulators, prefetching a few tiles ahead into L2.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "exp_avx2.h"

namespace {

constexpr int ROWS = 4;        // W rows a tile reads together
constexpr int MC_MAX = 3;      // x rows a tile multiplies: ROWS x MC_MAX accumulators + ROWS weights
// x rows a call takes (the caller checks): measured against oneDNN's packed float32 GEMM on
// SmolLM2's shapes, every layer's weights cold, 2 threads on an AVX2 Zen 3, this wins up to 16
// rows (14.9 against 28.6 ms at 1 row, 42.6 against 52.0 at 16) and ties at 24
constexpr int64_t MAX_M = 16;
constexpr int PREFETCH_TILES = 4;

AVX2_FMA inline __m256 widen8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

AVX2_FMA inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the R x MC dot products of W rows [R, K] with x rows [MC, K] (row strides K) into
// sums[m * R + r]; K's tail below 8 summed one by one
template <int R, int MC>
AVX2_FMA inline void tile(const float* x, const uint16_t* w, int64_t K, float* sums) {
  __m256 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k & 31) == 0)   // one prefetch per 64-byte line of each row, PREFETCH_TILES tiles on
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_TILES * ROWS) * K + k),
                     _MM_HINT_T1);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen8(w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum8(acc[m][r]);
      for (int64_t j = k; j < K; ++j) s += x[m * K + j] * raypd_bf16::bf16_to_f(w[r * K + j]);
      sums[m * R + r] = s;
    }
}

// W rows [n0, n0 + R) against every x row, MC_MAX rows at a time, written (with bias) to out
template <int R>
AVX2_FMA void row_block(float* out, const float* x, const uint16_t* w, const float* bias,
                        int64_t n0, int64_t M, int64_t N, int64_t K) {
  float sums[MC_MAX * R];
  for (int64_t m0 = 0; m0 < M; m0 += MC_MAX) {
    const int mc = static_cast<int>(std::min<int64_t>(MC_MAX, M - m0));
    if (mc == 3)
      tile<R, 3>(x + m0 * K, w + n0 * K, K, sums);
    else if (mc == 2)
      tile<R, 2>(x + m0 * K, w + n0 * K, K, sums);
    else
      tile<R, 1>(x + m0 * K, w + n0 * K, K, sums);
    for (int m = 0; m < mc; ++m)
      for (int r = 0; r < R; ++r)
        out[(m0 + m) * N + n0 + r] = sums[m * R + r] + (bias != nullptr ? bias[n0 + r] : 0.f);
  }
}

}  // namespace

extern "C" int64_t raypd_linear_w16_max() {
  return raypd_simd::cpu_has_avx2_fma() ? MAX_M : 0;
}

// out [M, N] float32, x [M, K] float32, w [N, K] bf16, bias [N] float32 or null, contiguous;
// 1 <= M <= raypd_linear_w16_max() (> 0: the CPU has AVX2 + FMA), both checked by the caller.
extern "C" void raypd_linear_w16(float* out, const float* x, const uint16_t* w, const float* bias,
                                 int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t tiles = N / ROWS;
#pragma omp parallel for num_threads(std::max(1, nthreads)) schedule(static) \
    if (nthreads > 1 && N * K >= (1 << 16))
  for (int64_t t = 0; t < tiles; ++t) row_block<ROWS>(out, x, w, bias, t * ROWS, M, N, K);
  for (int64_t n = tiles * ROWS; n < N; ++n) row_block<1>(out, x, w, bias, n, M, N, K);
}
