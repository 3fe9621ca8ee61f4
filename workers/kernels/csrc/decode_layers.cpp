// The compact model's layers for a pure decode step in one call: the fused small ops
// (fused_ops.cpp), the linears and the paged decode attention (paged_decode.cpp), the pool
// written in place. Two element types:
// - float32 activations and pool, the linears' weights held as bf16 (linear_w16.cpp's packed
//   layout): raypd_decode_layers_f32;
// - bf16 activations and pool, the linears VNNI-packed (kernels.pack_vnni) and run by
//   linear_small_m.cpp (AVX512-BF16) or linear_amx.cpp (AMX-BF16): raypd_decode_layers_bf16.
// It calls the same kernels, with the same arguments and in the same order, as
// workers/llama.py's _Layer.forward_fused, so its result is that path's, bit for bit; what it
// saves is the Python between them (~10 calls a layer, each a few microseconds of argument
// checks, allocations and ctypes conversions: SmolLM2 at batch 1, ~4 ms of a ~22 ms step in
// float32, ~5 ms of ~13 in bf16).
// Invariants (checked by the callers, CompactLlama._one_call_rows / _one_call in
// workers/llama.py and kernels.decode_layers): every pointer below is a contiguous buffer of
// the element type (or packed bf16 weights) of the shape named; 1 <= T <= the linear kernel's
// row limit; the decode groups' rows partition [0, T).
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
void raypd_add_rms_norm_f32(float* x, float* h, const float* delta, const float* weight,
                            int64_t T, int64_t D, double eps, int nthreads);
int raypd_rope_and_cache_f32(float* qkv, const float* cos, const float* sin, float* k_cache,
                             float* v_cache, const int64_t* slots, int64_t T, int64_t H,
                             int64_t Hkv, int64_t D, int64_t num_slots, int nthreads);
void raypd_silu_mul_f32(float* out, const float* gate_up, int64_t T, int64_t I, int nthreads);
void raypd_linear_w16(float* out, const float* x, const uint16_t* wp, const float* bias,
                      int64_t M, int64_t N, int64_t K, int nthreads);
void raypd_add_rms_norm(uint16_t* x, uint16_t* h, const uint16_t* delta, const uint16_t* weight,
                        int64_t T, int64_t D, double eps, int nthreads);
int raypd_rope_and_cache(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin,
                         uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots, int64_t T,
                         int64_t H, int64_t Hkv, int64_t D, int64_t num_slots, int nthreads);
void raypd_silu_mul(uint16_t* out, const uint16_t* gate_up, int64_t T, int64_t I, int nthreads);
void raypd_linear_small_m(uint16_t* out, const uint16_t* x, const uint16_t* wp,
                          const uint16_t* bias, int64_t M, int64_t N, int64_t K, int nthreads);
void raypd_linear_amx(uint16_t* out, const uint16_t* x, const uint16_t* wp, const uint16_t* bias,
                      int64_t M, int64_t N, int64_t K, int nthreads);
int raypd_paged_decode(const void* q, const void* k_cache, const void* v_cache,
                       const int64_t* block_tables, const int64_t* context_lens, void* out,
                       int64_t B, int64_t H, int64_t D, int64_t bs, int64_t Hkv, int64_t W,
                       int64_t num_blocks, double scale, int64_t window, int dtype, int nthreads,
                       int path);
}

namespace {

// One layer's operands, as int64 words (pointers and sizes) in this order.
enum LayerWord {
  QKV, QKV_BIAS, O, O_BIAS, GATE_UP, DOWN, LN1, LN2, K_CACHE, V_CACHE, WINDOW, LAYER_WORDS
};
// One decode group's: its rows [start, start + count), block tables [count, width], lengths.
enum GroupWord { START, COUNT, TABLES, LENS, WIDTH, GROUP_WORDS };

template <typename T> T* at(const int64_t* words, int64_t i) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(words[i]));
}

// the element type's kernels
template <typename E> struct Kernels {
  using Linear = void (*)(E*, const E*, const uint16_t*, const E*, int64_t, int64_t, int64_t,
                          int);
  void (*add_rms_norm)(E*, E*, const E*, const E*, int64_t, int64_t, double, int);
  int (*rope_and_cache)(E*, const E*, const E*, E*, E*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int);
  void (*silu_mul)(E*, const E*, int64_t, int64_t, int);
  Linear linear;
  int dtype;   // paged_decode's code: 0 float32, 1 bf16
};

// dims: T (rows), hidden, H, Hkv, D, I (intermediate), bs, num_blocks (pool blocks per layer).
// path: the decode attention's, raypd_paged_decode's argument (workers/kernels/isa.py's choice).
// h [T, hidden]: the residual stream (in place); delta [T, hidden]: the last layer's output,
// still to be added to h (the caller's final norm adds it). cos, sin [T, D]; slots [T].
// Returns 0, or 1 when a slot or a block table entry is outside the pool (the step is then
// unusable: the caller raises).
template <typename E>
int decode_layers(const Kernels<E>& k, const int64_t* layers, int64_t L, const int64_t* groups,
                  int64_t num_groups, E* h, E* delta, const int64_t* dims, double eps,
                  double scale, const E* cos, const E* sin, const int64_t* slots, int nthreads,
                  int path) {
  const int64_t T = dims[0], hidden = dims[1], H = dims[2], Hkv = dims[3], D = dims[4],
                I = dims[5], bs = dims[6], num_blocks = dims[7];
  const int64_t heads = H + 2 * Hkv, num_slots = num_blocks * bs;
  std::vector<E> x(T * hidden), qkv(T * heads * D), q(T * H * D), attn(T * H * D),
      o(T * hidden), gu(T * 2 * I), act(T * I);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* w = layers + l * LAYER_WORDS;
    k.add_rms_norm(x.data(), h, l ? delta : nullptr, at<const E>(w, LN1), T, hidden, eps,
                   nthreads);
    k.linear(qkv.data(), x.data(), at<const uint16_t>(w, QKV), at<const E>(w, QKV_BIAS), T,
             heads * D, hidden, nthreads);
    E* k_cache = at<E>(w, K_CACHE);
    E* v_cache = at<E>(w, V_CACHE);
    if (k.rope_and_cache(qkv.data(), cos, sin, k_cache, v_cache, slots, T, H, Hkv, D,
                         num_slots, nthreads))
      return 1;
    for (int64_t t = 0; t < T; ++t)   // the query heads of each row, contiguous
      std::memcpy(q.data() + t * H * D, qkv.data() + t * heads * D, H * D * sizeof(E));
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t* gw = groups + g * GROUP_WORDS;
      const int64_t start = gw[START];
      if (raypd_paged_decode(q.data() + start * H * D, k_cache, v_cache,
                             at<const int64_t>(gw, TABLES), at<const int64_t>(gw, LENS),
                             attn.data() + start * H * D, gw[COUNT], H, D, bs, Hkv, gw[WIDTH],
                             num_blocks, scale, w[WINDOW], k.dtype, nthreads, path))
        return 1;
    }
    k.linear(o.data(), attn.data(), at<const uint16_t>(w, O), at<const E>(w, O_BIAS), T, hidden,
             H * D, nthreads);
    k.add_rms_norm(x.data(), h, o.data(), at<const E>(w, LN2), T, hidden, eps, nthreads);
    k.linear(gu.data(), x.data(), at<const uint16_t>(w, GATE_UP), nullptr, T, 2 * I, hidden,
             nthreads);
    k.silu_mul(act.data(), gu.data(), T, I, nthreads);
    k.linear(delta, act.data(), at<const uint16_t>(w, DOWN), nullptr, T, hidden, I, nthreads);
  }
  return 0;
}

}  // namespace

// float32 activations and pool, linears by linear_w16 (arguments: decode_layers above)
extern "C" int raypd_decode_layers_f32(const int64_t* layers, int64_t L, const int64_t* groups,
                                       int64_t num_groups, float* h, float* delta,
                                       const int64_t* dims, double eps, double scale,
                                       const float* cos, const float* sin, const int64_t* slots,
                                       int nthreads, int path) {
  static const Kernels<float> k{raypd_add_rms_norm_f32, raypd_rope_and_cache_f32,
                                raypd_silu_mul_f32, raypd_linear_w16, 0};
  return decode_layers(k, layers, L, groups, num_groups, h, delta, dims, eps, scale, cos, sin,
                       slots, nthreads, path);
}

// bf16 activations and pool, linears by linear_amx (amx != 0) or linear_small_m
extern "C" int raypd_decode_layers_bf16(const int64_t* layers, int64_t L,
                                        const int64_t* groups, int64_t num_groups, uint16_t* h,
                                        uint16_t* delta, const int64_t* dims, double eps,
                                        double scale, const uint16_t* cos, const uint16_t* sin,
                                        const int64_t* slots, int nthreads, int path, int amx) {
  static const Kernels<uint16_t> small_m{raypd_add_rms_norm, raypd_rope_and_cache,
                                         raypd_silu_mul, raypd_linear_small_m, 1};
  static const Kernels<uint16_t> with_amx{raypd_add_rms_norm, raypd_rope_and_cache,
                                          raypd_silu_mul, raypd_linear_amx, 1};
  return decode_layers(amx ? with_amx : small_m, layers, L, groups, num_groups, h, delta, dims,
                       eps, scale, cos, sin, slots, nthreads, path);
}
