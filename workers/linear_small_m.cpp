// A linear layer for few rows (decode steps: a handful of tokens), bf16 on CPUs with
// AVX512-BF16: out [M, N] = x [M, K] @ W [N, K]^T (+ bias [N]), float32 sums, rounded once to
// bf16 (as oneDNN's bf16 GEMM does; only the summation order differs).
//
// At a few rows a linear only streams its weights (2 N K bytes, a few flops a byte), so it runs
// at the memory's rate or not at all: each thread walks a contiguous range of W's rows (one
// stream the hardware prefetcher follows), four rows at a time against every x row (x stays in
// L1), one vdpbf16ps per 32 bf16 of a row, prefetching a few tiles ahead. oneDNN's prepacked
// GEMM streams cold weights at about half the memory rate on these shapes.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"

namespace {

constexpr int ROWS = 4;        // W rows a tile reads together
// x rows a call takes (the caller checks): measured against oneDNN's packed GEMM with every
// layer's weights cold (SmolLM2's shapes, 2 threads), this wins up to 6 rows and loses at 8
constexpr int64_t MAX_M = 4;
// how far ahead (in tiles of ROWS rows) each thread prefetches its weights into L2: the
// hardware prefetcher alone ramps up too slowly on each call's short streams (~16 GB/s cold
// against ~27 with 4 tiles ahead; 1-2 tiles or L1 hints gained less)
constexpr int PREFETCH_TILES = 4;

// the R x MC dot products of W rows [R, K] with x rows [MC, K] (row strides K), into
// sums[m * R + r]; the tail of K below 32 read with a mask
template <int R, int MC>
AVX512_BF16 inline void tile(const uint16_t* x, const uint16_t* w, int64_t K, float* sums) {
  __m512 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r)   // rows PREFETCH_TILES tiles on, into L2 (past W's end: no-op)
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_TILES * ROWS) * K + k),
                   _MM_HINT_T1);
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (k < K) {   // masked-off lanes load as zero and add nothing
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) sums[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// rows [n0, n0 + R) of W against x rows [m0, m0 + MC), written (with bias) to out
template <int R, int MC>
AVX512_BF16 inline void rows(uint16_t* out, const uint16_t* x, const uint16_t* w,
                             const uint16_t* bias, int64_t n0, int64_t m0, int64_t N,
                             int64_t K) {
  float sums[MC * R];
  tile<R, MC>(x + m0 * K, w + n0 * K, K, sums);
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      const float b = bias != nullptr ? raypd_bf16::bf16_to_f(bias[n0 + r]) : 0.f;
      out[(m0 + m) * N + n0 + r] = raypd_bf16::f_to_bf16(sums[m * R + r] + b);
    }
}

// every x row (in chunks of up to 4) against W rows [n0, n0 + R)
template <int R>
AVX512_BF16 void row_block(uint16_t* out, const uint16_t* x, const uint16_t* w,
                           const uint16_t* bias, int64_t n0, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows<R, 4>(out, x, w, bias, n0, m, N, K);
  switch (M - m) {
    case 3: rows<R, 3>(out, x, w, bias, n0, m, N, K); break;
    case 2: rows<R, 2>(out, x, w, bias, n0, m, N, K); break;
    case 1: rows<R, 1>(out, x, w, bias, n0, m, N, K); break;
    default: break;
  }
}

}  // namespace

extern "C" int64_t raypd_linear_small_m_max() {
  return raypd_bf16::cpu_has_avx512_bf16() ? MAX_M : 0;
}

// out [M, N], x [M, K], w [N, K], bias [N] or null: bf16, contiguous; 1 <= M <= MAX_M on a CPU
// with AVX512-BF16 (raypd_linear_small_m_max() > 0), both checked by the caller.
extern "C" void raypd_linear_small_m(uint16_t* out, const uint16_t* x, const uint16_t* w,
                                     const uint16_t* bias, int64_t M, int64_t N, int64_t K,
                                     int nthreads) {
  const int64_t tiles = N / ROWS;
  // a few contiguous ranges of rows per thread (not one row tile at a time): each thread's
  // weights are one stream
#pragma omp parallel for num_threads(std::max(1, nthreads)) schedule(static) \
    if (nthreads > 1 && N * K >= (1 << 16))
  for (int64_t t = 0; t < tiles; ++t) row_block<ROWS>(out, x, w, bias, t * ROWS, M, N, K);
  for (int64_t n = tiles * ROWS; n < N; ++n) row_block<1>(out, x, w, bias, n, M, N, K);
}
