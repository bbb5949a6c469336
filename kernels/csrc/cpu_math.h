// Float helpers shared by pagedserve's CPU kernels (cpu_attention.cpp, cpu_layer_ops.cpp,
// cpu_gguf.cpp).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu {

// Allocations on whole cache lines, for what AMX tiles load and store: a tile's 64-byte rows each
// on one line (malloc's 16-byte alignment put every row across two in some processes and not in
// others: docs/benchmarks-history.md, "Aligned tiles"). Elements are default-initialized (a resize
// leaves them as they come): every user writes before it reads.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline float load(float x) { return x; }
inline float load(c10::Half x) { return static_cast<float>(x); }
inline float load(c10::BFloat16 x) {
  // bf16 is the upper half of a float32: a shift the compiler vectorizes.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN): integer operations the
// compiler vectorizes, where c10::BFloat16's constructor keeps loops scalar.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>((u >> 16) | 0x40u) : rounded;
}

// A float result stored in T, rounded as torch rounds it.
template <typename T>
inline T store(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 store<c10::BFloat16>(float v) {
  return c10::BFloat16(bf16_bits(v), c10::BFloat16::from_bits());
}

// v rounded to T's precision, kept as a float (a rounding torch does between two ops).
template <typename T>
inline float round_as(float v) {
  return load(store<T>(v));
}

// exp(x) for x <= 0 in plain arithmetic the compiler vectorizes (libm's expf is not): Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6 polynomial for e^r (relative error
// about 1e-7), and 2^n through the exponent bits. exp of anything below -87 (a masked key's -inf
// included) is 0.
// The constants, shared with cpu_attention.cpp's 16-lane twin: ln 2 in two parts (exact high
// bits, then the rest) and the polynomial's coefficients, highest degree first.
constexpr float kExpFloor = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  const bool underflow = x < kExpFloor;
  x = underflow ? kExpFloor : x;
  const float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kLn2High;
  r = r + n * kLn2Low;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive over 16 lanes (the same reduction and polynomial); lanes below -87 give 0.
inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}

// A 16 x 16 tile of 32-bit values (rows `stride` floats apart) as its columns: columns[c][r] =
// tile[r][c] (4 rounds of shuffles).
inline void transpose16(const float* tile, int64_t stride, __m512 columns[16]) {
  __m512 t[16], u[16];
  for (int r = 0; r < 16; r += 2) {  // lane-wise pairs of rows
    const __m512 a = _mm512_loadu_ps(tile + r * stride);
    const __m512 b = _mm512_loadu_ps(tile + (r + 1) * stride);
    t[r] = _mm512_unpacklo_ps(a, b), t[r + 1] = _mm512_unpackhi_ps(a, b);
  }
  for (int g = 0; g < 16; g += 4) {  // lane L of u[g + q]: column 4 L + q of rows g..g+3
    u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int q = 0; q < 4; ++q) {  // lane L of the 4 row groups side by side: column 4 L + q
    const __m512 even_lo = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x88);
    const __m512 odd_lo = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xDD);
    const __m512 even_hi = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xDD);
    columns[q] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
    columns[q + 8] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD);
    columns[q + 4] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
    columns[q + 12] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD);
  }
}
#endif

#if defined(__AMX_TILE__)
// AMX's tile configuration: palette 1, all 8 tiles of 16 rows x 64 bytes (16 floats, or 32
// bfloat16 values, or 16 pairs of them), the shape every AMX product here uses. Per thread.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void load_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}
#endif

}  // namespace pagedserve_cpu
