// Prefill attention, bf16 on CPUs with AMX-BF16 or AVX512-BF16: a chunk of Tq new tokens
// against S keys (its cached prefix, then itself), causal from the bottom right (query i at
// position S - Tq + i sees keys 0..S - Tq + i; with a sliding window of W, only the W newest of
// them), grouped-query heads, no mask tensor: flash-style blocks with an online softmax. K and
// V are first packed per KV head: K as [keys][D] rows, V transposed [D][keys] (zero past S).
// Each work item is one query head x 16 query rows, the rows as the 16 lanes of S^T = K Q^T
// and O^T = V^T P^T, so the softmax's max and sum over keys and the rescale of O^T are
// vertical (no horizontal reductions). Keys past the diagonal (or before the window) are never
// read. P is rounded to bf16 before P.V (as flash attention's P.V).
//
// AMX (item_amx): per step of 64 keys, S^T as four 16 x 16 tiles (tdpbf16ps over head_dim in
// 32s), the softmax on AVX512, P.V into four 16 x 16 float32 tiles a pass of 64 head_dim
// columns. Tiles: 0, 1 = S (16 rows x 16 keys each); 2 = A (Q or P, 16 x 32 bf16); 3 = B; 4-7 =
// P.V. No sliding window (the caller falls back).
//
// AVX512-BF16 (item_avx512, a CPU without AMX): per step of 32 keys, S^T by vdpbf16ps, each
// of Q's d-pairs (16 rows x 2, one zmm) against each key's d-pair broadcast (16 independent
// accumulators, one per key); P^T as 16 key-pair registers; O^T[d] (one zmm of 16 rows) by
// 16 vdpbf16ps of those against V's key-pairs at d broadcast, 8 columns at a time (eight
// independent chains hide vdpbf16ps' latency), rescaled as it is loaded (skipped in a step
// where no row's max moved). Scores stay unscaled: the softmax works in log2 units.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "amx.h"
#include "bf16.h"
#include "exp_avx512.h"

namespace {

using raypd_amx::TileConfig;

AMX_BF16 void configure() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

constexpr int STEP = 64;   // keys a step

// Packed K and V live in a buffer of the calling thread, kept from call to call and never
// zeroed (pack_k and pack_v write every element they read, the padding included): a fresh
// zero-filled vector for each call (~0.8 MB a layer for 1,024 keys of SmolLM2) cost 12-15% of
// the kernel (the zeroing, and page faults where malloc mapped it anew). Up to KEEP_BYTES
// stays allocated between calls; a larger need is served and freed by that call alone.
constexpr int64_t KEEP_BYTES = int64_t{64} << 20;

class Workspace {
 public:
  explicit Workspace(int64_t elems) {
    thread_local std::unique_ptr<uint16_t[]> kept;
    thread_local int64_t kept_elems = 0;
    if (elems > kept_elems && elems * 2 <= KEEP_BYTES) {
      kept.reset(new uint16_t[elems]);   // (default-initialised: not zeroed)
      kept_elems = elems;
    }
    if (elems <= kept_elems) {
      data = kept.get();
    } else {
      own_.reset(new uint16_t[elems]);
      data = own_.get();
    }
  }
  uint16_t* data;

 private:
  std::unique_ptr<uint16_t[]> own_;
};

struct Shape {
  int64_t Tq, S, H, Hkv, D, offset, window;   // window: 0 = none
  int64_t q_row, k_row, v_row;   // elements from one token to the next (heads x D packed)
  float scale;
  int64_t spad;   // S rounded up to a step of keys
  // V^T's row stride (elements): spad + 32, never a multiple of 4 KB (a tile's 16 rows at a
  // 4 KB stride all fall into one L1 set: 16 > its 12 ways, and P.V's loads missed)
  int64_t vs;
  // null: key j's row is row j of k and v; else they are the paged pool ([blocks, bs, Hkv,
  // D]) and key j's row is slot table[j / bs] * bs + j % bs (a chunk's cached prefix read in
  // place: no gathered copy of it)
  const int64_t* table;
  int64_t bs;
};

// the row of k and v that holds key j
inline int64_t kv_row(const Shape& s, int64_t key) {
  return s.table ? s.table[key / s.bs] * s.bs + key % s.bs : key;
}

// K of KV head h as A tiles of S^T = K Q^T: [spad][D], rows past S zero
void pack_k(uint16_t* kp, const uint16_t* k, const Shape& s, int64_t h, int64_t key) {
  uint16_t* dst = kp + key * s.D;
  if (key < s.S) std::memcpy(dst, k + kv_row(s, key) * s.k_row + h * s.D, s.D * 2);
  else std::memset(dst, 0, s.D * 2);
}

// V of KV head h transposed, as A tiles of O^T = V^T P^T: [D][vs], columns past S zero;
// keys a run of consecutive rows at a time (a block of the table, or all of them)
void pack_v(uint16_t* vt, const uint16_t* v, const Shape& s, int64_t h, int64_t d) {
  uint16_t* dst = vt + d * s.vs;
  const int64_t run = s.table ? s.bs : s.S;
  for (int64_t k0 = 0; k0 < s.S; k0 += run) {
    const uint16_t* src = v + kv_row(s, k0) * s.v_row + h * s.D + d;
    const int64_t n = std::min(run, s.S - k0);
    for (int64_t i = 0; i < n; ++i) dst[k0 + i] = src[i * s.v_row];
  }
  std::fill(dst + s.S, dst + s.spad, uint16_t{0});
}

// V of KV head h transposed as the AMX paths read it: one 16 x 32 A tile (head_dim rows
// 16 i.., keys 32 b..) a contiguous 1 KB block, block (b, i) at (b D / 16 + i) x 512 elements,
// keys past S zero. (As [D][keys] rows, a tile's 16 rows were 16 far-apart lines, each its own
// stream: P.V's loads missed L1 and L2.)
inline const uint16_t* vblock(const uint16_t* vt, const Shape& s, int64_t key, int64_t i) {
  return vt + ((key / 32) * (s.D / 16) + i) * 512;
}
void pack_v_tiles(uint16_t* vt, const uint16_t* v, const Shape& s, int64_t h, int64_t d) {
  uint16_t* dst = vt + (d / 16) * 512 + (d % 16) * 32;
  const int64_t bstride = (s.D / 16) * 512;   // from one block of 32 keys to the next
  const int64_t run = s.table ? s.bs : s.S;
  for (int64_t k0 = 0; k0 < s.S; k0 += run) {
    const uint16_t* src = v + kv_row(s, k0) * s.v_row + h * s.D + d;
    const int64_t n = std::min(run, s.S - k0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = k0 + i;
      dst[(key / 32) * bstride + key % 32] = src[i * s.v_row];
    }
  }
  for (int64_t key = s.S; key < s.spad; ++key) dst[(key / 32) * bstride + key % 32] = 0;
}

// 2^t for t <= 0 to about 1e-4 relative (what probabilities rounded to bf16, 2^-8, need):
// 2^n * 2^f, |f| <= 1/2, 2^f by a cubic; very negative t gives 0 (the AVX512-BF16 path's
// scores come in log2 units)
AVX512_BF16 inline __m512 exp2_bf16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0555041f), f, _mm512_set1_ps(0.2402265f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931472f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// e^x for x <= 0, the same way
AVX512_BF16 inline __m512 exp_bf16(__m512 x) {
  return exp2_bf16(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)),
                                 _mm512_set1_ps(1.44269504088896341f)));
}

// lanes of bf16 pairs: lane 2r = a[r], lane 2r + 1 = b[r] (a, b: 16 floats each)
AVX512_BF16 inline __m512i interleave_bf16(__m512 a, __m512 b) {
  const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);   // a in lanes 0-15, b in 16-31
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return _mm512_permutexvar_epi16(idx, ab);
}

// the positions of query rows first..first + 15, one a lane
AVX512_BF16 inline __m512i positions(int64_t first) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
}

// the rows (lanes) that see key `key` of S: low < key <= pos (low = pos - window, or -1)
AVX512_BF16 inline __mmask16 visible(int64_t key, int64_t S, __m512i pos, __m512i low) {
  if (key >= S) return 0;
  const __m512i kv = _mm512_set1_epi32(static_cast<int>(key));
  return _mm512_cmple_epi32_mask(kv, pos) & _mm512_cmpgt_epi32_mask(kv, low);
}

// O^T [D][16 rows] / l -> bf16 rows [16 qb, 16 qb + rows) of query head hq in out [Tq, H, D]:
// a row's 16 columns at a time, gathered from O^T (one column is 16 floats apart)
AVX512_BF16 inline void finish(uint16_t* out, const float* ot, __m512 l, const Shape& s,
                               int64_t hq, int64_t qb, int64_t rows) {
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));   // l >= 1 for every row
  const __m512i cols = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = out + ((16 * qb + r) * s.H + hq) * s.D;
    const __m512 ir = _mm512_set1_ps(inv[r]);
    for (int64_t d0 = 0; d0 < s.D; d0 += 16) {
      const __m512 o = _mm512_i32gather_ps(cols, ot + 16 * d0 + r, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d0),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o, ir)));
    }
  }
}

// Q^T of query head hq, rows [16 qb, 16 qb + rows), as [D / 2 pairs][16 rows][2] (zero rows
// past Tq): one zmm a d-pair; a pair moved as one 32-bit word
inline void pack_q(uint16_t* qp, const uint16_t* q, const Shape& s, int64_t hq, int64_t qb,
                   int64_t rows) {
  const int64_t DP = s.D / 2;
  for (int64_t r = 0; r < 16; ++r) {
    const uint16_t* src = q + (16 * qb + r) * s.q_row + hq * s.D;
    for (int64_t p = 0; p < DP; ++p) {
      uint32_t pair = 0;
      if (r < rows) std::memcpy(&pair, src + 2 * p, 4);
      std::memcpy(qp + (p * 16 + r) * 2, &pair, 4);
    }
  }
}

// query head hq, query rows [16 qb, 16 qb + 16) (rows past Tq computed on zeros, not stored).
// Everything per row is a lane: S^T tiles are [16 keys x 16 rows], so the softmax's max and
// sum over keys are vertical (no horizontal reductions), and so is the rescale of O^T.
AMX_BF16 void item_amx(uint16_t* out, const uint16_t* q, const uint16_t* kp, const uint16_t* vt,
                       const Shape& s, int64_t hq, int64_t qb) {
  const int64_t D = s.D, rows = std::min<int64_t>(16, s.Tq - 16 * qb);
  alignas(64) uint16_t qp[128 * 16];      // Q^T as B tiles: [D / 32][16 pairs][16 rows][2]
  alignas(64) float sbuf[STEP * 16];      // S^T of a step: [64 keys][16 rows]
  alignas(64) uint16_t pbuf[STEP * 16];   // P^T as two B tiles: [32 key pairs][16 rows][2]
  alignas(64) float tbuf[64 * 16];        // P.V of a pass: [64 columns][16 rows]
  alignas(64) float ot[128 * 16];         // O^T: [D][16 rows]
  pack_q(qp, q, s, hq, qb, rows);   // (d-pairs 16 c.. 16 c + 15: the B tile of D's c-th 32)
  std::memset(ot, 0, sizeof(float) * D * 16);
  __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
  const int64_t first = s.offset + 16 * qb;            // the position of row 0
  const int64_t kend = std::min(s.S, first + rows);    // keys any stored row sees
  const __m512i pos = positions(first);   // each row's position: it sees keys <= pos
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t k0 = 0; k0 < kend; k0 += STEP) {
    // S^T = K Q^T for keys [k0, k0 + 64): tiles 4-7, 16 keys each (tile numbers are
    // immediates: one call each)
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const uint16_t* kk = kp + k0 * D;
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(3, qp + c * 512, 64);
      _tile_loadd(2, kk + 32 * c, D * 2);
      _tile_dpbf16ps(4, 2, 3);
      _tile_loadd(2, kk + 16 * D + 32 * c, D * 2);
      _tile_dpbf16ps(5, 2, 3);
      _tile_loadd(2, kk + 32 * D + 32 * c, D * 2);
      _tile_dpbf16ps(6, 2, 3);
      _tile_loadd(2, kk + 48 * D + 32 * c, D * 2);
      _tile_dpbf16ps(7, 2, 3);
    }
    _tile_stored(4, sbuf, 64);
    _tile_stored(5, sbuf + 256, 64);
    _tile_stored(6, sbuf + 512, 64);
    _tile_stored(7, sbuf + 768, 64);
    const bool edge = k0 + STEP > first || k0 + STEP > s.S;   // some key masked for some row
    __mmask16 vis[STEP];
    __m512 mx = m;
    for (int j = 0; j < STEP; ++j) {
      const __m512 sc = _mm512_mul_ps(_mm512_load_ps(sbuf + 16 * j), scale);
      _mm512_store_ps(sbuf + 16 * j, sc);
      vis[j] = 0xFFFF;
      if (edge) vis[j] = visible(k0 + j, s.S, pos, _mm512_set1_epi32(-1));
      mx = _mm512_mask_max_ps(mx, vis[j], mx, sc);
    }
    const __m512 alpha = raypd_simd::exp_nonpositive(_mm512_sub_ps(m, mx));
    l = _mm512_mul_ps(l, alpha);
    m = mx;
    for (int j = 0; j < STEP; j += 2) {
      const __m512 p0 = _mm512_maskz_mov_ps(
          vis[j], exp_bf16(_mm512_sub_ps(_mm512_load_ps(sbuf + 16 * j), mx)));
      const __m512 p1 = _mm512_maskz_mov_ps(
          vis[j + 1], exp_bf16(_mm512_sub_ps(_mm512_load_ps(sbuf + 16 * j + 16), mx)));
      l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
      _mm512_store_si512(pbuf + j * 16, interleave_bf16(p0, p1));
    }
    _tile_loadd(0, pbuf, 64);          // P^T of keys [k0, k0 + 32)
    _tile_loadd(1, pbuf + 512, 64);    // and [k0 + 32, k0 + 64)
    for (int64_t pass = 0; pass * 64 < D; ++pass) {
      const int64_t chunks = std::min<int64_t>(4, D / 16 - 4 * pass);   // of 16 columns
      const int64_t i0 = 4 * pass;   // V^T's first 16-row block this pass
      _tile_zero(4);
      _tile_loadd(2, vblock(vt, s, k0, i0), 64);
      _tile_dpbf16ps(4, 2, 0);
      _tile_loadd(2, vblock(vt, s, k0 + 32, i0), 64);
      _tile_dpbf16ps(4, 2, 1);
      _tile_stored(4, tbuf, 64);
      if (chunks > 1) {
        _tile_zero(5);
        _tile_loadd(2, vblock(vt, s, k0, i0 + 1), 64);
        _tile_dpbf16ps(5, 2, 0);
        _tile_loadd(2, vblock(vt, s, k0 + 32, i0 + 1), 64);
        _tile_dpbf16ps(5, 2, 1);
        _tile_stored(5, tbuf + 256, 64);
      }
      if (chunks > 2) {
        _tile_zero(6);
        _tile_loadd(2, vblock(vt, s, k0, i0 + 2), 64);
        _tile_dpbf16ps(6, 2, 0);
        _tile_loadd(2, vblock(vt, s, k0 + 32, i0 + 2), 64);
        _tile_dpbf16ps(6, 2, 1);
        _tile_stored(6, tbuf + 512, 64);
      }
      if (chunks > 3) {
        _tile_zero(7);
        _tile_loadd(2, vblock(vt, s, k0, i0 + 3), 64);
        _tile_dpbf16ps(7, 2, 0);
        _tile_loadd(2, vblock(vt, s, k0 + 32, i0 + 3), 64);
        _tile_dpbf16ps(7, 2, 1);
        _tile_stored(7, tbuf + 768, 64);
      }
      float* o = ot + 64 * pass * 16;
      for (int64_t d = 0; d < 16 * chunks; ++d)
        _mm512_store_ps(o + 16 * d, _mm512_fmadd_ps(_mm512_load_ps(o + 16 * d), alpha,
                                                    _mm512_load_ps(tbuf + 16 * d)));
    }
  }
  finish(out, ot, l, s, hq, qb, rows);
}

// D <= 64 on AMX (item_amx_o): O^T stays in tiles 4-7 (16 head_dim rows x 16 query rows
// each) across all steps of 32 keys; tiles 0, 1 = S^T (16 keys x 16 rows each), 2 = A (K or
// V^T), 3 = B (Q^T or P^T). The softmax rescales lazily: a row's reference max moves only when
// the step's max passes it by more than LAZY (log2 units, so p <= 2^LAZY), and only then are
// O^T's tiles stored, scaled and reloaded (after the first few steps, almost never). Scores
// stay raw: p = 2^(S c - m c), c = scale log2 e, one fmsub a key.
constexpr int OSTEP = 32;     // keys a step of item_amx_o
constexpr float LAZY = 8.f;   // log2 units a row's max may grow before O^T is rescaled

AMX_BF16 void item_amx_o(uint16_t* out, const uint16_t* q, const uint16_t* kp,
                         const uint16_t* vt, const Shape& s, int64_t hq, int64_t qb) {
  const int64_t D = s.D, rows = std::min<int64_t>(16, s.Tq - 16 * qb), dt = D / 16;
  alignas(64) uint16_t qp[64 * 16];       // Q^T as B tiles: [D / 32][16 pairs][16 rows][2]
  alignas(64) float sbuf[OSTEP * 16];     // S^T of a step: [32 keys][16 rows]
  alignas(64) uint16_t pbuf[2][OSTEP * 16];   // P^T as B tiles: [16 key pairs][16 rows][2]
  alignas(64) float ot[64 * 16];          // O^T: [D][16 rows]
  pack_q(qp, q, s, hq, qb, rows);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
  const int64_t first = s.offset + 16 * qb;            // the position of row 0
  const int64_t kend = std::min(s.S, first + rows);    // keys any stored row sees
  const __m512i pos = positions(first);   // each row's position: it sees keys <= pos
  const __m512 c = _mm512_set1_ps(s.scale * 1.44269504088896341f);
  const __m512 lazy = _mm512_set1_ps(LAZY);
  // S^T = K Q^T of keys [k0, k0 + 32) into tiles 0, 1
  const auto scores = [&](int64_t k0) {
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* kk = kp + k0 * D;
    for (int64_t ch = 0; ch < D / 32; ++ch) {
      _tile_loadd(3, qp + ch * 512, 64);
      _tile_loadd(2, kk + 32 * ch, D * 2);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(2, kk + 16 * D + 32 * ch, D * 2);
      _tile_dpbf16ps(1, 2, 3);
    }
  };
  // O^T += V^T P^T of the step at k0 (its P^T in pbuf[b]): V^T's rows into three A tiles in
  // turn, so a load need not wait for the product before it to have read its tile
  const auto values = [&](int64_t k0, int b) {
    _tile_loadd(3, pbuf[b], 64);
    _tile_loadd(2, vblock(vt, s, k0, 0), 64);
    _tile_loadd(0, vblock(vt, s, k0, 1), 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_dpbf16ps(5, 0, 3);
    if (dt > 2) {
      _tile_loadd(1, vblock(vt, s, k0, 2), 64);
      _tile_loadd(2, vblock(vt, s, k0, 3), 64);
      _tile_dpbf16ps(6, 1, 3);
      _tile_dpbf16ps(7, 2, 3);
    }
  };
  // pipelined: the next step's S^T runs on the tiles while this step's softmax runs on
  // AVX512, and a step's P.V waits a step (a tile load of P^T just stored by vector stores
  // stalled until they had drained)
  scores(0);
  _tile_stored(0, sbuf, 64);
  _tile_stored(1, sbuf + 256, 64);
  int64_t pending = -1;   // the step whose P.V is still to do (its P^T in pbuf[pending & 1])
  for (int64_t k0 = 0, it = 0; k0 < kend; k0 += OSTEP, ++it) {
    const bool next = k0 + OSTEP < kend;
    if (next) scores(k0 + OSTEP);
    const bool edge = k0 + OSTEP > first || k0 + OSTEP > s.S;   // some key masked for some row
    __mmask16 vis[OSTEP];
    __m512 mxs[4] = {m, m, m, m};   // (four chains: one would wait on each max's latency)
    for (int j = 0; j < OSTEP; ++j) {
      vis[j] = edge ? visible(k0 + j, s.S, pos, _mm512_set1_epi32(-1)) : 0xFFFF;
      mxs[j & 3] = _mm512_mask_max_ps(mxs[j & 3], vis[j], mxs[j & 3],
                                      _mm512_load_ps(sbuf + 16 * j));
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mxs[0], mxs[1]), _mm512_max_ps(mxs[2], mxs[3]));
    if (k0 == 0) {
      m = mx;   // (every row sees key 0)
    } else if (_mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(mx, m), c), lazy, _CMP_GT_OQ)) {
      if (pending >= 0) values(pending * OSTEP, pending & 1);   // (its P is at the old max)
      pending = -1;
      const __m512 alpha = exp2_bf16(_mm512_mul_ps(_mm512_sub_ps(m, mx), c));
      l = _mm512_mul_ps(l, alpha);
      m = mx;
      _tile_stored(4, ot, 64);
      _tile_stored(5, ot + 256, 64);
      _tile_stored(6, ot + 512, 64);
      _tile_stored(7, ot + 768, 64);
      for (int64_t d = 0; d < D; ++d)
        _mm512_store_ps(ot + 16 * d, _mm512_mul_ps(_mm512_load_ps(ot + 16 * d), alpha));
      _tile_loadd(4, ot, 64);
      _tile_loadd(5, ot + 256, 64);
      _tile_loadd(6, ot + 512, 64);
      _tile_loadd(7, ot + 768, 64);
    }
    const __m512 mc = _mm512_mul_ps(m, c);
    uint16_t* pb = pbuf[it & 1];
    __m512 ls[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};   // (two chains of sums)
    for (int j = 0; j < OSTEP; j += 2) {
      __m512 p0 = exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(sbuf + 16 * j), c, mc));
      __m512 p1 = exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(sbuf + 16 * j + 16), c, mc));
      if (edge) {
        p0 = _mm512_maskz_mov_ps(vis[j], p0);
        p1 = _mm512_maskz_mov_ps(vis[j + 1], p1);
      }
      ls[(j >> 1) & 1] = _mm512_add_ps(ls[(j >> 1) & 1], _mm512_add_ps(p0, p1));
      _mm512_store_si512(pb + j * 16, interleave_bf16(p0, p1));
    }
    l = _mm512_add_ps(l, _mm512_add_ps(ls[0], ls[1]));
    if (next) {   // (this step's scores are read: the buffer takes the next step's)
      _tile_stored(0, sbuf, 64);
      _tile_stored(1, sbuf + 256, 64);
    }
    if (pending >= 0) values(pending * OSTEP, pending & 1);
    pending = it;
  }
  if (pending >= 0) values(pending * OSTEP, pending & 1);
  _tile_stored(4, ot, 64);
  _tile_stored(5, ot + 256, 64);
  if (dt > 2) {
    _tile_stored(6, ot + 512, 64);
    _tile_stored(7, ot + 768, 64);
  }
  finish(out, ot, l, s, hq, qb, rows);
}

constexpr int KEYS = 32;   // keys a step of the AVX512-BF16 path (STEP is a multiple)
constexpr int COLS = 8;    // O^T columns a pass of P.V: independent accumulator chains

// query head hq, query rows [16 qb, 16 qb + 16) on AVX512-BF16 (rows past Tq computed on zeros,
// not stored)
AVX512_BF16 void item_avx512(uint16_t* out, const uint16_t* q, const uint16_t* kp,
                             const uint16_t* vt, const Shape& s, int64_t hq, int64_t qb) {
  const int64_t D = s.D, DP = D / 2, rows = std::min<int64_t>(16, s.Tq - 16 * qb);
  alignas(64) uint16_t qp[128 * 16];   // Q^T: [D / 2][16 rows][2]
  alignas(64) float sbuf[KEYS * 16];   // S^T of a step: [32 keys][16 rows]
  alignas(64) float ot[128 * 16];      // O^T: [D][16 rows]
  pack_q(qp, q, s, hq, qb, rows);
  std::memset(ot, 0, sizeof(float) * D * 16);
  __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
  const int64_t first = s.offset + 16 * qb;            // the position of row 0
  const int64_t kend = std::min(s.S, first + rows);    // keys any stored row sees
  // keys no row sees: before row 0's window (whole steps of them skipped)
  const int64_t kstart = s.window > 0 ? std::max<int64_t>(0, first - s.window + 1) / KEYS * KEYS
                                      : 0;
  const __m512i pos = positions(first);   // each row's position: it sees keys <= pos
  // and keys > pos - window (all keys >= 0 without a window)
  const __m512i low = s.window > 0 ? _mm512_sub_epi32(pos, _mm512_set1_epi32(
                                         static_cast<int>(s.window)))
                                   : _mm512_set1_epi32(-1);
  const __m512 scale = _mm512_set1_ps(s.scale);
  // raw scores to log2 units: p = 2^((S - max S) scale log2 e), one fmsub a key, no scaled S
  const __m512 to_log2 = _mm512_set1_ps(s.scale * 1.44269504088896341f);
  for (int64_t k0 = kstart; k0 < kend; k0 += KEYS) {
    // some key masked for some row: past the diagonal or S, or before a window
    const bool edge = k0 + KEYS > first || k0 + KEYS > s.S || (s.window > 0 &&
                                                                k0 <= first + 15 - s.window);
    __mmask16 vis[KEYS];
    for (int j = 0; j < KEYS; ++j) vis[j] = edge ? visible(k0 + j, s.S, pos, low) : 0xFFFF;
    // S^T = K Q^T for keys [k0, k0 + 32), 16 keys a pass, unscaled; the rows' running max
    // taken from the registers
    __m512 mx = m;
    for (int half = 0; half < 2; ++half) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      const int32_t* kk = reinterpret_cast<const int32_t*>(kp + (k0 + 16 * half) * D);
      for (int64_t p = 0; p < DP; ++p) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * 32);
        for (int j = 0; j < 16; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(kk[j * DP + p]), qv);
      }
      for (int j = 0; j < 16; ++j) {
        mx = _mm512_mask_max_ps(mx, vis[16 * half + j], mx, acc[j]);
        _mm512_store_ps(sbuf + 16 * (16 * half + j), acc[j]);
      }
    }
    // alpha is exactly 1 where no row's max moved (most steps past the first few): O^T is
    // then left as it is
    const bool moved = _mm512_cmp_ps_mask(mx, m, _CMP_NEQ_OQ) != 0;
    const __m512 alpha = raypd_simd::exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(m, mx), scale));
    l = _mm512_mul_ps(l, alpha);
    m = mx;
    const __m512 mxc = _mm512_mul_ps(mx, to_log2);
    __m512bh pp[KEYS / 2];   // P^T as key pairs: lane 2r + i = row r's p of key 2 jp + i
    for (int jp = 0; jp < KEYS / 2; ++jp) {
      const int j = 2 * jp;
      const __m512 p0 = _mm512_maskz_mov_ps(
          vis[j], exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(sbuf + 16 * j), to_log2, mxc)));
      const __m512 p1 = _mm512_maskz_mov_ps(
          vis[j + 1],
          exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(sbuf + 16 * j + 16), to_log2, mxc)));
      l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
      pp[jp] = (__m512bh)interleave_bf16(p0, p1);
    }
    // O^T[d] = alpha O^T[d] + sum over key pairs of P^T pair x (V[2 jp, d], V[2 jp + 1, d])
    for (int64_t d0 = 0; d0 < D; d0 += COLS) {
      __m512 o[COLS];
      for (int c = 0; c < COLS; ++c) {
        o[c] = _mm512_load_ps(ot + 16 * (d0 + c));
        if (moved) o[c] = _mm512_mul_ps(o[c], alpha);
      }
      for (int jp = 0; jp < KEYS / 2; ++jp)
        for (int c = 0; c < COLS; ++c) {
          const int32_t pair =
              *reinterpret_cast<const int32_t*>(vt + (d0 + c) * s.vs + k0 + 2 * jp);
          o[c] = _mm512_dpbf16_ps(o[c], pp[jp], (__m512bh)_mm512_set1_epi32(pair));
        }
      for (int c = 0; c < COLS; ++c) _mm512_store_ps(ot + 16 * (d0 + c), o[c]);
    }
  }
  finish(out, ot, l, s, hq, qb, rows);
}

}  // namespace

// out [Tq, H, D] contiguous; q [Tq, H, D], k, v [S, Hkv, D] with each token's heads x D
// contiguous, tokens q_row / k_row / v_row elements apart; bf16; S >= Tq >= 1, H a multiple of
// Hkv, D a multiple of 32 up to 128; window 0 (none) or the newest keys a query sees; amx: on
// AMX-BF16 (a CPU whose tile state this process was granted, raypd_linear_amx_max() > 0; no
// window), else AVX512-BF16 (raypd_linear_small_m_max() > 0). table: null, or k and v are the
// paged pool and key j is at slot table[j / bs] * bs + j % bs (every entry the first
// ceil(S / bs) of the table holds within the pool). All checked by the caller.
extern "C" void raypd_prefill_attention_bf16(uint16_t* out, const uint16_t* q, const uint16_t* k,
                                             const uint16_t* v, int64_t Tq, int64_t S,
                                             int64_t H, int64_t Hkv, int64_t D, int64_t q_row,
                                             int64_t k_row, int64_t v_row, double scale,
                                             int64_t window, int nthreads, int amx,
                                             const int64_t* table, int64_t bs) {
  Shape s{Tq, S, H, Hkv, D, S - Tq, window, q_row, k_row, v_row, static_cast<float>(scale),
          (S + STEP - 1) / STEP * STEP, 0, table, bs};
  s.vs = s.spad + 32;
  const int64_t per_head = s.spad * D, per_head_v = s.vs * D;
  Workspace packed(Hkv * (per_head + per_head_v));
  uint16_t* const kpack = packed.data;
  uint16_t* const vpack = packed.data + Hkv * per_head;
  const int64_t qblocks = (Tq + 15) / 16, items = H * qblocks, G = H / Hkv;
  const int threads = std::max(1, nthreads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < Hkv * s.spad; ++w)
      pack_k(kpack + (w / s.spad) * per_head, k, s, w / s.spad, w % s.spad);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < Hkv * D; ++w)
      if (amx) pack_v_tiles(vpack + (w / D) * per_head_v, v, s, w / D, w % D);
      else pack_v(vpack + (w / D) * per_head_v, v, s, w / D, w % D);
    if (amx) configure();   // tile state is per thread
    // the longest items (the last query blocks) first; a KV head's query heads side by side
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t qb = qblocks - 1 - w / H, hq = w % H;
      const uint16_t* kh = kpack + (hq / G) * per_head;
      const uint16_t* vh = vpack + (hq / G) * per_head_v;
      if (amx && s.D <= 64) item_amx_o(out, q, kh, vh, s, hq, qb);
      else if (amx) item_amx(out, q, kh, vh, s, hq, qb);
      else item_avx512(out, q, kh, vh, s, hq, qb);
    }
    if (amx) raypd_amx::release_tiles();
  }
}
