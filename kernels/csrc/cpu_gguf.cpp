// Matmuls by a GGUF file's own blocks, kept as the file stores them, on any x86 CPU with AVX2:
// `engine/models/quantized_linear.py` `BlockWeight` calls them. The types: Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0 (blocks of 32 values) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256: 8 sub-blocks
// of 32 with 6-bit scales and mins; Q6_K 16 of 16 with int8 scales), what llama.cpp's Q4_K_M and
// Q5_K_M files hold (with Q5_0 / Q8_0 where a row is not a multiple of 256).
//
// The activations are quantized too, each row in blocks of 32, so that a block's product is integer
// dot products of 32 bytes by 32 bytes (c the activation's codes, q the weight's). Unlike
// llama.cpp's int8 codes (dx = max|x| / 127), each value is a 15-bit code c = round(x / dx) with dx
// = max|x| / 32512, held as two int8 codes c = 255 h + l (|h|, |l| <= 127), and a block's sum is
// 255 * sum q h + sum q l: exact in int32, so a row's result is the same whatever rows share the
// step and however they are tiled. int8 codes cost 1.5 points of top-1 agreement with the model's
// float32 values on SmolLM2 (docs/benchmarks-history.md, "One request, one answer"); 15 bits are as
// close as bfloat16 activations multiplied by the dequantized weights. sx = dx * sum(c) is what a
// Q4 block's offset multiplies:
//
//   Q8_0   w = d * q (q int8)              sum_i w_i x_i = d * dx * sum_i q_i c_i
//   Q4_1   w = d * q + m (q 0..15)         sum_i w_i x_i = d * dx * sum_i q_i c_i + m * sx
//   Q4_0   w = d * (q - 8)                 Q4_1 with m = -8 d
//   Q5_1   Q4_1 with q 0..31 (a fifth bit per value from a 32-bit mask); Q5_0: m = -16 d
//   Q4_K   sub-block j: Q4_1 with d = d * sc_j and m = -dmin * m_j; Q5_K: Q5_1's likewise
//   Q6_K   w = d * sc_h * (q - 32), q 0..63, sc_h per half block of 16 values: the integer sums
//          of each half are kept apart (lanes 0-3 and 4-7 of the dot's 8) and scaled by their own
//          sc_h; the -32 comes off as 32 * sum c, one dot per activation block for all rows
//
// The integer dot is `vpdpbusd` where the CPU has AVX-VNNI or AVX512-VNNI, else `vpmaddubsw` +
// `vpmaddwd` (unsigned by signed bytes: Q8_0's signs move onto the activations). Blocks are
// GGUF's (ggml-common.h): a float16 d, Q4_1's float16 m, then the codes (Q4: 16 bytes, low
// nibbles values 0..15, high nibbles 16..31; Q8_0: 32 int8).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_BLOCK_DOT 1
#endif

#include "cpu_kernels.h"
#include "cpu_math.h"

namespace {

constexpr int64_t kBlock = 32;
// GGML's type ids (gguf.GGMLQuantizationType), as the Python side passes them.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
                  kQ6_K = 14;

// A file block's bytes (a K-quant's super-block of 256 values).
constexpr int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// A Q4_0, Q4_1, Q5_0 or Q8_0 weight whose rows come interleaved by groups of 8
// (`QuantizedRows.interleave` on the Python side, which passes its type id plus kRows8). Per group
// and block of 32 values: the 8 rows' float16 d (Q4_1: then their 8 m; Q5_0: then 32 bytes of fifth
// bits, byte 4 r + p holding in bit g row r's of value 4 g + p), then runs of 32 bytes, run g
// holding each row's code bytes 4 g .. 4 g + 3 in row order (4 runs of Q4 nibbles, 8 of Q8_0 codes
// stored plus 128, as unsigned bytes). Q4_K per group and super-block of 256 values: the 8 rows'
// float16 d, their float16 dmin, per block j of 32 the 8 rows' 6-bit scales sc_j and mins m_j as
// bytes, then per block Q4_0's 4 runs (value i's nibble low, i + 16's high): 1184 bytes against the
// file's 1152. Q6_K per group and super-block: the 8 rows' float16 d, per block j the rows' int8
// scales of its two half blocks (8 + 8), then per block 4 runs of the codes' low 4 bits as Q4_0's
// and 64 bytes of their top 2 bits, byte 4 r + p holding in bits 2 g, 2 g + 1 row r's of value 4 g
// + p (values 0-15, then 16-31): the file's 210 bytes a row. One 256-bit load is then 4 codes of 8
// rows (and, in a Q4 block's high nibbles, 4 more), so that vpdpbusd sums the 8 rows at once, each
// in its own lane, and a block's 8 scales are one conversion: about a third of the instructions per
// (row, block) of the file's layout (rows8_linear; docs/benchmarks-history.md, "Rows interleaved by
// 8"). Same size as the file's blocks.
constexpr int64_t kRows8 = 1000, kGroupRows = 8;
constexpr bool is_rows8(int64_t qtype) {
  return qtype == kQ4_0 + kRows8 || qtype == kQ4_1 + kRows8 || qtype == kQ5_0 + kRows8 ||
         qtype == kQ8_0 + kRows8 || qtype == kQ4_K + kRows8 || qtype == kQ6_K + kRows8;
}
constexpr int64_t kQ6KHead = 16 + 8 * 16;  // d, each block's two scales per row
constexpr int64_t kQ4KHead = 32 + 8 * 16;             // d, dmin, each block's sc and m bytes
constexpr int64_t kQ4KGroupBytes = kQ4KHead + 8 * 128;  // and the 8 blocks' runs
// A group's bytes per file block (a K-quant's super-block).
constexpr int64_t group_block_bytes(int64_t qtype) {
  return qtype == kQ4_K ? kQ4KGroupBytes : kGroupRows * block_bytes(qtype);
}
// Runs of 32 code bytes per group and block.
constexpr int kRuns(int64_t qtype) { return qtype == kQ8_0 ? 8 : 4; }
// The bytes before a group's block's runs: d, Q4_1's m, Q5_0's fifth bits.
constexpr int64_t kHead(int64_t qtype) {
  return qtype == kQ4_1 ? 32 : qtype == kQ5_0 ? 48 : 16;
}
// A block's m per unit of d where the type has no m of its own: Q4_0's -8, Q5_0's -16, and
// -128 for Q8_0's codes stored plus 128 where they are taken so (`unsigned_q8`).
constexpr float kOffset(int64_t qtype, bool unsigned_q8) {
  return qtype == kQ4_0 ? -8.0f : qtype == kQ5_0 ? -16.0f : unsigned_q8 ? -128.0f : 0.0f;
}

constexpr bool is_k_quant(int64_t qtype) {
  return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K;
}
// Blocks of 32 per file block: a K-quant's super-block holds 8.
constexpr int64_t sub_blocks(int64_t qtype) { return is_k_quant(qtype) ? 8 : 1; }

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

// The largest 15-bit code: 127 * 255 + 127, so that both halves of c = 255 h + l fit in int8
// within -127..127 (Q8_0's sign trick on AVX2 negates them).
constexpr float kCodeMax = 32512.0f;

// One row of K activations into blocks of 15-bit codes c = round(x / dx), dx = max|x| / kCodeMax,
// stored as two int8 codes per value: h = round(c / 255) in `high`, l = c - 255 h in `low`;
// sx = dx * sum(c) (what a Q4 block's offset multiplies), and the sums of c over each half block
// of 16 (what Q6_K's -32 multiplies, in `halves`).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* high, int8_t* low, float* d, float* s,
                  int32_t* halves) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 base = _mm256_set1_ps(255.0f), inverse_base = _mm256_set1_ps(1.0f / 255.0f);
  constexpr int kRound = _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC;
  // 8 int32 -> 8 int8 per vector, 32 in value order (packs interleave the 128-bit lanes).
  const auto pack = [](const __m256i* q, int8_t* out) {
    const __m256i w8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                          _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  };
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    load32(x + b * kBlock, v);
    __m256 amax = _mm256_andnot_ps(sign, v[0]);
    for (int j = 1; j < 4; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float max_abs = _mm_cvtss_f32(m);
    const float dx = max_abs / kCodeMax;
    const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? kCodeMax / max_abs : 0.0f);
    __m256i h[4], l[4], sum32 = _mm256_setzero_si256();
    const auto total = [](__m256i v) {
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      t = _mm_hadd_epi32(t, t);
      return _mm_cvtsi128_si32(_mm_hadd_epi32(t, t));
    };
    for (int j = 0; j < 4; ++j) {
      // Whole numbers in float32, exactly: c, then h (c / 255 is at least 1/510 from a tie, far
      // beyond the product's rounding) and l = c - 255 h.
      const __m256 c = _mm256_round_ps(_mm256_mul_ps(v[j], inverse), kRound);
      const __m256 hf = _mm256_round_ps(_mm256_mul_ps(c, inverse_base), kRound);
      h[j] = _mm256_cvtps_epi32(hf);
      l[j] = _mm256_cvtps_epi32(_mm256_fnmadd_ps(hf, base, c));
      sum32 = _mm256_add_epi32(sum32, _mm256_cvtps_epi32(c));
      if (j == 1) halves[2 * b] = total(sum32);
    }
    const int32_t sum = total(sum32);
    halves[2 * b + 1] = sum - halves[2 * b];
    pack(h, high + b * kBlock);
    pack(l, low + b * kBlock);
    d[b] = dx;
    s[b] = dx * static_cast<float>(sum);
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

// acc + dot_u8s8(u, s), in one instruction with VNNI.
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

// A block's integer sum from the dot products of its two code halves: 255 h + l.
inline __m256i combine(__m256i high, __m256i low) {
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(high, 8), high), low);
}

// dot_u8s8 of u by the activation codes c = 255 h + l.
inline __m256i dot2(__m256i u, __m256i h, __m256i l) {
  return combine(dot_u8s8(u, h), dot_u8s8(u, l));
}

// A Q4 block's 32 codes in value order (low nibbles, then high ones), one byte each.
inline __m256i q4_codes(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// A 32-bit mask as 32 bytes, byte i 16 where bit i is set (Q5's fifth bits), else 0.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t mask;
  std::memcpy(&mask, qh, 4);
  // Byte i takes the mask's byte i / 8, then keeps bit i % 8 of it.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(mask)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// The 32 codes of block `b` of a row, one byte each in value order: unsigned (0..15, 0..31, 0..63)
// but Q8_0's, signed. Q4_K's sub-block j is the low (even j) or high (odd j) nibbles of 32 bytes;
// Q5_K's adds a fifth bit; Q6_K's sub-block s = 4 n + t takes 4 bits of ql[64 n + 32 (t & 1) ...]
// (low nibbles for t < 2) and bits 2 t, 2 t + 1 of qh[128 + 32 n ...] (ggml's
// dequantize_row_q6_K).
template <int64_t QType>
inline __m256i block_codes(const uint8_t* row, int64_t b) {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (QType == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 34 + 2));
  } else if constexpr (QType == kQ4_0 || QType == kQ4_1) {
    return q4_codes(row + b * block_bytes(QType) + (QType == kQ4_1 ? 4 : 2));
  } else if constexpr (QType == kQ5_0 || QType == kQ5_1) {
    const uint8_t* block = row + b * block_bytes(QType) + (QType == kQ5_1 ? 4 : 2);
    return _mm256_or_si256(q4_codes(block + 4), fifth_bits(block));
  } else if constexpr (QType == kQ4_K || QType == kQ5_K) {
    const int64_t s = b % 8;
    const uint8_t* block = row + b / 8 * block_bytes(QType);
    const __m256i bytes = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + (QType == kQ5_K ? 48 : 16) + 32 * (s / 2)));
    const __m256i codes = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
    if constexpr (QType == kQ4_K) return codes;
    // Q5_K: value i's fifth bit is bit s of qh[i] (32 bytes after the scales).
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
    return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  } else {  // Q6_K
    const int64_t s = b % 8, n = s / 4, t = s % 4;
    const uint8_t* block = row + b / 8 * 210;
    const __m256i ql = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + 64 * n + 32 * (t & 1)));
    const __m256i qh =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * n));
    const __m256i low = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    const __m256i high = _mm256_and_si256(
        _mm256_slli_epi16(_mm256_srli_epi16(qh, static_cast<int>(2 * t)), 4),
        _mm256_set1_epi8(0x30));
    return _mm256_or_si256(low, high);
  }
}

// A block-of-32 type's (d, m): w = d * code + m.
template <int64_t QType>
inline __m128 block_pair(const uint8_t* block) {
  int32_t halves;  // Q4_1, Q5_1: d and m, two float16; Q4_0, Q5_0: d, then other bytes
  std::memcpy(&halves, block, 4);
  const __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
  if constexpr (QType == kQ4_0 || QType == kQ5_0) {
    const float offset = QType == kQ4_0 ? -8.0f : -16.0f;
    return _mm_mul_ps(_mm_broadcastss_ps(pair), _mm_setr_ps(1.0f, offset, 0.0f, 0.0f));
  }
  return pair;
}

// A K-quant super-block's scales, per block of 32: Q4_K's and Q5_K's (d sc_j, -dmin m_j) pairs in
// `pairs[2 j]`, `pairs[2 j + 1]`; Q6_K's d sc_h per half block of 16 in `pairs[0..15]`.
template <int64_t QType>
inline void super_block_scales(const uint8_t* block, float* pairs) {
  if constexpr (QType == kQ4_K || QType == kQ5_K) {
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    const uint8_t* q = block + 4;  // 12 bytes: 6-bit scales and mins (ggml's get_scale_min_k4)
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      pairs[2 * j] = d * static_cast<float>(sc);
      pairs[2 * j + 1] = -dmin * static_cast<float>(m);
    }
  } else {
    const float d = half_to_float(block + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (int h = 0; h < 16; ++h) pairs[h] = d * static_cast<float>(sc[h]);
  }
}

// The activations after quantization: codes [M, K] as their high and low halves (`codes`, `low`),
// per block each row's (dx, sx) pair, block by block ([K / 32, M, 2]): a tile's rows have theirs
// side by side; and likewise the integer sums of each half block's codes (`halves`). Each row is
// quantized alone: its codes are the same in a step of any rows.
struct QuantizedActivations {
  // Left uninitialized: every byte is written, and zeroing them is a pass over memory per call.
  std::unique_ptr<int8_t[]> codes, low;
  std::vector<float> scales;
  std::vector<int32_t> halves;
  int64_t m, k;

  template <typename T>
  QuantizedActivations(const T* x, int64_t rows, int64_t cols)
      : codes(new int8_t[rows * cols]), low(new int8_t[rows * cols]),
        scales(cols / kBlock * rows * 2), halves(cols / kBlock * rows * 2), m(rows), k(cols) {
    const int64_t nblocks = k / kBlock;
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> d(nblocks), s(nblocks);
      std::vector<int32_t> h(2 * nblocks);
      for (int64_t i = begin; i < end; ++i) {
        quantize_row(x + i * k, k, codes.get() + i * k, low.get() + i * k, d.data(), s.data(),
                     h.data());
        for (int64_t b = 0; b < nblocks; ++b) {
          scales[(b * m + i) * 2] = d[b];
          scales[(b * m + i) * 2 + 1] = s[b];
          halves[(b * m + i) * 2] = h[2 * b];
          halves[(b * m + i) * 2 + 1] = h[2 * b + 1];
        }
      }
    });
  }

  // Row i's codes of block b as 8 runs of 4 (what a broadcast takes), high and low halves.
  void quads(int64_t i, int64_t b, int32_t* high, int32_t* low_half) const {
    std::memcpy(high, codes.get() + i * k + b * kBlock, 32);
    std::memcpy(low_half, low.get() + i * k + b * kBlock, 32);
  }
};

// How far ahead of the block it reads each weight row's stream is fetched: one stream per tile row
// outruns the hardware prefetcher, and a step of few rows is bound by how many bytes are in flight
// from memory (about bandwidth x latency: 4 KiB on the dev VMs). 4 KiB made a decode step of one
// stream, lm_head included, 1.6x faster than 512 bytes did (docs/benchmarks-history.md, "The decode
// step as one call").
constexpr int kPrefetchBytes = 4096;

// Q4_0 and Q4_1 where the integer dot is vpdpbusd: its sums of 4 products do not saturate, so a
// block's high nibbles can be multiplied where they are (16 x the value) instead of shifted down
// and moved into place. Fewer instructions per block: the decode GEMV is bound by them, not by
// memory (as fast with the weights in L2 as from L3: docs/benchmarks-history.md, "Fewer
// instructions per Q4 block").
template <int64_t QType>
constexpr bool kNibbleDot = (QType == kQ4_0 || QType == kQ4_1) &&
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
                            true;
#else
                            false;
#endif
template <int64_t QType>
constexpr int64_t kNibbles = QType == kQ4_1 ? 4 : 2;  // where a block's codes start

// RW weight rows (`rows[r]`) by RX activation rows (from row `first`): out[r * RX + j] = the
// dot product of weight row r and activation row j. Each block's weight codes are expanded once
// for the RX rows, each activation block loaded once for the RW rows. A block's two factors come
// as one pair: (d, m) * (dx, sx) = (d dx, m sx), the first the integer sum's scale, the second
// the offset's share, summed lane-wise (Q8_0, Q6_K: no offset). K-quants decode each row's
// super-block scales once for its 8 blocks.
template <int64_t QType, int RW, int RX>
void dot_tile(const uint8_t* const* rows, const QuantizedActivations& x, int64_t first,
              float* out) {
  constexpr int64_t kSub = sub_blocks(QType);
  const int64_t nblocks = x.k / kBlock;
  __m256 acc[RW][RX];
  __m128 offset[RW][RX];
  for (int r = 0; r < RW; ++r)
    for (int j = 0; j < RX; ++j) {
      acc[r][j] = _mm256_setzero_ps();
      offset[r][j] = _mm_setzero_ps();
    }
  float scales[RW][16];  // K-quants: the super-block's (see super_block_scales)
  [[maybe_unused]] const __m256i nibble_masks =
      _mm256_setr_epi64x(0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL,
                         static_cast<long long>(0xf0f0f0f0f0f0f0f0ULL),
                         static_cast<long long>(0xf0f0f0f0f0f0f0f0ULL));
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t s = b % kSub;
    if constexpr (is_k_quant(QType)) {
      if (s == 0) {
        for (int r = 0; r < RW; ++r) {
          const uint8_t* block = rows[r] + b / kSub * block_bytes(QType);
          for (int line = 0; line < 4; ++line)  // a super-block spans up to 4 cache lines
            _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + 64 * line),
                         _MM_HINT_T0);
          super_block_scales<QType>(block, scales[r]);
        }
      }
    }
    __m256i c[RX], l[RX];  // each activation row's high and low codes
    for (int j = 0; j < RX; ++j) {
      const int64_t at = (first + j) * x.k + b * kBlock;
      c[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes.get() + at));
      l[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.low.get() + at));
    }
    const float* xs = x.scales.data() + (b * x.m + first) * 2;
    [[maybe_unused]] __m128 q4_scales[RX];  // kNibbleDot: (dx, sx), Q4_0's (dx, -8 sx)
    if constexpr (kNibbleDot<QType>)
      for (int j = 0; j < RX; ++j)
        q4_scales[j] = _mm_mul_ps(
            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xs + 2 * j))),
            _mm_setr_ps(1.0f, QType == kQ4_0 ? -8.0f : 1.0f, 0.0f, 0.0f));
    [[maybe_unused]] __m256i bias[RX];  // Q6_K: 32 * sum c per half block, lanes 0-3 and 4-7
    if constexpr (QType == kQ6_K)
      for (int j = 0; j < RX; ++j) bias[j] = dot2(_mm256_set1_epi8(32), c[j], l[j]);
    for (int r = 0; r < RW; ++r) {
      if constexpr (!is_k_quant(QType))
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + b * block_bytes(QType) +
                                                   kPrefetchBytes),
                     _MM_HINT_T0);
      if constexpr (kNibbleDot<QType>) {
        // The block's 16 bytes in both halves, masked to the low nibbles (values 0-15) and to the
        // high ones in place (16 x values 16-31: that half of acc adds 16 times its share, taken
        // off at the end); d and m (Q4_0: d and 2 bytes of codes) converted from memory.
        const uint8_t* block = rows[r] + b * block_bytes(QType);
        const __m256i codes = _mm256_and_si256(
            _mm256_broadcastsi128_si256(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbles<QType>))),
            nibble_masks);
        __m128 pair = _mm_cvtph_ps(_mm_loadu_si64(block));
        if constexpr (QType == kQ4_0) pair = _mm_moveldup_ps(pair);  // (d, d): m = -8 d
        for (int j = 0; j < RX; ++j) {
          const __m256i sums = dot2(codes, c[j], l[j]);
          const __m128 factors = _mm_mul_ps(pair, q4_scales[j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcastss_ps(factors),
                                      acc[r][j]);
          offset[r][j] = _mm_add_ps(offset[r][j], factors);
        }
        continue;
      }
      const __m256i codes = block_codes<QType>(rows[r], b);
      if constexpr (QType == kQ8_0) {
        const float d = half_to_float(rows[r] + b * 34);
        const __m256i magnitude = _mm256_sign_epi8(codes, codes);
        for (int j = 0; j < RX; ++j) {
          const __m256i sums = dot2(magnitude, _mm256_sign_epi8(c[j], codes),
                                    _mm256_sign_epi8(l[j], codes));
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * xs[2 * j]),
                                      acc[r][j]);
        }
      } else if constexpr (QType == kQ6_K) {
        const __m256 halves = _mm256_set_m128(_mm_set1_ps(scales[r][2 * s + 1]),
                                              _mm_set1_ps(scales[r][2 * s]));
        for (int j = 0; j < RX; ++j) {
          const __m256i sums = _mm256_sub_epi32(dot2(codes, c[j], l[j]), bias[j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                      _mm256_mul_ps(halves, _mm256_set1_ps(xs[2 * j])), acc[r][j]);
        }
      } else {
        __m128 pair;
        if constexpr (is_k_quant(QType))
          pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales[r] + 2 * s)));
        else
          pair = block_pair<QType>(rows[r] + b * block_bytes(QType));
        for (int j = 0; j < RX; ++j) {
          const __m256i sums = dot2(codes, c[j], l[j]);
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
      const float off = QType == kQ8_0 || QType == kQ6_K
                            ? 0.0f
                            : _mm_cvtss_f32(_mm_movehdup_ps(offset[r][j]));
      if constexpr (kNibbleDot<QType>)
        acc[r][j] = _mm256_mul_ps(acc[r][j], _mm256_setr_ps(1.0f, 1.0f, 1.0f, 1.0f, 0.0625f,
                                                           0.0625f, 0.0625f, 0.0625f));
      out[r * RX + j] = hsum(acc[r][j]) + off;
    }
}

// Tiles: 4 weight rows by up to 4 activation rows (16 accumulators: AVX2's 16 vector
// registers hold them with the codes in flight only at RX <= 2 for RW = 4; measured either way
// in docs/benchmarks-history.md, "Quantized weights on every x86 CPU").
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

// Whether the integer dot takes Q8_0's codes plus 128 as they are stored (vpdpbusd's sums do
// not saturate); vpmaddubsw's pairwise sums would, so AVX2 builds take the signed codes back.
constexpr bool kUnsignedQ8 =
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    true;
#else
    false;
#endif

// Q5_0's fifth bits of run g of an interleaved block (`bits`, its 32 bytes of them: bit g of
// each byte) as 16 or 0 in each byte, to add to the run's nibbles. Bit g moves to bit 4 within its
// byte (a 16-bit lane's shift carries no other byte's bit into bit 4 of either byte).
inline __m256i fifth_of_run(__m256i bits, int g) {
  const __m256i moved = g <= 4 ? _mm256_slli_epi16(bits, 4 - g) : _mm256_srli_epi16(bits, g - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i fifth_of_run(__m512i bits, int g) {
  const __m512i moved = g <= 4 ? _mm512_slli_epi16(bits, 4 - g) : _mm512_srli_epi16(bits, g - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(16));
}
#endif

// Where block b's runs of code bytes start in a group of interleaved rows.
template <int64_t QType>
inline const uint8_t* group_runs(const uint8_t* group, int64_t b) {
  if constexpr (QType == kQ4_K) return group + b / 8 * kQ4KGroupBytes + kQ4KHead + b % 8 * 128;
  if constexpr (QType == kQ6_K) return group + b / 8 * 1680 + kQ6KHead + b % 8 * 192;
  return group + b * group_block_bytes(QType) + kHead(QType);
}

// The cache lines of block b of a group (and, at a super-block's first, its scales): into L1, or
// `Far` into L2. A step of few rows reads each weight once, at memory's pace: fetched into L1 a
// pair ahead, its lines held L1's few miss buffers (a thread pulled 12 GB/s); into L2 two pairs
// ahead, 20 (docs/benchmarks-history.md, "One request, one answer", second sitting). A step of more
// rows multiplies a pair's blocks by tile after tile of them, from L1.
template <int64_t QType, bool Far>
inline void prefetch_group_block(const uint8_t* group, int64_t b) {
  const auto fetch = [](const uint8_t* p) {
    if constexpr (Far)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
    else
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  };
  const uint8_t* runs = group_runs<QType>(group, b);
  const uint8_t* start = runs - kHead(QType);
  int64_t bytes = group_block_bytes(QType);
  if constexpr (is_k_quant(QType)) start = runs, bytes = QType == kQ6_K ? 192 : 128;
  for (int64_t line = 0; line < bytes; line += 64) fetch(start + line);
  if constexpr (is_k_quant(QType)) {
    constexpr int64_t kSuper = group_block_bytes(QType);
    constexpr int64_t kHeader = QType == kQ6_K ? kQ6KHead : kQ4KHead;
    if (b % 8 == 0)
      for (int64_t line = 0; line < kHeader; line += 64)
        fetch(group + b / 8 * kSuper + line);
  }
}

// The 8 rows' d and m of block b of a group: w = d * code + m. Q4_K's are d sc_j and -dmin m_j,
// exact in float32 as super_block_scales makes them. Q6_K's, w = d sc (code - 32) per half block:
// d sc of the first half in `d`, of the second in `m` (exact too). `Unsigned` (VNNI): Q8_0's
// codes are taken as stored, plus 128.
template <int64_t QType, bool Unsigned = kUnsignedQ8>
inline void group_scales(const uint8_t* group, int64_t b, __m256& d, __m256& m) {
  const auto halves = [](const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  if constexpr (QType == kQ6_K) {
    const uint8_t* super = group + b / 8 * 1680;
    const uint8_t* bytes = super + 16 + b % 8 * 16;  // 8 first halves' scales, then 8 seconds'
    const auto ints = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(p))));
    };
    d = _mm256_mul_ps(halves(super), ints(bytes));
    m = _mm256_mul_ps(halves(super), ints(bytes + 8));
  } else if constexpr (QType == kQ4_K) {
    const uint8_t* super = group + b / 8 * kQ4KGroupBytes;
    const uint8_t* bytes = super + 32 + b % 8 * 16;  // 8 sc_j, then 8 m_j
    const auto ints = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(p))));
    };
    d = _mm256_mul_ps(halves(super), ints(bytes));
    m = _mm256_mul_ps(_mm256_xor_ps(halves(super + 16), _mm256_set1_ps(-0.0f)), ints(bytes + 8));
  } else {
    d = halves(group + b * group_block_bytes(QType));
    m = QType == kQ4_1 ? halves(group + b * group_block_bytes(QType) + 16)
                       : _mm256_mul_ps(d, _mm256_set1_ps(kOffset(QType, Unsigned)));
  }
}

// Q6_K's top 2 bits of run g % 4 of a half block (`bits`: bits 2 g, 2 g + 1 of each byte) as
// bits 4 and 5 of each byte, to add to the run's low 4 bits (the same shift as fifth_of_run's).
inline __m256i top_of_run(__m256i bits, int g) {
  const __m256i moved = g <= 2 ? _mm256_slli_epi16(bits, 4 - 2 * g)
                               : _mm256_srli_epi16(bits, 2 * g - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i top_of_run(__m512i bits, int g) {
  const __m512i moved = g <= 2 ? _mm512_slli_epi16(bits, 4 - 2 * g)
                               : _mm512_srli_epi16(bits, 2 * g - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
}
#endif

// NG groups of 8 interleaved rows (`groups`, group_bytes apart) by RX activation rows (from row
// `first`): sums[j * NG * 8 + row] for activation row j. Per block, each activation row's 32
// codes are 8 broadcasts of 4, each group's codes 4 loads (Q8_0: 8); the offset is a
// multiply-add of the 8 rows' m: Q4_1's m sx, Q4_0's -8 d sx, Q8_0's -128 d sx (its codes are
// stored plus 128).
template <int64_t QType, int NG, int RX>
void rows8_tile(const uint8_t* groups, int64_t group_bytes, const QuantizedActivations& x,
                int64_t first, float* sums, bool far) {
  constexpr bool kQ8 = QType == kQ8_0;
  const int64_t nblocks = x.k / kBlock;
  const __m256i low4 = _mm256_set1_epi8(15), bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[NG][RX], offset[NG][RX];
  for (int q = 0; q < NG; ++q)
    for (int j = 0; j < RX; ++j) acc[q][j] = offset[q][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int q = 0; q < NG; ++q) {
      const uint8_t* group = groups + q * group_bytes;
      // The same block of the groups the next call takes (the tile's groups are read side by
      // side, so a fixed distance ahead would land in the other group's rows).
      if (far)
        prefetch_group_block<QType, true>(group + 2 * NG * group_bytes, b);
      else
        prefetch_group_block<QType, false>(group + NG * group_bytes, b);
      __m256 d, m;
      group_scales<QType>(group, b, d, m);
      const uint8_t* runs = group_runs<QType>(group, b);
      __m256i codes[8];  // the codes of values 4 g .. 4 g + 3, 8 rows
      for (int g = 0; g < kRuns(QType); ++g) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(runs + 32 * g));
        if constexpr (kQ8) {
          codes[g] = kUnsignedQ8 ? raw : _mm256_xor_si256(raw, bias);
        } else {  // the high nibbles are the values 16 further on
          codes[g] = _mm256_and_si256(raw, low4);
          codes[4 + g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
      }
      if constexpr (QType == kQ5_0) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(runs - 32));
        for (int g = 0; g < 8; ++g) codes[g] = _mm256_or_si256(codes[g], fifth_of_run(bits, g));
      }
      if constexpr (QType == kQ6_K)
        for (int g = 0; g < 8; ++g)
          codes[g] = _mm256_or_si256(
              codes[g], top_of_run(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                       runs + 128 + 32 * (g / 4))),
                                   g % 4));
      for (int j = 0; j < RX; ++j) {
        int32_t quads[8], low_quads[8];
        x.quads(first + j, b, quads, low_quads);
        // Two chains of dot products per half of the codes: values 0-15 and 16-31.
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
        for (int g = 0; g < 4; ++g) {
          const __m256i c0 = _mm256_set1_epi32(quads[g]), c1 = _mm256_set1_epi32(quads[g + 4]);
          const __m256i l0 = _mm256_set1_epi32(low_quads[g]);
          const __m256i l1 = _mm256_set1_epi32(low_quads[g + 4]);
          if (kQ8 && !kUnsignedQ8) {
            const __m256i u0 = _mm256_sign_epi8(codes[g], codes[g]);
            const __m256i u1 = _mm256_sign_epi8(codes[g + 4], codes[g + 4]);
            s0 = dot_add(s0, u0, _mm256_sign_epi8(c0, codes[g]));
            s1 = dot_add(s1, u1, _mm256_sign_epi8(c1, codes[g + 4]));
            t0 = dot_add(t0, u0, _mm256_sign_epi8(l0, codes[g]));
            t1 = dot_add(t1, u1, _mm256_sign_epi8(l1, codes[g + 4]));
          } else {
            s0 = dot_add(s0, codes[g], c0);
            s1 = dot_add(s1, codes[g + 4], c1);
            t0 = dot_add(t0, codes[g], l0);
            t1 = dot_add(t1, codes[g + 4], l1);
          }
        }
        const float* xs = x.scales.data() + (b * x.m + first + j) * 2;
        const __m256 dx = _mm256_set1_ps(xs[0]);
        if constexpr (QType == kQ6_K) {  // each half's sum less 32 sum c, by its own scale
          const int32_t* halves = x.halves.data() + (b * x.m + first + j) * 2;
          const __m256i first_half =
              _mm256_sub_epi32(combine(s0, t0), _mm256_set1_epi32(32 * halves[0]));
          const __m256i second_half =
              _mm256_sub_epi32(combine(s1, t1), _mm256_set1_epi32(32 * halves[1]));
          acc[q][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first_half), _mm256_mul_ps(d, dx),
                                      acc[q][j]);
          acc[q][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second_half), _mm256_mul_ps(m, dx),
                                      acc[q][j]);
          continue;
        }
        const __m256i sums = combine(_mm256_add_epi32(s0, s1), _mm256_add_epi32(t0, t1));
        acc[q][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), acc[q][j]);
        offset[q][j] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[1]), offset[q][j]);
      }
    }
  }
  for (int j = 0; j < RX; ++j)
    for (int q = 0; q < NG; ++q)
      _mm256_storeu_ps(sums + (j * NG + q) * kGroupRows, _mm256_add_ps(acc[q][j], offset[q][j]));
}

// Activation rows per 512-bit tile of two groups: 8 rows' sums and offsets and a block's 8 code
// vectors fill 24 of AVX-512's 32 registers.
constexpr int kTileCols16 = 8;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
constexpr bool kRows16 = true;
// rows8_tile for two groups at once (NG = 2), in 512-bit vectors: group q's 8 rows in the low
// half, q + 1's in the high, so each broadcast of an activation row's 4 codes and each vpdpbusd
// serves 16 rows. Lane by lane the same integer sums and the same float32 operations in the same
// order as rows8_tile's, so a row's result is the same bits whichever of the two computes it.
template <int64_t QType, int RX>
void rows16_tile(const uint8_t* groups, int64_t group_bytes, const QuantizedActivations& x,
                 int64_t first, float* sums, bool far) {
  constexpr bool kQ8 = QType == kQ8_0;
  const int64_t nblocks = x.k / kBlock;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[RX], offset[RX];
#pragma GCC unroll 8
  for (int j = 0; j < RX; ++j) acc[j] = offset[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* g1 = groups + group_bytes;
    if (far) {  // the block of the pair after next
      prefetch_group_block<QType, true>(groups + 4 * group_bytes, b);
      prefetch_group_block<QType, true>(g1 + 4 * group_bytes, b);
    } else {  // the next pair's
      prefetch_group_block<QType, false>(groups + 2 * group_bytes, b);
      prefetch_group_block<QType, false>(g1 + 2 * group_bytes, b);
    }
    // The two groups' scales side by side: the same values as rows8_tile's, lane by lane.
    __m256 d0, m0, d1, m1;
    group_scales<QType, true>(groups, b, d0, m0);
    group_scales<QType, true>(g1, b, d1, m1);
    const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(d0)), _mm256_castps_pd(d1), 1));
    const __m512 m = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(m0)), _mm256_castps_pd(m1), 1));
    const uint8_t* c0 = group_runs<QType>(groups, b);
    const uint8_t* c1 = group_runs<QType>(g1, b);
    __m512i codes[8];
#pragma GCC unroll 8
    for (int g = 0; g < kRuns(QType); ++g) {
      const __m512i raw = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + 32 * g))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1 + 32 * g)), 1);
      // Q8_0's codes plus 128 as stored (vpdpbusd's sums do not saturate); Q4's high nibbles are
      // the values 16 further on.
      codes[g] = kQ8 ? raw : _mm512_and_si512(raw, low4);
      if constexpr (!kQ8) codes[4 + g] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if constexpr (QType == kQ5_0) {
      const __m512i bits = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 - 32))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1 - 32)), 1);
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) codes[g] = _mm512_or_si512(codes[g], fifth_of_run(bits, g));
    }
    if constexpr (QType == kQ6_K) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m512i bits = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(c0 + 128 + 32 * half))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1 + 128 + 32 * half)), 1);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g)
          codes[4 * half + g] = _mm512_or_si512(codes[4 * half + g], top_of_run(bits, g));
      }
    }
    // Unrolled, or the rows' sums live on the stack (3x slower).
#pragma GCC unroll 8
    for (int j = 0; j < RX; ++j) {
      // Each 4 codes broadcast straight from memory (a load, not a move from a general register,
      // which took one port and held the tile at a third of its speed).
      const int8_t* h_codes = x.codes.get() + (first + j) * x.k + b * kBlock;
      const int8_t* l_codes = x.low.get() + (first + j) * x.k + b * kBlock;
      const auto splat = [](const int8_t* p) {
        return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
      };
      __m512i high[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      __m512i low[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {  // a chain per half: values 0-15, 16-31
        high[g / 4] = _mm512_dpbusd_epi32(high[g / 4], codes[g], splat(h_codes + 4 * g));
        low[g / 4] = _mm512_dpbusd_epi32(low[g / 4], codes[g], splat(l_codes + 4 * g));
      }
      const auto combine16 = [](__m512i h, __m512i l) {  // 255 h + l
        return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), h), l);
      };
      const float* xs = x.scales.data() + (b * x.m + first + j) * 2;
      const __m512 dx = _mm512_set1_ps(xs[0]);
      if constexpr (QType == kQ6_K) {  // as rows8_tile: each half by its own scale
        const int32_t* halves = x.halves.data() + (b * x.m + first + j) * 2;
        const __m512i first_half =
            _mm512_sub_epi32(combine16(high[0], low[0]), _mm512_set1_epi32(32 * halves[0]));
        const __m512i second_half =
            _mm512_sub_epi32(combine16(high[1], low[1]), _mm512_set1_epi32(32 * halves[1]));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first_half), _mm512_mul_ps(d, dx), acc[j]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second_half), _mm512_mul_ps(m, dx), acc[j]);
        continue;
      }
      const __m512i sum = combine16(_mm512_add_epi32(high[0], high[1]),
                                    _mm512_add_epi32(low[0], low[1]));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), acc[j]);
      offset[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[1]), offset[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < RX; ++j) _mm512_storeu_ps(sums + j * 16, _mm512_add_ps(acc[j], offset[j]));
}

// rows16_tile for `cols` (1 to kTileCols16) activation rows.
template <int64_t QType, int RX = kTileCols16>
void rows16_tiles(int cols, const uint8_t* groups, int64_t group_bytes,
                  const QuantizedActivations& x, int64_t first, float* sums, bool far) {
  if constexpr (RX > 1) {
    if (cols < RX)
      return rows16_tiles<QType, RX - 1>(cols, groups, group_bytes, x, first, sums, far);
  }
  rows16_tile<QType, RX>(groups, group_bytes, x, first, sums, far);
}
#else
constexpr bool kRows16 = false;
template <int64_t QType>
void rows16_tiles(int, const uint8_t*, int64_t, const QuantizedActivations&, int64_t, float*,
                  bool) {}
#endif

// Activation rows per pass over a thread's weights: their codes (2 bytes a value) stay in the
// core's L2 while every pair of groups of the thread multiplies them.
constexpr int64_t kRowChunk = 128;

template <int64_t QType, typename T, typename U>
void rows8_linear(const T* x, int64_t m, int64_t k, const uint8_t* weight, int64_t n, U* out,
                  int64_t ldo) {
  const int64_t groups = n / kGroupRows;
  const int64_t group_bytes = k / kBlock / sub_blocks(QType) * group_block_bytes(QType);
  const QuantizedActivations xq(x, m, k);
  // Rows enough for one tile a pair: each block is read once, and fetched into L2 from further
  // ahead (prefetch_group_block).
  const bool far = m <= (kRows16 ? kTileCols16 : kTileCols);
  // Threads split pairs of groups. A pair is multiplied at once (512-bit vectors of 16 rows
  // where the build has AVX512-VNNI; one activation row as two independent chains of products
  // elsewhere), else a group at a time, up to 4 activation rows per tile.
  at::parallel_for(0, (groups + 1) / 2, 4, [&](int64_t begin, int64_t end) {
    float sums[2 * kGroupRows * kTileCols16];
    for (int64_t row0 = 0; row0 < m; row0 += kRowChunk) {
      const int64_t row_end = std::min(m, row0 + kRowChunk);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t g0 = 2 * pair;
        const int ng = static_cast<int>(std::min<int64_t>(2, groups - g0));
        const bool both = ng == 2 && (kRows16 || m == 1);
        for (int q0 = 0; q0 < ng; q0 += both ? 2 : 1) {
          const uint8_t* w = weight + (g0 + q0) * group_bytes;
          const int nq = both ? 2 : 1;
          const int64_t step = nq == 2 && kRows16 ? kTileCols16 : kTileCols;
          for (int64_t i = row0; i < row_end; i += step) {
            const int cols = static_cast<int>(std::min<int64_t>(step, row_end - i));
            if (nq == 2 && kRows16) {
              rows16_tiles<QType>(cols, w, group_bytes, xq, i, sums, far);
            } else if (nq == 2) {
              rows8_tile<QType, 2, 1>(w, group_bytes, xq, i, sums, far);
            } else if (cols == 4) {
              rows8_tile<QType, 1, 4>(w, group_bytes, xq, i, sums, far);
            } else if (cols == 3) {
              rows8_tile<QType, 1, 3>(w, group_bytes, xq, i, sums, far);
            } else if (cols == 2) {
              rows8_tile<QType, 1, 2>(w, group_bytes, xq, i, sums, far);
            } else {
              rows8_tile<QType, 1, 1>(w, group_bytes, xq, i, sums, far);
            }
            const int rows = nq * kGroupRows;
            for (int j = 0; j < cols; ++j)
              for (int c = 0; c < rows; ++c)
                out[(i + j) * ldo + (g0 + q0) * kGroupRows + c] =
                    pagedserve_cpu::store<U>(sums[j * rows + c]);
          }
        }
      }
    }
  });
}

// Row r of a group of 8 interleaved rows back in the file's layout: `row` gets its nblocks
// blocks (for the ops that read a row at a time: dequantizing, the AMX tiles).
template <int64_t QType>
void ungroup_row(const uint8_t* group, int64_t nblocks, int r, uint8_t* row) {
  if constexpr (QType == kQ6_K) {
    for (int64_t sb = 0; sb < nblocks / 8; ++sb) {
      const uint8_t* super = group + sb * 1680;
      uint8_t* block = row + sb * 210;
      uint8_t q[256];  // the 6-bit codes in value order
      for (int j = 0; j < 8; ++j) {
        block[192 + 2 * j] = super[16 + 16 * j + r];
        block[193 + 2 * j] = super[24 + 16 * j + r];
        const uint8_t* runs = super + kQ6KHead + 192 * j;
        for (int t = 0; t < 16; ++t) {
          const int g = t / 4, p = t % 4;
          const uint8_t nibbles = runs[32 * g + 4 * r + p];
          const int top0 = (runs[128 + 4 * r + p] >> (2 * g)) & 3;
          const int top1 = (runs[160 + 4 * r + p] >> (2 * g)) & 3;
          q[32 * j + t] = static_cast<uint8_t>((nibbles & 15) | top0 << 4);
          q[32 * j + t + 16] = static_cast<uint8_t>((nibbles >> 4) | top1 << 4);
        }
      }
      for (int n = 0; n < 2; ++n)  // ggml's dequantize_row_q6_K, packed back
        for (int l = 0; l < 32; ++l) {
          const uint8_t* v = q + 128 * n + l;
          block[64 * n + l] = static_cast<uint8_t>((v[0] & 15) | (v[64] & 15) << 4);
          block[64 * n + l + 32] = static_cast<uint8_t>((v[32] & 15) | (v[96] & 15) << 4);
          block[128 + 32 * n + l] =
              static_cast<uint8_t>(v[0] >> 4 | (v[32] >> 4) << 2 | (v[64] >> 4) << 4 | (v[96] >> 4) << 6);
        }
      std::memcpy(block + 208, super + 2 * r, 2);
    }
    return;
  }
  if constexpr (QType == kQ4_K) {
    for (int64_t sb = 0; sb < nblocks / 8; ++sb) {
      const uint8_t* super = group + sb * kQ4KGroupBytes;
      uint8_t* block = row + sb * 144;
      std::memcpy(block, super + 2 * r, 2);
      std::memcpy(block + 2, super + 16 + 2 * r, 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; ++j) sc[j] = super[32 + 16 * j + r], mn[j] = super[40 + 16 * j + r];
      for (int j = 0; j < 4; ++j) {  // ggml's get_scale_min_k4, packed back
        block[4 + j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
        block[8 + j] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
        block[12 + j] = static_cast<uint8_t>((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
      }
      // Block j's value t: the low nibble of byte t (t < 16) or the high one of byte t - 16 in
      // its runs; in the file, the low (even j) or high (odd j) nibble of byte 32 (j / 2) + t.
      uint8_t values[8][32];
      for (int j = 0; j < 8; ++j)
        for (int t = 0; t < 16; ++t) {
          const uint8_t byte = super[kQ4KHead + 128 * j + 32 * (t / 4) + 4 * r + t % 4];
          values[j][t] = byte & 15, values[j][t + 16] = byte >> 4;
        }
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 32; ++t)
          block[16 + 32 * i + t] = static_cast<uint8_t>(values[2 * i][t] | values[2 * i + 1][t] << 4);
    }
    return;
  }
  constexpr int64_t kBytes = block_bytes(QType), kHalves = QType == kQ4_1 ? 2 : 1;
  constexpr int64_t kCodes = QType == kQ5_0 ? 6 : 2 * kHalves;  // where a block's codes start
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* chunk = group + b * kGroupRows * kBytes;
    uint8_t* block = row + b * kBytes;
    for (int64_t h = 0; h < kHalves; ++h) std::memcpy(block + 2 * h, chunk + 16 * h + 2 * r, 2);
    if constexpr (QType == kQ5_0) {  // value 4 g + p's fifth bit: bit g of byte 16 + 4 r + p
      uint32_t qh = 0;
      for (int p = 0; p < 4; ++p)
        for (int g = 0; g < 8; ++g) qh |= uint32_t((chunk[16 + 4 * r + p] >> g) & 1) << (4 * g + p);
      std::memcpy(block + 2, &qh, 4);
    }
    for (int g = 0; g < kRuns(QType); ++g) {
      uint32_t quad;
      std::memcpy(&quad, chunk + kHead(QType) + 32 * g + 4 * r, 4);
      if constexpr (QType == kQ8_0) quad ^= 0x80808080u;  // stored plus 128
      std::memcpy(block + kCodes + 4 * g, &quad, 4);
    }
  }
}

template <int64_t QType, typename T, typename U>
void block_linear(const T* x, int64_t m, int64_t k, const uint8_t* weight, int64_t n, U* out,
                  int64_t ldo) {
  const int64_t row_bytes = k / kBlock / sub_blocks(QType) * block_bytes(QType);
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
            out[(i + j) * ldo + first + r] = pagedserve_cpu::store<U>(sums[r * cols + j]);
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

#if defined(__AVX512F__)
// 16 floats stored as float32, or as bfloat16 rounded to nearest even: one instruction with
// AVX512-BF16 (the same rounding, finite values), else store8's integer rounding per half (the
// AVX2 builds' code, which their tests cover).
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(c10::BFloat16* o, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));
#else
  store8(o, _mm512_castps512_ps256(v));
  store8(o + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#endif
}
#endif

// Block b's 32 values (w = d * code + m, per half block of 16 for Q6_K) of one row; `scales` the
// super-block's for K-quants. The products are exact in float32 (Q6_K's rounded once, as gguf's
// d * sc * (q - 32) is), so the values are gguf's own. AVX-512 builds take a half block per
// instruction: the AMX path dequantizes every weight tile it multiplies, in the caches, where
// the instructions are the cost.
template <int64_t QType, typename T>
inline void dequantize_block(const uint8_t* row, int64_t b, const float* scales, T* o) {
  const __m256i codes = block_codes<QType>(row, b);
  const int64_t s = b % sub_blocks(QType);
  float d[2], m[2];  // per half block
  if constexpr (QType == kQ6_K) {
    for (int h = 0; h < 2; ++h) d[h] = scales[2 * s + h], m[h] = -32.0f * d[h];
  } else {
    float pair[4];
    if constexpr (is_k_quant(QType)) {
      pair[0] = scales[2 * s], pair[1] = scales[2 * s + 1];
    } else if constexpr (QType == kQ8_0) {
      pair[0] = half_to_float(row + b * 34), pair[1] = 0.0f;
    } else {
      _mm_storeu_ps(pair, block_pair<QType>(row + b * block_bytes(QType)));
    }
    d[0] = d[1] = pair[0];
    m[0] = m[1] = pair[1];
  }
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  for (int h = 0; h < 2; ++h) {
#if defined(__AVX512F__)
    const __m512i wide =
        QType == kQ8_0 ? _mm512_cvtepi8_epi32(halves[h]) : _mm512_cvtepu8_epi32(halves[h]);
    store16(o + 16 * h, _mm512_fmadd_ps(_mm512_set1_ps(d[h]), _mm512_cvtepi32_ps(wide),
                                        _mm512_set1_ps(m[h])));
#else
    for (int q = 0; q < 2; ++q) {
      const __m128i eight = q == 0 ? halves[h] : _mm_srli_si128(halves[h], 8);
      const __m256i wide =
          QType == kQ8_0 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
      store8(o + 16 * h + 8 * q, _mm256_fmadd_ps(_mm256_set1_ps(d[h]), _mm256_cvtepi32_ps(wide),
                                                 _mm256_set1_ps(m[h])));
    }
#endif
  }
}

// One row of GGUF blocks (`w`, the file's layout) as K values.
template <int64_t QType, typename T>
void dequantize_row(const uint8_t* w, int64_t k, T* out) {
  float scales[16];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    if (is_k_quant(QType) && b % 8 == 0)
      super_block_scales<QType>(w + b / 8 * block_bytes(QType), scales);
    dequantize_block<QType>(w, b, scales, out + b * kBlock);
  }
}

// Rows of GGUF blocks as values, `Rows8` of groups of 8 interleaved rows: all n of them (steps of
// many rows, where a dense GEMM beats the block dot products), or rows ids[0..m-1] (a kept
// embedding's lookups: the weight's n rows checked).
template <int64_t QType, bool Rows8, typename T>
void dequantize_rows(const uint8_t* weight, int64_t n, int64_t k, T* out,
                     const int64_t* ids = nullptr, int64_t m = 0) {
  const int64_t row_bytes = k / kBlock / sub_blocks(QType) * block_bytes(QType);
  for (int64_t i = 0; ids != nullptr && i < m; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n, "row ", ids[i], " of a weight of ", n, " rows");
  at::parallel_for(0, ids ? m : n, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> ungrouped(Rows8 ? row_bytes : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = ids ? ids[i] : i;
      const uint8_t* w = weight + row * row_bytes;
      if constexpr (Rows8) {
        ungroup_row<QType>(weight + row / kGroupRows * (k / kBlock / sub_blocks(QType)) *
                                        group_block_bytes(QType),
                           k / kBlock,
                           static_cast<int>(row % kGroupRows), ungrouped.data());
        w = ungrouped.data();
      }
      dequantize_row<QType>(w, k, out + i * k);
    }
  });
}

// Calls f with the type's template instance (a std::integral_constant<int64_t, QType>).
template <typename F>
void with_qtype(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    default: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
}

// The same for a weight of interleaved rows, with its blocks' type (Q4_0, Q4_1, Q5_0, Q8_0,
// Q4_K or Q6_K).
template <typename F>
void with_rows8_qtype(int64_t qtype, F&& f) {
  if (qtype == kQ4_0 + kRows8) return f(std::integral_constant<int64_t, kQ4_0>{});
  if (qtype == kQ5_0 + kRows8) return f(std::integral_constant<int64_t, kQ5_0>{});
  if (qtype == kQ8_0 + kRows8) return f(std::integral_constant<int64_t, kQ8_0>{});
  if (qtype == kQ4_K + kRows8) return f(std::integral_constant<int64_t, kQ4_K>{});
  if (qtype == kQ6_K + kRows8) return f(std::integral_constant<int64_t, kQ6_K>{});
  return f(std::integral_constant<int64_t, kQ4_1>{});
}
#endif

#if defined(PAGEDSERVE_BLOCK_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_AMX 1
// Steps of more rows in bfloat16 on CPUs with AMX: each thread dequantizes a pair of 16-row
// weight tiles into its core's caches (64 KB at K = 1024) and multiplies them there by AMX's bf16
// tiles, so that the weights are read as blocks once per step and no dequantized weight goes
// through memory (the dense route writes and reads back every weight in bf16; measured:
// docs/benchmarks-history.md).
//
// The roles are swapped to fit AMX's layouts without a transpose of the weights: a product tile
// is out^T, 16 weight rows by 16 activation rows, C += A B with A a weight tile (16 rows x 32
// values of K, row-major as dequantized) and B a chunk of 16 activation rows in AMX's pair layout
// (K / 2 rows of 16 (k, k + 1) pairs), built once per call; product tiles are transposed in
// registers into rows of the output.

constexpr int kAmxRows = 16;     // rows of a tile: weight rows, and activation rows per chunk

// Linux hands out AMX's tile state only to a process that asks (XTILEDATA, once per process).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// x [m, k] bf16 as AMX B tiles: chunk c (16 rows, zero-padded), block kb -> 16 x 16 (k, k + 1)
// pairs, [pair][row]: the transpose of the chunk's [row][pair] (bf16 pairs moved as floats).
pagedserve_cpu::LineVector<uint32_t> activation_tiles(const c10::BFloat16* x, int64_t m,
                                                      int64_t k) {
  const int64_t chunks = (m + kAmxRows - 1) / kAmxRows, nblocks = k / kBlock;
  pagedserve_cpu::LineVector<uint32_t> tiles(chunks * nblocks * 256);
  at::parallel_for(0, chunks * nblocks, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float padded[16 * 16] = {};  // a last chunk's rows, zeros past row m
    for (int64_t index = begin; index < end; ++index) {
      const int64_t c = index / nblocks, kb = index % nblocks;
      const int64_t rows = std::min<int64_t>(16, m - 16 * c);
      const auto* source = reinterpret_cast<const float*>(x + 16 * c * k + kb * kBlock);
      int64_t stride = k / 2;
      if (rows < 16) {
        for (int64_t r = 0; r < rows; ++r) std::memcpy(padded + r * 16, source + r * stride, 64);
        source = padded, stride = 16;
      }
      __m512 columns[16];
      pagedserve_cpu::transpose16(source, stride, columns);
      auto* tile = reinterpret_cast<float*>(tiles.data() + index * 256);
      for (int p = 0; p < 16; ++p) _mm512_storeu_ps(tile + p * 16, columns[p]);
    }
  });
  return tiles;
}

// Block b of a row as 32 bfloat16 values, gguf's values rounded as dequantize_block rounds
// them. A block of 4- or 5-bit codes has at most 32 distinct values: they are computed once (d q
// + m for q = 0..31, in float32, rounded to bf16) and looked up by code (vpermw), half the
// instructions of converting each value; Q8_0 and Q6_K convert.
// A Q4 block's 32 values d q + m as bfloat16 from its 16 code bytes: the bytes widened twice to
// 16-bit lanes, the second copy shifted to its high nibbles; vpermw reads an index's low 5 bits,
// so the first copy's high nibble (bit 4) picks between the table's two equal halves.
inline void q4_bf16(float d, float m, const uint8_t* codes, c10::BFloat16* o) {
  const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_fmadd_ps(_mm512_set1_ps(d), low, _mm512_set1_ps(m));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512i words =
      _mm512_srlv_epi16(_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(raw)), shifts);
  _mm512_storeu_si512(o, _mm512_permutexvar_epi16(words, table));
}

// Runs r[0..3] of an interleaved group's block (run g: 4 code bytes of each of 8 rows) as each
// row's 16 bytes: rows i and i + 4 in the halves of out[i].
inline void runs_to_rows(const __m256i* r, __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The interleaved types whose groups the AMX path dequantizes as they are stored; Q5_0's and
// the K-quants' rows are put back in the file's layout first (ungroup_row).
template <int64_t QType>
constexpr bool kGroupDequantize = QType == kQ4_0 || QType == kQ4_1 || QType == kQ8_0;

// Block b of a group of 8 interleaved rows (Q4_0, Q4_1, Q8_0) as bfloat16: row i's 32 values at
// o + i * kBlock, the values dequantize_bf16 gives for the file's blocks.
template <int64_t QType>
inline void dequantize_group_bf16(const uint8_t* group, int64_t b, c10::BFloat16* o) {
  static_assert(kGroupDequantize<QType>, "Q4_0, Q4_1 and Q8_0 groups only");
  constexpr int64_t kBytes = kGroupRows * block_bytes(QType), kScales = QType == kQ4_1 ? 32 : 16;
  const uint8_t* chunk = group + b * kBytes;
  alignas(32) float d[8], m[8];
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
  _mm256_store_ps(d, dv);
  _mm256_store_ps(m, QType == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                          reinterpret_cast<const __m128i*>(chunk + 16)))
                                    : _mm256_mul_ps(dv, _mm256_set1_ps(QType == kQ4_0 ? -8.0f
                                                                                     : -128.0f)));
  // Each row's code bytes, through a buffer: read back as memory operands, they cost no shuffle.
  __m256i runs[8], rows[8];
  alignas(32) uint8_t bytes[2][4][32];  // [values 0-15, 16-31 (Q8_0)][row % 4][row / 4 half]
  for (int g = 0; g < kRuns(QType); ++g)
    runs[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + kScales + 32 * g));
  for (int h = 0; h < kRuns(QType) / 4; ++h) {
    runs_to_rows(runs + 4 * h, rows);
    for (int i = 0; i < 4; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes[h][i]), rows[i]);
  }
  for (int i = 0; i < kGroupRows; ++i) {
    c10::BFloat16* row = o + i * kBlock;
    if constexpr (QType == kQ8_0) {  // codes plus 128: d u - 128 d, d q rounded once
      for (int h = 0; h < 2; ++h) {
        const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_load_si128(reinterpret_cast<const __m128i*>(bytes[h][i % 4] + 16 * (i / 4)))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * h),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(
                                _mm512_set1_ps(d[i]), u, _mm512_set1_ps(m[i]))));
      }
    } else {
      q4_bf16(d[i], m[i], bytes[0][i % 4] + 16 * (i / 4), row);
    }
  }
}

template <int64_t QType>
inline void dequantize_bf16(const uint8_t* row, int64_t b, const float* scales,
                            c10::BFloat16* o) {
  if constexpr (QType == kQ8_0 || QType == kQ6_K) {
    dequantize_block<QType>(row, b, scales, o);
  } else if constexpr (QType == kQ4_0 || QType == kQ4_1) {
    const uint8_t* block = row + b * block_bytes(QType);
    const __m128 pair = block_pair<QType>(block);
    q4_bf16(_mm_cvtss_f32(pair), _mm_cvtss_f32(_mm_movehdup_ps(pair)),
            block + (QType == kQ4_1 ? 4 : 2), o);
  } else {
    float pair[4];
    if constexpr (is_k_quant(QType)) {
      pair[0] = scales[2 * (b % 8)], pair[1] = scales[2 * (b % 8) + 1];
    } else {
      _mm_storeu_ps(pair, block_pair<QType>(row + b * block_bytes(QType)));
    }
    const __m512 d = _mm512_set1_ps(pair[0]), m = _mm512_set1_ps(pair[1]);
    const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i table_low = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(d, low, m));
    __m512i table = _mm512_castsi256_si512(table_low);
    if constexpr (QType == kQ5_0 || QType == kQ5_1 || QType == kQ5_K) {
      const __m512 high = _mm512_add_ps(low, _mm512_set1_ps(16.0f));
      table = _mm512_inserti64x4(table, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(d, high, m)),
                                 1);
    }
    const __m512i codes = _mm512_cvtepu8_epi16(block_codes<QType>(row, b));
    _mm512_storeu_si512(o, _mm512_permutexvar_epi16(codes, table));
  }
}

// One pass over K of WT weight tiles (16 rows each, `weights` + w * tile) by CH activation
// chunks (16 rows each, `activations` + c * chunk): product tile w * 2 + c in `products`. Tiles
// 4-5 hold the weights, 6-7 the activations, 0-3 the products: each block's 4 loads feed 4
// multiplications, and no tile is loaded again while a multiplication may still read it.
template <int WT, int CH>
inline void tile_pass(const c10::BFloat16* weights, int64_t tile, const uint32_t* activations,
                      int64_t chunk, int64_t nblocks, float (*products)[kAmxRows * kAmxRows]) {
  _tile_zero(0);
  if constexpr (CH > 1) _tile_zero(1);
  if constexpr (WT > 1) _tile_zero(2);
  if constexpr (WT > 1 && CH > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < nblocks; ++kb) {
    _tile_loadd(4, weights + kb * kAmxRows * kBlock, kBlock * 2);
    if constexpr (WT > 1) _tile_loadd(5, weights + tile + kb * kAmxRows * kBlock, kBlock * 2);
    _tile_loadd(6, activations + kb * 256, 64);
    if constexpr (CH > 1) _tile_loadd(7, activations + chunk + kb * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CH > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (WT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (WT > 1 && CH > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, products[0], 64);
  if constexpr (CH > 1) _tile_stored(1, products[1], 64);
  if constexpr (WT > 1) _tile_stored(2, products[2], 64);
  if constexpr (WT > 1 && CH > 1) _tile_stored(3, products[3], 64);
}

inline void tile_pass_any(int wt, int ch, const c10::BFloat16* weights, int64_t tile,
                          const uint32_t* activations, int64_t chunk, int64_t nblocks,
                          float (*products)[kAmxRows * kAmxRows]) {
  const auto pass = wt == 2 ? (ch == 2 ? tile_pass<2, 2> : tile_pass<2, 1>)
                            : (ch == 2 ? tile_pass<1, 2> : tile_pass<1, 1>);
  pass(weights, tile, activations, chunk, nblocks, products);
}

template <int64_t QType, bool Rows8 = false>
void amx_linear(const c10::BFloat16* x, int64_t m, int64_t k, const uint8_t* weight, int64_t n,
                c10::BFloat16* out, int64_t ldo) {
  const int64_t nblocks = k / kBlock;
  const int64_t row_bytes = nblocks / sub_blocks(QType) * block_bytes(QType);
  const int64_t group_bytes = nblocks / sub_blocks(QType) * group_block_bytes(QType);
  const int64_t chunks = (m + kAmxRows - 1) / kAmxRows, chunk = nblocks * 256;
  const auto activations = activation_tiles(x, m, k);
  // Threads take pairs of weight tiles (32 rows), dequantized block-major: [2][nblocks][16][32].
  const int64_t tile = nblocks * kAmxRows * kBlock;
  const int64_t pairs = (n + 2 * kAmxRows - 1) / (2 * kAmxRows);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    pagedserve_cpu::load_full_tiles();
    pagedserve_cpu::LineVector<c10::BFloat16> buffer(2 * tile);  // written before it is read
    c10::BFloat16* weights = buffer.data();
    alignas(64) float products[4][kAmxRows * kAmxRows];
    float scales[16];
    std::vector<uint8_t> ungrouped(Rows8 ? row_bytes : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * 2 * kAmxRows;
      const int count = static_cast<int>(std::min<int64_t>(2 * kAmxRows, n - first));
      // The next pair's rows are fetched a row at a time while this pair's are dequantized.
      const uint8_t* next = t + 1 < end ? weight + (first + 2 * kAmxRows) * row_bytes : nullptr;
      const int next_count =
          next ? static_cast<int>(std::min<int64_t>(2 * kAmxRows, n - first - 2 * kAmxRows)) : 0;
      const int wt = count > kAmxRows ? 2 : 1;
      for (int r = 0; r < wt * kAmxRows; ++r) {
        c10::BFloat16* dst = weights + r / kAmxRows * tile + r % kAmxRows * kBlock;
        if (r >= count) {  // rows past the weight's last: zeros
          for (int64_t kb = 0; kb < nblocks; ++kb)
            std::memset(dst + kb * kAmxRows * kBlock, 0, kBlock * 2);
          continue;
        }
        if constexpr (Rows8 && kGroupDequantize<QType>) {  // a group at a time (a pair's 32
          if (r % kGroupRows != 0) continue;                 // rows are 4 whole groups)
          // The next pair's same group, a block's lines at a time, as this one is read.
          const uint8_t* ahead = r < next_count ? next + r * row_bytes : nullptr;
          constexpr int64_t kBytes = kGroupRows * block_bytes(QType);
          for (int64_t kb = 0; kb < nblocks; ++kb) {
            if (ahead != nullptr)
              for (int64_t line = 0; line < kBytes; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + kb * kBytes + line),
                             _MM_HINT_T1);
            dequantize_group_bf16<QType>(weight + (first + r) * row_bytes, kb,
                                         dst + kb * kAmxRows * kBlock);
          }
          continue;
        }
        if (r < next_count)
          for (int64_t offset = 0; offset < row_bytes; offset += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + r * row_bytes + offset),
                         _MM_HINT_T1);
        const uint8_t* row = weight + (first + r) * row_bytes;
        if constexpr (Rows8) {  // Q5_0, Q4_K, Q6_K: the row in the file's layout first
          ungroup_row<QType>(weight + (first + r) / kGroupRows * group_bytes, nblocks,
                             static_cast<int>((first + r) % kGroupRows), ungrouped.data());
          row = ungrouped.data();
        }
        for (int64_t kb = 0; kb < nblocks; ++kb) {
          if (is_k_quant(QType) && kb % 8 == 0)
            super_block_scales<QType>(row + kb / 8 * block_bytes(QType), scales);
          dequantize_bf16<QType>(row, kb, scales, dst + kb * kAmxRows * kBlock);
        }
      }
      for (int64_t c0 = 0; c0 < chunks; c0 += 2) {
        const int ch = static_cast<int>(std::min<int64_t>(2, chunks - c0));
        tile_pass_any(wt, ch, weights, tile, activations.data() + c0 * chunk, chunk,
                      nblocks, products);
        // Product tile w * 2 + c is out^T: its column j holds weight rows first + 16 w ... by
        // activation row (c0 + c) * 16 + j.
        for (int w = 0; w < wt; ++w) {
          const int rows = std::min(kAmxRows, count - w * kAmxRows);
          const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1);
          for (int c = 0; c < ch; ++c) {
            __m512 columns[16];
            pagedserve_cpu::transpose16(products[w * 2 + c], 16, columns);
            for (int j = 0; j < kAmxRows; ++j) {
              const int64_t i = (c0 + c) * kAmxRows + j;
              if (i >= m) break;
              _mm256_mask_storeu_epi16(out + i * ldo + first + w * kAmxRows, valid,
                                       (__m256i)_mm512_cvtneps_pbh(columns[j]));
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif


// The checks the ops share: weight holds [N, K] values in `qtype`'s blocks (rows interleaved by
// 8 for kRows8 + Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K: [N / 8, a group's bytes]); returns
// (N, K).
std::pair<int64_t, int64_t> check_blocks(const at::Tensor& weight, int64_t qtype) {
  const int64_t group = is_rows8(qtype) ? kGroupRows : 1;
  const int64_t base = qtype - (group > 1 ? kRows8 : 0);
  const int64_t bytes = group > 1 ? group_block_bytes(base) : block_bytes(base);
  const int64_t values = kBlock * sub_blocks(base);
  TORCH_CHECK(bytes > 0,
              "GGUF block weights are Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), "
              "Q5_K (13) or Q6_K (14), or Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K with rows "
              "interleaved by 8 (", kQ4_0 + kRows8, ", ", kQ4_1 + kRows8, ", ", kQ5_0 + kRows8,
              ", ", kQ8_0 + kRows8, ", ", kQ4_K + kRows8, ", ", kQ6_K + kRows8, "), got type ",
              qtype);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) % bytes == 0,
              "weight must be contiguous uint8 [N / ", group, ", K / ", values, " * ", bytes,
              "] (GGUF blocks)");
  return {weight.size(0) * group, weight.size(1) / bytes * values};
}

}  // namespace

namespace pagedserve_cpu {

bool amx_available() {
#if defined(PAGEDSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

int64_t gguf_weight_rows(const at::Tensor& weight, int64_t qtype) {
  return check_blocks(weight, qtype).first;
}

void gguf_block_dequantize(const at::Tensor& weight, int64_t qtype, at::Tensor& out,
                           const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(kHasBlockDot, "this build has no GGUF block kernels (they need AVX2, F16C and FMA)");
  const auto [n, k] = check_blocks(weight, qtype);
  TORCH_CHECK(!rows || (rows->scalar_type() == at::kLong && rows->dim() == 1 &&
                        rows->is_contiguous()),
              "rows must be a contiguous int64 vector of row ids");
  const int64_t m = rows ? rows->size(0) : n;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == k && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be contiguous float32 or bfloat16 [", m, ", ", k, "]");
#if defined(PAGEDSERVE_BLOCK_DOT)
  const auto* w = weight.data_ptr<uint8_t>();
  const int64_t* ids = rows ? rows->data_ptr<int64_t>() : nullptr;
  const auto run = [&](auto type, auto rows8) {
    constexpr int64_t QType = decltype(type)::value;
    constexpr bool Rows8 = decltype(rows8)::value;
    if (out.scalar_type() == at::kFloat)
      dequantize_rows<QType, Rows8>(w, n, k, out.data_ptr<float>(), ids, m);
    else
      dequantize_rows<QType, Rows8>(w, n, k, out.data_ptr<at::BFloat16>(), ids, m);
  };
  if (is_rows8(qtype))
    with_rows8_qtype(qtype, [&](auto type) { run(type, std::true_type{}); });
  else
    with_qtype(qtype, [&](auto type) { run(type, std::false_type{}); });
#endif
}

void gguf_block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                       at::Tensor& out) {
  TORCH_CHECK(kHasBlockDot, "this build has no GGUF block kernels (they need AVX2, F16C and FMA)");
  const auto [n, k] = check_blocks(weight, qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [rows, ", k, "]");
  // out may be a slice of wider rows: a weight stacked from parts of different block types
  // writes each part's columns. A bfloat16 x may write float32 (the lm_head's logits, which
  // would otherwise be rounded to bfloat16 and converted back).
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
                  out.stride(1) == 1 && out.stride(0) >= n &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat),
              "out must be [", x.size(0), ", ", n,
               "] of x's dtype or float32 with contiguous rows");
#if defined(PAGEDSERVE_BLOCK_DOT)
  const auto* w = weight.data_ptr<uint8_t>();
  const int64_t m = x.size(0), ldo = out.stride(0);
  // `linear(x, out)` on the tensors' data, the one pair of types they have.
  const auto by_dtype = [&](auto linear) {
    if (x.scalar_type() == at::kFloat)
      linear(x.data_ptr<float>(), out.data_ptr<float>());
    else if (out.scalar_type() == at::kFloat)
      linear(x.data_ptr<at::BFloat16>(), out.data_ptr<float>());
    else
      linear(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  };
  if (is_rows8(qtype)) {
    with_rows8_qtype(qtype, [&](auto type) {
      by_dtype([&](const auto* xs, auto* outs) {
        rows8_linear<decltype(type)::value>(xs, m, k, w, n, outs, ldo);
      });
    });
    return;
  }
  with_qtype(qtype, [&](auto type) {
    by_dtype([&](const auto* xs, auto* outs) {
      block_linear<decltype(type)::value>(xs, m, k, w, n, outs, ldo);
    });
  });
#endif
}

void gguf_amx_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                     at::Tensor& out) {
  TORCH_CHECK(amx_available(),
              "this build or process has no AMX tiles (they need a CPU with AMX-BF16, a native "
              "build and the kernel's permission)");
  const auto [n, k] = check_blocks(weight, qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() &&
                  x.scalar_type() == at::kBFloat16,
              "x must be contiguous bfloat16 [rows, ", k, "]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
                  out.stride(1) == 1 && out.stride(0) >= n && out.scalar_type() == at::kBFloat16,
              "out must be bfloat16 [", x.size(0), ", ", n, "] with contiguous rows");
#if defined(PAGEDSERVE_AMX)
  const auto run = [&](auto type, auto rows8) {
    amx_linear<decltype(type)::value, decltype(rows8)::value>(
        x.data_ptr<at::BFloat16>(), x.size(0), k, weight.data_ptr<uint8_t>(), n,
        out.data_ptr<at::BFloat16>(), out.stride(0));
  };
  if (is_rows8(qtype))
    with_rows8_qtype(qtype, [&](auto type) { run(type, std::true_type{}); });
  else
    with_qtype(qtype, [&](auto type) { run(type, std::false_type{}); });
#endif
}

}  // namespace pagedserve_cpu

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("amx_available() -> bool");
  m.def("gguf_amx_linear(Tensor x, Tensor weight, int qtype, Tensor(a!) out) -> ()");
  m.def("block_dot_isa() -> str");
  m.def("gguf_block_linear(Tensor x, Tensor weight, int qtype, Tensor(a!) out) -> ()");
  m.def("gguf_block_dequantize(Tensor weight, int qtype, Tensor(a!) out, Tensor? rows=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("gguf_block_linear", &pagedserve_cpu::gguf_block_linear);
  m.impl("gguf_block_dequantize", &pagedserve_cpu::gguf_block_dequantize);
  m.impl("gguf_amx_linear", &pagedserve_cpu::gguf_amx_linear);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CatchAll, m) {
  m.impl("block_dot_isa", &block_dot_isa);
  m.impl("amx_available", &pagedserve_cpu::amx_available);
}
