// The super-block kernel (sbmm: Q4_K / Q6_K rows in their own integers) for CPUs with AVX2 but
// no AVX-512 (AMD Zen 2 / 3, Intel before Ice Lake): included by qlinear.cpp, after QuantizedActs.
//
// Owns the AVX2 versions of the activation quantization and of one tile's dot products; the
// layout (qlinear.cpp's "Super-block weights" comment), the dispatch and the threading are
// qlinear.cpp's. Without vpdpbusd, a 64-byte vector's products are taken 32 bytes at a time
// (one super-block's 8 groups): vpmaddubsw (u8 x s8 pairs into int16; a pair's sum is at most
// 2 * 63 * 127 = 16002, so two vectors' sums add without saturating: q4_k adds its four value
// vectors' eight, 8 * 2 * 15 * 127 = 30480) then vpmaddwd by ones (int16 pairs into int32 lane l:
// group l's 4-byte word). The integer sums are the AVX-512 kernel's; the float epilogue runs per
// super-block (8 lanes) instead of per chunk (16), so the two paths' float sums differ in order
// (the same bound against the reference holds; a row's result still does not depend on M).
#pragma once

#define FT_AVX2 __attribute__((target("avx2,fma,f16c")))

inline bool cpu_supports_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#include "acts_portable.h"  // the activations' quantization without AVX-512

// Bits 4-5 of a q6_k value vector from the high-pair vector (see with_high_pair).
template <int K>
FT_AVX2 inline __m256i high_pair_avx2(__m256i hi) {
  if constexpr (K == 0) return _mm256_slli_epi16(hi, 4);
  else if constexpr (K == 1) return _mm256_slli_epi16(hi, 2);
  else if constexpr (K == 2) return hi;
  else return _mm256_srli_epi16(hi, 2);
}

FT_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// out[i * ldo + n] for weight row n and activation rows [m0, m0 + MT).
template <int MT, int KIND>
FT_AVX2 void sb_row_avx2(const uint8_t* wq, const uint8_t* wmeta, int64_t C, bool half, int64_t n,
                         const QuantizedActs& a, int64_t m0, bool first_pass, float* out, int64_t ldo) {
  constexpr int64_t CB = KIND == 4 ? 256 : 384, MB = 40;
  const int64_t row_bytes = C * CB - (half ? CB / 2 : 0), meta_row = C * MB;
  const int64_t qstride = a.chunks * 512, gstride = a.chunks * 16;
  const __m256i low4 = _mm256_set1_epi8(0x0f), mask30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  if (first_pass) {  // the row's bytes requested as it starts (decode is memory-bound)
    const char* p = reinterpret_cast<const char*>(wq + n * row_bytes);
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* w = wq + n * row_bytes + c * CB;
    const uint8_t* meta = wmeta + n * meta_row + c * MB;
    const bool half_chunk = half && c == C - 1;
    const int64_t vstep = half_chunk ? 32 : 64;
    const __m128 dd = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 32)));  // d0 d1 dmin0 dmin1
    for (int h = 0; h < (half_chunk ? 1 : 2); ++h) {  // super-block h: bytes [32 h, 32 h + 32) of each vector
      const int64_t ho = 32 * h;
      const __m256 d = _mm256_set1_ps(dd[h]);
      __m256i dot[MT], dotB[KIND == 4 ? 1 : MT];
      if constexpr (KIND == 4) {
        __m256i s16[MT];
        for (int i = 0; i < MT; ++i) s16[i] = _mm256_setzero_si256();
        for (int u = 0; u < 4; ++u) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * vstep + ho));
          const __m256i lo = _mm256_and_si256(packed, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
          for (int i = 0; i < MT; ++i) {
            const int8_t* aq = a.q + (m0 + i) * qstride + c * 512 + ho;
            const __m256i alo = _mm256_load_si256(reinterpret_cast<const __m256i*>(aq + (2 * u) * 64));
            const __m256i ahi = _mm256_load_si256(reinterpret_cast<const __m256i*>(aq + (2 * u + 1) * 64));
            s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi)));
          }
        }
        for (int i = 0; i < MT; ++i) dot[i] = _mm256_madd_epi16(s16[i], ones);
      } else {
        const __m256i hv0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 4 * vstep + ho));
        const __m256i hv1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 5 * vstep + ho));
        for (int i = 0; i < MT; ++i) dot[i] = dotB[i] = _mm256_setzero_si256();
#define FT_Q6_PAIR2(U, HV, KLO, KHI, DOT)                                                                        \
  {                                                                                                              \
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (U) * vstep + ho));           \
    const __m256i v0 = _mm256_or_si256(_mm256_and_si256(packed, low4), _mm256_and_si256(high_pair_avx2<KLO>(HV), mask30)); \
    const __m256i v1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),                    \
                                       _mm256_and_si256(high_pair_avx2<KHI>(HV), mask30));                      \
    for (int i = 0; i < MT; ++i) {                                                                               \
      const int8_t* aq = a.q + (m0 + i) * qstride + c * 512 + ho;                                               \
      const __m256i a0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(aq + (2 * (U)) * 64));              \
      const __m256i a1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(aq + (2 * (U) + 1) * 64));          \
      const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(v0, a0), _mm256_maddubs_epi16(v1, a1));           \
      DOT[i] = _mm256_add_epi32(DOT[i], _mm256_madd_epi16(s, ones));                                            \
    }                                                                                                            \
  }
        FT_Q6_PAIR2(0, hv0, 0, 1, dot)
        FT_Q6_PAIR2(1, hv0, 2, 3, dot)
        FT_Q6_PAIR2(2, hv1, 0, 1, dotB)
        FT_Q6_PAIR2(3, hv1, 2, 3, dotB)
#undef FT_Q6_PAIR2
      }
      // the epilogue of super-block h: its 8 groups' scales (bytes 8 h .. 8 h + 7 of each scale array)
      const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 8 * h));
      const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 16 + 8 * h));
      if constexpr (KIND == 4) {
        const __m256 S = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s0)), d);
        const __m256 Mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s1)), _mm256_set1_ps(dd[2 + h]));
        for (int i = 0; i < MT; ++i) {
          const int64_t o = (m0 + i) * gstride + c * 16 + 8 * h;
          const __m256 as = _mm256_load_ps(a.group_scale + o);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(S, as), acc[i]);
          acc[i] = _mm256_fnmadd_ps(Mn, _mm256_load_ps(a.group_sum + o), acc[i]);
        }
      } else {
        const __m256 SA = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s0)), d);
        const __m256 SB = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s1)), d);
        for (int i = 0; i < MT; ++i) {
          const int64_t o = (m0 + i) * gstride + c * 16 + 8 * h;
          const int64_t h0 = (2 * (m0 + i)) * gstride + c * 16 + 8 * h, h1 = h0 + gstride;
          const __m256 as = _mm256_load_ps(a.group_scale + o);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(SA, as), acc[i]);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dotB[i]), _mm256_mul_ps(SB, as), acc[i]);
          const __m256 off = _mm256_fmadd_ps(SA, _mm256_load_ps(a.half_sum + h0), _mm256_mul_ps(SB, _mm256_load_ps(a.half_sum + h1)));
          acc[i] = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), off, acc[i]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i) out[i * ldo + n] = hsum8(acc[i]);
}

// Rows [n0, n1) of a super-block weight against activation rows [m0, m0 + MT), at most 4 a pass
// (16 registers: 4 rows' sums, accumulators and the weight vectors).
template <int MT, int KIND>
FT_AVX2 void sb_tile_avx2(const uint8_t* wq, const uint8_t* wmeta, int64_t C, bool half, int64_t n0, int64_t n1,
                          const QuantizedActs& a, int64_t m0, bool first_pass, float* out, int64_t ldo) {
  if constexpr (MT > 4) {
    sb_tile_avx2<4, KIND>(wq, wmeta, C, half, n0, n1, a, m0, first_pass, out, ldo);
    sb_tile_avx2<MT - 4, KIND>(wq, wmeta, C, half, n0, n1, a, m0 + 4, false, out + 4 * ldo, ldo);
  } else {
    for (int64_t n = n0; n < n1; ++n) sb_row_avx2<MT, KIND>(wq, wmeta, C, half, n, a, m0, first_pass, out, ldo);
  }
}
