// Decode attention for CPUs with AVX2 and no AVX-512 (AMD Zen 2 / 3, Intel before Ice Lake):
// attention.cpp's attend_group on 8 lanes, included by attention.cpp.
//
// Owns the 8-lane helpers (loads and stores of float32 / bfloat16, exp, the sums) and the per-(request,
// KV head) work; the checks, the threading and the choice between the two kinds are attention.cpp's.
// The same arithmetic as the AVX-512 path (scale folded into the query, float32 scores, exp by
// the same polynomial, weighted sum, one rounding to the query dtype); the sums run over 8 lanes
// instead of 16, so the two agree to float32 rounding.
#pragma once

#define FT_AVX2 __attribute__((target("avx2,fma")))

namespace ft_avx2 {

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

FT_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
FT_AVX2 inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

FT_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
FT_AVX2 inline void store8(at::BFloat16* p, __m256 v) {  // round to nearest even; NaN stays NaN
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);  // 8 x uint16 in the low halves of the words
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// exp(x) for x <= 0, as ft_simd::exp16: x = n ln2 + r, the same degree-7 polynomial, times 2^n
// (built in the exponent bits: n >= -126 wherever x >= -87); below -87, 0.
FT_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.f))),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

FT_AVX2 inline float reduce(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// x[i] = exp(x[i] - m) in place; returns their sum.
FT_AVX2 inline float exp_sub_sum_(float* x, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = reduce(acc);
  for (; i < n; ++i) {  // the tail, one at a time through the same exp
    alignas(32) float one[8];
    _mm256_store_ps(one, exp8(_mm256_set1_ps(x[i] - m)));
    x[i] = one[0];
    sum += one[0];
  }
  return sum;
}

// a[0, 8 NV) = sum over j of p[j] V[slot[j]] (p[j] = 0: skipped, never read), in registers.
template <typename T, int NV>
FT_AVX2 inline void weighted_sum(const float* p, const T* v, int64_t slot_stride, const int64_t* slots, int64_t S,
                                 float* a) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    if (p[j] == 0.f) continue;
    const T* vr = v + slots[j] * slot_stride;
    const __m256 vp = _mm256_set1_ps(p[j]);
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(vp, load8(vr + 8 * i), acc[i]);
  }
  for (int i = 0; i < NV; ++i) store8(a + 8 * i, acc[i]);
}

// attention.cpp's attend_group (the same arguments and work layout) on 8 lanes.
template <typename T>
FT_AVX2 void attend_group(const T* q, int64_t q_head_stride, const T* k, const T* v, int64_t slot_stride, int64_t D,
                          int64_t G, const int64_t* slots, const bool* visible, int64_t S, float scale, T* out,
                          float* work, int64_t prefetch_keys) {
  float* qf = work;         // [G, D]
  float* sc = qf + G * D;   // [G, S]
  float* acc = sc + G * S;  // [G, D]
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; d += 8) store8(qf + h * D + d, _mm256_mul_ps(load8(q + h * q_head_stride + d), vscale));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < S; ++j) {
    if (!visible[j]) {
      for (int64_t h = 0; h < G; ++h) sc[h * S + j] = kNegInf;
      continue;
    }
    const T* kr = k + slots[j] * slot_stride;
    if (j + prefetch_keys < S && visible[j + prefetch_keys]) {
      const char* nk = reinterpret_cast<const char*>(k + slots[j + prefetch_keys] * slot_stride);
      const char* nv = reinterpret_cast<const char*>(v + slots[j + prefetch_keys] * slot_stride);
      for (int64_t o = 0; o < D * int64_t(sizeof(T)); o += 64) {
        _mm_prefetch(nk + o, _MM_HINT_T0);
        _mm_prefetch(nv + o, _MM_HINT_T1);
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {  // D % 16 == 0 (attention.cpp checks)
        a0 = _mm256_fmadd_ps(load8(qf + h * D + d), load8(kr + d), a0);
        a1 = _mm256_fmadd_ps(load8(qf + h * D + d + 8), load8(kr + d + 8), a1);
      }
      sc[h * S + j] = reduce(_mm256_add_ps(a0, a1));
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* s = sc + h * S;
    float m = kNegInf;
    for (int64_t j = 0; j < S; ++j) m = std::max(m, s[j]);
    float* a = acc + h * D;
    std::memset(a, 0, sizeof(float) * D);
    if (m == kNegInf) {  // nothing visible: zeros rather than NaN
      for (int64_t d = 0; d < D; d += 8) store8(out + h * D + d, _mm256_setzero_ps());
      continue;
    }
    const float inv = 1.f / exp_sub_sum_(s, S, m);
    switch (D) {  // the common head sizes keep the sum in registers
      case 64: weighted_sum<T, 8>(s, v, slot_stride, slots, S, a); break;
      case 128:  // two halves of 8 registers each (16 accumulators would leave none for the rest)
        weighted_sum<T, 8>(s, v, slot_stride, slots, S, a);
        weighted_sum<T, 8>(s, v + 64, slot_stride, slots, S, a + 64);
        break;
      default:
        for (int64_t jj = 0; jj < S; ++jj) {
          const float p = s[jj];
          if (p == 0.f) continue;
          const T* vr = v + slots[jj] * slot_stride;
          const __m256 vp = _mm256_set1_ps(p);
          for (int64_t d = 0; d < D; d += 8) store8(a + d, _mm256_fmadd_ps(vp, load8(vr + d), load8(a + d)));
        }
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 8) store8(out + h * D + d, _mm256_mul_ps(load8(a + d), vinv));
  }
}

}  // namespace ft_avx2
