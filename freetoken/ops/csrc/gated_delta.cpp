// One decode token of a Gated DeltaNet layer for B requests, updating the requests' states where
// they lie in the state pool (no gather, no scatter, no temporaries):
//
// - `recurrent_gated_delta_`: per request b and value head h, with S = states[slots[b], h]
//   [Dk, Dv] (float32), the key / query head h / (Hv / Hk), e = exp(g) and beta:
//   S <- e S + k (beta (v - e S^T k))^T, then out = S^T q. Two passes over S per head: the first
//   reads it for S^T k, the second (S still in L2) writes the new state and sums S^T q.
// - `causal_conv1d_step_`: the short depthwise convolution's step, its state (the last K - 1
//   inputs per channel) shifted in place.
//
// Owns the arithmetic only; freetoken/ops/gated_delta.py chooses between these and the torch
// reference (the prefill chunks' form, other devices, no extension built) and documents it. The
// loops are plain C++, compiled once as they are and once for AVX-512 (chosen at run time).
#include "extension.h"  // ATen and pybind11 (not the whole of <torch/extension.h>)

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

// One value head of one request: the state S [dk, dv] in place, out [dv].
inline __attribute__((always_inline)) void head_step(float* __restrict S, const float* __restrict q,
                                                     const float* __restrict k, const float* __restrict v,
                                                     float e, float beta, float* __restrict out, int64_t dk,
                                                     int64_t dv, float* __restrict delta) {
  for (int64_t j = 0; j < dv; ++j) delta[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {  // delta = S^T k (before the decay)
    const float ki = k[i];
    const float* row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) delta[j] += row[j] * ki;
  }
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = (v[j] - e * delta[j]) * beta;
    out[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {  // S <- e S + k delta^T; out += S^T q
    const float ki = k[i], qi = q[i];
    float* row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      const float s = e * row[j] + ki * delta[j];
      row[j] = s;
      out[j] += s * qi;
    }
  }
}

FT_AVX512 void head_step_avx512(float* S, const float* q, const float* k, const float* v, float e, float beta,
                                float* out, int64_t dk, int64_t dv, float* delta) {
  head_step(S, q, k, v, e, beta, out, dk, dv, delta);
}

void head_step_plain(float* S, const float* q, const float* k, const float* v, float e, float beta, float* out,
                     int64_t dk, int64_t dv, float* delta) {
  head_step(S, q, k, v, e, beta, out, dk, dv, delta);
}

const bool kAvx512 = ft_simd::cpu_supported();

void check_f32(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              ": a contiguous float32 CPU tensor is expected");
  TORCH_CHECK(t.dim() == dim, what, ": expected ", dim, " dimensions, got ", t.dim());
}

// q, k [B, Hk, Dk]; v [B, Hv, Dv]; g (log decay), beta [B, Hv]; states [S, Hv, Dk, Dv]; slots
// int64 [B], distinct -> out [B, Hv, Dv]; states[slots] updated in place.
at::Tensor recurrent_gated_delta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots) {
  check_f32(q, 3, "q");
  check_f32(k, 3, "k");
  check_f32(v, 3, "v");
  check_f32(g, 2, "g");
  check_f32(beta, 2, "beta");
  check_f32(states, 4, "states");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots: int64 [B]");
  const int64_t B = v.size(0), hv = v.size(1), dv = v.size(2), hk = q.size(1), dk = q.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && q.size(0) == B && slots.size(0) == B, "q, k, v, slots: batch sizes differ");
  TORCH_CHECK(hk > 0 && hv % hk == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(g.size(0) == B && g.size(1) == hv && beta.sizes() == g.sizes(), "g, beta: [B, Hv] expected");
  TORCH_CHECK(states.size(1) == hv && states.size(2) == dk && states.size(3) == dv, "states: [S, Hv, Dk, Dv] expected");
  const int64_t n_slots = states.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(slot[b] >= 0 && slot[b] < n_slots, "slot ", slot[b], " out of range");
  at::Tensor out = at::empty({B, hv, dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = states.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t per_key = hv / hk;
  const auto step = kAvx512 ? head_step_avx512 : head_step_plain;
  at::parallel_for(0, B * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> delta(dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / hv, h = bh % hv, kh = h / per_key;
      step(sp + (slot[b] * hv + h) * dk * dv, qp + (b * hk + kh) * dk, kp + (b * hk + kh) * dk,
           vp + (b * hv + h) * dv, std::exp(gp[bh]), bp[bh], op + bh * dv, dk, dv, delta.data());
    }
  });
  return out;
}

// x [B, C]; states [S, C, K - 1] (float32); weight [C, K] (float32); slots int64 [B] -> out [B, C]
// float32 (out[c] = sum_j weight[c, j] input[j], the inputs being the state then x[c]); the state
// shifted by one input in place.
at::Tensor causal_conv1d_step_(const at::Tensor& x, at::Tensor& states, const at::Tensor& weight,
                               const at::Tensor& slots) {
  check_f32(x, 2, "x");
  check_f32(states, 3, "states");
  check_f32(weight, 2, "weight");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == x.size(0), "slots: int64 [B]");
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1), n_slots = states.size(0);
  TORCH_CHECK(weight.size(0) == C && states.size(1) == C && states.size(2) == K - 1, "conv shapes differ");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(slot[b] >= 0 && slot[b] < n_slots, "slot ", slot[b], " out of range");
  at::Tensor out = at::empty({B, C}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = states.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * C, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t bc = begin; bc < end; ++bc) {
      const int64_t b = bc / C, c = bc % C;
      float* s = sp + (slot[b] * C + c) * (K - 1);
      const float* w = wp + c * K;
      const float xin = xp[bc];
      float acc = 0.f;
      for (int64_t j = 0; j < K - 1; ++j) acc += w[j] * s[j];
      acc += w[K - 1] * xin;
      for (int64_t j = 0; j + 1 < K - 1; ++j) s[j] = s[j + 1];
      if (K > 1) s[K - 2] = xin;
      op[bc] = acc;
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's Gated DeltaNet decode step, in place on the state pool (see gated_delta.cpp)";
  m.def("recurrent_gated_delta_", &recurrent_gated_delta_, "one token of the gated delta rule per request",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("states"), py::arg("slots"));
  m.def("causal_conv1d_step_", &causal_conv1d_step_, "one token of the causal conv1d per request", py::arg("x"),
        py::arg("states"), py::arg("weight"), py::arg("slots"));
}
