// The small per-layer ops of a decode step, each one call instead of two to ten torch ops:
// RMSNorm (computed in float32, as transformers does), rotary embedding applied in place, q/k
// norms with rope, the residual add fused with the norms around it, and the MLP's act(gate) * up
// (torch's kernels, called from here).
//
// Owns the arithmetic only; freetoken/ops/layers.py chooses between these and the torch
// reference (float64, other devices) and documents the rounding. Rows (every dimension but the
// last) may be strided; the last dimension must be contiguous. Plain C++ loops: at decode sizes
// (a few hundred values per row) a call costs about a microsecond, so no SIMD of our own.
#include "extension.h"  // ATen and pybind11 (not the whole of <torch/extension.h>)

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kGrainRows = 64;  // rows per parallel task: decode (1-16 rows) runs inline

// Row r of a tensor viewed as [rows, D]: its first element.
template <typename T>
struct Rows {
  T* base;
  int64_t inner;      // size of the second-to-last dimension (1 for a 2-D tensor)
  int64_t stride0;    // element stride of the first dimension
  int64_t stride1;    // element stride of the second-to-last dimension (3-D only)
  T* row(int64_t r) const { return base + (r / inner) * stride0 + (r % inner) * stride1; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& x) {
  if (x.dim() == 2) return {x.data_ptr<T>(), 1, x.stride(0), 0};
  return {x.data_ptr<T>(), x.size(1), x.stride(0), x.stride(1)};
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, what, ": expected [T, D] or [T, H, D]");
  TORCH_CHECK(x.stride(-1) == 1, what, ": the last dimension must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, what,
              ": bfloat16 or float32 only");
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const float* w, float eps, bool weight_after_cast, at::Tensor& out) {
  const int64_t D = x.size(-1);
  const int64_t n = x.numel() / D;
  const Rows<T> in = rows_of<T>(x);
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = in.row(r);
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) {
        const float v = static_cast<float>(src[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      T* o = dst + r * D;
      if (weight_after_cast) {  // Llama: w * round(x / rms), the product rounded again
        for (int64_t i = 0; i < D; ++i) o[i] = T(static_cast<float>(T(static_cast<float>(src[i]) * inv)) * w[i]);
      } else {  // Gemma, gpt-oss: round(x / rms * w)
        for (int64_t i = 0; i < D; ++i) o[i] = T(static_cast<float>(src[i]) * inv * w[i]);
      }
    }
  });
}

// y = x / rms(x) * w over the last dimension; a new contiguous tensor of x's shape and dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_after_cast) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(-1),
              "rms_norm: weight must be float32 [D]");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* w = weight.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows<at::BFloat16>(x, w, static_cast<float>(eps), weight_after_cast, out);
  } else {
    rms_norm_rows<float>(x, w, static_cast<float>(eps), weight_after_cast, out);
  }
  return out;
}

template <typename T>
void rope_rows(at::Tensor& x, const float* cos, const float* sin) {
  const int64_t D = x.size(-1), half = D / 2, heads = x.size(1);
  const int64_t n = x.size(0) * heads;
  const Rows<T> rows = rows_of<T>(x);
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* v = rows.row(r);
      const float* c = cos + (r / heads) * half;
      const float* s = sin + (r / heads) * half;
      for (int64_t j = 0; j < half; ++j) {
        const float a = static_cast<float>(v[j]), b = static_cast<float>(v[j + half]);
        v[j] = T(a * c[j] - b * s[j]);
        v[j + half] = T(b * c[j] + a * s[j]);
      }
    }
  });
}

// Rotate the halves (x1, x2) of each head of x [T, H, D] in place into
// (x1 c - x2 s, x2 c + x1 s), with cos, sin float32 [T, D / 2].
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rope_");
  TORCH_CHECK(x.dim() == 3 && x.size(-1) % 2 == 0, "rope_: expected [T, H, D] with D even");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == x.size(0) && t->size(1) == x.size(-1) / 2,
                "rope_: cos and sin must be float32 [T, D / 2]");
  }
  if (x.scalar_type() == at::kBFloat16) {
    rope_rows<at::BFloat16>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
  } else {
    rope_rows<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
  }
}

template <typename T>
float row_inv_rms(const T* src, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float v = static_cast<float>(src[i]);
    ss += v * v;
  }
  return 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
}

template <typename T>
void norm_row(const T* src, const float* w, float inv, int64_t D, bool weight_after_cast, T* o) {
  if (weight_after_cast) {
    for (int64_t i = 0; i < D; ++i) o[i] = T(static_cast<float>(T(static_cast<float>(src[i]) * inv)) * w[i]);
  } else {
    for (int64_t i = 0; i < D; ++i) o[i] = T(static_cast<float>(src[i]) * inv * w[i]);
  }
}

// The residual step between two sub-blocks, one call instead of two to four ops:
//   x_out = x + (h_weight ? rms_norm(h) * h_weight : h)      (each term rounded as torch rounds it)
//   y     = rms_norm(x_out) * weight                          (when weight is given)
// x, h [T, D] contiguous; weights float32 [D]; the norms in the form of `rms_norm` (both with the
// same eps and weight_after_cast). Returns (x_out, y) or (x_out,) without weight.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const c10::optional<at::Tensor>& h_weight,
                                     const c10::optional<at::Tensor>& weight, double eps, bool weight_after_cast) {
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && h.is_contiguous() && h.sizes() == x.sizes() &&
                  h.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and h must be contiguous [T, D] of one dtype");
  const int64_t T = x.size(0), D = x.size(1);
  for (const c10::optional<at::Tensor>* w : {&h_weight, &weight}) {
    TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == at::kFloat && (*w)->is_contiguous() && (*w)->numel() == D),
                "add_rms_norm: weights must be float32 [D]");
  }
  at::Tensor x_out = at::empty_like(x);
  at::Tensor y = weight.has_value() ? at::empty_like(x) : at::Tensor();
  const float* hw = h_weight.has_value() ? h_weight->data_ptr<float>() : nullptr;
  const float* w = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    using T_ = scalar_t;
    const T_* xp = x.data_ptr<T_>();
    const T_* hp = h.data_ptr<T_>();
    T_* xo = x_out.data_ptr<T_>();
    T_* yo = w ? y.data_ptr<T_>() : nullptr;
    at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
      std::vector<T_> normed(hw ? size_t(D) : 0);
      for (int64_t r = begin; r < end; ++r) {
        const T_* hr = hp + r * D;
        if (hw) {
          norm_row<T_>(hr, hw, row_inv_rms<T_>(hr, D, e), D, weight_after_cast, normed.data());
          hr = normed.data();
        }
        T_* xr = xo + r * D;
        for (int64_t i = 0; i < D; ++i) xr[i] = T_(static_cast<float>(xp[r * D + i]) + static_cast<float>(hr[i]));
        if (w) norm_row<T_>(xr, w, row_inv_rms<T_>(xr, D, e), D, weight_after_cast, yo + r * D);
      }
    });
  });
  if (w) return {x_out, y};
  return {x_out};
}

// The attention input of a layer, in place on its fused projection qkv [T, (H + 2 n_kv) D] (rows
// strided, the last dimension contiguous): each of the H query heads and n_kv key heads RMS-normed
// by its weight when given (q_w, k_w float32 [D]; the form of `rms_norm`), rounded, then rotated
// like `rope_` by cos, sin float32 [T, D / 2]. One call for what is two to four.
void qk_norm_rope_(at::Tensor qkv, int64_t H, int64_t n_kv, const c10::optional<at::Tensor>& q_w,
                   const c10::optional<at::Tensor>& k_w, double eps, bool weight_after_cast,
                   const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(qkv, "qk_norm_rope_");
  TORCH_CHECK(qkv.dim() == 2, "qk_norm_rope_: expected qkv [T, (H + 2 n_kv) D]");
  const int64_t T = qkv.size(0), heads = H + n_kv;
  TORCH_CHECK(H > 0 && n_kv > 0 && qkv.size(1) % (H + 2 * n_kv) == 0, "qk_norm_rope_: width is not (H + 2 n_kv) D");
  const int64_t D = qkv.size(1) / (H + 2 * n_kv), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "qk_norm_rope_: head_dim must be even");
  for (const c10::optional<at::Tensor>* w : {&q_w, &k_w}) {
    TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == at::kFloat && (*w)->is_contiguous() && (*w)->numel() == D),
                "qk_norm_rope_: norm weights must be float32 [D]");
  }
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == half,
                "qk_norm_rope_: cos and sin must be float32 [T, D / 2]");
  }
  const float* qw = q_w.has_value() ? q_w->data_ptr<float>() : nullptr;
  const float* kw = k_w.has_value() ? k_w->data_ptr<float>() : nullptr;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t stride = qkv.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "qk_norm_rope_", [&] {
    using T_ = scalar_t;
    T_* base = qkv.data_ptr<T_>();
    at::parallel_for(0, T * heads, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / heads, h = r % heads;
        T_* v = base + t * stride + h * D;
        const float* w = h < H ? qw : kw;
        if (w) norm_row<T_>(v, w, row_inv_rms<T_>(v, D, e), D, weight_after_cast, v);
        const float* c = cp + t * half;
        const float* s = sp + t * half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = static_cast<float>(v[j]), b = static_cast<float>(v[j + half]);
          v[j] = T_(a * c[j] - b * s[j]);
          v[j + half] = T_(b * c[j] + a * s[j]);
        }
      }
    });
  });
}

// act(gate) * up on the fused gate/up output gate_up [..., 2 I] (gate columns first): torch's own
// silu / tanh-gelu and multiply (the same kernels, so the same bits), called from here so that a
// decode step pays one Python call for the three ops instead of three (~5 -> ~3 us at one row).
// A loop of our own with libm's tanh was 3x slower than torch's vectorized kernels.
at::Tensor gated_act(const at::Tensor& gate_up, bool gelu_tanh) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gated_act: the last dimension must be 2 I");
  const int64_t I = gate_up.size(-1) / 2;
  const at::Tensor gate = gate_up.narrow(-1, 0, I);
  at::Tensor act = gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate);
  return act.mul_(gate_up.narrow(-1, I, I));  // in place on act's fresh memory: the values of act * up
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's fused RMSNorm and in-place rotary embedding (see layers.cpp)";
  m.def("rms_norm", &rms_norm, "x / rms(x) * w in float32", py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("weight_after_cast"));
  m.def("rope_", &rope_, "rotary embedding in place", py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("add_rms_norm", &add_rms_norm, "x + norm(h) (or x + h), then norm of the sum", py::arg("x"), py::arg("h"),
        py::arg("h_weight"), py::arg("weight"), py::arg("eps"), py::arg("weight_after_cast"));
  m.def("qk_norm_rope_", &qk_norm_rope_, "q/k head norms and rope in place on the fused projection", py::arg("qkv"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("q_weight"), py::arg("k_weight"), py::arg("eps"),
        py::arg("weight_after_cast"), py::arg("cos"), py::arg("sin"));
  m.def("gated_act", &gated_act, "act(gate) * up by torch's kernels, one call", py::arg("gate_up"),
        py::arg("gelu_tanh"));
}
