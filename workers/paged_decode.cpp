// Decode attention that reads the paged KV pool in place (no gathered copy of the context).
// One query token per sequence; for each (sequence, KV head) the G query heads of its group
// score every context token, softmax in float32, then accumulate V. Invariants: k_cache and
// v_cache are [num_blocks, block_size, kv_heads, head_dim] contiguous; block_tables[b] covers
// context_lens[b] tokens; window > 0 keeps only the last `window` keys.
// Plain C++ with a C ABI (no torch headers, so it builds in a second or two; workers/kernels.py
// loads it with ctypes and hands it the tensors' data pointers). bf16 is carried as its raw
// 16 bits; float -> bf16 rounds to nearest even, as torch does. Serial, as the torch-extension
// build of this kernel was (at::parallel_for ran serially there: it was built without OpenMP).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct bf16 { uint16_t x; };

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
template <> inline float to_f<bf16>(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T> inline T from_f(float f) { return static_cast<T>(f); }
template <> inline bf16 from_f<bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return bf16{0x7FC0};
  u += ((u >> 16) & 1u) + 0x7FFFu;   // round to nearest even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// a row of D values as float32; bf16 goes through integer shifts (the loop vectorizes)
template <typename T> inline void row_to_f(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}
template <> inline void row_to_f<bf16>(const bf16* src, float* dst, int64_t D) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t bits[512];
  for (int64_t d = 0; d < D; ++d) bits[d] = static_cast<uint32_t>(raw[d]) << 16;
  std::memcpy(dst, bits, D * sizeof(float));
}

// q, out: [B, H, D]; k_cache, v_cache: [num_blocks, bs, Hkv, D]; block_tables: [B, W] int64;
// context_lens: [B] int64; all contiguous
template <typename T>
void run(const T* __restrict__ qp, const T* __restrict__ kp, const T* __restrict__ vp,
         const int64_t* __restrict__ tp, const int64_t* __restrict__ lp, T* __restrict__ op,
         int64_t B, int64_t H, int64_t D, int64_t bs, int64_t Hkv, int64_t W, float scale,
         int64_t window) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements between consecutive tokens of a block
  std::vector<float> qf(G * D), acc(G * D), scores;
  for (int64_t item = 0; item < B * Hkv; ++item) {
    const int64_t b = item / Hkv, h = item % Hkv;
    const int64_t len = lp[b];
    const int64_t first = window > 0 && len > window ? len - window : 0;
    const int64_t n = len - first;
    scores.assign(G * n, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        qf[g * D + d] = to_f(qp[(b * H + h * G + g) * D + d]) * scale;
    for (int64_t t = first; t < len; ++t) {
      const T* kr = kp + (tp[b * W + t / bs] * bs + t % bs) * row + h * D;
      float kf[512];
      row_to_f(kr, kf, D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf.data() + g * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
        scores[g * n + (t - first)] = s;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * n;
      float m = -FLT_MAX;   // no infinities anywhere: masked keys are outside the loops
      for (int64_t i = 0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
      const float inv = 1.f / sum;
      for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = first; t < len; ++t) {
      const T* vr = vp + (tp[b * W + t / bs] * bs + t % bs) * row + h * D;
      float vf[512];
      row_to_f(vr, vf, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * n + (t - first)];
        float* ag = acc.data() + g * D;
        for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        op[(b * H + h * G + g) * D + d] = from_f<T>(acc[g * D + d]);
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

// dtype: 0 float32, 1 bfloat16. The caller (workers/kernels.py) checks shapes, contiguity and
// dtypes; head_dim <= 512 and H a multiple of Hkv. Returns 0, or 1 (nothing computed) when a
// context length or a block it reads is outside its table or the pool.
extern "C" int raypd_paged_decode(const void* q, const void* k_cache, const void* v_cache,
                                  const int64_t* block_tables, const int64_t* context_lens,
                                  void* out, int64_t B, int64_t H, int64_t D, int64_t bs,
                                  int64_t Hkv, int64_t W, int64_t num_blocks, double scale,
                                  int64_t window, int dtype) {
  if (!in_bounds(block_tables, context_lens, B, bs, W, num_blocks)) return 1;
  if (dtype == 1)
    run(static_cast<const bf16*>(q), static_cast<const bf16*>(k_cache),
        static_cast<const bf16*>(v_cache), block_tables, context_lens, static_cast<bf16*>(out),
        B, H, D, bs, Hkv, W, static_cast<float>(scale), window);
  else
    run(static_cast<const float*>(q), static_cast<const float*>(k_cache),
        static_cast<const float*>(v_cache), block_tables, context_lens,
        static_cast<float*>(out), B, H, D, bs, Hkv, W, static_cast<float>(scale), window);
  return 0;
}
