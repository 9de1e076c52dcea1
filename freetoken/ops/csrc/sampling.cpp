// The whole-row passes of the sampler, one call for what took four torch ops over every logit:
// temperature applied in place, each row's maximum, the log of its softmax normaliser and the
// maxima of its blocks of `block` logits (which the top-k search reads instead of the row); and,
// for a temperature-only draw, the row's softmax weights in place with their block sums.
//
// Owns the arithmetic only; freetoken/ops/sampling.py decides when it runs (CPU, float32,
// contiguous rows) and falls back to torch's ops otherwise. x / t is IEEE division, as torch's
// div_, so the scaled logits, the maxima and the block maxima are bit for bit torch's. The
// normaliser sums exp(x - max) with the vectorized exp of simd.h (~1 ulp) in float32 lanes folded
// into float64 every 1024 values: it agrees with torch's float32 sum to ~1e-6 relative, not bit for
// bit (the sampler's top-p cut tolerates 1e-5).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "simd.h"

namespace {

using namespace ft_simd;

constexpr int64_t kFold = 1024;  // values summed in float32 before the partial sum goes to float64

// One row: scale by 1 / t in place (t != 1), its maximum and block maxima.
FT_AVX512 float scale_max_avx512(float* x, int64_t V, float t, int64_t block, float* block_max) {
  const bool scale = t != 1.f;
  const __m512 vt = _mm512_set1_ps(t);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t vec_end = V - V % 16;
  const bool blocks = block_max != nullptr && block % 16 == 0;
  __m512 bmax = vmax;
  for (int64_t i = 0; i < vec_end; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (scale) {
      v = _mm512_div_ps(v, vt);
      _mm512_storeu_ps(x + i, v);
    }
    vmax = _mm512_max_ps(vmax, v);
    if (blocks) {
      bmax = _mm512_max_ps(bmax, v);
      if ((i + 16) % block == 0) {
        block_max[i / block] = _mm512_reduce_max_ps(bmax);
        bmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      }
    }
  }
  float m = _mm512_reduce_max_ps(vmax);
  for (int64_t i = vec_end; i < V; ++i) {
    if (scale) x[i] = x[i] / t;
    m = std::max(m, x[i]);
  }
  if (block_max != nullptr && !blocks) {  // a block width the vector loop does not tile
    for (int64_t b = 0; b < V / block; ++b)
      block_max[b] = *std::max_element(x + b * block, x + (b + 1) * block);
  }
  return m;
}

FT_AVX512 double log_mass_avx512(const float* x, int64_t V, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  double total = 0.0;
  const int64_t vec_end = V - V % 16;
  for (int64_t start = 0; start < vec_end; start += kFold) {
    const int64_t stop = std::min(start + kFold, vec_end);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = start; i < stop; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm)));
    total += static_cast<double>(_mm512_reduce_add_ps(acc));
  }
  for (int64_t i = vec_end; i < V; ++i) total += std::exp(static_cast<double>(x[i]) - m);
  return std::log(total);
}

float scale_max_scalar(float* x, int64_t V, float t, int64_t block, float* block_max) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) {
    if (t != 1.f) x[i] = x[i] / t;
    m = std::max(m, x[i]);
  }
  if (block_max != nullptr)
    for (int64_t b = 0; b < V / block; ++b) block_max[b] = *std::max_element(x + b * block, x + (b + 1) * block);
  return m;
}

double log_mass_scalar(const float* x, int64_t V, float m) {
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += std::exp(static_cast<double>(x[i]) - m);
  return std::log(total);
}

// x [R, V] float32 (scaled in place by temps [R] when given); mass [R] bool: which rows need the
// normaliser. Returns row_max [R] float32, log_mass [R] float64 (0 where not asked), and
// block_max [R, V / block] float32 (empty when block is 0 or does not divide V).
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_stats_(at::Tensor x, const c10::optional<at::Tensor>& temps,
                                                          const at::Tensor& mass, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "row_stats_: x must be a contiguous float32 CPU tensor [R, V]");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "row_stats_: empty rows");
  TORCH_CHECK(mass.scalar_type() == at::kBool && mass.numel() == R && mass.is_contiguous(), "row_stats_: mass must be bool [R]");
  at::Tensor t;
  if (temps.has_value()) {
    t = temps->contiguous();
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == R, "row_stats_: temps must be float32 [R]");
  }
  const bool with_blocks = block > 0 && V % block == 0;
  at::Tensor row_max = at::empty({R}, x.options());
  at::Tensor log_mass = at::zeros({R}, x.options().dtype(at::kDouble));
  at::Tensor block_max = at::empty({R, with_blocks ? V / block : 0}, x.options());
  float* xp = x.data_ptr<float>();
  const float* tp = temps.has_value() ? t.data_ptr<float>() : nullptr;
  const bool* mp = mass.data_ptr<bool>();
  float* rm = row_max.data_ptr<float>();
  double* lm = log_mass.data_ptr<double>();
  float* bm = with_blocks ? block_max.data_ptr<float>() : nullptr;
  static const bool simd = cpu_supported();  // the CPU does not change: checked once, not every step
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = xp + r * V;
      const float temp = tp != nullptr ? tp[r] : 1.f;
      float* blocks = bm != nullptr ? bm + r * (V / block) : nullptr;
      rm[r] = simd ? scale_max_avx512(row, V, temp, block, blocks) : scale_max_scalar(row, V, temp, block, blocks);
      if (mp[r]) lm[r] = simd ? log_mass_avx512(row, V, rm[r]) : log_mass_scalar(row, V, rm[r]);
    }
  });
  return {row_max, log_mass, block_max};
}

// One row: x = exp(x - m) in place, and the sum of each block of `block` values (the last block
// may be short) into sums.
FT_AVX512 void exp_block_sums_avx512(float* x, int64_t V, float m, int64_t block, float* sums) {
  for (int64_t b0 = 0, k = 0; b0 < V; b0 += block, ++k) sums[k] = exp_sub_sum_(x + b0, std::min(block, V - b0), m);
}

void exp_block_sums_scalar(float* x, int64_t V, float m, int64_t block, float* sums) {
  for (int64_t b0 = 0, k = 0; b0 < V; b0 += block, ++k) {
    float acc = 0.f;
    for (int64_t i = b0; i < std::min(b0 + block, V); ++i) acc += (x[i] = std::exp(x[i] - m));
    sums[k] = acc;
  }
}

// x [R, V] float32 becomes exp(x - row_max[:, None]) in place (the unnormalised softmax weights of
// a temperature-only draw). Returns the sums of each row's blocks of `block` weights
// [R, ceil(V / block)] float32 (the last block may be short). One pass where torch made three
// (subtract, exp, block sums) over every logit of the batch.
at::Tensor exp_block_sums_(at::Tensor x, const at::Tensor& row_max, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "exp_block_sums_: x must be a contiguous float32 CPU tensor [R, V]");
  TORCH_CHECK(block > 0, "exp_block_sums_: block must be positive");
  const int64_t R = x.size(0), V = x.size(1), nb = (V + block - 1) / block;
  const at::Tensor m = row_max.contiguous();
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.numel() == R, "exp_block_sums_: row_max must be float32 [R]");
  at::Tensor sums = at::empty({R, nb}, x.options());
  float* xp = x.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* sp = sums.data_ptr<float>();
  static const bool simd = cpu_supported();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (simd)
        exp_block_sums_avx512(xp + r * V, V, mp[r], block, sp + r * nb);
      else
        exp_block_sums_scalar(xp + r * V, V, mp[r], block, sp + r * nb);
    }
  });
  return sums;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's whole-row sampler passes (see sampling.cpp)";
  m.def("row_stats_", &row_stats_, "temperature in place, row maxima, log normalisers and block maxima",
        py::arg("x"), py::arg("temps"), py::arg("mass"), py::arg("block"));
  m.def("exp_block_sums_", &exp_block_sums_, "x = exp(x - row_max) in place, and each block's sum",
        py::arg("x"), py::arg("row_max"), py::arg("block"));
}
