// Decode attention over a paged KV cache: one query token per request, in one call; and the
// step's K/V rows written into the pools, one call for both.
//
// Owns the arithmetic only; freetoken/ops/attention.py decides when it runs (CPU, bfloat16 or
// float32 with K/V of the same dtype, head_dim a multiple of 16, an AVX-512 or AVX2 CPU:
// attention_avx2.h) and falls back to torch's matmuls otherwise. Per request b and KV head g, with the G = H / n_kv query heads of g:
//   s[h, j] = (q[b, h] * scale) . K[slot[b, j], g]   for visible keys j (others: -inf)
//   p = softmax_j(s)          out[b, h] = sum_j p[h, j] V[slot[b, j], g]
// in float32, rounded once to the query dtype. Keys that are not visible are never read (their
// slots may be anything). The torch path gathers every slot's K and V into new tensors, converts
// them to float32 and runs ~10 ops per layer; this reads each visible row once, in place.
#include "extension.h"  // ATen and pybind11 (not the whole of <torch/extension.h>)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"
#include "attention_avx2.h"  // the same on 8 lanes, for CPUs without AVX-512

namespace {

using namespace ft_simd;

constexpr int64_t kTaskFlops = 1 << 16;  // least multiply-adds per parallel task
// How many keys ahead of the one being scored its K and V rows are prefetched. A decode step reads
// every layer's K/V rows once, from memory, scattered page by page over the pool: without it a
// SmolLM2 decode forward over 1000 cached keys took 11.6 ms, with it 7.2 (8 keys ahead: 7.6).
constexpr int64_t kPrefetchKeys = 16;

// a[0, 16 NV) = sum over j of p[j] V[slot[j]] (p[j] = 0: skipped, never read), in registers: the
// same sums in the same order as one pass through memory per key, without each key's FMAs waiting
// on the previous key's stores (a 1000-key decode spent most of its attention time there).
template <typename T, int NV>
FT_AVX512 inline void weighted_sum(const float* p, const T* v, int64_t slot_stride, const int64_t* slots, int64_t S,
                                   float* a) {
  __m512 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    if (p[j] == 0.f) continue;  // not visible, or underflowed
    const T* vr = v + slots[j] * slot_stride;
    const __m512 vp = _mm512_set1_ps(p[j]);
    for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(vp, load16(vr + 16 * i), acc[i]);
  }
  for (int i = 0; i < NV; ++i) store16(a + 16 * i, acc[i]);
}

// One request b and KV head g. work: G * D query floats, G * S scores, G * D accumulators.
template <typename T>
FT_AVX512 void attend_group(const T* q, int64_t q_head_stride, const T* k, const T* v, int64_t slot_stride,
                            int64_t D, int64_t G, const int64_t* slots, const bool* visible, int64_t S,
                            float scale, T* out, float* work) {
  float* qf = work;         // [G, D]
  float* sc = qf + G * D;   // [G, S]
  float* acc = sc + G * S;  // [G, D]
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; d += 16) store16(qf + h * D + d, _mm512_mul_ps(load16(q + h * q_head_stride + d), vscale));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < S; ++j) {
    if (!visible[j]) {
      for (int64_t h = 0; h < G; ++h) sc[h * S + j] = kNegInf;
      continue;
    }
    const T* kr = k + slots[j] * slot_stride;
    if (j + kPrefetchKeys < S && visible[j + kPrefetchKeys]) {  // the K and V rows read kPrefetchKeys keys later
      const char* nk = reinterpret_cast<const char*>(k + slots[j + kPrefetchKeys] * slot_stride);
      const char* nv = reinterpret_cast<const char*>(v + slots[j + kPrefetchKeys] * slot_stride);
      for (int64_t o = 0; o < D * int64_t(sizeof(T)); o += 64) {
        _mm_prefetch(nk + o, _MM_HINT_T0);
        _mm_prefetch(nv + o, _MM_HINT_T1);  // summed after every score: to L2
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 32 <= D; d += 32) {
        a0 = _mm512_fmadd_ps(load16(qf + h * D + d), load16(kr + d), a0);
        a1 = _mm512_fmadd_ps(load16(qf + h * D + d + 16), load16(kr + d + 16), a1);
      }
      if (d < D) a0 = _mm512_fmadd_ps(load16(qf + h * D + d), load16(kr + d), a0);
      sc[h * S + j] = reduce(_mm512_add_ps(a0, a1));
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* s = sc + h * S;
    float m = kNegInf;
    for (int64_t j = 0; j < S; ++j) m = std::max(m, s[j]);
    float* a = acc + h * D;
    std::memset(a, 0, sizeof(float) * D);
    if (m == kNegInf) {  // nothing visible (never for a real row): zeros rather than NaN
      for (int64_t d = 0; d < D; d += 16) store16(out + h * D + d, _mm512_setzero_ps());
      continue;
    }
    const float inv = 1.f / exp_sub_sum_(s, S, m);
    switch (D) {  // the common head sizes keep the sum in registers
      case 64: weighted_sum<T, 4>(s, v, slot_stride, slots, S, a); break;
      case 128: weighted_sum<T, 8>(s, v, slot_stride, slots, S, a); break;
      case 256: weighted_sum<T, 16>(s, v, slot_stride, slots, S, a); break;
      default:
        for (int64_t jj = 0; jj < S; ++jj) {
          const float p = s[jj];
          if (p == 0.f) continue;  // not visible, or underflowed
          const T* vr = v + slots[jj] * slot_stride;
          const __m512 vp = _mm512_set1_ps(p);
          for (int64_t d = 0; d < D; d += 16) store16(a + d, _mm512_fmadd_ps(vp, load16(vr + d), load16(a + d)));
        }
    }
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 16) store16(out + h * D + d, _mm512_mul_ps(load16(a + d), vinv));
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const at::Tensor& visible, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t n_kv = k_cache.size(-2), G = H / n_kv, S = slots.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = visible.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), slot_stride = n_kv * D;
  const int64_t per_task = std::max<int64_t>(1, S * D * (G + 1));
  const int64_t grain = std::max<int64_t>(1, kTaskFlops / per_task);
  static const bool avx512 = cpu_supported();  // else AVX2 (supported() said one of them)
  at::parallel_for(0, B * n_kv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work(size_t(G * (2 * D + S)));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / n_kv, g = t % n_kv;
      if (avx512)
        attend_group<T>(qp + b * qs0 + g * G * qs1, qs1, kp + g * D, vp + g * D, slot_stride, D, G,
                        sp + b * S, mp + b * S, S, float(scale), op + (b * H + g * G) * D, work.data());
      else
        ft_avx2::attend_group<T>(qp + b * qs0 + g * G * qs1, qs1, kp + g * D, vp + g * D, slot_stride, D, G,
                                 sp + b * S, mp + b * S, S, float(scale), op + (b * H + g * G) * D, work.data(),
                                 kPrefetchKeys);
    }
  });
}

// q [B, H, D] (rows strided, last dimension contiguous); k_cache, v_cache [..., n_kv, D]
// contiguous (any number of leading slot dimensions); slots int64 [B, S] (flat slot of each key);
// visible bool [B, S]. Returns [B, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& visible, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "decode_attention: q must be CPU [B, H, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "decode_attention: bfloat16 or float32");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "decode_attention: K/V must have q's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: K/V caches must be contiguous and of one shape");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 16 == 0 && k_cache.size(-1) == D, "decode_attention: head_dim must match and be a multiple of 16");
  const int64_t n_kv = k_cache.size(-2);
  TORCH_CHECK(n_kv > 0 && H % n_kv == 0, "decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2 && slots.size(0) == B,
              "decode_attention: slots must be int64 [B, S]");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.is_contiguous() && visible.sizes() == slots.sizes(),
              "decode_attention: visible must be bool [B, S]");
  at::Tensor out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;
  if (q.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(q, k_cache, v_cache, slots, visible, scale, out);
  else
    run<float>(q, k_cache, v_cache, slots, visible, scale, out);
  return out;
}

// k_pool[slots[t]] = k[t] and v_pool[slots[t]] = v[t] for the T tokens of a step. Pools [..., n_kv, D]
// contiguous; k, v [T, n_kv, D] of the pools' dtype with each token's heads packed (row stride
// free: views of the fused projection output); slots int64 [T], each a row of the pools.
void write_kv_(at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "write_kv_: pools must be contiguous and of one shape");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == k_pool.scalar_type() &&
                  v.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type(),
              "write_kv_: k and v must be [T, n_kv, D] of the pools' dtype");
  const int64_t T = k.size(0), n_kv = k.size(1), D = k.size(2), row = n_kv * D;
  TORCH_CHECK(k_pool.size(-2) == n_kv && k_pool.size(-1) == D, "write_kv_: k and v do not match the pools' heads");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == D, "write_kv_: each token's heads must be packed");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 && slots.size(0) == T,
              "write_kv_: slots must be int64 [T]");
  const int64_t rows = k_pool.numel() / row;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const size_t elt = k.element_size(), bytes = size_t(row) * elt;
  auto* kd = static_cast<char*>(k_pool.data_ptr());
  auto* vd = static_cast<char*>(v_pool.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    TORCH_CHECK(slot >= 0 && slot < rows, "write_kv_: slot ", slot, " is outside the pool (", rows, " rows)");
    std::memcpy(kd + size_t(slot) * bytes, ks + size_t(t * k.stride(0)) * elt, bytes);
    std::memcpy(vd + size_t(slot) * bytes, vs + size_t(t * v.stride(0)) * elt, bytes);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's decode attention over a paged KV cache (see attention.cpp)";
  m.def("supported", [] { return cpu_supported() || ft_avx2::cpu_supported(); },
        "whether this CPU runs decode_attention: AVX-512 F/BW/VL and FMA, or AVX2 and FMA");
  m.def("decode_attention", &decode_attention, "one query per request over its visible key slots",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("visible"), py::arg("scale"));
  m.def("write_kv_", &write_kv_, "a step's K/V rows into the pools", py::arg("k_pool"), py::arg("v_pool"),
        py::arg("slots"), py::arg("k"), py::arg("v"));
}
