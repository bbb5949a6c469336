// Matmuls by weights kept quantized, for steps of many rows: `engine/quantized_linear.py` uses
// torch's CPU int4/int8 kernels for steps of few rows (they unpack the weight again for every few
// rows, which is cheap next to reading it) and these for more rows (BENCHMARKS.md, "Quantized
// weights on CPU").
//
// int4 weights are in torch's CPU int4 pack (`_convert_weight_to_int4pack_for_cpu`), so one copy
// serves both kernels. For N a multiple of 64: output features in blocks of 64; a block holds,
// for each input k, 32 bytes whose low nibbles are features 0..31 of the block and whose high
// nibbles are features 32..63. A weight is (code - 8) * scale + zero, with scale and zero per
// (group of `group` inputs, feature), stored as bfloat16 pairs [K / group, N, 2]: read as one
// little-endian uint32, a pair holds the scale's bits in its low half and the zero's in its high
// half. int8 weights are [N, K] codes with a bfloat16 scale per feature (torch's int8 layout).

// The Tensor class alone, not <ATen/ATen.h> (every op's declaration): each source then compiles
// in about two thirds of the time, which a user waits through on first start.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_math.h"

namespace {

using pagedserve_cpu::bf16_bits;
using pagedserve_cpu::bits_to_float;

// ---- x @ W^T with W kept quantized, for steps of many rows (AVX512-BF16 CPUs) ----------------
//
// Per block of 64 output features, the weight is dequantized once into a bfloat16 tile laid out
// for `vdpbf16ps` (for each pair of inputs (2p, 2p+1), 64 lanes each holding W[n, 2p] and
// W[n, 2p+1]), which stays in the core's caches while every row of x is multiplied by it: rows
// in tiles of kRows, each row's pair of inputs broadcast against the block's 4 vectors of 16
// features, accumulated in float32 over all of K. The int4 tile holds (code - 8) * scale + zero
// rounded to bfloat16, as torch's int4 kernel computes it; the int8 tile holds the codes
// themselves (exact in bfloat16), and each feature's scale multiplies its float32 sum.

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Gemm = true;
constexpr int kRows = 6;  // 6 rows x 4 vectors = 24 accumulators + 4 tile vectors + 1 broadcast

// 16 codes (bytes at `bytes`, nibble `shift`) of one input, dequantized to float32.
inline __m512 dequantize16(const uint8_t* bytes, int shift, __m512 scale, __m512 zero) {
  const __m512i codes = _mm512_and_si512(
      _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)bytes)), shift),
      _mm512_set1_epi32(15));
  const __m512 centred = _mm512_sub_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(8.f));
  return _mm512_fmadd_ps(centred, scale, zero);
}

void int4_tile(const uint8_t* packed, const uint32_t* scale_zeros, int64_t n, int64_t k,
               int64_t group, int64_t block, uint32_t* tile) {
  // cvtne2ps_pbh(b, a) puts a's 16 values in the low half and b's in the high half; this index
  // interleaves them into the (input 2p, input 2p + 1) pairs of each feature.
  alignas(64) static const uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const uint8_t* base = packed + block * k * 32;
  for (int64_t g = 0; g < k / group; ++g) {
    const uint32_t* sz = scale_zeros + g * n + block * 64;
    __m512 scale[4], zero[4];  // features 0-15, 16-31 (low nibbles), 32-47, 48-63 (high)
    for (int v = 0; v < 4; ++v) {
      const __m512i pairs = _mm512_loadu_si512(sz + 16 * v);
      scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      zero[v] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xffff0000)));
    }
    for (int64_t kk = g * group; kk < (g + 1) * group; kk += 2) {
      const uint8_t* b0 = base + kk * 32;
      const uint8_t* b1 = b0 + 32;
      uint32_t* row = tile + (kk / 2) * 64;
      for (int v = 0; v < 4; ++v) {
        const int offset = 16 * (v & 1), shift = v < 2 ? 0 : 4;
        const __m512 w0 = dequantize16(b0 + offset, shift, scale[v], zero[v]);
        const __m512 w1 = dequantize16(b1 + offset, shift, scale[v], zero[v]);
        const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
        _mm512_storeu_si512(row + 16 * v, _mm512_permutexvar_epi16(interleave, halves));
      }
    }
  }
}

// r[j] lane p -> r[p] lane j, for 16 vectors of 16 32-bit lanes.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// The int8 codes are rows of inputs; the tile wants, per input pair, 64 features side by side.
// 16 features x 32 inputs at a time: each feature's 32 codes become 16 (input 2p, 2p + 1)
// bfloat16 pairs in one vector, and a 16 x 16 transpose turns those into 16 pairs' vectors of 16
// features.
void int8_tile(const int8_t* codes, int64_t k, int64_t block, uint32_t* tile) {
  for (int f = 0; f < 64; f += 16) {
    const int8_t* rows = codes + (block * 64 + f) * k;
    for (int64_t kk = 0; kk < k; kk += 32) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int8_t* src = rows + j * k + kk;
        const __m128i first = _mm_loadu_si128((const __m128i*)src);
        const __m128i second = _mm_loadu_si128((const __m128i*)(src + 16));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second));
        r[j] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // inputs kk..kk+31 in order: 16 pairs
      }
      transpose16x16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + (kk / 2 + p) * 64 + f, r[p]);
    }
  }
}

template <int R>
void rows_times_tile(const uint16_t* x, int64_t k, const uint32_t* tile, float* acc) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const uint32_t* t = tile + p * 64;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(t + 16);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(t + 32);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(t + 48);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c[r][0] = _mm512_dpbf16_ps(c[r][0], a, w0);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], a, w1);
      c[r][2] = _mm512_dpbf16_ps(c[r][2], a, w2);
      c[r][3] = _mm512_dpbf16_ps(c[r][3], a, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc + r * 64 + v * 16, c[r][v]);
}

void rows_times_tile_any(int rows, const uint16_t* x, int64_t k, const uint32_t* tile,
                         float* acc) {
  switch (rows) {
    case 6: return rows_times_tile<6>(x, k, tile, acc);
    case 5: return rows_times_tile<5>(x, k, tile, acc);
    case 4: return rows_times_tile<4>(x, k, tile, acc);
    case 3: return rows_times_tile<3>(x, k, tile, acc);
    case 2: return rows_times_tile<2>(x, k, tile, acc);
    default: return rows_times_tile<1>(x, k, tile, acc);
  }
}

// `make_tile(block, tile)` dequantizes a block; `scale(n)` is a feature's factor on its sum.
template <typename MakeTile, typename Scale>
void quantized_gemm(const uint16_t* x, int64_t m, int64_t n, int64_t k, uint16_t* out,
                    MakeTile make_tile, Scale scale) {
  // torch's thread count (as the attention kernel takes it), not OpenMP's default in this thread.
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n / 64));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<uint32_t> tile(k / 2 * 64);
    float acc[kRows * 64];
#pragma omp for schedule(dynamic, 1)
    for (int64_t block = 0; block < n / 64; ++block) {
      make_tile(block, tile.data());
      float factor[64];
      for (int j = 0; j < 64; ++j) factor[j] = scale(block * 64 + j);
      for (int64_t row = 0; row < m; row += kRows) {
        const int rows = int(std::min<int64_t>(kRows, m - row));
        rows_times_tile_any(rows, x + row * k, k, tile.data(), acc);
        for (int r = 0; r < rows; ++r) {
          uint16_t* o = out + (row + r) * n + block * 64;
#pragma omp simd
          for (int j = 0; j < 64; ++j) o[j] = bf16_bits(acc[r * 64 + j] * factor[j]);
        }
      }
    }
  }
}
#else
constexpr bool kHasBf16Gemm = false;
#endif

void check_gemm_args(const at::Tensor& x, const at::Tensor& out, int64_t n, int64_t k) {
  TORCH_CHECK(kHasBf16Gemm, "this build has no bfloat16 GEMM (the CPU lacks AVX512-BF16)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
                  x.size(1) == k,
              "x must be contiguous bfloat16 [rows, ", k, "]");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == n,
              "out must be contiguous bfloat16 [", x.size(0), ", ", n, "]");
}

bool quantized_gemm_available() { return kHasBf16Gemm; }

void int4pack_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros,
                     int64_t group, at::Tensor& out) {
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.dim() == 3 &&
                  scale_zeros.is_contiguous() && packed.is_contiguous(),
              "scale_zeros must be contiguous bfloat16 [K / group, N, 2]");
  const int64_t n = scale_zeros.size(1), k = scale_zeros.size(0) * group;
  TORCH_CHECK(n % 64 == 0 && group % 2 == 0 && packed.numel() * 2 == n * k,
              "packed does not hold a [", n, ", ", k, "] int4 weight with N a multiple of 64");
  check_gemm_args(x, out, n, k);
#if defined(__AVX512BF16__)
  const auto* p = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint32_t*>(scale_zeros.data_ptr<at::BFloat16>());
  quantized_gemm(
      reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.size(0), n, k,
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
      [&](int64_t block, uint32_t* tile) { int4_tile(p, sz, n, k, group, block, tile); },
      [](int64_t) { return 1.f; });
#endif
}

void int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                 at::Tensor& out) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n % 64 == 0 && k % 32 == 0,
              "int8 GEMM needs N a multiple of 64 and K a multiple of 32, got [", n, ", ", k, "]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == n &&
                  scales.is_contiguous(),
              "scales must be contiguous bfloat16 [N]");
  check_gemm_args(x, out, n, k);
#if defined(__AVX512BF16__)
  const auto* c = codes.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  quantized_gemm(
      reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.size(0), n, k,
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
      [&](int64_t block, uint32_t* tile) { int8_tile(c, k, block, tile); },
      [&](int64_t feature) { return bits_to_float(uint32_t(s[feature]) << 16); });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quantized_gemm_available() -> bool");
  m.def(
      "int4pack_linear(Tensor x, Tensor packed, Tensor scale_zeros, int group, Tensor(a!) out) "
      "-> ()");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("int4pack_linear", &int4pack_linear);
  m.impl("int8_linear", &int8_linear);
}

// No tensor arguments: registered for every dispatch key.
TORCH_LIBRARY_IMPL(pagedserve_cpu, CatchAll, m) {
  m.impl("quantized_gemm_available", &quantized_gemm_available);
}
