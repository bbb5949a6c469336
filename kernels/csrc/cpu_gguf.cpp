// Matmuls by a GGUF file's own blocks (Q4_0, Q4_1, Q8_0), kept as the file stores them, on any
// x86 CPU with AVX2: `engine/models/quantized_linear.py` `BlockWeight` calls them.
//
// As llama.cpp does, the activations are quantized too, each row in blocks of 32 to int8 with a
// float scale (dx = max|x| / 127; sx = dx * the block's code sum), so that a block's product is
// one integer dot product of 32 bytes by 32 bytes:
//
//   Q8_0   w = d * q (q int8)            sum_i w_i x_i = d * dx * sum_i q_i c_i
//   Q4_1   w = d * q + m (q 0..15)       sum_i w_i x_i = d * dx * sum_i q_i c_i + m * sx
//   Q4_0   w = d * (q - 8)               Q4_1 with m = -8 d
//
// (c the activation's codes). The integer dot is `vpdpbusd` where the CPU has AVX-VNNI or
// AVX512-VNNI, else `vpmaddubsw` + `vpmaddwd` (unsigned by signed bytes: Q8_0's signs move onto
// the activations). Blocks are GGUF's: a float16 d, Q4_1's float16 m, then the codes (Q4: 16
// bytes, low nibbles values 0..15, high nibbles 16..31; Q8_0: 32 int8).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_BLOCK_DOT 1
#endif

#include "cpu_math.h"

namespace {

constexpr int64_t kBlock = 32;
// GGML's type ids (gguf.GGMLQuantizationType), as the Python side passes them.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

constexpr int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return 0;
  }
}

#if defined(PAGEDSERVE_BLOCK_DOT)
constexpr bool kHasBlockDot = true;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// 32 activations (float32 or bfloat16) as 4 vectors of 8 floats.
inline void load32(const float* x, __m256 v[4]) {
  for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j);
}
inline void load32(const c10::BFloat16* x, __m256 v[4]) {
  for (int j = 0; j < 4; ++j) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * j));
    v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

// One row of K activations into int8 blocks: codes round(x / dx) with dx = max|x| / 127, and
// sx = dx * sum(codes) (what a Q4 block's offset multiplies).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    load32(x + b * kBlock, v);
    __m256 amax = _mm256_andnot_ps(sign, v[0]);
    for (int j = 1; j < 4; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float max_abs = _mm_cvtss_f32(m);
    const float dx = max_abs / 127.0f;
    const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtps_epi32(  // rounds to nearest (even), MXCSR's default
          _mm256_round_ps(_mm256_mul_ps(v[j], inverse), _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC));
    // The code sum, then 32 int32 -> 32 int8 in order (packs interleave the 128-bit lanes).
    const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                           _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    const __m256i w16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i w16b = _mm256_packs_epi32(q[2], q[3]);
    __m256i w8 = _mm256_packs_epi16(w16a, w16b);
    w8 = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kBlock), w8);
    d[b] = dx;
    s[b] = dx * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

// 8 int32 sums of 4 (unsigned byte x signed byte) products each.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A Q4 block's 32 codes in value order (low nibbles, then high ones), one byte each.
inline __m256i q4_codes(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// The activations after quantization: codes [M, K], and per block each row's (dx, sx) pair,
// block by block ([K / 32, M, 2]): a tile's rows have theirs side by side.
struct QuantizedActivations {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  int64_t m, k;

  template <typename T>
  QuantizedActivations(const T* x, int64_t rows, int64_t cols)
      : codes(rows * cols), scales(cols / kBlock * rows * 2), m(rows), k(cols) {
    const int64_t nblocks = k / kBlock;
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> d(nblocks), s(nblocks);
      for (int64_t i = begin; i < end; ++i) {
        quantize_row(x + i * k, k, codes.data() + i * k, d.data(), s.data());
        for (int64_t b = 0; b < nblocks; ++b) {
          scales[(b * m + i) * 2] = d[b];
          scales[(b * m + i) * 2 + 1] = s[b];
        }
      }
    });
  }
};

// How far ahead of the block it reads each weight row's stream is fetched: one stream per tile
// row outruns the hardware prefetcher (measured: BENCHMARKS.md).
constexpr int kPrefetchBytes = 512;

// RW weight rows (`rows[r]`) by RX activation rows (from row `first`): out[r * RX + j] = the
// dot product of weight row r and activation row j. Each block's weight codes are expanded once
// for the RX rows, each activation block loaded once for the RW rows. A block's two factors come
// as one pair: (d, m) * (dx, sx) = (d dx, m sx), the first the integer sum's scale, the second
// the offset's share, summed lane-wise (Q8_0: no offset).
template <int64_t QType, int RW, int RX>
void dot_tile(const uint8_t* const* rows, const QuantizedActivations& x, int64_t first,
              float* out) {
  const int64_t nblocks = x.k / kBlock;
  __m256 acc[RW][RX];
  __m128 offset[RW][RX];
  for (int r = 0; r < RW; ++r)
    for (int j = 0; j < RX; ++j) {
      acc[r][j] = _mm256_setzero_ps();
      offset[r][j] = _mm_setzero_ps();
    }
  // Q4_0's (d, m) from d alone: (d, -8 d).
  const __m128 q4_0_pair = _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f);
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256i c[RX];
    for (int j = 0; j < RX; ++j)
      c[j] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.codes.data() + (first + j) * x.k + b * kBlock));
    const float* xs = x.scales.data() + (b * x.m + first) * 2;
    for (int r = 0; r < RW; ++r) {
      const uint8_t* block = rows[r] + b * block_bytes(QType);
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T0);
      if constexpr (QType == kQ8_0) {
        const float d = half_to_float(block);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int j = 0; j < RX; ++j) {
          const __m256i sums = dot_u8s8(magnitude, _mm256_sign_epi8(c[j], w));
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * xs[2 * j]),
                                      acc[r][j]);
        }
      } else {
        int32_t halves;  // Q4_1: d and m, two float16; Q4_0: d, then the codes
        std::memcpy(&halves, block, 4);
        __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
        if constexpr (QType == kQ4_0)
          pair = _mm_mul_ps(_mm_broadcastss_ps(pair), q4_0_pair);
        const __m256i codes = q4_codes(block + (QType == kQ4_1 ? 4 : 2));
        for (int j = 0; j < RX; ++j) {
          const __m256i sums = dot_u8s8(codes, c[j]);
          const __m128 factors = _mm_mul_ps(
              pair, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xs + 2 * j))));
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcastss_ps(factors),
                                      acc[r][j]);
          offset[r][j] = _mm_add_ps(offset[r][j], factors);
        }
      }
    }
  }
  for (int r = 0; r < RW; ++r)
    for (int j = 0; j < RX; ++j) {
      const float off = QType == kQ8_0 ? 0.0f : _mm_cvtss_f32(_mm_movehdup_ps(offset[r][j]));
      out[r * RX + j] = hsum(acc[r][j]) + off;
    }
}

// Tiles: 4 weight rows by up to 4 activation rows (16 accumulators: AVX2's 16 vector
// registers hold them with the codes in flight only at RX <= 2 for RW = 4; measured either way
// in BENCHMARKS.md, "Quantized weights on every x86 CPU").
constexpr int kTileRows = 4;  // weight rows per tile
constexpr int kTileCols = 4;  // activation rows per tile

template <int64_t QType, int RW>
void dot_tile_cols(int cols, const uint8_t* const* rows, const QuantizedActivations& x,
                   int64_t first, float* out) {
  switch (cols) {
    case 4: return dot_tile<QType, RW, 4>(rows, x, first, out);
    case 3: return dot_tile<QType, RW, 3>(rows, x, first, out);
    case 2: return dot_tile<QType, RW, 2>(rows, x, first, out);
    default: return dot_tile<QType, RW, 1>(rows, x, first, out);
  }
}

template <int64_t QType>
void dot_tile_any(int nrows, int cols, const uint8_t* const* rows, const QuantizedActivations& x,
                  int64_t first, float* out) {
  switch (nrows) {
    case 4: return dot_tile_cols<QType, 4>(cols, rows, x, first, out);
    case 3: return dot_tile_cols<QType, 3>(cols, rows, x, first, out);
    case 2: return dot_tile_cols<QType, 2>(cols, rows, x, first, out);
    default: return dot_tile_cols<QType, 1>(cols, rows, x, first, out);
  }
}

template <int64_t QType, typename T>
void block_linear(const T* x, int64_t m, int64_t k, const uint8_t* weight, int64_t n, T* out) {
  const int64_t row_bytes = k / kBlock * block_bytes(QType);
  const QuantizedActivations xq(x, m, k);
  // Threads split the weight rows (each reads only its own); every activation row is
  // multiplied by a tile of weight rows while they are in the core's caches.
  const int64_t groups = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kTileRows;
      const int count = static_cast<int>(std::min<int64_t>(kTileRows, n - first));
      const uint8_t* rows[kTileRows];
      for (int r = 0; r < count; ++r) rows[r] = weight + (first + r) * row_bytes;
      float sums[kTileRows * kTileCols];
      for (int64_t i = 0; i < m; i += kTileCols) {
        const int cols = static_cast<int>(std::min<int64_t>(kTileCols, m - i));
        dot_tile_any<QType>(count, cols, rows, xq, i, sums);
        for (int r = 0; r < count; ++r)
          for (int j = 0; j < cols; ++j)
            out[(i + j) * n + first + r] = pagedserve_cpu::store<T>(sums[r * cols + j]);
      }
    }
  });
}
#else
constexpr bool kHasBlockDot = false;
#endif

// The instructions the block dot products run on in this build (the start-up log says it).
std::string block_dot_isa() {
#if !defined(PAGEDSERVE_BLOCK_DOT)
  return "";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "AVX512-VNNI vpdpbusd";
#elif defined(__AVXVNNI__)
  return "AVX-VNNI vpdpbusd";
#else
  return "AVX2 vpmaddubsw";
#endif
}

#if defined(PAGEDSERVE_BLOCK_DOT)
// 8 floats stored as float32, or as bfloat16 rounded to nearest even (finite values).
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(c10::BFloat16* o, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), halves);
}

// One block's 32 values: d * code + m (Q4), d * code (Q8_0, m = 0).
template <typename T>
inline void dequantize_block(const uint8_t* block, int64_t qtype, T* o) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  __m256i codes;
  __m256 m = _mm256_setzero_ps();
  if (qtype == kQ8_0) {
    codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    codes = q4_codes(block + (qtype == kQ4_1 ? 4 : 2));
    m = qtype == kQ4_1 ? _mm256_set1_ps(half_to_float(block + 2))
                       : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  }
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  for (int h = 0; h < 2; ++h) {
    for (int q = 0; q < 2; ++q) {
      const __m128i eight = q == 0 ? halves[h] : _mm_srli_si128(halves[h], 8);
      const __m256i wide =
          qtype == kQ8_0 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
      store8(o + 16 * h + 8 * q, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(wide), m));
    }
  }
}

// Rows of GGUF blocks as values: a kept embedding's lookups, and steps of many rows, where a
// dense GEMM beats the block dot products.
template <typename T>
void dequantize_rows(const uint8_t* weight, int64_t n, int64_t k, int64_t qtype, T* out) {
  const int64_t nblocks = k / kBlock, bytes = block_bytes(qtype);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t* block = weight + (row * nblocks + b) * bytes;
        T* o = out + row * k + b * kBlock;
        dequantize_block(block, qtype, o);
      }
    }
  });
}
#endif

// The checks both ops share: weight holds [N, K] values in `qtype`'s blocks; returns (N, K).
std::pair<int64_t, int64_t> check_blocks(const at::Tensor& weight, int64_t qtype) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(bytes > 0, "GGUF block weights are Q4_0 (2), Q4_1 (3) or Q8_0 (8), got type ",
              qtype);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) % bytes == 0,
              "weight must be contiguous uint8 [N, K / 32 * ", bytes, "] (GGUF blocks)");
  return {weight.size(0), weight.size(1) / bytes * kBlock};
}

void gguf_block_dequantize(const at::Tensor& weight, int64_t qtype, at::Tensor& out) {
  TORCH_CHECK(kHasBlockDot, "this build has no GGUF block kernels (they need AVX2, F16C and FMA)");
  const auto [n, k] = check_blocks(weight, qtype);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == k && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be contiguous float32 or bfloat16 [", n, ", ", k, "]");
#if defined(PAGEDSERVE_BLOCK_DOT)
  const auto* w = weight.data_ptr<uint8_t>();
  if (out.scalar_type() == at::kFloat)
    dequantize_rows(w, n, k, qtype, out.data_ptr<float>());
  else
    dequantize_rows(w, n, k, qtype, out.data_ptr<at::BFloat16>());
#endif
}

void gguf_block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                       at::Tensor& out) {
  TORCH_CHECK(kHasBlockDot, "this build has no GGUF block kernels (they need AVX2, F16C and FMA)");
  const auto [n, k] = check_blocks(weight, qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [rows, ", k, "]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
                  out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "out must be contiguous [", x.size(0), ", ", n, "] of x's dtype");
#if defined(PAGEDSERVE_BLOCK_DOT)
  const auto* w = weight.data_ptr<uint8_t>();
  const int64_t m = x.size(0);
  auto run = [&](auto* xs, auto* os) {
    switch (qtype) {
      case kQ4_0: return block_linear<kQ4_0>(xs, m, k, w, n, os);
      case kQ4_1: return block_linear<kQ4_1>(xs, m, k, w, n, os);
      default: return block_linear<kQ8_0>(xs, m, k, w, n, os);
    }
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>(), out.data_ptr<float>());
  else
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("block_dot_isa() -> str");
  m.def("gguf_block_linear(Tensor x, Tensor weight, int qtype, Tensor(a!) out) -> ()");
  m.def("gguf_block_dequantize(Tensor weight, int qtype, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("gguf_block_linear", &gguf_block_linear);
  m.impl("gguf_block_dequantize", &gguf_block_dequantize);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CatchAll, m) {
  m.impl("block_dot_isa", &block_dot_isa);
}
