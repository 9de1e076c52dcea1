// AVX-512 helpers the C++ kernels share: the target attribute, the run-time CPU check, float32 /
// bfloat16 loads and stores of 16 values, a vectorized exp, a horizontal sum and an in-place
// exp-and-sum. Header-only; each
// kernel file (attention.cpp, sampling.cpp) is its own extension and includes it.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#define FT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace ft_simd {

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}

FT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
FT_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

FT_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
FT_AVX512 inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even; NaN stays NaN
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// exp(x) for x <= 0 (scores minus their maximum), ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-7
// Taylor polynomial of exp(r), times 2^n. Below -87 the result flushes to 0.
FT_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512 y = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}

FT_AVX512 inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// x[i] = exp(x[i] - m) for i in [0, n), in place; returns their sum (float32, 16 lanes added in
// order, then across). A softmax's numerators: the attention scores, a sampler block's weights.
FT_AVX512 inline float exp_sub_sum_(float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 tail = __mmask16((1u << (n - i)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), vm));
    _mm512_mask_storeu_ps(x + i, tail, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, e));
  }
  return reduce(acc);
}

}  // namespace ft_simd
