// A linear layer for decode steps (1-64 rows), bf16 on CPUs with AVX512-BF16: out [M, N] =
// x [M, K] @ W [N, K]^T (+ bias [N]), float32 sums rounded once to bf16 (round to nearest even,
// as oneDNN's bf16 GEMM; only the summation order differs).
//
// W is read in the VNNI layout linear_amx.cpp reads (pack_vnni in workers/kernels/linears.py):
// blocks of 16 output columns, each K/2 k-pairs x 16 columns x 2 bf16 (64 bytes, one cache line and one
// zmm), N padded to a multiple of 16 with zero rows. A register tile is MC x NB accumulators
// (MC x rows, NB blocks of 16 columns, float32): per k-pair it loads NB lines of W and, for
// each x row, broadcasts the row's k-pair and runs NB vdpbf16ps. No horizontal sums (each
// accumulator lane is one output), and each W line serves MC rows.
//
// At a few rows a linear only streams its weights (2 N K bytes); at 16 rows it computes about
// as long as it streams (32 flops a weight: ~10 ms for SmolLM2's 135M weights at ~440 GFLOP/s,
// the bf16 matmul peak `raypd bench engine` measures on this 2-core VM, against ~8 ms to read
// them at ~33 GB/s). So the two must overlap:
// past MC rows the tile walks K in chunks of K_CHUNK pairs (NB x 2 KB of W, in L1) and runs
// every MC-row slice of x over a chunk before the next one, carrying its sums in a buffer, and
// every slice prefetches the next chunk; without the chunks the first slice streamed W while
// the others computed from L2, one after the other.
//
// Measured on the 2-core AVX512-BF16 VM (SmolLM2's 4 shapes x 30 layers + the LM head, every
// layer's weights cold, ms a step; /proc/cpuinfo: AMD EPYC, no AMX):
//   rows:                      1     4     8    16    32    48
//   this kernel               8.7   8.9   8.5  13.6  23.7  34.8
//   oneDNN packed GEMM       15.4  13.6  14.9  18.9  29.2  40.2
//   the kernel this replaced  9.8  11.0     -     -     -     -   (dot products along K
//     of plain W rows: one horizontal sum per output; bound by them past 4 rows)
// MC = 8, NB = 3 (24 accumulators of the 32 zmm) beat 6 x 4 and 12 x 2 by 5-15% at 8-24 rows.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"

namespace {

constexpr int64_t MAX_M = 64;     // rows a call takes (the caller checks)
constexpr int MC = 8;             // x rows per register tile
constexpr int NB = 3;             // column blocks (of 16) per register tile
constexpr int64_t K_CHUNK = 32;   // k-pairs of a chunk: NB x 2 KB of W
// how far ahead each W stream is prefetched into L2: one chunk (the hardware prefetcher alone
// ramps up too slowly on a call's short streams; 1-8 KB measured, 2 KB best by 5-10%)
constexpr int PREFETCH_BYTES = K_CHUNK * 64;

// x rows [m0, m0 + R) against blocks [nb0, nb0 + B) over k-pairs [kp0, kp1); float sums
// carried in acc_buf [R][B][16] (zeroed when first)
template <int R, int B>
AVX512_BF16 inline void tile(const uint16_t* x, const uint16_t* wp, int64_t nb0, int64_t m0,
                             int64_t K, int64_t kp0, int64_t kp1, float* acc_buf, bool first) {
  __m512 acc[R][B];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < B; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_buf + (m * B + j) * 16);
  const int64_t KP = K / 2;
  const uint16_t* w = wp + nb0 * KP * 32;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x + m0 * K);   // k-pairs of x's rows
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    __m512bh wv[B];
    for (int j = 0; j < B; ++j) {
      const uint16_t* p = w + (j * KP + kp) * 32;
      // past W's end: a prefetch is a no-op
      _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T1);
      wv[j] = (__m512bh)_mm512_loadu_si512(p);
    }
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[m * KP + kp]);
      for (int j = 0; j < B; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < B; ++j) _mm512_store_ps(acc_buf + (m * B + j) * 16, acc[m][j]);
}

template <int B>
AVX512_BF16 void tile_rows(int64_t rows, const uint16_t* x, const uint16_t* wp, int64_t nb0,
                           int64_t m0, int64_t K, int64_t kp0, int64_t kp1, float* buf,
                           bool first) {
  static_assert(MC == 8);
  switch (rows) {
    case 1: tile<1, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    case 2: tile<2, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    case 3: tile<3, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    case 4: tile<4, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    case 5: tile<5, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    case 6: tile<6, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    case 7: tile<7, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
    default: tile<8, B>(x, wp, nb0, m0, K, kp0, kp1, buf, first); break;
  }
}

// every x row against column blocks [nb0, nb0 + B), written (with bias) to out
template <int B>
AVX512_BF16 void blocks(uint16_t* out, const uint16_t* x, const uint16_t* wp,
                        const uint16_t* bias, int64_t nb0, int64_t M, int64_t N, int64_t K) {
  const int64_t slices = (M + MC - 1) / MC;
  const int64_t mc = (M + slices - 1) / slices;   // even slices: 9 rows are 5 + 4, not 8 + 1
  alignas(64) float buf[MAX_M * B * 16];
  const int64_t KP = K / 2;
  for (int64_t kp0 = 0; kp0 < KP; kp0 += K_CHUNK)
    for (int64_t m0 = 0; m0 < M; m0 += mc)
      tile_rows<B>(std::min(mc, M - m0), x, wp, nb0, m0, K, kp0, std::min(KP, kp0 + K_CHUNK),
                   buf + m0 * B * 16, kp0 == 0);
  for (int j = 0; j < B; ++j)   // row m's sums of block j at buf + (m B + j) 16, whatever m's slice
    raypd_bf16::store_sums(out, buf + j * 16, B * 16, bias, M, N, (nb0 + j) * 16);
}

}  // namespace

extern "C" int64_t raypd_linear_small_m_max() {
  return raypd_bf16::cpu_has_avx512_bf16() ? MAX_M : 0;
}

// out [M, N], x [M, K] (contiguous), wp: W packed as above, bias [N] or null; bf16; K even and
// 1 <= M <= raypd_linear_small_m_max() (> 0: the CPU has AVX512-BF16), checked by the caller.
extern "C" void raypd_linear_small_m(uint16_t* out, const uint16_t* x, const uint16_t* wp,
                                     const uint16_t* bias, int64_t M, int64_t N, int64_t K,
                                     int nthreads) {
  const int64_t nblocks = (N + 15) / 16;
  const int threads = std::max(1, nthreads);
  // each thread one contiguous range of blocks (its W is NB streams), balanced to one block
#pragma omp parallel num_threads(threads) if (threads > 1 && N * K >= (1 << 16))
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t b1 = nblocks * (t + 1) / T;
    int64_t b = nblocks * t / T;
    for (; b + NB <= b1; b += NB) blocks<NB>(out, x, wp, bias, b, M, N, K);
    static_assert(NB == 3);
    if (b1 - b == 2) blocks<2>(out, x, wp, bias, b, M, N, K);
    if (b1 - b == 1) blocks<1>(out, x, wp, bias, b, M, N, K);
  }
}
