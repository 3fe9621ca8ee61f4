// A linear layer for decode steps (1-16 rows), bf16 on CPUs with AMX-BF16: out [M, N] =
// x [M, K] @ W [N, K]^T (+ bias [N]), float32 sums rounded once to bf16 (round to nearest even,
// as oneDNN's bf16 GEMM; only the summation order differs).
//
// W is kept packed in the layout AMX's B tiles read (VNNI): blocks of 16 output columns, each
// block K/2 rows of 16 columns x 2 consecutive k (64 bytes), wp[nb][kp][n][2] = W[16 nb + n]
// [2 kp + {0, 1}], N padded to a multiple of 16 with zero rows (pack_vnni in
// workers/kernels/linears.py).
// A block of 16 k-pairs is one contiguous 1 KB B tile, and a thread's blocks are one stream.
//
// At 1-16 rows a linear only streams its weights (2 N K bytes), so the point is to stream them
// at the memory's rate. Measured with every layer's weights cold (SmolLM2's 4 shapes x 30
// layers + the LM head, 2 threads): oneDNN's packed GEMM ~15.5-16.5 ms a step at 1-16 rows;
// AVX512-BF16 dot products (linear_small_m.cpp) ~11.3 ms at 1 row but bound by instructions
// past 4 rows (25.6 ms at 16); AMX (one tdpbf16ps per 16 x 16 x 32 MACs) ~11.7-12.4 ms at any
// 2-16 rows. One row: vdpbf16ps on the same packed layout (each W load against x's broadcast
// k-pair) read 11.4 ms against AMX's 11.8-12.0, so it takes that path.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "bf16.h"

namespace {

using raypd_amx::TileConfig;

constexpr int64_t MAX_M = 16;   // rows of an A tile
// bytes ahead that each stream of W is prefetched into L2 (the hardware prefetcher alone ramps
// up too slowly on a call's short streams; 1-8 KB measured within noise of each other)
constexpr int PREFETCH_BYTES = 2048;

// tiles: 0, 1 = C (M x 16 float32, two column blocks), 2 = A (M x 32 bf16 of x), 3, 4 = B
AMX_BF16 void configure(int M) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 3; ++t) c.rows[t] = static_cast<uint8_t>(M), c.colsb[t] = 64;
  for (int t = 3; t < 5; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// column blocks nb0 and nb0 + 1 (if it exists) against every x row, by AMX
AMX_BF16 void amx_pair(uint16_t* out, const uint16_t* x, const uint16_t* wp,
                       const uint16_t* bias, int M, int64_t nb0, int64_t nblocks, int64_t N,
                       int64_t K) {
  const bool two = nb0 + 1 < nblocks;
  const uint16_t* b0 = wp + nb0 * K * 16;     // a block: K/2 k-pairs x 32 bf16
  const uint16_t* b1 = two ? b0 + K * 16 : b0;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < K; k += 32) {
    const char* p0 = reinterpret_cast<const char*>(b0 + k * 16);
    const char* p1 = reinterpret_cast<const char*>(b1 + k * 16);
    for (int line = 0; line < 1024; line += 64) {   // past W's end: a prefetch is a no-op
      _mm_prefetch(p0 + PREFETCH_BYTES + line, _MM_HINT_T1);
      if (two) _mm_prefetch(p1 + PREFETCH_BYTES + line, _MM_HINT_T1);
    }
    _tile_loadd(2, x + k, K * 2);
    _tile_loadd(3, p0, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (two) {
      _tile_loadd(4, p1, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  alignas(64) float sums[16 * 16];
  _tile_stored(0, sums, 64);
  raypd_bf16::store_sums(out, sums, 16, bias, M, N, nb0 * 16);
  if (two) {
    _tile_stored(1, sums, 64);
    raypd_bf16::store_sums(out, sums, 16, bias, M, N, (nb0 + 1) * 16);
  }
}

// one x row against column blocks [nb0, nb0 + NB): each 64-byte load of W (16 columns x one
// k-pair) against x's k-pair broadcast, one vdpbf16ps
template <int NB>
AMX_BF16 void row_blocks(uint16_t* out, const uint16_t* x, const uint16_t* wp,
                         const uint16_t* bias, int64_t nb0, int64_t N, int64_t K) {
  __m512 acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
  const uint16_t* w0 = wp + nb0 * K * 16;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * kp, 4);
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
    for (int j = 0; j < NB; ++j) {
      const uint16_t* p = w0 + (j * K / 2 + kp) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T1);
      acc[j] = _mm512_dpbf16_ps(acc[j], xb, (__m512bh)_mm512_loadu_si512(p));
    }
  }
  for (int j = 0; j < NB; ++j) {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, acc[j]);
    raypd_bf16::store_sums(out, sums, 16, bias, 1, N, (nb0 + j) * 16);
  }
}

bool amx_usable() {
  __builtin_cpu_init();
  if (!raypd_bf16::cpu_has_avx512_bf16() || !__builtin_cpu_supports("amx-tile") ||
      !__builtin_cpu_supports("amx-bf16"))
    return false;
  // Linux hands a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM = 0x1023,
  // XFEATURE_XTILEDATA = 18); without it the first tile instruction faults
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

}  // namespace

// the most rows a call takes: MAX_M, or 0 where the CPU (or the kernel) gives no AMX-BF16
extern "C" int64_t raypd_linear_amx_max() {
  static const bool usable = amx_usable();
  return usable ? MAX_M : 0;
}

// out [M, N], x [M, K] (contiguous), wp: W packed as above, bias [N] or null; bf16;
// 1 <= M <= raypd_linear_amx_max() and K a multiple of 32, both checked by the caller.
extern "C" void raypd_linear_amx(uint16_t* out, const uint16_t* x, const uint16_t* wp,
                                 const uint16_t* bias, int64_t M, int64_t N, int64_t K,
                                 int nthreads) {
  const int64_t nblocks = (N + 15) / 16, pairs = (nblocks + 1) / 2;
  const int threads = std::max(1, nthreads);
  const bool parallel = threads > 1 && N * K >= (1 << 16);
  if (M == 1) {   // contiguous ranges of block pairs per thread: each thread's W is one stream
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t p = 0; p < pairs; ++p) {
      if (2 * p + 1 < nblocks) row_blocks<2>(out, x, wp, bias, 2 * p, N, K);
      else row_blocks<1>(out, x, wp, bias, 2 * p, N, K);
    }
    return;
  }
#pragma omp parallel num_threads(threads) if (parallel)
  {
    configure(static_cast<int>(M));   // tile state is per thread
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p)
      amx_pair(out, x, wp, bias, static_cast<int>(M), 2 * p, nblocks, N, K);
    raypd_amx::release_tiles();
  }
}
