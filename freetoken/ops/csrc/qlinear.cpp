// Weight-only quantized linear layers for CPU decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Owns the AVX-512 VNNI kernel and the activation quantization it needs; it does not own the weight
// format (freetoken/ops/quantized.py) nor the packing (freetoken/ops/qlinear.py), whose layout it
// assumes. A row's 32-groups are taken 16 at a time (a chunk; the last may hold nb < 16 groups),
// and a chunk's bytes are transposed so that int32 lane l of every vector belongs to group l:
//   bits 8: 8 vectors of nb * 4 bytes; byte [v][4 l + b] = q[group l][4 v + b] + 128 (uint8);
//   bits 4: 4 vectors of nb * 4 bytes; byte [u][4 l + b] = q[l][8 u + b] | q[l][8 u + 4 + b] << 4,
//     except a last chunk whose nb divides 16 (see `compact` in tile_kernel);
//   bits 5: the bits-4 bytes of the low nibbles, then one 64-bit mask per value vector (the 64
//     weight bytes one vpdpbusd takes: vector j meets activation bytes [64 j, 64 j + 64)) whose
//     bit i is the fifth bit of weight byte i: 8 masks in a full chunk, 2 u (or 1) in a compact one;
//   a row is K bytes (bits 8), K / 2 (bits 4) or ~5 K / 8 (bits 5), chunks in order, no padding;
//   scale, minimum: float16 [N, K / 32]; w = q * scale + minimum (minimum absent: 0), where q is the
//   stored byte minus 128 (bits 8), the nibble (bits 4), the 5-bit value minus 16 (bits 5).
// Activations are quantized per 32-group to int8 (absmax / 127, round to nearest, as llama.cpp's
// Q8 activations) into the same transposed layout. A chunk's eight vpdpbusd then accumulate each
// group's exact integer dot product in its own lane, and the float work is once per chunk:
// acc += float(dot) * weight scale * activation scale + (minimum - 128 scale (bits 8)) * sum(x_q).
// Compiled without -march: the AVX-512 functions carry a target attribute, and `supported()` tells
// Python whether this CPU can run them; Python never calls the kernel otherwise.
#include "extension.h"  // ATen and pybind11 (not the whole of <torch/extension.h>)
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <array>
#include <utility>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#define FT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace {

constexpr int64_t kGroup = 32;
#ifndef FT_MAX_ROWS
#define FT_MAX_ROWS 8
#endif
constexpr int kMaxRows = FT_MAX_ROWS;  // activation rows per pass over a tile (8: 16 accumulators fit the 32 registers)
constexpr int64_t kReadPad = 64;    // readable bytes the packed weight has past its end
constexpr int64_t kTaskBytes = 128 * 1024;  // least weight bytes per parallel task
constexpr int64_t kTileRows = 16;
// How far ahead of the rows being multiplied their weight bytes are prefetched. Decode streams
// every weight from memory once per step in short runs (one small matrix after another, split
// between threads), which the hardware prefetcher ramps up on too slowly: prefetching 4 KB ahead
// took the linear layers of a SmolLM2 / Gemma 3 decode step from ~15 to ~24 GB/s on one thread
// and from ~23 to ~36 GB/s on two (Zen 4; 2-8 KB all gave about the same).
#ifndef FT_PREFETCH_BYTES
#define FT_PREFETCH_BYTES 4096
#endif
constexpr int64_t kPrefetchBytes = FT_PREFETCH_BYTES;
#ifndef FT_PAIR_ROWS_FROM
#define FT_PAIR_ROWS_FROM 1
#endif
constexpr int kPairRowsFrom = FT_PAIR_ROWS_FROM;  // MT from which two weight rows share each activation load // weight rows per tile (a few KB: stays in L1 across row chunks)

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Whether this CPU runs the AVX-512 kernels; where not, the AVX2 ones (superblock_avx2.h,
// group32_avx2.h) if it has AVX2 (group32_supported / superblock_supported say; Python never calls
// a kernel otherwise). The CPU does not change: decided once, when the extension loads.
const bool kAvx512 = cpu_supported();

// Activations quantized per 32-group, in the chunk-transposed layout (always 16 lanes; groups past
// G are zero: q = 0, scale = 0).
struct QuantizedActs {
  int64_t chunks = 0;                 // ceil(G / 16)
  const int8_t* q = nullptr;          // [M, chunks, 8, 64]
  const float* group_scale = nullptr; // [M, chunks * 16]: scale of each group
  const float* group_sum = nullptr;   // [M, chunks * 16]: scale * sum(q) of each group
  const float* half_sum = nullptr;    // [M, 2, chunks * 16]: scale * sum(q) of each group's 16-halves
};

// Per calling thread, reused across calls: quantized activations are small (M * K bytes).
thread_local std::vector<uint8_t> t_scratch;

// The calling thread's scratch for M rows of G groups, 64-byte aligned: q [M, chunks, 8, 64], then
// group scales, group sums and half sums (float [M, chunks * 16], [M, ..], [M, 2, ..]); zeroed where
// G leaves a chunk short (groups past G: q = 0, scale = 0).
struct ActsScratch {
  int64_t chunks, g16;
  int8_t* q;
  float *gscale, *gsum, *hsum;
  ActsScratch(int64_t M, int64_t G) : chunks((G + 15) / 16), g16(chunks * 16) {
    const size_t q_bytes = size_t(M * chunks * 512);
    const size_t f_bytes = size_t(M * g16) * sizeof(float);
    const size_t total = q_bytes + 4 * f_bytes + 64;
    if (t_scratch.size() < total) t_scratch.resize(total);
    uint8_t* base = t_scratch.data();
    base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
    q = reinterpret_cast<int8_t*>(base);
    gscale = reinterpret_cast<float*>(base + q_bytes);
    gsum = reinterpret_cast<float*>(base + q_bytes + f_bytes);
    hsum = reinterpret_cast<float*>(base + q_bytes + 2 * f_bytes);
    if (G % 16) std::memset(base, 0, q_bytes + 4 * f_bytes);
  }
  // Dot lane j of row m's compact last chunk (its `tail` groups from `tail_start`) belongs to
  // group j % tail: that group's scale, repeated over the chunk's 16 lanes.
  void repeat_tail_scales(int64_t m, int64_t tail_start, int64_t tail) {
    float* ts = gscale + m * g16 + tail_start;
    for (int64_t j = tail; j < 16; ++j) ts[j] = ts[j % tail];
  }
  // The activations as the kernels read them, once the rows are written.
  QuantizedActs acts() const {
    QuantizedActs a;
    a.chunks = chunks;
    a.q = q;
    a.group_scale = gscale;
    a.group_sum = gsum;
    a.half_sum = hsum;
    return a;
  }
};

// Value vectors (one 64-bit mask each) of a bits-5 chunk of nb groups, and its bytes.
constexpr int64_t masks_of(int64_t nb) { return nb == 16 || 16 % nb ? 8 : nb < 4 ? 1 : nb / 2; }
constexpr int64_t chunk_bytes5(int64_t nb) { return nb * 16 + 8 * masks_of(nb); }

template <int BITS>
int64_t row_bytes_of(int64_t K) {
  if constexpr (BITS == 8) return K;
  if constexpr (BITS == 4) return K / 2;
  const int64_t G = K / kGroup;
  return (G / 16) * chunk_bytes5(16) + (G % 16 ? chunk_bytes5(G % 16) : 0);
}

FT_AVX512 inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
FT_AVX512 inline __m512 load16(const at::BFloat16* x) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
FT_AVX512 QuantizedActs quantize_acts(const T* x, int64_t M, int64_t K, bool compact_tail) {
  const int64_t G = K / kGroup;
  const int64_t tail = G % 16, tail_start = G - tail;
  ActsScratch buf(M, G);
  const int64_t chunks = buf.chunks, g16 = buf.g16;
  int8_t* q = buf.q;
  float *gscale = buf.gscale, *gsum = buf.gsum, *hsum = buf.hsum;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = x + m * K + g * kGroup;
      const __m512 v0 = load16(src), v1 = load16(src + 16);
      const __m512 amax = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
      const float d = _mm512_reduce_max_ps(amax) / 127.0f;
      const float id = d > 0.0f ? 1.0f / d : 0.0f;
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      alignas(32) int32_t words[8];  // the group's 32 int8 values as 8 words of 4
      _mm_store_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtsepi32_epi8(i0));
      _mm_store_si128(reinterpret_cast<__m128i*>(words + 4), _mm512_cvtsepi32_epi8(i1));
      int32_t* dst = reinterpret_cast<int32_t*>(q + (m * chunks + g / 16) * 512) + g % 16;
      const int64_t vstride = compact_tail && g >= tail_start ? tail : 16;
      for (int v = 0; v < 8; ++v) dst[v * vstride] = words[v];
      const int32_t isum0 = _mm512_reduce_add_epi32(i0), isum1 = _mm512_reduce_add_epi32(i1);
      gscale[m * g16 + g] = d;
      gsum[m * g16 + g] = d * float(isum0 + isum1);
      hsum[(2 * m) * g16 + g] = d * float(isum0);
      hsum[(2 * m + 1) * g16 + g] = d * float(isum1);
    }
    if (compact_tail && tail) buf.repeat_tail_scales(m, tail_start, tail);
  }
  return buf.acts();
}

// A vector of 64 low nibbles with each byte's fifth bit (16) set where the mask at `mask` says.
FT_AVX512 inline __m512i with_fifth(__m512i nibbles, const uint8_t* mask, __m512i fifth) {
  uint64_t bits;
  std::memcpy(&bits, mask, 8);
  return _mm512_mask_add_epi8(nibbles, _cvtu64_mask64(bits), nibbles, fifth);
}

// out[i, n] (float32) for the NR weight rows [n, n + NR) and activation rows [m0, m0 + MT): each
// activation vector loaded is used by NR weight rows (loads, not dpbusd, bound one row at M >= 4).
template <int MT, int BITS, int NR>
FT_AVX512 inline void rows_kernel(const uint8_t* wq, const at::Half* ws, const at::Half* wm, int64_t K,
                                  int64_t n, const QuantizedActs& a, int64_t m0, float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  const int64_t row_bytes = row_bytes_of<BITS>(K);
  const int64_t chunk_bytes = BITS == 8 ? 512 : BITS == 4 ? 256 : chunk_bytes5(16);
  const int64_t qstride = a.chunks * 512, gstride = a.chunks * 16;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i fifth = _mm512_set1_epi8(0x10);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 acc[NR][MT];
  for (int q = 0; q < NR; ++q)
    for (int i = 0; i < MT; ++i) acc[q][i] = _mm512_setzero_ps();
  // The weight bytes kPrefetchBytes past these rows', and their scales' and minima's as far ahead
  // in rows (a prefetch never faults: past the end it is dropped). Only on the first pass of
  // activation rows over a tile: later passes (M > kMaxRows) find the tile and what follows it in
  // cache already.
  if (m0 == 0) {
    const char* ahead = reinterpret_cast<const char*>(wq + n * row_bytes) + kPrefetchBytes;
    for (int64_t o = 0; o < NR * row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    const int64_t scale_ahead = kPrefetchBytes / row_bytes * G;  // halves: the same rows' groups
    for (int64_t o = 0; o < NR * G * 2; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ws + n * G + scale_ahead) + o, _MM_HINT_T0);
      if (wm) _mm_prefetch(reinterpret_cast<const char*>(wm + n * G + scale_ahead) + o, _MM_HINT_T0);
    }
  }
  for (int64_t c = 0; c < a.chunks; ++c) {
    const int64_t nb = std::min<int64_t>(16, G - c * 16);
    const uint8_t* w = wq + n * row_bytes + c * chunk_bytes;  // row n + q at w + q * row_bytes
    const int64_t vstep = nb * 4;  // bytes of one vector of this chunk
    const uint8_t* masks = w + nb * 16;  // bits 5: the chunk's masks follow its nibbles
    // Plain 64-byte loads even when nb < 16 (masked loads that miss the cache are slow on Zen 4):
    // lanes past nb hold the next bytes, times activation lanes that are zero. The packed tensor
    // has kReadPad readable bytes after its last row for this.
    __m512i dot[NR][MT];
    for (int q = 0; q < NR; ++q)
      for (int i = 0; i < MT; ++i) dot[q][i] = _mm512_setzero_si512();
    const int8_t* aq = a.q + m0 * qstride + c * 512;
    // A last chunk of nb groups with nb dividing 16 is compact: its words are read as contiguous
    // vectors (no idle lanes), so lane j always holds words of group j % nb. bits 4 pack that
    // 8-bit stream in blocks of B = min(128, nb * 32) bytes: byte i = blk[i] | blk[B / 2 + i] << 4.
    const bool compact = nb < 16 && 16 % nb == 0;
    if (compact && (BITS == 8 || nb < 4)) {
      // bits 8: nb / 2 vectors (nb = 1: half of one); bits 4, nb = 2: 32 bytes -> 64 values,
      // nb = 1: 16 bytes -> 32 (lanes past them meet zeros).
      const int64_t nv = BITS == 8 ? (nb * 32 + 63) / 64 : 1;
      for (int64_t j = 0; j < nv; ++j) {
        __m512i wv[NR];
        for (int q = 0; q < NR; ++q) {
          const uint8_t* src = w + q * row_bytes + j * 64;
          if constexpr (BITS == 8) {
            wv[q] = _mm512_loadu_si512(src);
          } else {
            const __m512i v = nb == 2
                ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)))
                : _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
            const __m512i shifts = nb == 2 ? _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)
                                           : _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
            wv[q] = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), low4);
            if constexpr (BITS == 5) wv[q] = with_fifth(wv[q], masks + q * row_bytes, fifth);
          }
        }
        for (int i = 0; i < MT; ++i) {
          const __m512i av = _mm512_load_si512(aq + i * qstride + j * 64);
          for (int q = 0; q < NR; ++q) dot[q][i] = _mm512_dpbusd_epi32(dot[q][i], wv[q], av);
        }
      }
    } else if (BITS == 8) {
      for (int v = 0; v < 8; ++v) {
        __m512i wv[NR];
        for (int q = 0; q < NR; ++q) wv[q] = _mm512_loadu_si512(w + q * row_bytes + v * vstep);
        for (int i = 0; i < MT; ++i) {
          const __m512i av = _mm512_load_si512(aq + i * qstride + v * 64);
          for (int q = 0; q < NR; ++q) dot[q][i] = _mm512_dpbusd_epi32(dot[q][i], wv[q], av);
        }
      }
    } else {
      // bits 4/5: full chunk (u = 4 vectors, stride vstep) or compact nb >= 4 (nb / 4 vectors of 64)
      const int64_t nu = compact ? nb / 4 : 4;
      const int64_t ustep = compact ? 64 : vstep;
      for (int64_t u = 0; u < nu; ++u) {
        __m512i lo[NR], hi[NR];
        for (int q = 0; q < NR; ++q) {
          const __m512i packed = _mm512_loadu_si512(w + q * row_bytes + u * ustep);
          lo[q] = _mm512_and_si512(packed, low4);
          hi[q] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
          if constexpr (BITS == 5) {
            lo[q] = with_fifth(lo[q], masks + q * row_bytes + 16 * u, fifth);
            hi[q] = with_fifth(hi[q], masks + q * row_bytes + 16 * u + 8, fifth);
          }
        }
        for (int i = 0; i < MT; ++i) {
          const __m512i alo = _mm512_load_si512(aq + i * qstride + (2 * u) * 64);
          const __m512i ahi = _mm512_load_si512(aq + i * qstride + (2 * u + 1) * 64);
          for (int q = 0; q < NR; ++q) {
            dot[q][i] = _mm512_dpbusd_epi32(dot[q][i], lo[q], alo);
            dot[q][i] = _mm512_dpbusd_epi32(dot[q][i], hi[q], ahi);
          }
        }
      }
    }
    const __mmask16 gmask = __mmask16((1u << nb) - 1u);
    const __m512i lane_group = _mm512_and_si512(iota, _mm512_set1_epi32(int(nb - 1)));
    for (int q = 0; q < NR; ++q) {
      const uint16_t* srow = reinterpret_cast<const uint16_t*>(ws) + (n + q) * G + c * 16;
      const __m512 S = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, srow));
      __m512 Mn = wm ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                           gmask, reinterpret_cast<const uint16_t*>(wm) + (n + q) * G + c * 16))
                     : _mm512_setzero_ps();
      if constexpr (BITS == 8) Mn = _mm512_fmadd_ps(_mm512_set1_ps(-128.0f), S, Mn);
      if constexpr (BITS == 5) Mn = _mm512_fmadd_ps(_mm512_set1_ps(-16.0f), S, Mn);
      const __m512 S_dot = compact ? _mm512_permutexvar_ps(lane_group, S) : S;
      for (int i = 0; i < MT; ++i) {
        const int64_t o = (m0 + i) * gstride + c * 16;
        const __m512 sa = _mm512_mul_ps(S_dot, _mm512_load_ps(a.group_scale + o));
        acc[q][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[q][i]), sa, acc[q][i]);
        // Group offsets (minimum, and the -128 of the 8-bit weights) times each group's sum.
        acc[q][i] = _mm512_fmadd_ps(Mn, _mm512_load_ps(a.group_sum + o), acc[q][i]);
      }
    }
  }
  for (int q = 0; q < NR; ++q)
    for (int i = 0; i < MT; ++i) out[i * ldo + n + q] = _mm512_reduce_add_ps(acc[q][i]);
}

// out[i, n] (float32, row stride ldo) for weight rows [n0, n1) and activation rows [m0, m0 + MT).
template <int MT, int BITS>
FT_AVX512 void tile_kernel(const uint8_t* wq, const at::Half* ws, const at::Half* wm, int64_t K,
                           int64_t n0, int64_t n1, const QuantizedActs& a, int64_t m0, float* out,
                           int64_t ldo) {
  constexpr int NR = MT >= kPairRowsFrom && MT <= 4 ? 2 : 1;  // MT > 4: 4 MT accumulators would spill
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) rows_kernel<MT, BITS, NR>(wq, ws, wm, K, n, a, m0, out, ldo);
  for (; n < n1; ++n) rows_kernel<MT, BITS, 1>(wq, ws, wm, K, n, a, m0, out, ldo);
}

#include "superblock_avx2.h"  // the super-block kernel for CPUs with AVX2 and no AVX-512
#include "group32_avx2.h"      // and the group-32 one

// ---- Super-block weights (GGUF Q4_K, Q6_K) in their own integers ------------------------------
// A row is padded to whole chunks of 512 weights (zero weights; the activations past K are zero
// too) and held as two arrays, read in the row's order:
//   q4_k: nibbles [N, C * 256] in the bits-4 layout of a full chunk (vector u: words 2u low,
//     2u + 1 high), meta [N, C * 40]: per chunk sc uint8[16] | m uint8[16] | d0 d1 dmin0 dmin1 f16,
//     where d_s, dmin_s belong to super-block s (groups 8 s .. 8 s + 7 of the chunk) and
//     w = d * sc * q - dmin * m, q the nibble;
//   q6_k: values [N, C * 384]: per chunk the bits-4 bytes of the low nibbles of u = q + 32
//     (256), then two vectors of high bit pairs (128): byte i of vector h holds bits 4-5 of value
//     vector 4 h + k at bits 2 k, 2 k + 1; meta [N, C * 40]: scA int8[16] | scB int8[16] | d0 d1 | 4 unused bytes
//     f16, where scA[l] scales the first 16 weights of group l (value vectors 0-3) and scB[l] the
//     last 16 (4-7), and w = d * sc * (u - 32).
// Where K % 512 == 256 the last chunk is a half one: of each of its 64-byte vectors only the first
// 32 bytes (groups 0-7) are stored (values [N, C * CB - CB / 2]; meta stays [N, C * 40]), read as
// 256-bit loads into lanes 0-7 (sb_vector): the experts' down projection at K = 768 reads 3/4 of
// the bytes of a row padded to 1024.
// The integer dot products are exact; the float work per chunk and activation row is
//   q4_k: acc += dot * (d sc * a_scale) - dmin m * a_sum,
//   q6_k: acc += dotA * (d scA * a_scale) + dotB * (d scB * a_scale) - 32 (d scA * a_sumA + d scB * a_sumB).
constexpr int kQ4K = 4, kQ6K = 6;
// The super-block kernel prefetches the rows it is about to multiply (their bytes are requested
// all at once at the row's start, which keeps more misses in flight than the loads alone), how far
// ahead depending on the CPU. AMD Zen 4 (M = 1, one row a pass, two threads): 0 bytes ahead
// measured 1.04x / 0.93x of the read rate (q4_k / q6_k), 2 KB ahead 0.95x / 0.87x, 4 KB 0.92x /
// 0.87x. Intel Xeon with AMX (2 vCPU, 2026-12-06; M = 1, two threads, twelve copies of one matrix
// read in turn, GB/s for q4_k 16384 x 2048 / q6_k 2048 x 8192 / q4_k 2048 x 8192): 0 ahead 21.0 /
// 20.4 / 25.8, 2 KB 21.3 / 27.2 / 37.6, 4 KB 27.0 / 33.9 / 32.1, 6 KB 28.0 / 26.2 / 36.2, 8 KB
// 25.9 / 29.0 / 43.7 (a noisy machine; 4 KB the best overall). The environment variable
// FT_SB_PREFETCH_BYTES, read once when the extension loads, overrides (for measuring).
inline int64_t sb_prefetch_bytes() {
  if (const char* env = std::getenv("FT_SB_PREFETCH_BYTES")) return std::max<int64_t>(0, std::atoll(env)) / 64 * 64;
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 0 : 4096;
}
const int64_t kSbPrefetchBytes = sb_prefetch_bytes();
template <int KIND> constexpr int64_t sb_chunk_bytes() { return KIND == kQ4K ? 256 : 384; }
constexpr int64_t kSbMetaBytes = 40;  // per chunk, both kinds (q6_k: 36 used; the f16 load reads 8)
// Batched rows (M > 1) are compute-bound: each row's chunk is prefetched this many chunks ahead
// (q4_k / q6_k at M = 4 from memory, two threads, idle Zen 4: 2 chunks 132 / 74 GMAC/s, 4 147 / 91,
// 8 153 / 52, against 103 / 60 with M = 1's request of the whole row as it starts).
#ifndef FT_SB_AHEAD_CHUNKS
#define FT_SB_AHEAD_CHUNKS 4
#endif
constexpr int64_t kSbAheadChunks = FT_SB_AHEAD_CHUNKS;
constexpr int kSbQ6Rows = 4;  // activation rows a q6_k pass takes at most (sb_tile_kernel)

// A value vector of a q6_k chunk: low nibbles `lo` (0..15 per byte) with the high bit pair k of
// `hi` as bits 4-5 (16-bit shifts: the bits that cross a byte boundary fall outside 0x30).
template <int K>
FT_AVX512 inline __m512i with_high_pair(__m512i lo, __m512i hi, __m512i mask30) {
  __m512i h;
  if constexpr (K == 0) h = _mm512_slli_epi16(hi, 4);
  else if constexpr (K == 1) h = _mm512_slli_epi16(hi, 2);
  else if constexpr (K == 2) h = hi;
  else h = _mm512_srli_epi16(hi, 2);
  return _mm512_ternarylogic_epi32(lo, h, mask30, 0xF8);  // lo | (h & 0x30)
}

// A 64-byte vector of a super-block chunk at p: a whole chunk's, or a half chunk's 32 bytes in
// lanes 0-7 and zeros above (a 256-bit load: nothing past the row is read; the activations of
// lanes 8-15, groups past K, are zero as well).
template <bool HALF>
FT_AVX512 inline __m512i sb_vector(const uint8_t* p) {
  if constexpr (HALF)
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return _mm512_loadu_si512(p);
}

// The integer dot products of one chunk (w: row n's chunk; row n + r at w + r * row_bytes) with
// activation rows [m0, m0 + MT) (aq: row m0's chunk): dot (q4_k; q6_k: value vectors 0-3) and
// dotB (q6_k: 4-7). Vectors lie vstep apart: 64 bytes, or 32 in a half chunk (HALF).
template <int MT, int KIND, int NR, bool HALF>
FT_AVX512 inline void sb_chunk_dots(const uint8_t* w, int64_t row_bytes, const int8_t* aq, int64_t qstride,
                                    __m512i (&dot)[NR][MT], __m512i (&dotB)[NR][KIND == kQ6K ? MT : 1]) {
  constexpr int64_t vstep = HALF ? 32 : 64;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i mask30 = _mm512_set1_epi8(0x30);
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) {
      dot[r][i] = _mm512_setzero_si512();
      if constexpr (KIND == kQ6K) dotB[r][i] = _mm512_setzero_si512();
    }
  if constexpr (KIND == kQ4K) {
    for (int u = 0; u < 4; ++u) {
      __m512i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) {
        const __m512i packed = sb_vector<HALF>(w + r * row_bytes + u * vstep);
        lo[r] = _mm512_and_si512(packed, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
      for (int i = 0; i < MT; ++i) {
        const __m512i alo = _mm512_load_si512(aq + i * qstride + (2 * u) * 64);
        const __m512i ahi = _mm512_load_si512(aq + i * qstride + (2 * u + 1) * 64);
        for (int r = 0; r < NR; ++r) {
          dot[r][i] = _mm512_dpbusd_epi32(dot[r][i], lo[r], alo);
          dot[r][i] = _mm512_dpbusd_epi32(dot[r][i], hi[r], ahi);
        }
      }
    }
  } else {
    // u = 0, 1: value vectors 0-3 (first halves, dotA); u = 2, 3: 4-7 (dotB). High pairs of
    // value vector j: vector j / 4 of the chunk's high bytes (after the 4 low vectors), pair j % 4.
    __m512i hv[NR][2];
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h) hv[r][h] = sb_vector<HALF>(w + r * row_bytes + (4 + h) * vstep);
#define FT_Q6_PAIR(U, H, KLO, KHI, DOT)                                                          \
  {                                                                                              \
    __m512i v0[NR], v1[NR];                                                                      \
    for (int r = 0; r < NR; ++r) {                                                               \
      const __m512i packed = sb_vector<HALF>(w + r * row_bytes + (U) * vstep);                   \
      v0[r] = with_high_pair<KLO>(_mm512_and_si512(packed, low4), hv[r][H], mask30);             \
      v1[r] = with_high_pair<KHI>(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), hv[r][H], mask30); \
    }                                                                                            \
    for (int i = 0; i < MT; ++i) {                                                               \
      const __m512i a0 = _mm512_load_si512(aq + i * qstride + (2 * (U)) * 64);                   \
      const __m512i a1 = _mm512_load_si512(aq + i * qstride + (2 * (U) + 1) * 64);               \
      for (int r = 0; r < NR; ++r) {                                                             \
        DOT[r][i] = _mm512_dpbusd_epi32(DOT[r][i], v0[r], a0);                                   \
        DOT[r][i] = _mm512_dpbusd_epi32(DOT[r][i], v1[r], a1);                                   \
      }                                                                                          \
    }                                                                                            \
  }
    FT_Q6_PAIR(0, 0, 0, 1, dot)
    FT_Q6_PAIR(1, 0, 2, 3, dot)
    FT_Q6_PAIR(2, 1, 0, 1, dotB)
    FT_Q6_PAIR(3, 1, 2, 3, dotB)
#undef FT_Q6_PAIR
  }
}

// Bytes of a super-block row of C chunks of CB bytes, the last a half one when `half`.
inline int64_t sb_row_bytes(int64_t C, bool half, int64_t CB) { return C * CB - (half ? CB / 2 : 0); }

template <int MT, int KIND, int NR>
FT_AVX512 inline void sb_rows_kernel(const uint8_t* wq, const uint8_t* wmeta, int64_t C, bool half, int64_t n,
                                     const QuantizedActs& a, int64_t m0, bool first_pass, float* out, int64_t ldo) {
  constexpr int64_t CB = sb_chunk_bytes<KIND>(), MB = kSbMetaBytes;
  const int64_t row_bytes = sb_row_bytes(C, half, CB), meta_row = C * MB;
  const int64_t qstride = a.chunks * 512, gstride = a.chunks * 16;
  const __m512i pick_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i pick_dmin = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_setzero_ps();
  // On the first pass over the rows (later passes find them in cache), M = 1 requests the rows'
  // bytes all at once as they start (kSbPrefetchBytes ahead), M > 1 each row's chunk
  // kSbAheadChunks ahead of the one being multiplied (past the row's end: the next pass's rows).
  if (MT == 1 && first_pass) {
    const char* ahead = reinterpret_cast<const char*>(wq + n * row_bytes) + kSbPrefetchBytes;
    for (int64_t o = 0; o < NR * row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    const char* meta_ahead = reinterpret_cast<const char*>(wmeta + n * meta_row) + kSbPrefetchBytes * MB / CB;
    for (int64_t o = 0; o < NR * meta_row; o += 64) _mm_prefetch(meta_ahead + o, _MM_HINT_T0);
  }
  for (int64_t c = 0; c < C; ++c) {
    const int8_t* aq = a.q + m0 * qstride + c * 512;
    const uint8_t* w = wq + n * row_bytes + c * CB;  // a half chunk is the last: it starts there too
    if (MT > 1 && first_pass) {  // never faults: a prefetch past the weight's end is dropped
      const int64_t ahead = c + kSbAheadChunks, row = ahead < C ? n : n + NR, ca = ahead < C ? ahead : ahead - C;
      for (int r = 0; r < NR; ++r) {
        const char* p = reinterpret_cast<const char*>(wq + (row + r) * row_bytes + ca * CB);
        for (int64_t o = 0; o < CB; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wmeta + (row + r) * meta_row + ca * MB), _MM_HINT_T0);
      }
    }
    __m512i dot[NR][MT], dotB[NR][KIND == kQ6K ? MT : 1];
    if (half && c == C - 1)
      sb_chunk_dots<MT, KIND, NR, true>(w, row_bytes, aq, qstride, dot, dotB);
    else
      sb_chunk_dots<MT, KIND, NR, false>(w, row_bytes, aq, qstride, dot, dotB);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* meta = wmeta + (n + r) * meta_row + c * MB;
      const __m128i dh = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 32));  // 4 f16 (q6_k: 2 used)
      const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(dh));
      const __m512 d = _mm512_permutexvar_ps(pick_d, dd);
      const __m128i s01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta));
      const __m128i s23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16));
      for (int i = 0; i < MT; ++i) {
        const int64_t o = (m0 + i) * gstride + c * 16;
        const __m512 as = _mm512_load_ps(a.group_scale + o);
        if constexpr (KIND == kQ4K) {
          const __m512 S = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s01)), d);
          const __m512 Mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s23)),
                                          _mm512_permutexvar_ps(pick_dmin, dd));
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][i]), _mm512_mul_ps(S, as), acc[r][i]);
          acc[r][i] = _mm512_fnmadd_ps(Mn, _mm512_load_ps(a.group_sum + o), acc[r][i]);
        } else {
          const __m512 SA = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s01)), d);
          const __m512 SB = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s23)), d);
          const int64_t h0 = (2 * (m0 + i)) * gstride + c * 16, h1 = h0 + gstride;
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][i]), _mm512_mul_ps(SA, as), acc[r][i]);
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dotB[r][i]), _mm512_mul_ps(SB, as), acc[r][i]);
          const __m512 off = _mm512_fmadd_ps(SA, _mm512_load_ps(a.half_sum + h0),
                                             _mm512_mul_ps(SB, _mm512_load_ps(a.half_sum + h1)));
          acc[r][i] = _mm512_fnmadd_ps(_mm512_set1_ps(32.0f), off, acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MT; ++i) out[i * ldo + n + r] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int BITS>
using TileFn = void (*)(const uint8_t*, const at::Half*, const at::Half*, int64_t, int64_t, int64_t,
                        const QuantizedActs&, int64_t, float*, int64_t);

template <int BITS, int... Ms>
constexpr std::array<TileFn<BITS>, sizeof...(Ms)> make_table(std::integer_sequence<int, Ms...>) {
  return {&tile_kernel<Ms + 1, BITS>...};
}

template <int BITS, int... Ms>
constexpr std::array<TileFn<BITS>, sizeof...(Ms)> make_table_avx2(std::integer_sequence<int, Ms...>) {
  return {&g32_tile_avx2<Ms + 1, BITS>...};
}

// The group-32 tile kernels this CPU runs: AVX-512 VNNI where it has them, else AVX2.
template <int BITS>
const std::array<TileFn<BITS>, kMaxRows>& tile_table() {
  static constexpr auto avx512 = make_table<BITS>(std::make_integer_sequence<int, kMaxRows>{});
  static constexpr auto avx2 = make_table_avx2<BITS>(std::make_integer_sequence<int, kMaxRows>{});
  return kAvx512 ? avx512 : avx2;
}

inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}

// The activation rows of x quantized per 32-group (see quantize_acts; without AVX-512 the same
// bits from acts_portable.h).
inline QuantizedActs quantize_x(const at::Tensor& x, bool compact_tail) {
  const int64_t M = x.size(0), K = x.size(1);
  if (!kAvx512)
    return x.scalar_type() == at::kFloat ? quantize_acts_portable(x.data_ptr<float>(), M, K, compact_tail)
                                         : quantize_acts_portable(x.data_ptr<at::BFloat16>(), M, K, compact_tail);
  return x.scalar_type() == at::kFloat ? quantize_acts(x.data_ptr<float>(), M, K, compact_tail)
                                       : quantize_acts(x.data_ptr<at::BFloat16>(), M, K, compact_tail);
}

// Rows [m0, m0 + mt) x columns [n0, n1) of y [., N] (float32 yf or bfloat16 yb) from a tile's
// buffer (buf[i * kTileRows + n - n0]), plus the bias bp (float32 or bfloat16; null: none).
inline void store_tile(const float* buf, int64_t mt, int64_t n0, int64_t n1, int64_t m0, int64_t N,
                       const void* bp, bool bias_f32, float* yf, uint16_t* yb) {
  for (int64_t i = 0; i < mt; ++i) {
    for (int64_t n = n0; n < n1; ++n) {
      float v = buf[i * kTileRows + (n - n0)];
      if (bp != nullptr)
        v += bias_f32 ? static_cast<const float*>(bp)[n] : float(static_cast<const at::BFloat16*>(bp)[n]);
      const int64_t o = (m0 + i) * N + n;
      if (yf != nullptr)
        yf[o] = v;
      else
        yb[o] = to_bf16_bits(v);
    }
  }
}

// y[M, N] (+ bias) from tile(mt, t0, t1, m0, buf): the weight rows [0, N) split between torch's
// threads in tiles of kTileRows, each task reading at least kTaskBytes of weights (~6 us at 20 GB/s:
// below that, waking a second thread costs about what it saves; a guess, not tuned on an idle machine).
template <typename Tile>
void parallel_tiles(int64_t M, int64_t N, int64_t row_bytes, const c10::optional<at::Tensor>& bias,
                    at::Tensor& y, const Tile& tile) {
  const bool f32_out = y.scalar_type() == at::kFloat;
  const bool has_bias = bias.has_value();
  const bool bias_f32 = has_bias && bias->scalar_type() == at::kFloat;
  const void* bp = has_bias ? bias->data_ptr() : nullptr;
  float* yf = f32_out ? y.data_ptr<float>() : nullptr;
  uint16_t* yb = f32_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(kTileRows, (kTaskBytes / row_bytes + kTileRows - 1) / kTileRows * kTileRows);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float buf[kMaxRows * kTileRows];
    for (int64_t t0 = begin; t0 < end; t0 += kTileRows) {
      const int64_t t1 = std::min(end, t0 + kTileRows);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t mt = std::min<int64_t>(kMaxRows, M - m0);
        // buf[i, n - t0]: the kernels index columns by absolute n, so shift the base back by t0.
        tile(mt, t0, t1, m0, buf - t0);
        store_tile(buf, mt, t0, t1, m0, N, bp, bias_f32, yf, yb);
      }
    }
  });
}

template <int BITS>
void run(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws,
         const c10::optional<at::Tensor>& wm, const c10::optional<at::Tensor>& bias, at::Tensor& y,
         int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t tail = (K / kGroup) % 16;
  const QuantizedActs a = quantize_x(x, tail && 16 % tail == 0);
  const uint8_t* q = wq.data_ptr<uint8_t>();
  const at::Half* s = ws.data_ptr<at::Half>();
  const at::Half* mn = wm.has_value() ? wm->data_ptr<at::Half>() : nullptr;
  const auto& table = tile_table<BITS>();
  parallel_tiles(M, N, row_bytes_of<BITS>(K), bias, y, [&](int64_t mt, int64_t t0, int64_t t1, int64_t m0, float* out) {
    table[mt - 1](q, s, mn, K, t0, t1, a, m0, out, kTileRows);
  });
}

// Rows [n0, n1) of a super-block weight against activation rows [m0, m0 + MT).
template <int MT, int KIND>
FT_AVX512 void sb_tile_kernel(const uint8_t* wq, const uint8_t* wmeta, int64_t C, bool half, int64_t n0, int64_t n1,
                              const QuantizedActs& a, int64_t m0, bool first_pass, float* out, int64_t ldo) {
  // Weight rows a pass (NR) and activation rows a pass, measured on an idle 2-core Zen 4 over
  // twelve copies of a matrix read in turn (q4_k 16384 x 2048, q6_k 2048 x 8192; GMAC/s at two
  // threads, M = 2 / 4 / 8): q4_k one row a pass 76 / 142 / 178, two rows (the choice before)
  // 69 / 132 / 178; q6_k two rows with at most 4 activation rows a pass 51 / 88 / 118, one row
  // 47 / 71 / 94, and two rows but 8 activation rows a pass (before) 39 / 63 / 76. At M = 1
  // one weight row at a time: at two threads over 230-330 MB of 1.1B-shaped matrices
  // (interleaved with stream_read of as many bytes, idle Zen 4), one row reached 0.92x (q4_k) /
  // 0.87x (q6_k) of the read rate where two rows sharing each activation load reached 0.68x / 0.67x,
  // and four 0.75x / 0.69x (FT_SB_NR to measure again).
#ifndef FT_SB_NR
#define FT_SB_NR 1
#endif
  if constexpr (KIND == kQ6K && MT > kSbQ6Rows) {  // a q6_k pass of 8 rows was slower than two of 4
    sb_tile_kernel<kSbQ6Rows, KIND>(wq, wmeta, C, half, n0, n1, a, m0, first_pass, out, ldo);
    sb_tile_kernel<MT - kSbQ6Rows, KIND>(wq, wmeta, C, half, n0, n1, a, m0 + kSbQ6Rows, false,
                                         out + kSbQ6Rows * ldo, ldo);
  } else {
    constexpr int NR = MT == 1 ? FT_SB_NR : KIND == kQ6K ? 2 : 1;
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) sb_rows_kernel<MT, KIND, NR>(wq, wmeta, C, half, n, a, m0, first_pass, out, ldo);
    for (; n < n1; ++n) sb_rows_kernel<MT, KIND, 1>(wq, wmeta, C, half, n, a, m0, first_pass, out, ldo);
  }
}

using SbTileFn = void (*)(const uint8_t*, const uint8_t*, int64_t, bool, int64_t, int64_t, const QuantizedActs&,
                          int64_t, bool, float*, int64_t);

template <int KIND, int... Ms>
constexpr std::array<SbTileFn, sizeof...(Ms)> make_sb_table(std::integer_sequence<int, Ms...>) {
  return {&sb_tile_kernel<Ms + 1, KIND>...};
}

template <int KIND>
const std::array<SbTileFn, kMaxRows>& sb_tile_table() {
  static constexpr auto table = make_sb_table<KIND>(std::make_integer_sequence<int, kMaxRows>{});
  return table;
}

template <int KIND, int... Ms>
constexpr std::array<SbTileFn, sizeof...(Ms)> make_sb_table_avx2(std::integer_sequence<int, Ms...>) {
  return {&sb_tile_avx2<Ms + 1, KIND>...};
}

// The super-block tile kernels this CPU runs: AVX-512 VNNI where it has them, else AVX2.

template <int KIND>
const std::array<SbTileFn, kMaxRows>& sb_tiles() {
  static constexpr auto avx512 = make_sb_table<KIND>(std::make_integer_sequence<int, kMaxRows>{});
  static constexpr auto avx2 = make_sb_table_avx2<KIND>(std::make_integer_sequence<int, kMaxRows>{});
  return kAvx512 ? avx512 : avx2;
}

// Whether this CPU runs every kernel here, in one kind or the other (qmm, sbmm, grouped_sbmm, stream_read).
inline bool kernels_supported() { return kAvx512 || cpu_supports_avx2(); }


// y[M, N] = x[M, K] @ dequant(W)[N, K]^T + bias for a super-block weight (kind 4: q4_k, 6: q6_k).
at::Tensor sbmm(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& wmeta,
                const c10::optional<at::Tensor>& bias, int64_t kind) {
  TORCH_CHECK(x_in.dim() == 2, "sbmm: x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "sbmm: x must be float32 or bfloat16");
  TORCH_CHECK(kind == kQ4K || kind == kQ6K, "sbmm: kind must be 4 (q4_k) or 6 (q6_k)");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  const int64_t C = (K + 511) / 512;
  const int64_t CB = kind == kQ4K ? sb_chunk_bytes<kQ4K>() : sb_chunk_bytes<kQ6K>();
  TORCH_CHECK(K % 256 == 0, "sbmm: K must be a multiple of 256");
  const bool half = K % 512 != 0;  // K % 256 == 0: a last chunk of one super-block
  const int64_t RB = sb_row_bytes(C, half, CB);
  TORCH_CHECK(wq.is_contiguous() && wq.size(1) == RB, "sbmm: weight must be contiguous [N, ", RB, "] bytes");
  TORCH_CHECK(wmeta.is_contiguous() && wmeta.size(0) == N && wmeta.size(1) == C * kSbMetaBytes,
              "sbmm: meta must be contiguous [N, ", C * kSbMetaBytes, "] bytes");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedActs a = quantize_x(x, false);
  const uint8_t* q = wq.data_ptr<uint8_t>();
  const uint8_t* meta = wmeta.data_ptr<uint8_t>();
  const auto& table = kind == kQ4K ? sb_tiles<kQ4K>() : sb_tiles<kQ6K>();
  parallel_tiles(M, N, RB, bias, y, [&](int64_t mt, int64_t t0, int64_t t1, int64_t m0, float* out) {
    table[mt - 1](q, meta, C, half, t0, t1, a, m0, m0 == 0, out, kTileRows);
  });
  return y;
}

// y[M, N] = x[M, K] @ dequant(W)[N, K]^T + bias, in x's dtype (float32 or bfloat16).
at::Tensor qmm(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& ws,
               const c10::optional<at::Tensor>& wm, const c10::optional<at::Tensor>& bias,
               int64_t bits) {
  TORCH_CHECK(x_in.dim() == 2, "qmm: x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "qmm: x must be float32 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  TORCH_CHECK(K % kGroup == 0 && ws.size(1) == K / kGroup, "qmm: K does not match the weight");
  const int64_t row_bytes = bits == 8 ? row_bytes_of<8>(K) : bits == 5 ? row_bytes_of<5>(K) : row_bytes_of<4>(K);
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "qmm: bits must be 4, 5 or 8");
  TORCH_CHECK(wq.is_contiguous() && wq.size(1) == row_bytes &&
                  wq.storage().nbytes() >= size_t((wq.storage_offset() + N * row_bytes + kReadPad)),
              "qmm: packed weight must be contiguous [N, row bytes] with ", kReadPad, " bytes of padding");
  TORCH_CHECK(ws.is_contiguous() && (!wm.has_value() || wm->is_contiguous()), "qmm: scales must be contiguous");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (bits == 8)
    run<8>(x, wq, ws, wm, bias, y, N);
  else if (bits == 5)
    run<5>(x, wq, ws, wm, bias, y, N);
  else
    run<4>(x, wq, ws, wm, bias, y, N);
  return y;
}

// Groups of activation rows, each against its own super-block weight (a mixture of experts' step):
// y[P, N] where rows [offsets[a], offsets[a + 1]) of x meet weight a (values[a], metas[a], all of
// one kind and shape [N, K]). One quantization of x and one parallel loop over every group's row
// tiles: a decode step's 8 experts are one task list for the threads, not 8 calls of 2 each.
at::Tensor grouped_sbmm(const at::Tensor& x_in, const at::Tensor& offsets, const std::vector<at::Tensor>& values,
                        const std::vector<at::Tensor>& metas, int64_t kind, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2, "grouped_sbmm: x must be [P, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "grouped_sbmm: x must be float32 or bfloat16");
  TORCH_CHECK(kind == kQ4K || kind == kQ6K, "grouped_sbmm: kind must be 4 (q4_k) or 6 (q6_k)");
  const at::Tensor x = x_in.contiguous();
  const int64_t P = x.size(0), K = x.size(1);
  const int64_t A = int64_t(values.size());
  TORCH_CHECK(K % 256 == 0, "grouped_sbmm: K must be a multiple of 256");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == A + 1 &&
                  int64_t(metas.size()) == A, "grouped_sbmm: offsets [A + 1] int64 and A values and metas");
  const int64_t C = (K + 511) / 512;
  const int64_t CB = kind == kQ4K ? sb_chunk_bytes<kQ4K>() : sb_chunk_bytes<kQ6K>();
  const bool half = K % 512 != 0;  // K % 256 == 0: a last chunk of one super-block
  const int64_t RB = sb_row_bytes(C, half, CB);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[A] == P, "grouped_sbmm: offsets must run from 0 to P");
  std::vector<const uint8_t*> vp(A), mp(A);
  for (int64_t g = 0; g < A; ++g) {
    TORCH_CHECK(off[g] <= off[g + 1], "grouped_sbmm: offsets must not decrease");
    TORCH_CHECK(values[g].is_contiguous() && values[g].size(0) == N && values[g].size(1) == RB,
                "grouped_sbmm: weight ", g, " must be contiguous [", N, ", ", RB, "] bytes");
    TORCH_CHECK(metas[g].is_contiguous() && metas[g].size(0) == N && metas[g].size(1) == C * kSbMetaBytes,
                "grouped_sbmm: meta ", g, " must be contiguous [", N, ", ", C * kSbMetaBytes, "] bytes");
    vp[g] = values[g].data_ptr<uint8_t>();
    mp[g] = metas[g].data_ptr<uint8_t>();
  }
  at::Tensor y = at::empty({P, N}, x.options());
  if (P == 0 || N == 0) return y;
  const QuantizedActs a = quantize_x(x, false);
  const auto& table = kind == kQ4K ? sb_tiles<kQ4K>() : sb_tiles<kQ6K>();
  const bool f32_out = y.scalar_type() == at::kFloat;
  float* yf = f32_out ? y.data_ptr<float>() : nullptr;
  uint16_t* yb = f32_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;  // per group
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / (RB * kTileRows));
  at::parallel_for(0, A * tiles, grain, [&](int64_t begin, int64_t end) {
    float buf[kMaxRows * kTileRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / tiles, n0 = (t % tiles) * kTileRows, n1 = std::min(N, n0 + kTileRows);
      for (int64_t m0 = off[g]; m0 < off[g + 1]; m0 += kMaxRows) {
        const int64_t mt = std::min<int64_t>(kMaxRows, off[g + 1] - m0);
        // prefetching on each group's first pass (its rows start at off[g], not 0)
        table[mt - 1](vp[g], mp[g], C, half, n0, n1, a, m0, m0 == off[g], buf - n0, kTileRows);
        store_tile(buf, mt, n0, n1, m0, N, nullptr, false, yf, yb);
      }
    }
  });
  return y;
}

// The machine's read bandwidth as the kernels see it (`ft bench roofline`): every byte of `t` read
// once with 64-byte loads, the tensor split between torch's threads in contiguous ranges (as the
// kernels split a weight's rows), prefetching kPrefetchBytes ahead like them. Returns a checksum
// (so the loads are not optimised away).
FT_AVX512 int64_t read_range(const uint8_t* p, int64_t n) {
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  int64_t o = 0;
  for (; o + 256 <= n; o += 256) {
    for (int64_t j = 0; j < 256; j += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o + kPrefetchBytes + j, _MM_HINT_T0);
    acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(p + o));
    acc1 = _mm512_xor_si512(acc1, _mm512_loadu_si512(p + o + 64));
    acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(p + o + 128));
    acc1 = _mm512_xor_si512(acc1, _mm512_loadu_si512(p + o + 192));
  }
  int64_t tail = 0;
  for (; o < n; ++o) tail += p[o];
  return _mm512_reduce_add_epi64(_mm512_xor_si512(acc0, acc1)) + tail;
}

// read_range with 32-byte loads, for CPUs without AVX-512.
FT_AVX2 int64_t read_range_avx2(const uint8_t* p, int64_t n) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  int64_t o = 0;
  for (; o + 128 <= n; o += 128) {
    for (int64_t j = 0; j < 128; j += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o + kPrefetchBytes + j, _MM_HINT_T0);
    acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
    acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 32)));
    acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 64)));
    acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 96)));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(acc0, acc1));
  int64_t tail = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; o < n; ++o) tail += p[o];
  return tail;
}

int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "stream_read: a contiguous CPU tensor");
  const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = t.numel() * int64_t(t.element_size());
  constexpr int64_t kBlock = 4096;
  std::atomic<int64_t> sum{0};
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 32, [&](int64_t b, int64_t e) {
    const int64_t len = std::min(n, e * kBlock) - b * kBlock;
    sum += kAvx512 ? read_range(p + b * kBlock, len) : read_range_avx2(p + b * kBlock, len);
  });
  return sum.load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's AVX-512 VNNI weight-only quantized matmul (see qlinear.cpp)";
  m.def("supported", &cpu_supported, "whether this CPU has AVX-512 F/BW/VL/VNNI (every kernel here)");
  m.def("group32_supported", &kernels_supported,
        "whether this CPU runs qmm and stream_read: AVX-512 VNNI, or AVX2 + FMA + F16C");
  m.def("superblock_supported", &kernels_supported,
        "whether this CPU runs sbmm / grouped_sbmm: AVX-512 VNNI, or AVX2 + FMA + F16C");
  m.attr("bits") = py::make_tuple(4, 5, 8);  // the weight widths qmm takes
  m.attr("superblock_kinds") = py::make_tuple(4, 6);  // q4_k, q6_k: what sbmm takes
  m.attr("superblock_layout") = 2;  // 2: a K % 512 == 256 row ends in a half chunk (1: padded to whole ones)
  m.def("qmm", &qmm, "y = x @ dequant(W)^T + bias", py::arg("x"), py::arg("q"), py::arg("scale"),
        py::arg("minimum"), py::arg("bias"), py::arg("bits"));
  m.def("stream_read", &stream_read, "read every byte of a tensor once (bandwidth measurement); a checksum", py::arg("t"));
  m.def("sbmm", &sbmm, "y = x @ dequant(W)^T + bias for a super-block (Q4_K / Q6_K) weight", py::arg("x"),
        py::arg("q"), py::arg("meta"), py::arg("bias"), py::arg("kind"));
  m.def("grouped_sbmm", &grouped_sbmm,
        "y rows [offsets[a], offsets[a + 1]) = x rows @ dequant(W_a)^T, every W_a super-block of one kind",
        py::arg("x"), py::arg("offsets"), py::arg("values"), py::arg("metas"), py::arg("kind"), py::arg("n"));
}
