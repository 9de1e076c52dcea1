// The group-32 kernel (qmm: 4-, 5- and 8-bit weights, a float16 scale and minimum per 32) for CPUs
// with AVX2 but no AVX-512 (AMD Zen 2 / 3, Intel before Ice Lake): included by qlinear.cpp, after
// superblock_avx2.h.
//
// Owns one weight row's dot products and float epilogue in AVX2; the layout (qlinear.cpp's header
// comment and ops/layout.py), the activations' quantization (acts_portable.h), the dispatch and the
// threading are qlinear.cpp's. Without vpdpbusd, a 64-byte vector's products are taken 32 bytes
// (8 groups) at a time: vpmaddubsw (u8 x s8 pairs into int16) then vpmaddwd by ones (int16 pairs
// into int32 lane l: group l's 4-byte word).
// - bits 4 / 5: unsigned values of at most 31, a pair's sum at most 2 * 31 * 127 = 7874, so the
//   low- and high-nibble vectors' sums add in int16 before widening;
// - bits 8: the stored byte is q + 128, and 255 * 127 * 2 would saturate int16, so the product is
//   taken as |q| * (a with q's sign) (vpsignb; |q| <= 128 as an unsigned byte, |a| <= 127): at
//   most 2 * 128 * 127 = 32512. The dot is then of q itself, and the epilogue leaves out the
//   AVX-512 kernel's -128 * scale * sum(a) term.
// A full chunk is two halves (groups 0-7, 8-15); a non-compact last chunk of nb groups the halves
// its groups reach (its vectors are nb * 4 bytes: the lanes past nb meet zero activations). A
// compact last chunk (nb in 1, 2, 4, 8) is a stream of nb * 32 bytes read 32 at a time, where lane
// j always holds words of group j % nb (nb divides 8). The integer sums are exact; the float sums
// run per 8 groups instead of 16, in another order than the AVX-512 kernel's (the same bound
// against the reference holds; a row's result does not depend on M).
#pragma once

// 32 bytes whose byte i is 16 where bit i of `bits` is set, else 0 (a bits-5 value's fifth bit).
FT_AVX2 inline __m256i fifth_bits_avx2(uint32_t bits) {
  const __m256i bytes = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// Bits [32 h, 32 h + 32) of the 64-bit mask at p (little-endian, as _pack5 writes it).
inline uint32_t mask_half(const uint8_t* p, int h) {
  uint32_t bits;
  std::memcpy(&bits, p + 4 * h, 4);
  return bits;
}

// Up to 8 float16 values from p as floats (lanes past count: 0); never reads past p + count.
FT_AVX2 inline __m256 load_halves(const at::Half* p, int64_t count) {
  if (count >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, size_t(std::max<int64_t>(count, 0)) * 2);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
}

// dot += the int32 sums of pairs of w (unsigned bytes) times a (signed), per 4-byte word; bits 8:
// w is |q| and sign_of q (weight_bytes8).
template <int BITS>
FT_AVX2 inline __m256i dot_add(__m256i dot, __m256i w, __m256i a, __m256i ones, __m256i sign_of = __m256i()) {
  if constexpr (BITS == 8) {  // w: |q| (as unsigned bytes: -128 -> 128), times a with q's sign
    return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(a, sign_of)), ones));
  } else {
    return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones));
  }
}

// A bits-8 weight vector (stored bytes q + 128) as |q| (unsigned) and q (for its sign).
FT_AVX2 inline __m256i weight_bytes8(__m256i stored, __m256i* q) {
  *q = _mm256_xor_si256(stored, _mm256_set1_epi8(char(0x80)));
  return _mm256_abs_epi8(*q);
}

// Segment s (32 bytes) of a compact last chunk's value stream (nb groups): bits 8 its bytes;
// bits 4 / 5 the nibbles (blocks of B = min(128, nb * 32) stream bytes, byte i of a block's packed
// half = stream[i] | stream[B / 2 + i] << 4) and, bits 5, the fifth bits of value vector s / 2.
template <int BITS>
FT_AVX2 inline __m256i compact_segment(const uint8_t* w, const uint8_t* masks, int64_t nb, int64_t s) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * s));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i v;
    if (nb == 1) {  // 16 packed bytes: stream bytes 0-15 low nibbles, 16-31 high
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
      v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low4);
    } else {
      const int64_t B = std::min<int64_t>(128, nb * 32), at = 32 * s;
      const int64_t base = at / B * (B / 2), pos = at % B;
      const bool high = pos >= B / 2;
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + base + pos - (high ? B / 2 : 0)));
      v = _mm256_and_si256(high ? _mm256_srli_epi16(p, 4) : p, low4);
    }
    if constexpr (BITS == 5) v = _mm256_or_si256(v, fifth_bits_avx2(mask_half(masks + 8 * (s / 2), int(s % 2))));
    return v;
  }
}

// acc[i] += dot[i] * (weight scale * activation scale) + offset * activation group sum, for the
// 8 lanes of groups [g0, g0 + count) of a row (their scales at ws, minima at wm, null: none);
// `lanes`, where not null, maps a dot lane to its group (a compact chunk: lane j, group j % nb).
template <int MT, int BITS>
FT_AVX2 inline void g32_epilogue(__m256* acc, const __m256i* dot, const at::Half* ws, const at::Half* wm, int64_t count,
                                 const QuantizedActs& a, int64_t m0, int64_t g0, const __m256i* lanes) {
  const int64_t gstride = a.chunks * 16;
  const __m256 S = load_halves(ws, count);
  __m256 Mn = wm ? load_halves(wm, count) : _mm256_setzero_ps();
  if constexpr (BITS == 5) Mn = _mm256_fmadd_ps(_mm256_set1_ps(-16.0f), S, Mn);  // the stored value is q + 16
  const __m256 S_dot = lanes ? _mm256_permutevar8x32_ps(S, *lanes) : S;
  for (int i = 0; i < MT; ++i) {
    const int64_t o = (m0 + i) * gstride + g0;
    const __m256 sa = _mm256_mul_ps(S_dot, _mm256_load_ps(a.group_scale + o));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), sa, acc[i]);
    acc[i] = _mm256_fmadd_ps(Mn, _mm256_load_ps(a.group_sum + o), acc[i]);
  }
}

// out[i * ldo + n] for weight row n and activation rows [m0, m0 + MT) (at most 4: 16 registers).
template <int MT, int BITS>
FT_AVX2 void g32_row_avx2(const uint8_t* wq, const at::Half* ws, const at::Half* wm, int64_t K, int64_t n,
                          const QuantizedActs& a, int64_t m0, float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  const int64_t row_bytes = row_bytes_of<BITS>(K);
  const int64_t chunk_bytes = BITS == 8 ? 512 : BITS == 4 ? 256 : chunk_bytes5(16);
  const int64_t qstride = a.chunks * 512;
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  if (m0 == 0) {  // the first pass over the row: its bytes kPrefetchBytes ahead (qlinear.cpp)
    const char* ahead = reinterpret_cast<const char*>(wq + n * row_bytes) + kPrefetchBytes;
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
  }
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < a.chunks; ++c) {
    const int64_t nb = std::min<int64_t>(16, G - c * 16);
    const uint8_t* w = wq + n * row_bytes + c * chunk_bytes;
    const uint8_t* masks = w + nb * 16;  // bits 5: the chunk's masks follow its nibbles
    const int8_t* aq = a.q + m0 * qstride + c * 512;
    __m256i dot[MT];
    if (nb < 16 && 16 % nb == 0) {  // compact: one stream of nb * 32 bytes
      for (int i = 0; i < MT; ++i) dot[i] = _mm256_setzero_si256();
      for (int64_t s = 0; s < nb; ++s) {
        __m256i wv = compact_segment<BITS>(w, masks, nb, s), q = _mm256_setzero_si256();
        if constexpr (BITS == 8) wv = weight_bytes8(wv, &q);
        for (int i = 0; i < MT; ++i)
          dot[i] = dot_add<BITS>(dot[i], wv, _mm256_load_si256(reinterpret_cast<const __m256i*>(aq + i * qstride + 32 * s)), ones, q);
      }
      const __m256i lanes = _mm256_and_si256(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(int(nb - 1)));
      g32_epilogue<MT, BITS>(acc, dot, ws + n * G + c * 16, wm ? wm + n * G + c * 16 : nullptr, nb, a, m0, c * 16, &lanes);
      continue;
    }
    const int64_t vstep = nb * 4;  // bytes of one vector of this chunk
    for (int64_t h = 0; 8 * h < nb; ++h) {  // groups [8 h, 8 h + 8): bytes [32 h, 32 h + 32) of each vector
      for (int i = 0; i < MT; ++i) dot[i] = _mm256_setzero_si256();
      if constexpr (BITS == 8) {
        for (int v = 0; v < 8; ++v) {
          __m256i q;
          const __m256i wv = weight_bytes8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * vstep + 32 * h)), &q);
          for (int i = 0; i < MT; ++i)
            dot[i] = dot_add<8>(dot[i], wv, _mm256_load_si256(reinterpret_cast<const __m256i*>(aq + i * qstride + v * 64 + 32 * h)), ones, q);
        }
      } else {
        for (int u = 0; u < 4; ++u) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * vstep + 32 * h));
          __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
          if constexpr (BITS == 5) {
            lo = _mm256_or_si256(lo, fifth_bits_avx2(mask_half(masks + 16 * u, int(h))));
            hi = _mm256_or_si256(hi, fifth_bits_avx2(mask_half(masks + 16 * u + 8, int(h))));
          }
          for (int i = 0; i < MT; ++i) {
            const int8_t* ai = aq + i * qstride + 32 * h;
            const __m256i alo = _mm256_load_si256(reinterpret_cast<const __m256i*>(ai + (2 * u) * 64));
            const __m256i ahi = _mm256_load_si256(reinterpret_cast<const __m256i*>(ai + (2 * u + 1) * 64));
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
            dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16, ones));
          }
        }
      }
      const int64_t g0 = c * 16 + 8 * h;
      g32_epilogue<MT, BITS>(acc, dot, ws + n * G + g0, wm ? wm + n * G + g0 : nullptr, std::min<int64_t>(8, nb - 8 * h), a, m0, g0, nullptr);
    }
  }
  for (int i = 0; i < MT; ++i) out[i * ldo + n] = hsum8(acc[i]);
}

// Rows [n0, n1) of a group-32 weight against activation rows [m0, m0 + MT), at most 4 a pass.
template <int MT, int BITS>
FT_AVX2 void g32_tile_avx2(const uint8_t* wq, const at::Half* ws, const at::Half* wm, int64_t K, int64_t n0,
                           int64_t n1, const QuantizedActs& a, int64_t m0, float* out, int64_t ldo) {
  if constexpr (MT > 4) {
    g32_tile_avx2<4, BITS>(wq, ws, wm, K, n0, n1, a, m0, out, ldo);
    g32_tile_avx2<MT - 4, BITS>(wq, ws, wm, K, n0, n1, a, m0 + 4, out + 4 * ldo, ldo);
  } else {
    for (int64_t n = n0; n < n1; ++n) g32_row_avx2<MT, BITS>(wq, ws, wm, K, n, a, m0, out, ldo);
  }
}
