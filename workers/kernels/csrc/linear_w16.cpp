// A float32 linear layer for few rows (decode steps) whose weights are bf16 values: out [M, N] =
// x [M, K] @ W [N, K]^T (+ bias [N]), x, out and bias float32, W stored as bf16, AVX2 + FMA.
//
// A float32 model loaded from a bf16 checkpoint (SmolLM2's) holds weights that are bf16 values
// widened; stored as bf16 they lose nothing (bf16 -> float32 is exact), so every product and
// every float32 sum is what the float32 GEMM computes, only in another order. At a few rows a
// linear only streams its weights, so reading half the bytes is up to twice as fast: the case
// of a CPU without native bf16 (AVX2 only, such as AMD Zen 3), where the model runs in float32.
//
// W is packed once (kernels.pack_w16) in tiles of ROWS rows: [ceil(N / 4)][K8 / 8][4][8] bf16,
// K8 = K rounded up to 8, zero past N and K, so each tile's 4 rows are read as one sequential
// stream, one 64-byte line per 8 columns (the plain [N][K] layout read 4 streams at once and
// ran at ~0.65x: SmolLM2's linears, 1 row, 2 threads, Zen 3, 21-23 against 14-16 ms). Each
// thread walks a contiguous range of tiles against every x row (x stays in L1): 8 bf16 of each
// row are widened to 8 floats (zero-extend, shift left 16) once per x chunk of MC rows and
// multiplied into MC x ROWS accumulators, prefetching PREFETCH_LINES lines ahead.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_avx2.h"

namespace {

constexpr int ROWS = 4;        // W rows a tile reads together
constexpr int MC_MAX = 3;      // x rows a tile multiplies: ROWS x MC_MAX accumulators + ROWS weights
// x rows a call takes (the caller checks): measured against oneDNN's packed float32 GEMM on
// SmolLM2's shapes, every layer's weights cold, 2 threads on an AVX2 Zen 3, this wins up to 16
// rows (14.9 against 28.6 ms at 1 row, 42.6 against 52.0 at 16) and ties at 24
constexpr int64_t MAX_M = 16;
constexpr int PREFETCH_LINES = 16;   // 1 KB ahead (measured best of 0, 8, 16, 32, 64)

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

// the ROWS x MC dot products of a packed tile's rows with x rows [MC, K8] (row stride K8) into
// sums[m * ROWS + r]
template <int MC>
AVX2_FMA inline void tile(const float* x, const uint16_t* wt, int64_t K8, float* sums) {
  __m256 acc[MC][ROWS];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t kc = 0; kc < K8 / 8; ++kc) {
    const uint16_t* w = wt + kc * 8 * ROWS;   // one 64-byte line: 8 columns of the 4 rows
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_LINES * 8 * ROWS), _MM_HINT_T0);
    __m256 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = widen8(w + r * 8);
    for (int m = 0; m < MC; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K8 + kc * 8);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < ROWS; ++r) sums[m * ROWS + r] = hsum8(acc[m][r]);
}

// tile t (W rows [4 t, 4 t + 4), those below N written) against every x row, with bias
AVX2_FMA void row_block(float* out, const float* x, const uint16_t* wt, const float* bias,
                        int64_t t, int64_t M, int64_t N, int64_t K8) {
  float sums[MC_MAX * ROWS];
  const int rows = static_cast<int>(std::min<int64_t>(ROWS, N - ROWS * t));
  for (int64_t m0 = 0; m0 < M; m0 += MC_MAX) {
    const int mc = static_cast<int>(std::min<int64_t>(MC_MAX, M - m0));
    if (mc == 3)
      tile<3>(x + m0 * K8, wt, K8, sums);
    else if (mc == 2)
      tile<2>(x + m0 * K8, wt, K8, sums);
    else
      tile<1>(x + m0 * K8, wt, K8, sums);
    for (int m = 0; m < mc; ++m)
      for (int r = 0; r < rows; ++r)
        out[(m0 + m) * N + ROWS * t + r] =
            sums[m * ROWS + r] + (bias != nullptr ? bias[ROWS * t + r] : 0.f);
  }
}

}  // namespace

extern "C" int64_t raypd_linear_w16_max() {
  return raypd_simd::cpu_has_avx2_fma() ? MAX_M : 0;
}

// out [M, N] float32 = x [M, K] float32 @ W^T (+ bias [N] float32 or null), W [N, K] packed as
// wp (the layout above), all contiguous; 1 <= M <= raypd_linear_w16_max() (> 0: the CPU has
// AVX2 + FMA), both checked by the caller.
extern "C" void raypd_linear_w16(float* out, const float* x, const uint16_t* wp, const float* bias,
                                 int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t K8 = (K + 7) / 8 * 8, tiles = (N + ROWS - 1) / ROWS;
  std::vector<float> padded;   // x with K8 columns (zeros past K) where K is not a multiple of 8
  if (K8 != K) {
    padded.assign(static_cast<size_t>(M * K8), 0.f);
    for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * K8, x + m * K, K * 4);
    x = padded.data();
  }
#pragma omp parallel for num_threads(std::max(1, nthreads)) schedule(static) \
    if (nthreads > 1 && N * K >= (1 << 16))
  for (int64_t t = 0; t < tiles; ++t) row_block(out, x, wp + t * ROWS * K8, bias, t, M, N, K8);
}
