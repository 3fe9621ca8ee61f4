// Decode attention that reads the paged KV pool in place (no gathered copy of the context).
// One query token per sequence; for each (sequence, KV head) the G query heads of its group
// score every context token, softmax in float32, then accumulate V. Invariants: k_cache and
// v_cache are [num_blocks, block_size, kv_heads, head_dim] contiguous; block_tables[b] covers
// context_lens[b] tokens; window > 0 keeps only the last `window` keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }
template <> inline float to_f<at::BFloat16>(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// a row of D values as float32; bf16 goes through integer shifts (the loop vectorizes)
template <typename T> static inline void row_to_f(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}
template <> inline void row_to_f<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t D) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t bits[512];
  for (int64_t d = 0; d < D; ++d) bits[d] = static_cast<uint32_t>(raw[d]) << 16;
  std::memcpy(dst, bits, D * sizeof(float));
}

template <typename T>
static void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                torch::Tensor& out, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, W = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t row = Hkv * D;  // elements between consecutive tokens of a block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lp[b];
      const int64_t first = window > 0 && len > window ? len - window : 0;
      const int64_t n = len - first;
      scores.assign(G * n, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(qp[(b * H + h * G + g) * D + d]) * static_cast<float>(scale);
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
          op[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be [B, H, D] contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) <= 512, "head_dim > 512");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads not a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(q, k_cache, v_cache, tables, lens, out, scale, window);
  else if (q.scalar_type() == at::kFloat)
    run<float>(q, k_cache, v_cache, tables, lens, out, scale, window);
  else
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16");
  return out;
}
