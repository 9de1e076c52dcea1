// The whole-row passes of the sampler, one call for what took four torch ops over every logit:
// temperature applied in place, each row's maximum, the log of its softmax normaliser and the
// maxima of its blocks of `block` logits (which the top-k search reads instead of the row); and,
// for a temperature-only draw, the row's softmax weights in place with their block sums. And the
// deep cut: the tokens a top-p / min-p filter keeps on a flat row, whose cut lies past the row's
// topk (`deep_cut`, below).
//
// Owns the arithmetic only; freetoken/ops/sampling.py decides when it runs (CPU, float32,
// contiguous rows) and falls back to torch's ops otherwise. x / t is IEEE division, as torch's
// div_, so the scaled logits, the maxima and the block maxima are bit for bit torch's. The
// normaliser sums exp(x - max) with the vectorized exp of simd.h (~1 ulp) in float32 lanes folded
// into float64 every 1024 values: it agrees with torch's float32 sum to ~1e-6 relative, not bit for
// bit (the sampler's top-p cut tolerates 1e-5).
#include "extension.h"  // ATen and pybind11 (not the whole of <torch/extension.h>)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

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

// ---- The deep cut -------------------------------------------------------------------------------
//
// The kept tokens of one row whose cut lies past its topk (a flat row: top_p 0.95 keeps ~44,000
// of 49,152 tokens), exactly as the full-sort filter keeps them: rank the tokens by logit (equal
// logits by ascending id), keep rank r while the mass of the ranks before r is < top_p (p = exp(x -
// max) * scale, scale = exp(-log_mass): mass relative to the whole row) and exp(x - max) >= min_p;
// rank 0 always stays (top_k is off on such rows: the kernel declines a row with top_k < V). Nothing
// is sorted but the tokens of one narrow bucket of logits:
//
//   1. one pass writes rel = exp(x - max) in float64 for every token and adds it to the token's
//      bucket: (max - x) in 1/128 logit steps (bucket 0 holds the max; 64 logits below it and -inf
//      share the last). A larger logit never lands in a later bucket and equal logits share one, so
//      the buckets are runs of ranks;
//   2. a walk over the bucket sums, in rank order, finds the first bucket the cut may lie in (its
//      mass may carry top_p across, or its lower edge may fall below min_p's edge); one more pass
//      gathers its tokens, which are sorted by (logit desc, id asc) and walked rank by rank. That
//      finds the last kept token exactly; a bucket that keeps all its tokens (the bucket test is
//      conservative) sends the walk on to the next;
//   3. a last pass keeps, in id order, every token with a larger logit than the last kept one, or an
//      equal logit and an id no larger, and writes its id and its rel (from pass 1) divided by the
//      kept mass (the walk's sum).
//
// A row with top_p off needs no walk: min_p keeps exactly the tokens with rel >= min_p (rank 0 has
// rel 1), in one pass and a division. The AVX-512 passes compute rel with exp8d (~1 ulp), the plain
// path with std::exp; either way the kept set is the full sort's up to float64 rounding of the mass
// at a knife edge, and the probabilities are float64 ratios. A row with a NaN (or a logit above the
// given max) is left to the caller's torch path: the kernel returns empty tensors.

constexpr int32_t kBucketsPerLogit = 128;
constexpr int32_t kBuckets = 8192;  // 64 logits below the max; tokens farther down share the last
constexpr int64_t kChunk = 256;     // tokens whose buckets are computed before they are added up

// Clamped to [0, kBuckets - 1] whatever x is (NaN: the last; above m: the first), so that no
// logit can index outside the buckets before the row is found wanting.
inline int32_t bucket_of(float x, float m) {
  float d = (m - x) * static_cast<float>(kBucketsPerLogit);  // +inf for x = -inf
  d = d < static_cast<float>(kBuckets - 1) ? d : static_cast<float>(kBuckets - 1);
  return static_cast<int32_t>(d > 0.f ? d : 0.f);
}

// The same bucket for 16 logits: the same float32 subtraction, an exact product by a power of two
// and truncation (min_ps returns its second operand for NaN, as the scalar test does).
FT_AVX512 inline __m512i bucket16(__m512 x, __m512 vm) {
  const __m512 d = _mm512_mul_ps(_mm512_sub_ps(vm, x), _mm512_set1_ps(static_cast<float>(kBucketsPerLogit)));
  const __m512 below_last = _mm512_min_ps(d, _mm512_set1_ps(static_cast<float>(kBuckets - 1)));
  return _mm512_cvttps_epi32(_mm512_max_ps(below_last, _mm512_setzero_ps()));
}

// exp(x) in float64 for x <= 0, ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, the first
// short enough that n * ln2_hi is exact), a degree-13 Taylor polynomial of exp(r) (truncation
// < 1e-17), times 2^n. 0 below -745.2 (under the smallest denormal) and for -inf.
FT_AVX512 inline __m512d exp8d(__m512d x) {
  static constexpr double kInvFactorial[14] = {1.0,           1.0,           1.0 / 2,        1.0 / 6,
                                               1.0 / 24,      1.0 / 120,     1.0 / 720,      1.0 / 5040,
                                               1.0 / 40320,   1.0 / 362880,  1.0 / 3628800,  1.0 / 39916800,
                                               1.0 / 479001600, 1.0 / 6227020800};
  const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);
  r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
  __m512d p = _mm512_set1_pd(kInvFactorial[13]);
  for (int k = 12; k >= 0; --k) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(kInvFactorial[k]));
  const __m512d y = _mm512_scalef_pd(p, n);
  return _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(x, _mm512_set1_pd(-745.2), _CMP_GE_OQ), y);
}

// exp(x - m) in float64 of 16 float32 logits, as two halves of 8.
FT_AVX512 inline void rel16(__m512 x, __m512d md, __m512d* lo, __m512d* hi) {
  *lo = exp8d(_mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), md));
  *hi = exp8d(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), md));
}

inline double rel_of(float x, float m) { return std::exp(static_cast<double>(x) - static_cast<double>(m)); }

FT_AVX512 inline __mmask16 tail16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

// Pass 1 (top_p rows): rel[i] = exp(x_i - m) for every token, each bucket's float64 sum of it in
// mass. False if the row has a NaN or a logit above m. The buckets of a chunk are computed into a
// buffer before they are added up: read back while the vector store of the same 16 was in flight,
// they stalled on store forwarding (8% slower on Zen 4).
FT_AVX512 bool mass_avx512(const float* x, int64_t V, float m, double* rel, double* mass) {
  const __m512 vm = _mm512_set1_ps(m);
  const __m512d md = _mm512_set1_pd(m);
  alignas(64) int32_t b[kChunk];
  __mmask16 bad = 0;
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t n = std::min(kChunk, V - c);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 live = tail16(n - i);
      const __m512 v = _mm512_maskz_loadu_ps(live, x + c + i);
      bad |= _mm512_mask_cmp_ps_mask(live, v, vm, _CMP_NLE_UQ);  // NaN, or above the max
      _mm512_store_si512(b + i, bucket16(v, vm));
      __m512d lo, hi;
      rel16(v, md, &lo, &hi);
      _mm512_mask_storeu_pd(rel + c + i, static_cast<__mmask8>(live), lo);
      _mm512_mask_storeu_pd(rel + c + i + 8, static_cast<__mmask8>(live >> 8), hi);
    }
    for (int64_t j = 0; j < n; ++j) mass[b[j]] += rel[c + j];
  }
  return bad == 0;
}

bool mass_scalar(const float* x, int64_t V, float m, double* rel, double* mass) {
  for (int64_t i = 0; i < V; ++i) {
    if (!(x[i] <= m)) return false;
    rel[i] = rel_of(x[i], m);
    mass[bucket_of(x[i], m)] += rel[i];
  }
  return true;
}

struct Token {
  float x;
  int32_t id;
  double rel;
};

// Pass 2: the tokens of bucket `bucket` in id order, with their rel from pass 1. Returns how many
// tokens lie in the buckets before it (ranked before all of them).
FT_AVX512 int64_t gather_avx512(const float* x, int64_t V, float m, int32_t bucket, const double* rel,
                                std::vector<Token>& out) {
  const __m512 vm = _mm512_set1_ps(m);
  const __m512i vb = _mm512_set1_epi32(bucket);
  int64_t before = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = tail16(V - i);
    const __m512i b = bucket16(_mm512_maskz_loadu_ps(live, x + i), vm);
    before += __builtin_popcount(_mm512_mask_cmplt_epi32_mask(live, b, vb));
    for (uint32_t hit = _mm512_mask_cmpeq_epi32_mask(live, b, vb); hit; hit &= hit - 1) {
      const int64_t j = i + __builtin_ctz(hit);
      out.push_back({x[j], static_cast<int32_t>(j), rel[j]});
    }
  }
  return before;
}

int64_t gather_scalar(const float* x, int64_t V, float m, int32_t bucket, const double* rel, std::vector<Token>& out) {
  int64_t before = 0;
  for (int64_t i = 0; i < V; ++i) {
    const int32_t b = bucket_of(x[i], m);
    before += b < bucket;
    if (b == bucket) out.push_back({x[i], static_cast<int32_t>(i), rel[i]});
  }
  return before;
}

// Pass 3 (top_p rows): the kept tokens are those with a logit above cx, or equal to it and an id
// no larger than cid. ids[n] = i and probs[n] = rel[i] / total for each, in id order. Returns n,
// or cap + 1 (and stops) if there are more than the cap the walk counted and the buffers hold.
FT_AVX512 int64_t keep_avx512(const float* x, int64_t V, float cx, int64_t cid, double total, const double* rel,
                              int64_t* ids, double* probs, int64_t cap) {
  const __m512 vx = _mm512_set1_ps(cx);
  const int32_t last_id = static_cast<int32_t>(std::max<int64_t>(-1, std::min<int64_t>(cid, INT32_MAX)));
  const __m512i last = _mm512_set1_epi32(last_id);
  const __m512i lane32 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i lane64 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  const __m512d vt = _mm512_set1_pd(total);
  int64_t n = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = tail16(V - i);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    const __m512i id = _mm512_add_epi32(lane32, _mm512_set1_epi32(static_cast<int32_t>(i)));
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, v, vx, _CMP_GT_OQ) |
                           (_mm512_mask_cmp_ps_mask(live, v, vx, _CMP_EQ_OQ) & _mm512_cmple_epi32_mask(id, last));
    if (!keep) continue;
    const __m512d lo = _mm512_maskz_loadu_pd(static_cast<__mmask8>(live), rel + i);
    const __m512d hi = _mm512_maskz_loadu_pd(static_cast<__mmask8>(live >> 8), rel + i + 8);
    for (int half = 0; half < 2; ++half) {
      const __mmask8 k = static_cast<__mmask8>(keep >> (8 * half));
      if (!k) continue;
      const int64_t count = __builtin_popcount(k);
      if (n + count > cap) return cap + 1;
      const __mmask8 head = static_cast<__mmask8>((1u << count) - 1u);
      const __m512i id64 = _mm512_add_epi64(lane64, _mm512_set1_epi64(i + 8 * half));
      // compress in a register, then a masked store: a compressing store to memory is slow on Zen 4
      _mm512_mask_storeu_epi64(ids + n, head, _mm512_maskz_compress_epi64(k, id64));
      _mm512_mask_storeu_pd(probs + n, head, _mm512_div_pd(_mm512_maskz_compress_pd(k, half ? hi : lo), vt));
      n += count;
    }
  }
  return n;
}

int64_t keep_scalar(const float* x, int64_t V, float cx, int64_t cid, double total, const double* rel, int64_t* ids,
                    double* probs, int64_t cap) {
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!(x[i] > cx || (x[i] == cx && i <= cid))) continue;
    if (n == cap) return cap + 1;
    ids[n] = i;
    probs[n++] = rel[i] / total;
  }
  return n;
}

// min_p alone (top_p off): ids and rel of every token with rel >= min_p, in id order, their sum in
// total. False if the row has a NaN or a logit above m.
FT_AVX512 bool min_p_avx512(const float* x, int64_t V, float m, double min_p, int64_t* ids, double* rel,
                            int64_t* kept, double* total) {
  const __m512 vm = _mm512_set1_ps(m);
  const __m512d md = _mm512_set1_pd(m);
  const __m512d vp = _mm512_set1_pd(min_p);
  const __m512i lane64 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  // 16 logits all below this are all dropped: no exp for them (a margin far wider than float32's
  // rounding of the edge)
  const __m512 floor = _mm512_set1_ps(
      static_cast<float>(static_cast<double>(m) + std::log(min_p) - 1e-3 - 1e-6 * std::fabs(static_cast<double>(m))));
  __m512d acc = _mm512_setzero_pd();
  __mmask16 bad = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = tail16(V - i);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    bad |= _mm512_mask_cmp_ps_mask(live, v, vm, _CMP_NLE_UQ);
    if (!_mm512_mask_cmp_ps_mask(live, v, floor, _CMP_GE_OQ)) continue;
    __m512d r[2];
    rel16(v, md, &r[0], &r[1]);
    for (int half = 0; half < 2; ++half) {
      const __mmask8 k = static_cast<__mmask8>(live >> (8 * half)) & _mm512_cmp_pd_mask(r[half], vp, _CMP_GE_OQ);
      if (!k) continue;
      const int64_t count = __builtin_popcount(k);
      const __mmask8 head = static_cast<__mmask8>((1u << count) - 1u);
      const __m512i id64 = _mm512_add_epi64(lane64, _mm512_set1_epi64(i + 8 * half));
      _mm512_mask_storeu_epi64(ids + n, head, _mm512_maskz_compress_epi64(k, id64));
      _mm512_mask_storeu_pd(rel + n, head, _mm512_maskz_compress_pd(k, r[half]));
      acc = _mm512_mask_add_pd(acc, k, acc, r[half]);
      n += count;
    }
  }
  *kept = n;
  *total = _mm512_reduce_add_pd(acc);
  return bad == 0;
}

bool min_p_scalar(const float* x, int64_t V, float m, double min_p, int64_t* ids, double* rel, int64_t* kept,
                  double* total) {
  int64_t n = 0;
  double sum = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (!(x[i] <= m)) return false;
    const double r = rel_of(x[i], m);
    if (!(r >= min_p)) continue;
    ids[n] = i;
    rel[n++] = r;
    sum += r;
  }
  *kept = n;
  *total = sum;
  return true;
}

// x [V] float32, one row (temperature applied); row_max its maximum; log_mass the log of its
// softmax normaliser relative to row_max (read only when top_p < 1); top_k (the kernel runs only
// with it off: >= V), top_p (1: off), min_p (0: off). Returns the kept ids ascending [m] int64 and
// their renormalised probabilities [m] float64; two empty tensors where
// it declines the row (a NaN in it, a logit above row_max, a non-finite max or normaliser, top_k
// on): the caller's torch path decides those. simd = false takes the plain path (tests).
std::tuple<at::Tensor, at::Tensor> deep_cut(const at::Tensor& x, double row_max, double log_mass, int64_t top_k,
                                            double top_p, double min_p, bool simd) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous(),
              "deep_cut: x must be a contiguous float32 CPU tensor [V]");
  const int64_t V = x.size(0);
  TORCH_CHECK(V > 0 && V < INT32_MAX, "deep_cut: row length out of range");
  const auto out = [&](int64_t n) {
    return std::make_tuple(at::empty({n}, x.options().dtype(at::kLong)),
                           at::empty({n}, x.options().dtype(at::kDouble)));
  };
  const float m = static_cast<float>(row_max);
  const bool with_mass = top_p < 1.0;
  if (!std::isfinite(m) || top_k < V || !(min_p <= 1.0) || (with_mass && !std::isfinite(log_mass))) return out(0);
  static const bool avx512 = cpu_supported();
  simd = simd && avx512;
  const float* xp = x.data_ptr<float>();
  // V-long buffers kept by the thread between calls: fresh ones cost a page fault every 4 KB
  thread_local std::vector<double> rel_buf;
  thread_local std::vector<int64_t> id_buf;
  if (static_cast<int64_t>(rel_buf.size()) < V) rel_buf.resize(V);
  double* rel = rel_buf.data();

  if (!with_mass) {  // min_p alone: its edge is the cut
    if (static_cast<int64_t>(id_buf.size()) < V) id_buf.resize(V);
    int64_t n = 0;
    double total = 0.0;
    if (!(simd ? min_p_avx512(xp, V, m, min_p, id_buf.data(), rel, &n, &total)
               : min_p_scalar(xp, V, m, min_p, id_buf.data(), rel, &n, &total)))
      return out(0);
    auto [ids, probs] = out(n);
    std::copy(id_buf.data(), id_buf.data() + n, ids.data_ptr<int64_t>());
    double* pp = probs.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) pp[i] = rel[i] / total;  // division, as the torch path's rel / rel.sum()
    return {ids, probs};
  }

  std::vector<double> mass(kBuckets, 0.0);
  if (!(simd ? mass_avx512(xp, V, m, rel, mass.data()) : mass_scalar(xp, V, m, rel, mass.data()))) return out(0);
  const double scale = std::exp(-log_mass);  // p = rel * scale
  // min_p's edge as a distance below the max: a bucket wholly above it (with a margin far wider
  // than the float32 rounding of max - x) keeps every token on min_p's account
  const double edge = min_p > 0.0 ? -std::log(min_p) : std::numeric_limits<double>::infinity();
  float cx = -std::numeric_limits<float>::infinity();  // the last kept token: every one until a cut is found
  int64_t cid = V;
  int64_t kept = V;
  double above = 0.0;  // the rel of every token ranked before the bucket walked
  bool any = false;    // a token ranked before it (rank 0 always stays)
  std::vector<Token> tokens;
  for (int32_t b = 0; b < kBuckets; ++b) {
    if (b < kBuckets - 1 && mass[b] == 0.0) continue;  // empty: a token less than 64 below the max has rel > 0
    const double lower_edge = static_cast<double>(b + 1) / kBucketsPerLogit;  // max - x < this in bucket b
    const bool may_cut = b == kBuckets - 1 ||
                         (min_p > 0.0 && lower_edge * (1 + 1e-6) > edge - 1e-9 * (1 + edge)) ||
                         (above + mass[b]) * scale >= top_p * (1 - 1e-9);
    if (!may_cut) {
      above += mass[b];
      any = true;
      continue;
    }
    tokens.clear();
    const int64_t before = simd ? gather_avx512(xp, V, m, b, rel, tokens) : gather_scalar(xp, V, m, b, rel, tokens);
    std::sort(tokens.begin(), tokens.end(),
              [](const Token& a, const Token& c) { return a.x > c.x || (a.x == c.x && a.id < c.id); });
    double within = 0.0;
    size_t i = 0;
    for (; i < tokens.size(); ++i) {
      const bool drop = (min_p > 0.0 && tokens[i].rel < min_p) || (above + within) * scale >= top_p;
      if (drop && (any || i > 0)) break;  // tokens[i] is the first token dropped
      within += tokens[i].rel;
    }
    above += within;
    any = any || !tokens.empty();
    if (i < tokens.size() || b == kBuckets - 1) {
      kept = before + static_cast<int64_t>(i);
      if (i < tokens.size()) {
        cx = i ? tokens[i - 1].x : tokens[0].x;  // i = 0: the earlier buckets, every logit above tokens[0]'s
        cid = i ? tokens[i - 1].id : -1;
      }
      break;
    }
  }
  auto [ids, probs] = out(kept);
  int64_t* ip = ids.data_ptr<int64_t>();
  double* pp = probs.data_ptr<double>();
  const int64_t n = simd ? keep_avx512(xp, V, cx, cid, above, rel, ip, pp, kept)
                         : keep_scalar(xp, V, cx, cid, above, rel, ip, pp, kept);
  TORCH_CHECK(n == kept, "deep_cut: kept ", n, " tokens where the walk counted ", kept);
  return {ids, probs};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FreeToken's whole-row sampler passes (see sampling.cpp)";
  m.def("row_stats_", &row_stats_, "temperature in place, row maxima, log normalisers and block maxima",
        py::arg("x"), py::arg("temps"), py::arg("mass"), py::arg("block"));
  m.def("exp_block_sums_", &exp_block_sums_, "x = exp(x - row_max) in place, and each block's sum",
        py::arg("x"), py::arg("row_max"), py::arg("block"));
  m.def("deep_cut", &deep_cut, "the kept ids (ascending) and probabilities of a row whose cut lies past its topk",
        py::arg("x"), py::arg("row_max"), py::arg("log_mass"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("simd") = true);
}
