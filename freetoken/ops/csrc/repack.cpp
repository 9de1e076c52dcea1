// The sbmm kernel's rows made and read natively, at load (freetoken.ops._repack_cpu).
//
// Owns two conversions of the layout superblock.py's docstring and csrc/qlinear.cpp define:
// - into it: a matrix's rows of GGUF super-blocks (uint8 [N, K / 256 * block bytes], as the file
//   holds them; a fused projection's parts read where they lie) -> (values, meta) uint8 rows,
//   byte for byte what superblock.pack_values makes of requant.to_superblocks' integers. No float math, no per-weight intermediates: each 32-weight
//   group's bytes are moved once.
// - out of it: (values, meta) rows -> float32 or bfloat16 weights [R, K], bit for bit what
//   quantized.dequantize gives (float32 products d * sc and dmin * m, then q * scale + minimum,
//   one rounding to bfloat16, nearest-even): the prefill copies and embedding rows.
// - Q8_0 rows -> the group-32 kernel's bits-8 rows and scales (layout.py's `_pack`), the one
//   group-32 file type moved natively (the others are decoded and packed by torch, ops/qlinear.py).
// Rows are split over OpenMP threads. It does not run the matmul (qlinear.cpp) and knows no other
// GGUF type. Tests hold each equal to the torch paths.
//
// The layout, for a chunk of 512 weights (16 groups of 32; a row is padded with zero groups to
// whole chunks, and a last half chunk keeps only the first 32 bytes of each 64-byte vector):
//   q4_k values: vector u (0..3), byte 4 l + b = q(l, 8u + b) | q(l, 8u + 4 + b) << 4
//   q6_k values: the same over the low nibbles of u = q + 32, then two vectors of high bit
//                pairs: vector h, byte 4 l + b, bits 2k..2k+1 = bits 4-5 of u(l, 16h + 4k + b)
//   meta (40 bytes): q4_k sc[16] | m[16] | d, d | dmin, dmin; q6_k scales of each group's first
//                16 weights [16] | of its last 16 [16] | d, d | 4 zero bytes.

#include "extension.h"  // ATen and pybind11 (not the whole of <torch/extension.h>)

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kSuper = 256;  // weights per GGUF super-block
constexpr int64_t kChunk = 512;  // weights per kernel chunk: two super-blocks
constexpr int64_t kMeta = 40;    // meta bytes per chunk
constexpr int64_t kQ4Block = 144, kQ6Block = 210;  // GGUF block bytes

// The 6-bit scale and minimum of sub-block j (0..7) of a Q4_K block's 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// A new tensor for a conversion's output in its own anonymous map, asked for transparent huge
// pages (madvise: the kernel's default mode is "madvise"): its first touch, which the conversion
// pays, faults 2 MB at a time instead of 4 KB (for the 1.1B's 725 MB of rows, ~180,000 faults
// fewer), and the kernel that later streams these weights misses the TLB less. Unmapped when
// the tensor's storage is freed. at::empty where the map cannot be had.
at::Tensor fresh(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t bytes = c10::elementSize(dtype);
  for (const int64_t n : sizes) bytes *= n;
  if (bytes < (int64_t(1) << 21)) return at::empty(sizes, dtype);
  void* p = mmap(nullptr, size_t(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return at::empty(sizes, dtype);
  madvise(p, size_t(bytes), MADV_HUGEPAGE);  // advice: a kernel without THP ignores it
  return at::from_blob(p, sizes, [bytes](void* q) { munmap(q, size_t(bytes)); }, at::TensorOptions().dtype(dtype));
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}
inline void store32(uint8_t* p, uint32_t w) { std::memcpy(p, &w, 4); }
constexpr uint32_t kLow4 = 0x0F0F0F0Fu, kLow2 = 0x03030303u;

// The four value-vector words of one 32-weight group l (bytes 4 l .. 4 l + 3 of vectors 0-3, stride
// apart) from its weights' low nibbles g[i] = (src[i] >> shift) & 15: byte b of word u is
// g[8 u + b] | g[8 u + 4 + b] << 4. Four bytes a step as one 32-bit word (little-endian: masking
// with 0x0F per byte after the shift keeps each byte's own nibble).
inline void put_nibbles(const uint8_t* src, int shift, int l, int64_t stride, uint8_t* values) {
  for (int u = 0; u < 4; ++u) {
    const uint32_t lo = (load32(src + 8 * u) >> shift) & kLow4;
    const uint32_t hi = (load32(src + 8 * u + 4) >> shift) & kLow4;
    store32(values + u * stride + 4 * l, lo | (hi << 4));
  }
}

// One row of Q4_K blocks -> its values and meta.
void q4_k_row(const uint8_t* raw, int64_t k, uint8_t* values, uint8_t* meta) {
  const int64_t blocks = k / kSuper;
  for (int64_t s_all = 0; s_all < blocks; ++s_all) {
    const int64_t c = s_all / 2, s = s_all % 2;
    const bool half = (c == blocks / 2);  // the last chunk holds one super-block
    const int64_t stride = half ? 32 : 64;
    const uint8_t* block = raw + s_all * kQ4Block;
    uint8_t* vb = values + c * 256;
    uint8_t* mb = meta + c * kMeta;
    std::memcpy(mb + 32 + 2 * s, block, 2);      // d
    std::memcpy(mb + 36 + 2 * s, block + 2, 2);  // dmin
    const uint8_t* qs = block + 16;
    for (int j = 0; j < 8; ++j) {
      const int l = 8 * s + j;
      scale_min_k4(j, block + 4, mb + l, mb + 16 + l);
      put_nibbles(qs + 32 * (j / 2), (j & 1) ? 4 : 0, l, stride, vb);  // group j: low or high nibbles
    }
  }
}

// One row of Q6_K blocks -> its values and meta.
void q6_k_row(const uint8_t* raw, int64_t k, uint8_t* values, uint8_t* meta) {
  const int64_t blocks = k / kSuper;
  alignas(64) uint8_t u[kSuper];
  for (int64_t s_all = 0; s_all < blocks; ++s_all) {
    const int64_t c = s_all / 2, s = s_all % 2;
    const bool half = (c == blocks / 2);
    const int64_t stride = half ? 32 : 64;
    const uint8_t* block = raw + s_all * kQ6Block;
    uint8_t* vb = values + c * 384;  // only the last chunk is ever half: every chunk starts here
    uint8_t* mb = meta + c * kMeta;
    // u = q + 32 of the block's 256 weights, in order (ggml's dequantize_row_q6_K), four at a time:
    // weight l of each quarter takes a nibble of ql and a bit pair of qh.
    for (int h2 = 0; h2 < 2; ++h2) {
      const uint8_t* ql = block + 64 * h2;
      const uint8_t* qh = block + 128 + 32 * h2;
      uint8_t* y = u + 128 * h2;
      for (int l = 0; l < 32; l += 4) {
        const uint32_t a = load32(ql + l), b = load32(ql + l + 32), h = load32(qh + l);
        store32(y + l, (a & kLow4) | ((h & kLow2) << 4));
        store32(y + l + 32, (b & kLow4) | (((h >> 2) & kLow2) << 4));
        store32(y + l + 64, ((a >> 4) & kLow4) | (((h >> 4) & kLow2) << 4));
        store32(y + l + 96, ((b >> 4) & kLow4) | (((h >> 6) & kLow2) << 4));
      }
    }
    const uint8_t* scales = block + 192;  // int8, one per 16 weights
    for (int j = 0; j < 8; ++j) {
      const int l = 8 * s + j;
      mb[l] = scales[2 * j];
      mb[16 + l] = scales[2 * j + 1];
      const uint8_t* g = u + 32 * j;
      put_nibbles(g, 0, l, stride, vb);
      // high pairs: byte b of vector h's word holds bits 4-5 of g[16 h + 4 kk + b] at bits 2 kk
      for (int h = 0; h < 2; ++h) {
        uint32_t word = 0;
        for (int kk = 0; kk < 4; ++kk) word |= ((load32(g + 16 * h + 4 * kk) >> 4) & kLow2) << (2 * kk);
        store32(vb + 4 * stride + h * stride + 4 * l, word);
      }
    }
    std::memcpy(mb + 32 + 2 * s, block + 208, 2);  // d
  }
}

// (values, meta) of the [N, K] matrix whose GGUF blocks are the row blocks `parts` stacked (each
// uint8 [rows, K / 256 * block bytes]: a fused projection's parts are read where they lie, not
// concatenated first). kind: 4 (Q4_K) or 6 (Q6_K).
std::tuple<at::Tensor, at::Tensor> repack_superblocks(const std::vector<at::Tensor>& parts, int64_t kind,
                                                            int64_t k) {
  TORCH_CHECK(kind == 4 || kind == 6, "repack_superblocks: kind must be 4 or 6, got ", kind);
  TORCH_CHECK(k > 0 && k % kSuper == 0, "repack_superblocks: K must be a positive multiple of 256, got ", k);
  const int64_t block_bytes = kind == 4 ? kQ4Block : kQ6Block;
  const int64_t row_bytes = k / kSuper * block_bytes;
  std::vector<const uint8_t*> rows;
  for (const auto& raw : parts) {
    TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.device().is_cpu(),
                "repack_superblocks: each part must be contiguous uint8 [rows, bytes] on the CPU");
    TORCH_CHECK(raw.size(1) == row_bytes, "repack_superblocks: ", raw.size(1), " bytes per row, expected ", row_bytes,
                " for K ", k);
    const uint8_t* base = raw.data_ptr<uint8_t>();
    for (int64_t r = 0; r < raw.size(0); ++r) rows.push_back(base + r * row_bytes);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int64_t chunk_bytes = kind == 4 ? 256 : 384;
  const int64_t row_values = chunks * chunk_bytes - (k % kChunk ? chunk_bytes / 2 : 0);
  // Not zero-filled up front (a single-threaded memset of a GB, and every page faulted twice): the
  // row functions write every byte of values; each row's meta is cleared first (the unused bytes).
  auto values = fresh({n, row_values}, at::kByte);
  auto meta = at::empty({n, chunks * kMeta}, at::kByte);
  uint8_t* vp = values.data_ptr<uint8_t>();
  uint8_t* mp = meta.data_ptr<uint8_t>();
  {
    pybind11::gil_scoped_release no_gil;
  // dynamic: a core shared with another process (the API process, a client) does not hold up the other
#pragma omp parallel for schedule(dynamic, 16)
    for (int64_t r = 0; r < n; ++r) {
      std::memset(mp + r * chunks * kMeta, 0, chunks * kMeta);
      if (kind == 4)
        q4_k_row(rows[r], k, vp + r * row_values, mp + r * chunks * kMeta);
      else
        q6_k_row(rows[r], k, vp + r * row_values, mp + r * chunks * kMeta);
    }
  }
  return {values, meta};
}

// Round float32 to bfloat16 bits, nearest-even (NaN kept a quiet NaN), as torch does.
// Branch-free, so that a row's loop vectorizes.
inline uint16_t to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t nan = (x >> 16) | 0x40u, rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float from_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// The weights of one packed row (K of them) as float32 into out.
void dequantize_row(const uint8_t* values, const uint8_t* meta, int64_t kind, int64_t k, float* out) {
  const int64_t blocks = k / kSuper;
  const int64_t chunk_bytes = kind == 4 ? 256 : 384;
  for (int64_t s_all = 0; s_all < blocks; ++s_all) {
    const int64_t c = s_all / 2, s = s_all % 2;
    const int64_t stride = (c == blocks / 2) ? 32 : 64;
    const uint8_t* vb = values + c * chunk_bytes;
    const uint8_t* mb = meta + c * kMeta;
    const float d = from_f16(mb + 32 + 2 * s);
    const float dmin = kind == 4 ? from_f16(mb + 36 + 2 * s) : 0.0f;
    for (int j = 0; j < 8; ++j) {
      const int l = 8 * s + j;
      float* y = out + s_all * kSuper + 32 * j;
      alignas(16) uint8_t q[32];
      for (int u = 0; u < 4; ++u) {  // the inverse of put_nibbles
        const uint32_t word = load32(vb + u * stride + 4 * l);
        store32(q + 8 * u, word & kLow4);
        store32(q + 8 * u + 4, (word >> 4) & kLow4);
      }
      if (kind == 4) {
        const float scale = d * static_cast<float>(mb[l]);
        const float minimum = -(dmin * static_cast<float>(mb[16 + l]));
        for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(q[i]) * scale + minimum;
      } else {
        for (int h = 0; h < 2; ++h) {
          const uint32_t word = load32(vb + 4 * stride + h * stride + 4 * l);
          for (int kk = 0; kk < 4; ++kk) {
            uint8_t* p = q + 16 * h + 4 * kk;
            store32(p, load32(p) | (((word >> (2 * kk)) & kLow2) << 4));
          }
        }
        const float first = d * static_cast<float>(static_cast<int8_t>(mb[l]));
        const float last = d * static_cast<float>(static_cast<int8_t>(mb[16 + l]));
        for (int i = 0; i < 16; ++i) y[i] = static_cast<float>(static_cast<int>(q[i]) - 32) * first;
        for (int i = 16; i < 32; ++i) y[i] = static_cast<float>(static_cast<int>(q[i]) - 32) * last;
      }
    }
  }
}

// Rows of a packed weight (values [R, row bytes], meta [R, chunks * 40]) dequantized to float32
// or bfloat16 [R, K].
at::Tensor dequantize_superblocks(const at::Tensor& values, const at::Tensor& meta, int64_t kind, int64_t k,
                                     bool bf16) {
  TORCH_CHECK(kind == 4 || kind == 6, "dequantize_superblocks: kind must be 4 or 6, got ", kind);
  TORCH_CHECK(k > 0 && k % kSuper == 0, "dequantize_superblocks: K must be a positive multiple of 256, got ", k);
  TORCH_CHECK(values.scalar_type() == at::kByte && meta.scalar_type() == at::kByte && values.dim() == 2 &&
                  meta.dim() == 2 && values.is_contiguous() && meta.is_contiguous() && values.device().is_cpu() &&
                  meta.device().is_cpu() && values.size(0) == meta.size(0),
              "dequantize_superblocks: values and meta must be contiguous uint8 [R, bytes] on the CPU");
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int64_t chunk_bytes = kind == 4 ? 256 : 384;
  const int64_t row_values = chunks * chunk_bytes - (k % kChunk ? chunk_bytes / 2 : 0);
  TORCH_CHECK(values.size(1) == row_values && meta.size(1) == chunks * kMeta, "dequantize_superblocks: rows of ",
              values.size(1), " / ", meta.size(1), " bytes, expected ", row_values, " / ", chunks * kMeta, " for K ", k);
  const int64_t r = values.size(0);
  auto out = fresh({r, k}, bf16 ? at::kBFloat16 : at::kFloat);
  const uint8_t* vp = values.data_ptr<uint8_t>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  {
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel
    {
      std::vector<float> row(bf16 ? k : 0);
#pragma omp for schedule(dynamic, 16)
      for (int64_t i = 0; i < r; ++i) {
        float* y = bf16 ? row.data() : static_cast<float*>(op) + i * k;
        dequantize_row(vp + i * row_values, mp + i * chunks * kMeta, kind, k, y);
        if (bf16) {
          uint16_t* dst = static_cast<uint16_t*>(op) + i * k;
          for (int64_t j = 0; j < k; ++j) dst[j] = to_bf16(y[j]);
        }
      }
    }
  }
  return out;
}

constexpr int64_t kGroup = 32, kQ8Block = 34;  // Q8_0: d f16 | qs int8[32]
constexpr int64_t kReadPad = 64;                // bytes the group-32 kernel may read past the last row (layout.READ_PAD)

// One row of Q8_0 blocks -> the group-32 kernel's bits-8 row (layout._pack: q + 128, each chunk of
// nb <= 16 groups vector-major: byte 4 nb v + 4 l + b = weight 4 v + b of group l) and its float16
// scales; lo / hi widen to the row's smallest and largest integer (q + 128).
void q8_0_row(const uint8_t* raw, int64_t k, uint8_t* out, uint8_t* scale, uint8_t& lo, uint8_t& hi) {
  const int64_t groups = k / kGroup;
  for (int64_t c = 0; c < groups; c += 16) {
    const int64_t nb = groups - c < 16 ? groups - c : 16;
    uint8_t* chunk = out + c * kGroup;
    for (int64_t l = 0; l < nb; ++l) {
      const uint8_t* block = raw + (c + l) * kQ8Block;
      std::memcpy(scale + 2 * (c + l), block, 2);
      for (int v = 0; v < 8; ++v) {
        const uint32_t word = load32(block + 2 + 4 * v) ^ 0x80808080u;
        store32(chunk + 4 * nb * v + 4 * l, word);
      }
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    lo = out[j] < lo ? out[j] : lo;
    hi = out[j] > hi ? out[j] : hi;
  }
}

// The group-32 kernel's bits-8 form of the [N, K] Q8_0 matrix whose blocks are the row blocks
// `parts` stacked (each uint8 [rows, K / 32 * 34], read where they lie): (packed uint8 [N, K] with
// kReadPad zero bytes after it in its storage, scale float16 [N, K / 32], whether every integer
// lies in [-16, 15] — the caller packs such a matrix as 5 bits instead). Byte for byte what
// PackedWeight makes of requant.to_quantized's integers.
std::tuple<at::Tensor, at::Tensor, bool> repack_q8_0(const std::vector<at::Tensor>& parts, int64_t k) {
  TORCH_CHECK(k > 0 && k % kGroup == 0, "repack_q8_0: K must be a positive multiple of 32, got ", k);
  const int64_t row_bytes = k / kGroup * kQ8Block;
  std::vector<const uint8_t*> rows;
  for (const auto& raw : parts) {
    TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.device().is_cpu(),
                "repack_q8_0: each part must be contiguous uint8 [rows, bytes] on the CPU");
    TORCH_CHECK(raw.size(1) == row_bytes, "repack_q8_0: ", raw.size(1), " bytes per row, expected ", row_bytes,
                " for K ", k);
    const uint8_t* base = raw.data_ptr<uint8_t>();
    for (int64_t r = 0; r < raw.size(0); ++r) rows.push_back(base + r * row_bytes);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  auto flat = fresh({n * k + kReadPad}, at::kByte);
  auto scale = at::empty({n, k / kGroup}, at::kHalf);
  uint8_t* op = flat.data_ptr<uint8_t>();
  uint8_t* sp = reinterpret_cast<uint8_t*>(scale.data_ptr<at::Half>());
  std::memset(op + n * k, 0, kReadPad);
  uint8_t lo = 255, hi = 0;
  {
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel
    {
      uint8_t my_lo = 255, my_hi = 0;
#pragma omp for schedule(dynamic, 16)
      for (int64_t r = 0; r < n; ++r) q8_0_row(rows[r], k, op + r * k, sp + r * (k / kGroup) * 2, my_lo, my_hi);
#pragma omp critical
      {
        lo = my_lo < lo ? my_lo : lo;
        hi = my_hi > hi ? my_hi : hi;
      }
    }
  }
  const bool fits5 = n > 0 && lo >= 128 - 16 && hi <= 128 + 15;
  return {flat.narrow(0, 0, n * k).view({n, k}), scale, fits5};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack_superblocks", &repack_superblocks,
        "GGUF Q4_K / Q6_K row blocks [rows, bytes], stacked -> the sbmm kernel's (values, meta) rows", py::arg("parts"),
        py::arg("kind"), py::arg("k"));
  m.def("repack_q8_0", &repack_q8_0,
        "GGUF Q8_0 row blocks [rows, bytes], stacked -> the group-32 kernel's bits-8 rows, float16 scales, and "
        "whether the integers fit 5 bits",
        py::arg("parts"), py::arg("k"));
  m.def("dequantize_superblocks", &dequantize_superblocks,
        "the sbmm kernel's (values, meta) rows -> float32 or bfloat16 weights [R, K]", py::arg("values"),
        py::arg("meta"), py::arg("kind"), py::arg("k"), py::arg("bf16"));
}
