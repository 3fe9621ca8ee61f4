// Prefill attention, float32 on AVX2 + FMA (a CPU without native bf16, such as AMD Zen 3, runs
// the model in float32): a chunk of Tq new tokens against S keys (its cached prefix, then
// itself), causal from the bottom right (query i at position S - Tq + i sees keys
// 0..S - Tq + i; with a sliding window of W, only the W newest of them), grouped-query heads,
// no mask tensor: flash-style blocks with an online softmax.
//
// Each work item is QB query rows: the query heads of one KV head (G of them, up to QB) x
// QB / G tokens, so a step's keys and values serve them all; in register tiles of 6 rows x 16 columns
// (12 accumulators, 2 loads and 6 broadcasts per 12 FMAs). Per step of up to KS keys:
//   scores = (scale Q) K^T from K packed per KV head in tiles of 16 keys, each [D][16] (zero
//     past S), so a tile's 16 keys are two contiguous vector loads per head_dim element (a
//     plain [D][keys] transpose put every row of a tile in the same L1 sets: 2x slower);
//   the online softmax per row (keys a row cannot see are masked only by compares, never read
//     past the last row's position), P kept in float32;
//   O = O e^(m_old - m_new) + P V, from V packed per KV head ([S][D]: in place, a step's keys
//     lie a whole token apart, a multiple of 4 KB for some models, so in the same L1 sets).
// Keys past the block's last position (and before its first row's window) are never touched.
// Sums are float32 in another order than the reference's, and e^x is within 2e-7: outputs are
// PyTorch's to about 1e-6 relative.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "exp_avx2.h"

namespace {

using raypd_simd::exp8_nonpositive;

constexpr int64_t QB = 48;     // query rows an item takes (8 register tiles of 6)
constexpr int64_t RT = 6;      // rows a register tile
constexpr int64_t KS = 64;     // keys a step (4 column tiles of 16)
constexpr int64_t MAX_D = 256;

struct Shape {
  int64_t Tq, S, H, Hkv, D, offset, window;
  int64_t q_row;                 // elements from one query token to the next
  int64_t spad;                  // S rounded up to 16 keys
  float scale;
};

// acc[r] (RT rows x 16 keys) = q[r] . k[j0..j0 + 16) over D (q: [RT][D]; kt: the 16 keys'
// tile, [D][16], contiguous)
AVX2_FMA inline void scores_tile(const float* q, const float* kt, const Shape& s, float* out) {
  __m256 a[RT][2];
  for (int r = 0; r < RT; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < s.D; ++d) {
    const __m256 k0 = _mm256_load_ps(kt + d * 16), k1 = _mm256_load_ps(kt + d * 16 + 8);
    for (int r = 0; r < RT; ++r) {
      const __m256 b = _mm256_broadcast_ss(q + r * s.D + d);
      a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    _mm256_storeu_ps(out + r * KS, a[r][0]);
    _mm256_storeu_ps(out + r * KS + 8, a[r][1]);
  }
}

// o[r][c..c + 16) = o[r][..] alpha[r] + sum over n keys j of p[r][j] v[j][c..c + 16)
AVX2_FMA inline void pv_tile(float* o, const float* alpha, const float* p, const float* v,
                             int64_t n, const Shape& s) {
  __m256 a[RT][2];
  for (int r = 0; r < RT; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * s.D), al);
    a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * s.D + 8), al);
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * s.D), v1 = _mm256_loadu_ps(v + j * s.D + 8);
    for (int r = 0; r < RT; ++r) {
      const __m256 b = _mm256_broadcast_ss(p + r * KS + j);
      a[r][0] = _mm256_fmadd_ps(b, v0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(b, v1, a[r][1]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    _mm256_storeu_ps(o + r * s.D, a[r][0]);
    _mm256_storeu_ps(o + r * s.D + 8, a[r][1]);
  }
}

AVX2_FMA inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

AVX2_FMA inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// query heads [h0, h0 + gh) (of one KV head) x query tokens [tok t0, tok t0 + tok): row r is
// token t0 + r / gh of head h0 + r % gh, so the KV head's keys and values a step reads serve
// every head of the group (rows past the chunk's end computed on zeros, not stored)
AVX2_FMA void item(float* out, const float* q, const float* kt_all, const float* v,
                   const Shape& s, int64_t h0, int64_t gh, int64_t t0, int64_t tok) {
  const int64_t D = s.D, hkv = h0 / (s.H / s.Hkv);
  const int64_t ntok = std::min(tok, s.Tq - t0), rows = ntok * gh;
  const int64_t tiles = (rows + RT - 1) / RT;
  alignas(32) float qs[QB * MAX_D];   // scale q, rows past `rows` zero
  alignas(32) float ob[QB * MAX_D];   // unnormalised O
  alignas(32) float sb[QB * KS];      // scores, then probabilities, of a step
  float m[QB], l[QB], alpha[QB];
  for (int64_t r = 0; r < tiles * RT; ++r) {
    float* dst = qs + r * D;
    if (r < rows) {
      const float* src = q + (t0 + r / gh) * s.q_row + (h0 + r % gh) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * s.scale;
    } else {
      std::memset(dst, 0, D * sizeof(float));
    }
    m[r] = -FLT_MAX;
    l[r] = 0.f;
    alpha[r] = 1.f;
  }
  std::memset(ob, 0, tiles * RT * D * sizeof(float));
  const int64_t first = s.offset + t0, last = first + ntok - 1;   // the first, last positions
  // from a multiple of 16 keys, so no 16-key tile reads past kt's zero padding (spad)
  const int64_t kbeg = s.window > 0 ? std::max<int64_t>(0, first - s.window + 1) / 16 * 16 : 0;
  const int64_t kend = last + 1;                                  // keys any row sees
  const float* kt = kt_all + hkv * D * s.spad;
  const float* vh = v + hkv * s.S * D;
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k0 = kbeg; k0 < kend; k0 += KS) {
    const int64_t n = std::min(KS, kend - k0), n16 = (n + 15) / 16 * 16;   // kt is zero past S
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t c = 0; c < n16; c += 16)
        scores_tile(qs + t * RT * D, kt + (k0 + c) * D, s, sb + t * RT * KS + c);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first + r / gh;
      const int64_t lo = s.window > 0 ? pos - s.window + 1 : 0;   // keys [lo, pos] visible
      float* sr = sb + r * KS;
      if (k0 > pos || k0 + n <= lo) {   // no key of this step: P 0, O unchanged
        std::memset(sr, 0, n16 * sizeof(float));
        alpha[r] = 1.f;
        continue;
      }
      const __m256 hi_v = _mm256_set1_ps(static_cast<float>(pos - k0));   // lane j visible:
      const __m256 lo_v = _mm256_set1_ps(static_cast<float>(lo - k0));    // lo <= k0 + j <= pos
      __m256 mx = _mm256_set1_ps(-FLT_MAX);
      for (int64_t c = 0; c < n16; c += 8) {
        const __m256 j = _mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(c)));
        const __m256 vis = _mm256_and_ps(_mm256_cmp_ps(j, hi_v, _CMP_LE_OQ),
                                         _mm256_cmp_ps(j, lo_v, _CMP_GE_OQ));
        const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), _mm256_loadu_ps(sr + c), vis);
        _mm256_storeu_ps(sr + c, sc);
        mx = _mm256_max_ps(mx, sc);
      }
      const float mnew = std::max(m[r], hmax8(mx));
      alpha[r] = std::exp(m[r] - mnew);   // m[r] = -FLT_MAX at the first step: 0
      m[r] = mnew;
      const __m256 mv = _mm256_set1_ps(mnew);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < n16; c += 8) {
        const __m256 sc = _mm256_loadu_ps(sr + c);
        const __m256 vis = _mm256_cmp_ps(sc, _mm256_set1_ps(-FLT_MAX), _CMP_GT_OQ);
        const __m256 p = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(sc, mv)), vis);
        _mm256_storeu_ps(sr + c, p);
        sum = _mm256_add_ps(sum, p);
      }
      l[r] = l[r] * alpha[r] + hsum8(sum);
    }
    for (int64_t r = rows; r < tiles * RT; ++r) {   // padding rows: P 0
      std::memset(sb + r * KS, 0, n16 * sizeof(float));
      alpha[r] = 1.f;
    }
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t c = 0; c < D; c += 16)
        pv_tile(ob + t * RT * D + c, alpha + t * RT, sb + t * RT * KS, vh + k0 * D + c, n, s);
  }
  for (int64_t r = 0; r < rows; ++r) {   // every row sees at least its own key: l >= 1
    const float inv = 1.f / l[r];
    float* dst = out + ((t0 + r / gh) * s.H + h0 + r % gh) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = ob[r * D + d] * inv;
  }
}

}  // namespace

// Whether raypd_prefill_attention_f32 runs for head_dim D on this CPU.
extern "C" int raypd_prefill_attention_f32_ok(int64_t D) {
  return raypd_simd::cpu_has_avx2_fma() && D > 0 && D % 16 == 0 && D <= MAX_D;
}

// out [Tq, H, D] (contiguous) = causal attention of q [Tq, H, D] (the last Tq of S positions)
// over k, v [S, Hkv, D], each token's heads x D contiguous at q_row / k_row / v_row elements
// apart. window > 0: a sliding window of that many keys. The caller checks
// raypd_prefill_attention_f32_ok(D), 1 <= Tq <= S and H % Hkv == 0.
extern "C" void raypd_prefill_attention_f32(float* out, const float* q, const float* k,
                                            const float* v, int64_t Tq, int64_t S, int64_t H,
                                            int64_t Hkv, int64_t D, int64_t q_row, int64_t k_row,
                                            int64_t v_row, double scale, int64_t window,
                                            int nthreads) {
  Shape s{Tq, S, H, Hkv, D, S - Tq, window, q_row, (S + 15) / 16 * 16,
          static_cast<float>(scale)};
  // [Hkv][spad / 16][D][16], zero past S (64-byte aligned: the tiles' loads are aligned)
  const size_t kt_n = static_cast<size_t>(Hkv * D * s.spad);
  float* kt = static_cast<float*>(std::aligned_alloc(64, (kt_n * sizeof(float) + 63) / 64 * 64));
  std::vector<float> vp(static_cast<size_t>(Hkv * S * D));   // [Hkv][S][D]
  const int threads = std::max(1, nthreads);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t hb = 0; hb < Hkv * (s.spad / 16); ++hb) {   // one KV head's tile of 16 keys
      const int64_t h = hb / (s.spad / 16), j0 = hb % (s.spad / 16) * 16;
      float* dst = kt + hb * D * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const float* src = k + (j0 + j) * k_row + h * D;
        if (j0 + j < S) for (int64_t d = 0; d < D; ++d) dst[d * 16 + j] = src[d];
        else for (int64_t d = 0; d < D; ++d) dst[d * 16 + j] = 0.f;
      }
    }
#pragma omp for schedule(static)
    for (int64_t hj = 0; hj < Hkv * S; ++hj) {
      const int64_t h = hj / S, j = hj % S;
      std::memcpy(vp.data() + hj * D, v + j * v_row + h * D, D * sizeof(float));
    }
    // an item: gh query heads of one KV head (all G where G <= QB, else the largest divisor
    // of G that fits) x QB / gh tokens
    const int64_t G = H / Hkv;
    int64_t gh = std::min(G, QB);
    while (G % gh) --gh;
    const int64_t tok = QB / gh, blocks = (Tq + tok - 1) / tok, groups = H / gh;
    // the last query blocks see the most keys: first, so the dynamic schedule ends level
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < blocks * groups; ++i)
      item(out, q, kt, vp.data(), s, i % groups * gh, gh, (blocks - 1 - i / groups) * tok, tok);
  }
  std::free(kt);
}
