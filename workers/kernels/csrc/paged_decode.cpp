// Decode attention that reads the paged KV pool in place (no gathered copy of the context).
// One query token per sequence. Work items are (sequence, context split): each reads its keys
// and values block by block, once, for every KV head and all G query heads of each (GQA),
// with an online softmax per head (running max and sum in float32), so no score row is kept;
// the splits of a long context (when there are fewer sequences than threads) are merged at
// the end. Threads: OpenMP over the items, `nthreads` of them. (Items were (sequence, KV head)
// until the AVX512 path read a tile for all heads at once: each token's heads x D are
// contiguous, so a block is one run of memory. SmolLM2, batch 16 x 570 tokens, 2 threads:
// 0.59 -> 0.56 ms a layer with every layer's pool cold; 15.5 -> 13.9 ms of a decode step.)
// Dot products, chosen at run time (the path workers/kernels/isa.py passes): for bf16 pools, on
// a CPU with AMX-BF16 the scores of a 16-token tile by tdpbf16ps (K rows straight from the
// block against the query heads' Q^T, packed once an item) and P.V by vdpbf16ps (SmolLM2,
// batch 16 x 1,100 tokens, 2 threads, every layer cold: 0.89 -> 0.76 ms a layer); AVX512-BF16 alone
// (vdpbf16ps: bf16 pairs into float32) for both where there is no AMX; else AVX2 + FMA on
// rows widened to float32 (float32 pools, and bf16 pools on CPUs such as Zen 3); else (or the
// portable path forced) plain loops the compiler vectorizes, rows converted to float32 first.
// Invariants: k_cache and v_cache are [num_blocks, block_size, kv_heads, head_dim] contiguous;
// block_tables[b] covers context_lens[b] tokens; window > 0 keeps only the last `window` keys.
// Plain C++ with a C ABI (no torch headers; workers/kernels/bindings.py loads it with ctypes and
// hands it the tensors' data pointers). bf16 is carried as its raw 16 bits; float -> bf16 rounds to
// nearest even, as torch does.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "exp_avx2.h"
#include "exp_avx512.h"

namespace {

struct bf16 { uint16_t x; };

using raypd_bf16::bf16_to_f;
using raypd_bf16::f_to_bf16;
using raypd_simd::exp_nonpositive;

template <typename T> inline void row_to_f(const T* src, float* dst, int64_t D);
template <> inline void row_to_f<float>(const float* src, float* dst, int64_t D) {
  std::memcpy(dst, src, D * sizeof(float));
}
template <> inline void row_to_f<bf16>(const bf16* src, float* dst, int64_t D) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t bits[512];
  for (int64_t d = 0; d < D; ++d) bits[d] = static_cast<uint32_t>(raw[d]) << 16;
  std::memcpy(dst, bits, D * sizeof(float));
}

constexpr int64_t MAX_G = 16;     // query heads per KV head handled in registers / stack
constexpr int64_t MAX_D = 512;
constexpr int64_t MAX_HKV = 256;  // KV heads (checked by the caller with the pool's shape)

struct Shape {
  int64_t H, D, bs, Hkv, W, G, row;   // row: elements between consecutive tokens of a block
  float scale;
};

// One item's partial result: for each of its G query heads, the running max `m`, the running
// sum of exp(score - m) `l`, and acc = sum of exp(score - m) * v (G x D).
struct Partial {
  float m[MAX_G], l[MAX_G];
  float* acc;
};

// A run of tokens [t0, t1) of sequence b, KV head h: online softmax into `p` (portable).
template <typename T>
void attend_portable(const T* qp, const T* kp, const T* vp, const int64_t* table,
                     const Shape& s, int64_t b, int64_t h, int64_t t0, int64_t t1, Partial& p) {
  const int64_t G = s.G, D = s.D;
  float qf[MAX_G * MAX_D / 4 + 64];
  std::vector<float> qv;
  float* q = qf;
  if (G * D > static_cast<int64_t>(sizeof(qf) / sizeof(float))) { qv.resize(G * D); q = qv.data(); }
  for (int64_t g = 0; g < G; ++g) {
    row_to_f(qp + (b * s.H + h * G + g) * D, q + g * D, D);
    for (int64_t d = 0; d < D; ++d) q[g * D + d] *= s.scale;
  }
  float kf[MAX_D], vf[MAX_D];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = table[b * s.W + t / s.bs] * s.bs + t % s.bs;
    row_to_f(kp + slot * s.row + h * D, kf, D);
    row_to_f(vp + slot * s.row + h * D, vf, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float sc = 0.f;
      for (int64_t d = 0; d < D; ++d) sc += qg[d] * kf[d];
      float* ag = p.acc + g * D;
      if (sc > p.m[g]) {                 // a new max: rescale what was summed so far
        const float c = std::exp(p.m[g] - sc);
        p.l[g] *= c;
        for (int64_t d = 0; d < D; ++d) ag[d] *= c;
        p.m[g] = sc;
      }
      const float e = std::exp(sc - p.m[g]);
      p.l[g] += e;
      for (int64_t d = 0; d < D; ++d) ag[d] += e * vf[d];
    }
  }
}

// lane i of the result = the sum of v[i]'s 16 lanes (15 adds and 30 shuffles for 16 sums)
AVX512_BF16 inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Where head_dim index d sits after vpunpck{l,h}wd of two rows (128-bit lanes interleaved):
// within each 32, lo lanes 0-15 hold d = 8L + j, hi lanes d = 8L + 4 + j (L = lane / 4, j =
// lane % 4), i.e. lo: 0-3, 8-11, 16-19, 24-27 | hi: 4-7, 12-15, 20-23, 28-31.
inline int64_t unpack_order(int64_t d) {
  const int64_t c = d / 32, r = d % 32, L = r / 8, j = r % 4, half = (r % 8) / 4;
  return c * 32 + half * 16 + L * 4 + j;
}

// The same for bf16 with AVX512-BF16, for every KV head of sequence b, 16 tokens at a time (a
// block of 16, or what a block holds of the run): a tile's rows are read once for all heads
// (each token's heads x D are contiguous, so a block is one run of memory), head after head.
// Each token's key is scored against the head's G query heads with vdpbf16ps (bf16 pairs into
// float32), the 16 scores of a query head reduced at once (every query head's before any
// softmax, so the reductions overlap), softmaxed as one vector, the sum kept per lane; then
// the probabilities, rounded to bf16, weight the values two tokens a vdpbf16ps into each query
// head's accumulator, kept in `unpack_order` for the run. D a multiple of 32. p[h]: KV head h's
// partial. G and D / 32 are template constants for the common shapes (GT, DKT > 0; 0: read
// from the Shape), so that a tile's scores, query rows and accumulators stay in registers: with
// them known only at run time they went through the stack, and a tile cost 1.5x as long (SmolLM2,
// batch 8 x 544 tokens, one thread, the pool in cache: 232 -> 157 us a layer).
struct HeadState {            // one KV head's running softmax, between tiles
  float* acc;                 // G x D, in unpack_order
  float* lsum;                // G x 16 lanes of l
};

// The rows of one block on their way into L2, a few lines at a time between a tile's
// instructions. Issued all at once (192 lines for a SmolLM2 block), the prefetches filled the
// core's miss queue and the tile's own loads waited behind them: reading and computing took turns
// (with every layer's pool cold, 11-13 GB/s; spread out, 20-23).
struct Prefetcher {
  const char* k = nullptr;    // the block's first K row and first V row
  const char* v = nullptr;
  int64_t bytes = 0;          // of each
  int64_t off = 0;            // how far it has got
  // (the two lines and rest()'s loop written out: with one shared line(o) helper, the pool-cold
  // bench read half as fast, 11 GB/s against 22-26, while the in-cache one was unchanged)
  inline void next2() {       // the next two lines of each (a fixed count: the caller unrolls)
    if (off < bytes) { _mm_prefetch(k + off, _MM_HINT_T1); _mm_prefetch(v + off, _MM_HINT_T1); }
    if (off + 64 < bytes) {
      _mm_prefetch(k + off + 64, _MM_HINT_T1);
      _mm_prefetch(v + off + 64, _MM_HINT_T1);
    }
    off += 128;
  }
  inline void rest() {        // whatever is left
    for (; off < bytes; off += 64) {
      _mm_prefetch(k + off, _MM_HINT_T1);
      _mm_prefetch(v + off, _MM_HINT_T1);
    }
  }
};

// krow[i], vrow[i]: the tile's 16 rows; those past n repeat row 0 (scored, masked, weighted 0)
// AMXT: the scores by AMX instead (see attend_bf16_avx512): ktile, kstride: the tile's K rows
// (16 of them, kstride bytes apart, this head's D at h * D); qt: the head's Q^T B tiles.
template <int GT, int DKT, bool AMXT>
AMX_BF16
inline void tile_head(const bf16* qp, const bf16* const* krow, const bf16* const* vrow,
                      const Shape& s, int64_t b, int64_t h, int64_t n, Partial& p,
                      const HeadState& st, Prefetcher& pf, const bf16* ktile, int64_t kstride,
                      const uint32_t* qt, float* sbuf) {
  const int64_t G = GT ? GT : s.G, DK = DKT ? DKT : s.D / 32;   // 32 bf16 per 512-bit register
  const int64_t D = DK * 32;
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  alignas(64) float prob[MAX_G][16];
  __m512 sc[GT ? GT : MAX_G];           // every query head's scores first: their reductions
  if constexpr (AMXT) {                 // S^T [16 tokens][G] = K (16 x D) . Q^T (D x G)
    _tile_zero(0);
    for (int64_t j = 0; j < DK; ++j) {
      _tile_loadd(1, ktile + h * D + j * 32, kstride);
      _tile_loadd(2, qt + j * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sbuf, 4 * G);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                               11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(G)));
    for (int64_t g = 0; g < G; ++g)
      sc[g] = _mm512_mul_ps(
          _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(g))),
                              sbuf, 4),
          _mm512_set1_ps(s.scale));
  } else
  for (int64_t g = 0; g < G; ++g) {     // overlap, no query head waits for the one before
    const bf16* qg = qp + (b * s.H + h * G + g) * D;
    __m512bh q[DKT ? DKT : MAX_D / 32];
    for (int64_t j = 0; j < DK; ++j) q[j] = (__m512bh)_mm512_loadu_si512(qg + j * 32);
    __m512 dots[16];
#pragma GCC unroll 16
    for (int64_t i = 0; i < 16; ++i) {
      if (g == 0) pf.next2();
      __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int64_t j = 0; j < DK; ++j)
        a = _mm512_dpbf16_ps(a, q[j], (__m512bh)_mm512_loadu_si512(krow[i] + h * D + j * 32));
      dots[i] = a;
    }
    sc[g] = _mm512_mul_ps(reduce16(dots), _mm512_set1_ps(s.scale));
  }
  for (int64_t g = 0; g < G; ++g) {
    const float mx = std::max(p.m[g], _mm512_mask_reduce_max_ps(valid, sc[g]));
    __m512 lsum = _mm512_load_ps(st.lsum + 16 * g);
    if (mx > p.m[g]) {                 // a new max: rescale what was summed so far (always
      // rescaling, without the branch, measured the same on random scores)
      const float c = p.m[g] > -FLT_MAX ? std::exp(p.m[g] - mx) : 0.f;
      const __m512 cv = _mm512_set1_ps(c);
      lsum = _mm512_mul_ps(lsum, cv);
      float* ag = st.acc + g * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(ag + d, _mm512_mul_ps(_mm512_load_ps(ag + d), cv));
      p.m[g] = mx;
    }
    const __m512 e = _mm512_maskz_mov_ps(
        valid, exp_nonpositive(_mm512_sub_ps(sc[g], _mm512_set1_ps(mx))));
    _mm512_store_ps(st.lsum + 16 * g, _mm512_add_ps(lsum, e));   // lane-wise: one reduction
    _mm512_store_ps(prob[g], e);                                  // at the end
  }
  // probabilities to bf16 (as the P.V product of flash attention does), two tokens a 32-bit
  // pair: one vdpbf16ps adds two tokens' values into a query head's 16 lanes
  alignas(64) int32_t ppair[MAX_G][8];
  for (int64_t g = 0; g < G; ++g)
    _mm256_store_si256(reinterpret_cast<__m256i*>(ppair[g]),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(prob[g])));
  // (two 32-value chunks a pass, or the pair loop unrolled: both measured slower)
  for (int64_t c = 0; c < DK; ++c) {
    __m512 lo[GT ? GT : MAX_G], hi[GT ? GT : MAX_G];
    for (int64_t g = 0; g < G; ++g) {
      lo[g] = _mm512_load_ps(st.acc + g * D + c * 32);
      hi[g] = _mm512_load_ps(st.acc + g * D + c * 32 + 16);
    }
    for (int64_t i = 0; i < n; i += 2) {   // an odd run's last pair: a zero probability
      if constexpr (AMXT) pf.next2();      // (no score loop to spread the prefetches over)
      const __m512i x = _mm512_loadu_si512(vrow[i] + h * D + c * 32);
      const __m512i y = _mm512_loadu_si512(vrow[i + 1] + h * D + c * 32);
      const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(x, y);
      const __m512bh vh = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int64_t g = 0; g < G; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(ppair[g][i / 2]);
        lo[g] = _mm512_dpbf16_ps(lo[g], vl, pp);
        hi[g] = _mm512_dpbf16_ps(hi[g], vh, pp);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      _mm512_store_ps(st.acc + g * D + c * 32, lo[g]);
      _mm512_store_ps(st.acc + g * D + c * 32 + 16, hi[g]);
    }
  }
}

// How many blocks ahead a work item's rows are prefetched: at the run's first tile, the blocks
// up to there at once; then at each block's first tile, the block PREFETCH_BLOCKS on, spread over
// the tile. Measured with every layer's pool cold (SmolLM2's shapes, batch 16, 30 layers' pools,
// blocks of 16 in random order, 2 threads): 1, 2, 3 and 6 within run-to-run noise of each other.
constexpr int64_t PREFETCH_BLOCKS = 3;
// The AVX2 path's distance (its float32 blocks are twice the bytes): float32, SmolLM2's shapes,
// batch 16, every layer's pool cold, on this path forced on a Zen 4: 1, 2, 3 and 5 blocks on
// within noise of each other (20-22 GB/s), against 14.5 for the next block issued at once.
constexpr int64_t PF_AVX2 = 2;

// Per-thread scratch for a work item's running state (reused: no allocation per item)
inline float* item_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats + 16) buf.resize(floats + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                  ~uintptr_t{63});
}

// A run's tile at t (block blk) of sequence b: at the run's first tile, the rows of the blocks
// up to `ahead` on at once; at each block's first tile, the block `ahead` on, returned to be
// spread over the tile (empty otherwise).
template <typename T>
Prefetcher tile_prefetch(const T* kp, const T* vp, const int64_t* table, const Shape& s,
                         int64_t b, int64_t t0, int64_t t1, int64_t t, int64_t ahead) {
  const int64_t blk = t / s.bs, last_block = (t1 - 1) / s.bs;
  auto rows = [&](int64_t pb) {   // where block pb's rows of the run start, and their bytes
    const int64_t r0 = std::max(t0, pb * s.bs), r1 = std::min(t1, (pb + 1) * s.bs);
    const int64_t slot = table[b * s.W + pb] * s.bs + r0 % s.bs;
    return Prefetcher{reinterpret_cast<const char*>(kp + slot * s.row),
                      reinterpret_cast<const char*>(vp + slot * s.row),
                      (r1 - r0) * s.row * static_cast<int64_t>(sizeof(T))};
  };
  if (t == t0)
    for (int64_t pb = blk + 1; pb < blk + ahead && pb <= last_block; ++pb) rows(pb).rest();
  if ((t == t0 || t % s.bs == 0) && blk + ahead <= last_block) return rows(blk + ahead);
  return Prefetcher{};
}

// AMX (AMXT): a tile's scores S^T [16 tokens][G] for a KV head as tdpbf16ps of its K rows (an
// A tile straight from the block: 16 rows of 32 head_dim values, a row of the pool apart) with
// the head's query rows as a B tile (Q^T, head_dim pairs x G, packed once a work item), stored,
// and gathered into one vector of 16 scores per query head: no vdpbf16ps per token and query
// head, no 16-way reductions (the scores were ~2/3 of a tile's instructions). A tile of fewer
// than 16 rows (a run's end, a block's end) is copied out first, so the tile load stays in the
// block. The values still go through vdpbf16ps: an AMX P.V wants V in token pairs, which the
// pool's [token][head][head_dim] layout is not.
AMX_BF16 inline void configure_scores(int64_t G) {
  raypd_amx::TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  c.rows[0] = 16, c.colsb[0] = static_cast<uint16_t>(4 * G);   // S^T: 16 tokens x G float32
  c.rows[1] = 16, c.colsb[1] = 64;                              // K: 16 tokens x 32 bf16
  c.rows[2] = 16, c.colsb[2] = static_cast<uint16_t>(4 * G);   // Q^T: 16 pairs x G
  _tile_loadconfig(&c);
}

template <int GT, int DKT, bool AMXT>
AMX_BF16
void attend_bf16_avx512(const bf16* qp, const bf16* kp, const bf16* vp, const int64_t* table,
                        const Shape& s, int64_t b, int64_t t0, int64_t t1, Partial* const* p) {
  const int64_t G = s.G, D = s.D, Hkv = s.Hkv;
  thread_local std::vector<uint32_t> qt_buf;     // [Hkv][D / 32][16 pairs][16]: Q^T B tiles
  thread_local std::vector<bf16> ktile_buf;      // a short tile's K rows, 16 x row
  alignas(64) float sbuf[16 * MAX_G];
  if constexpr (AMXT) {
    configure_scores(G);
    qt_buf.assign(Hkv * (D / 32) * 256, 0u);
    ktile_buf.resize(16 * s.row);
    const uint16_t* q16 = reinterpret_cast<const uint16_t*>(qp) + b * s.H * D;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = q16 + (h * G + g) * D;
        for (int64_t d = 0; d < D; d += 2)
          qt_buf[(h * (D / 32) + d / 32) * 256 + (d % 32) / 2 * 16 + g] =
              static_cast<uint32_t>(qg[d]) | static_cast<uint32_t>(qg[d + 1]) << 16;
      }
  }
  const int64_t per_head = G * (D + 16);
  float* base_state = item_scratch(Hkv * per_head);   // acc and lsum of every KV head
  HeadState st[MAX_HKV];
  for (int64_t h = 0; h < Hkv; ++h) {
    st[h] = {base_state + h * per_head, base_state + h * per_head + G * D};
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < D; ++d) st[h].acc[g * D + unpack_order(d)] = p[h]->acc[g * D + d];
      for (int64_t i = 0; i < 16; ++i) st[h].lsum[16 * g + i] = i == 0 ? p[h]->l[g] : 0.f;
    }
  }
  const bf16* krow[16];
  const bf16* vrow[16];
  int64_t t = t0;
  while (t < t1) {
    const int64_t blk = t / s.bs;
    const int64_t n = std::min<int64_t>({16, t1 - t, (blk + 1) * s.bs - t});
    const int64_t base = table[b * s.W + blk] * s.bs + t % s.bs;
    for (int64_t i = 0; i < 16; ++i) {
      krow[i] = kp + (base + (i < n ? i : 0)) * s.row;
      vrow[i] = vp + (base + (i < n ? i : 0)) * s.row;
    }
    // blocks are scattered: no hardware prefetcher finds the next one
    Prefetcher pf = tile_prefetch(kp, vp, table, s, b, t0, t1, t, PREFETCH_BLOCKS);
    const bf16* ktile = krow[0];
    if (AMXT && n < 16) {                // rows past n: row 0 again (scored, then masked)
      for (int64_t i = 0; i < 16; ++i)
        std::memcpy(ktile_buf.data() + i * s.row, krow[i], s.row * sizeof(bf16));
      ktile = ktile_buf.data();
    }
    for (int64_t h = 0; h < Hkv; ++h)
      tile_head<GT, DKT, AMXT>(qp, krow, vrow, s, b, h, n, *p[h], st[h], pf, ktile,
                               s.row * static_cast<int64_t>(sizeof(bf16)),
                               AMXT ? qt_buf.data() + h * (D / 32) * 256 : nullptr, sbuf);
    pf.rest();
    t += n;
  }
  if constexpr (AMXT) raypd_amx::release_tiles();
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < D; ++d) p[h]->acc[g * D + d] = st[h].acc[g * D + unpack_order(d)];
      p[h]->l[g] = _mm512_reduce_add_ps(_mm512_load_ps(st[h].lsum + 16 * g));
    }
}

// attend_bf16_avx512 with G and D / 32 as constants where they are common ones
template <int DKT, bool AMXT>
AMX_BF16 void attend_bf16_g(const bf16* qp, const bf16* kp, const bf16* vp,
                            const int64_t* table, const Shape& s, int64_t b, int64_t t0,
                            int64_t t1, Partial* const* p) {
  switch (s.G) {
    case 1: return attend_bf16_avx512<1, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 2: return attend_bf16_avx512<2, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 3: return attend_bf16_avx512<3, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 4: return attend_bf16_avx512<4, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 5: return attend_bf16_avx512<5, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 6: return attend_bf16_avx512<6, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 7: return attend_bf16_avx512<7, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 8: return attend_bf16_avx512<8, DKT, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    default: return attend_bf16_avx512<0, 0, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
  }
}

// ... and D / 32 as a constant for head_dim 64 and 128
template <bool AMXT>
AMX_BF16 void attend_bf16_d(const bf16* qp, const bf16* kp, const bf16* vp,
                            const int64_t* table, const Shape& s, int64_t b, int64_t t0,
                            int64_t t1, Partial* const* p) {
  switch (s.D) {
    case 64: return attend_bf16_g<2, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    case 128: return attend_bf16_g<4, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
    default: return attend_bf16_avx512<0, 0, AMXT>(qp, kp, vp, table, s, b, t0, t1, p);
  }
}

// amx: the scores by AMX (path 3)
AMX_BF16 void attend_bf16(const bf16* qp, const bf16* kp, const bf16* vp,
                          const int64_t* table, const Shape& s, int64_t b, int64_t t0,
                          int64_t t1, Partial* const* p, bool amx) {
  if (amx) return attend_bf16_d<true>(qp, kp, vp, table, s, b, t0, t1, p);
  attend_bf16_d<false>(qp, kp, vp, table, s, b, t0, t1, p);
}

// The same on AVX2 + FMA (any x86-64 CPU since about 2013: Zen, Haswell), float32 or bf16 pools,
// for CPUs without AVX512-BF16 (and float32 pools everywhere): a work item's tiles of up to 8
// tokens (a block's, or what a block holds of the run) are read once for every KV head; bf16
// rows are widened to float32 once per tile. Per KV head: each token's key dotted with the head's
// G query heads (8 tokens' sums in flight, reduced into one register of 8 scores), an online
// softmax over the tile as one vector, then the values weighted by their probabilities into
// each query head's float32 accumulator (in memory between tiles, two 8-lane chunks at a time).
// D a multiple of 8. (The portable loops, one token and query head at a time with a scalar exp:
// SmolLM2 batch 16 x 570 tokens, float32, 2 threads, 4.4 ms a layer on a Zen 3.)
using raypd_simd::cpu_has_avx2_fma;
using raypd_simd::exp8_nonpositive;

AVX2_FMA inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2_FMA inline __m256 load8(const bf16* p) {   // bf16 -> float32 is exact: the bits shifted up
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// lane i of the result = the sum of v[i]'s 8 lanes
AVX2_FMA inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

AVX2_FMA inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}


// acc[j] (D floats, j < NG query heads) += sum over the tile's tokens i of prob[j][i] * v[i]:
// two 8-lane chunks at a time, each token's two value chunks loaded once for all NG heads
// (2 NG independent sums in registers). prob: NG rows of 8.
template <int NG>
AVX2_FMA inline void pv_avx2(const float (*prob)[8], const float* const* v, int64_t D,
                             int64_t h, int64_t n, float* acc) {
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) {
    __m256 a0[NG], a1[NG];
    for (int j = 0; j < NG; ++j) {
      a0[j] = _mm256_loadu_ps(acc + j * D + c);
      a1[j] = _mm256_loadu_ps(acc + j * D + c + 8);
    }
    for (int64_t i = 0; i < n; ++i) {
      const __m256 v0 = _mm256_loadu_ps(v[i] + h * D + c), v1 = _mm256_loadu_ps(v[i] + h * D + c + 8);
      for (int j = 0; j < NG; ++j) {
        const __m256 pv = _mm256_broadcast_ss(&prob[j][i]);
        a0[j] = _mm256_fmadd_ps(pv, v0, a0[j]);
        a1[j] = _mm256_fmadd_ps(pv, v1, a1[j]);
      }
    }
    for (int j = 0; j < NG; ++j) {
      _mm256_storeu_ps(acc + j * D + c, a0[j]);
      _mm256_storeu_ps(acc + j * D + c + 8, a1[j]);
    }
  }
  for (; c < D; c += 8) {
    __m256 a0[NG];
    for (int j = 0; j < NG; ++j) a0[j] = _mm256_loadu_ps(acc + j * D + c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 v0 = _mm256_loadu_ps(v[i] + h * D + c);
      for (int j = 0; j < NG; ++j)
        a0[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&prob[j][i]), v0, a0[j]);
    }
    for (int j = 0; j < NG; ++j) _mm256_storeu_ps(acc + j * D + c, a0[j]);
  }
}

// One KV head h over a tile of n <= 8 tokens: rows k[i], v[i] (float32, heads x D each);
// q: the head's G query rows, float32, scaled; acc: G x D; lsum: G x 8 lanes of l.
AVX2_FMA
inline void tile_head_avx2(const float* q, const float* const* k, const float* const* v,
                           int64_t G, int64_t D, int64_t h, int64_t n, Partial& p, float* acc,
                           float* lsum, Prefetcher& pf) {
  alignas(32) float prob[MAX_G][8];
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
  for (int64_t g = 0; g < G; ++g) {
    __m256 dots[8];
    for (int i = 0; i < 8; ++i) dots[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      pf.next2();
      const __m256 qv = _mm256_loadu_ps(q + g * D + c);
      for (int64_t i = 0; i < 8; ++i)   // rows past n point at row 0: computed, then masked
        dots[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + h * D + c), dots[i]);
    }
    const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), reduce8(dots), valid);
    const float mx = std::max(p.m[g], hmax8(sc));
    __m256 ls = _mm256_loadu_ps(lsum + 8 * g);
    if (mx > p.m[g]) {                 // a new max: rescale what was summed so far
      const float c = p.m[g] > -FLT_MAX ? std::exp(p.m[g] - mx) : 0.f;
      const __m256 cv = _mm256_set1_ps(c);
      ls = _mm256_mul_ps(ls, cv);
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(ag + d, _mm256_mul_ps(_mm256_loadu_ps(ag + d), cv));
      p.m[g] = mx;
    }
    const __m256 e = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(sc, _mm256_set1_ps(mx))), valid);
    _mm256_storeu_ps(lsum + 8 * g, _mm256_add_ps(ls, e));
    _mm256_store_ps(prob[g], e);
  }
  for (int64_t g = 0; g < G; g += 4) {   // query heads 4 at a time: a token's values loaded once
    switch (std::min<int64_t>(4, G - g)) {
      case 4: pv_avx2<4>(prob + g, v, D, h, n, acc + g * D); break;
      case 3: pv_avx2<3>(prob + g, v, D, h, n, acc + g * D); break;
      case 2: pv_avx2<2>(prob + g, v, D, h, n, acc + g * D); break;
      default: pv_avx2<1>(prob + g, v, D, h, n, acc + g * D); break;
    }
  }
}

// Tokens [t0, t1) of sequence b for every KV head (p[h]: KV head h's partial).
template <typename T>
AVX2_FMA void attend_avx2(const T* qp, const T* kp, const T* vp, const int64_t* table,
                          const Shape& s, int64_t b, int64_t t0, int64_t t1, Partial* const* p) {
  const int64_t G = s.G, D = s.D, Hkv = s.Hkv, HD = Hkv * D;
  std::vector<float> buf(s.H * D + Hkv * G * 8 + (sizeof(T) == 2 ? 16 * HD : 0) + 8);
  float* q = buf.data();                       // every query head, float32, scaled
  float* lsum = q + s.H * D;                   // Hkv x G x 8
  float* rows = lsum + Hkv * G * 8;            // bf16 pools: the tile's K then V rows, widened
  for (int64_t j = 0; j < s.H * D; ++j) {
    float x;
    if constexpr (sizeof(T) == 2) x = bf16_to_f(qp[b * s.H * D + j].x);
    else x = qp[b * s.H * D + j];
    q[j] = x * s.scale;
  }
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < 8; ++i) lsum[(h * G + g) * 8 + i] = i == 0 ? p[h]->l[g] : 0.f;
  const float* krow[8];
  const float* vrow[8];
  int64_t t = t0;
  while (t < t1) {
    const int64_t blk = t / s.bs;
    const int64_t n = std::min<int64_t>({8, t1 - t, (blk + 1) * s.bs - t});
    const int64_t base = table[b * s.W + blk] * s.bs + t % s.bs;
    // the rows of the block PF_AVX2 on, spread over the tile's score loops, as on the AVX512
    // path (blocks are scattered: no hardware prefetcher finds them; a block's own tiles are one
    // run of memory, which it does find)
    Prefetcher pf = tile_prefetch(kp, vp, table, s, b, t0, t1, t, PF_AVX2);
    for (int64_t i = 0; i < 8; ++i) {   // rows past n repeat row 0 (their scores are masked)
      const int64_t r = i < n ? i : 0;
      if constexpr (sizeof(T) == 2) {
        float* kf = rows + i * HD;
        float* vf = rows + (8 + i) * HD;
        if (i < n)
          for (int64_t d = 0; d < HD; d += 8) {
            _mm256_storeu_ps(kf + d, load8(kp + (base + r) * s.row + d));
            _mm256_storeu_ps(vf + d, load8(vp + (base + r) * s.row + d));
          }
        krow[i] = i < n ? kf : rows;
        vrow[i] = i < n ? vf : rows + 8 * HD;
      } else {
        krow[i] = reinterpret_cast<const float*>(kp + (base + r) * s.row);
        vrow[i] = reinterpret_cast<const float*>(vp + (base + r) * s.row);
      }
    }
    for (int64_t h = 0; h < Hkv; ++h)
      tile_head_avx2(q + h * G * D, krow, vrow, G, D, h, n, *p[h], p[h]->acc,
                     lsum + h * G * 8, pf);
    pf.rest();
    t += n;
  }
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t g = 0; g < G; ++g) {
      float l = 0.f;
      for (int64_t i = 0; i < 8; ++i) l += lsum[(h * G + g) * 8 + i];
      p[h]->l[g] = l;
    }
}

// q, out: [B, H, D]; k_cache, v_cache: [num_blocks, bs, Hkv, D]; block_tables: [B, W] int64;
// context_lens: [B] int64; all contiguous
template <typename T>
void run(const T* qp, const T* kp, const T* vp, const int64_t* tp, const int64_t* lp, T* op,
         int64_t B, const Shape& s, int64_t window, int nthreads, int path) {
  const int64_t items = B * s.Hkv;
  // split long contexts while there are fewer sequences than threads (at least 4 blocks a split)
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lp[b]);
  int64_t splits = 1;
  if (nthreads > 1 && B < 2 * nthreads)
    splits = std::max<int64_t>(1, std::min<int64_t>((2 * nthreads + B - 1) / B,
                                                     max_len / (4 * s.bs)));
  const int64_t G = s.G, D = s.D;
  std::vector<float> acc(items * splits * G * D, 0.f);
  std::vector<Partial> parts(items * splits);   // [b][h][split]
  for (int64_t i = 0; i < items * splits; ++i) {
    parts[i].acc = acc.data() + i * G * D;
    std::fill(parts[i].m, parts[i].m + G, -FLT_MAX);
    std::fill(parts[i].l, parts[i].l + G, 0.f);
  }
  // a work unit: one sequence's split, every KV head (its tiles are read once for all heads)
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t w = 0; w < B * splits; ++w) {
    const int64_t b = w / splits, k = w % splits;
    const int64_t len = lp[b];
    const int64_t first = window > 0 && len > window ? len - window : 0;
    const int64_t per = (len - first + splits - 1) / splits;
    const int64_t t0 = first + k * per, t1 = std::min(len, t0 + per);
    if (t0 >= t1) continue;
    Partial* p[MAX_HKV];
    for (int64_t h = 0; h < s.Hkv; ++h) p[h] = &parts[(b * s.Hkv + h) * splits + k];
    if constexpr (sizeof(T) == 2) {
      if (path >= 2) {
        attend_bf16(qp, kp, vp, tp, s, b, t0, t1, p, path == 3);
        continue;
      }
    }
    if (path == 1) {
      attend_avx2(qp, kp, vp, tp, s, b, t0, t1, p);
      continue;
    }
    for (int64_t h = 0; h < s.Hkv; ++h)
      attend_portable(qp, kp, vp, tp, s, b, h, t0, t1, *p[h]);
  }
  for (int64_t item = 0; item < items; ++item) {
    const int64_t b = item / s.Hkv, h = item % s.Hkv;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -FLT_MAX;
      for (int64_t k = 0; k < splits; ++k) mx = std::max(mx, parts[item * splits + k].m[g]);
      float l = 0.f, c[64];
      for (int64_t k = 0; k < splits && k < 64; ++k) {
        const Partial& p = parts[item * splits + k];
        c[k] = p.l[g] > 0.f ? std::exp(p.m[g] - mx) : 0.f;
        l += p.l[g] * c[k];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* o = op + (b * s.H + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.f;
        for (int64_t k = 0; k < splits && k < 64; ++k)
          v += parts[item * splits + k].acc[g * D + d] * c[k];
        if constexpr (sizeof(T) == 2)
          reinterpret_cast<uint16_t*>(o)[d] = f_to_bf16(v * inv);
        else
          o[d] = v * inv;
      }
    }
  }
}

}  // namespace

// True when every context length is within its block table and every block it reads is in
// the pool (the reads below go where these point; checked here, beside them, in O(blocks)).
static bool in_bounds(const int64_t* tp, const int64_t* lp, int64_t B, int64_t bs, int64_t W,
                      int64_t num_blocks) {
  for (int64_t b = 0; b < B; ++b) {
    if (lp[b] < 0 || lp[b] > W * bs) return false;
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      if (tp[b * W + i] < 0 || tp[b * W + i] >= num_blocks) return false;
  }
  return true;
}

// The paths a pool of this head_dim and dtype (0 float32, 1 bfloat16) can take on this CPU, bit
// p set where path p runs: 3 AMX scores and AVX512-BF16 values (bf16 pools), 2 AVX512-BF16 (bf16
// pools), 1 AVX2 + FMA, 0 the portable loops (always). Which one runs is not decided here:
// workers/kernels/isa.py picks the widest one RAYPD_KERNEL_ISA allows and passes it.
extern "C" int64_t raypd_linear_amx_max();   // linear_amx.cpp: > 0 where AMX-BF16 is usable
extern "C" int raypd_decode_paths(int64_t D, int dtype) {
  int paths = 1;
  if (cpu_has_avx2_fma() && D % 8 == 0 && D <= MAX_D) paths |= 1 << 1;
  if (dtype == 1 && D % 32 == 0 && D <= MAX_D && raypd_bf16::cpu_has_avx512_bf16())
    paths |= 1 << 2;
  if (dtype == 1 && D % 32 == 0 && D <= MAX_D && raypd_linear_amx_max() > 0) paths |= 1 << 3;
  return paths;
}

// dtype: 0 float32, 1 bfloat16; path: the one workers/kernels/isa.py chose among
// raypd_decode_paths(D, dtype). The caller (workers/kernels/attention.py) checks shapes,
// contiguity and dtypes; head_dim <= 512, H a multiple of Hkv, H / Hkv <= 16, Hkv <= 256.
// Returns 0; 1 (nothing computed) when a context length or a block it reads is outside its
// table or the pool; 2 (nothing computed) when `path` is not one of raypd_decode_paths'.
extern "C" int raypd_paged_decode(const void* q, const void* k_cache, const void* v_cache,
                                  const int64_t* block_tables, const int64_t* context_lens,
                                  void* out, int64_t B, int64_t H, int64_t D, int64_t bs,
                                  int64_t Hkv, int64_t W, int64_t num_blocks, double scale,
                                  int64_t window, int dtype, int nthreads, int path) {
  if (path < 0 || path > 3 || !((raypd_decode_paths(D, dtype) >> path) & 1)) return 2;
  if (!in_bounds(block_tables, context_lens, B, bs, W, num_blocks)) return 1;
  const Shape s{H, D, bs, Hkv, W, H / Hkv, Hkv * D, static_cast<float>(scale)};
  nthreads = std::max(1, nthreads);
  if (dtype == 1)
    run(static_cast<const bf16*>(q), static_cast<const bf16*>(k_cache),
        static_cast<const bf16*>(v_cache), block_tables, context_lens, static_cast<bf16*>(out),
        B, s, window, nthreads, path);
  else
    run(static_cast<const float*>(q), static_cast<const float*>(k_cache),
        static_cast<const float*>(v_cache), block_tables, context_lens,
        static_cast<float*>(out), B, s, window, nthreads, path);
  return 0;
}
