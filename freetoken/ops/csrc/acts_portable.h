// The activation quantization of qlinear.cpp's kernels in portable C++, for the AVX2 kernels
// (superblock_avx2.h, group32_avx2.h): included by superblock_avx2.h, after QuantizedActs.
//
// Owns nothing but the loop: the layout is QuantizedActs' (qlinear.cpp) and the bits are those of
// the AVX-512 quantize_acts: a group's scale amax / 127, values rounded to nearest even (the
// default rounding mode, as vcvtps2dq), sums exact in integers before one multiply. A compact tail
// (qlinear.cpp's "compact" last chunk: nb groups with nb dividing 16) lays its words out as one
// contiguous stream (word v of group l at v * nb + l) and repeats the group scales over the
// chunk's 16 lanes (lane j: group j % nb), as the AVX-512 loop does.
#pragma once

template <typename T>
QuantizedActs quantize_acts_portable(const T* x, int64_t M, int64_t K, bool compact_tail = false) {
  const int64_t G = K / kGroup;
  const int64_t tail = G % 16, tail_start = G - tail;
  ActsScratch buf(M, G);
  const int64_t chunks = buf.chunks, g16 = buf.g16;
  int8_t* q = buf.q;
  float *gscale = buf.gscale, *gsum = buf.gsum, *hsum = buf.hsum;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = x + m * K + g * kGroup;
      float v[32], amax = 0.0f;
      for (int i = 0; i < 32; ++i) {
        v[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float d = amax / 127.0f;
      const float id = d > 0.0f ? 1.0f / d : 0.0f;
      const int64_t vstride = compact_tail && g >= tail_start ? tail : 16;  // words between a group's words
      int8_t* dst = q + (m * chunks + g / 16) * 512 + (g % 16) * 4;  // word 0 of the group
      int32_t isum[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int32_t r = static_cast<int32_t>(std::clamp(std::nearbyint(v[i] * id), -128.0f, 127.0f));
        dst[(i / 4) * vstride * 4 + i % 4] = static_cast<int8_t>(r);
        isum[i / 16] += r;
      }
      gscale[m * g16 + g] = d;
      gsum[m * g16 + g] = d * float(isum[0] + isum[1]);
      hsum[(2 * m) * g16 + g] = d * float(isum[0]);
      hsum[(2 * m + 1) * g16 + g] = d * float(isum[1]);
    }
    if (compact_tail && tail) buf.repeat_tail_scales(m, tail_start, tail);
  }
  return buf.acts();
}
