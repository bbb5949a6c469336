// Paged attention for CPU tensors: pagedserve's compiled CPU backend (`kernels.cpu_ops`).
//
// Same contract as `kernels.reference.paged_attention` (its docstring has the index arithmetic):
// causal attention of each sequence's new tokens over its K/V, read in place from the paged cache
// through the block table (no gather), for decode and prefill/extend sequences in one batch.
//
// Work is split into items of (sequence, KV head, up to kTileTokens new tokens). An item's rows are
// its tokens times the GQA group's query heads, so every K/V block is loaded (and converted to
// float) once per item and shared by all the group's query heads. Items run on torch's OpenMP
// threads, costliest first, each thread taking the next item from an atomic counter (prefill
// tiles late in a long prompt cost more than early ones, and decodes cost little).
//
// A query row's result depends only on its own query, position and keys, never on the batch: its
// keys are taken block by block in order, with the same vector code whatever item it is in, so a
// token attended in a prefill chunk, in a decode step, alone or among many gives the same bits
// (tests/kernels/test_batch_invariance.py). Two faster paths break that and run only with
// `batch_variant` (PAGEDSERVE_BATCH_VARIANT=1, `kernels.cpu_features.batch_variant`): one stream's
// decode items split by keys across the threads, their softmax states merged after
// (split_decodes, merge_splits), and bfloat16 prefill items on AMX tiles.
//
// Per item and key block: each key is converted to float32 once and dotted with every row; the
// softmax is online (running max and sum per row, in float32); each value is converted once and
// added to every row's accumulator. A decode item whose rows fit one pass converts its keys and
// values as it loads them from the cache; other items convert a block into buffers first. The
// output is rounded to q's dtype once, at the end. head_dim 64 and 128 are compile-time
// constants, so those loops unroll and vectorize fully.
//
// `take`, when given, names the sequences to attend to (bool [sequences]); the others are left to
// the caller: for long prefills the reference's SDPA (oneDNN GEMMs) is faster than these dot
// products (`kernels.cpu_ops.kernel_attends`, docs/benchmarks-history.md).

// The Tensor class alone, not <ATen/ATen.h> (every op's declaration): each source then compiles
// in about two thirds of the time, which a user waits through on first start.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pagedserve_cpu::exp_nonpositive;
#if defined(__AVX512F__)
using pagedserve_cpu::exp_nonpositive16;
#endif
using pagedserve_cpu::load;

constexpr int64_t kTileTokens = 16;  // new tokens per work item in prefill/extend
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int32_t seq, first, last;       // new tokens first..last-1 of sequence seq
  int32_t kv_head, num_kv_heads;  // against KV heads kv_head..kv_head+num_kv_heads-1
  int64_t cost;                   // rows x keys, for the ordering
  // A decode item split by keys (split_decodes): keys key_lo..key_hi only, its rows' running
  // state left in partial slot `part` for the merge; part < 0: all its keys, normalized rows out.
  int32_t key_lo = 0, key_hi = std::numeric_limits<int32_t>::max(), part = -1;
};

// A split item's rows (the GQA group's query heads of its one token): unnormalized accumulators,
// then each row's running max and sum.
inline int64_t partial_floats(int64_t group, int64_t head_dim) { return group * (head_dim + 2); }

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t q_token, q_head;                         // q strides
  int64_t k_block, k_slot, k_head;                 // k_cache strides
  int64_t v_block, v_slot, v_head;                 // v_cache strides
  int64_t table_stride;                            // block_tables row stride
  int64_t window;                                  // 0: none
  float scale, softcap;                            // softcap 0: none
  bool amx;                                        // bf16 items of 16 rows or more on AMX tiles
};

// The scores and the P @ V of a GQA group's rows against a block's keys, for head_dim a
// compile-time multiple of 16 in builds with AVX2 and FMA (AVX-512's 16 lanes where the build has
// them, else AVX2's 8): each key and value is loaded once for up to 4 rows, four keys' dot products
// are reduced together, and the rows' accumulators stay in registers across the block's values.
// Written out because the compiler's versions of these loops chain each key's multiply-adds, keep
// the accumulator on the stack and stay at 8 lanes: in-cache decode attention at 64 sequences took
// 0.8x the time this way, and 0.75x from memory (docs/benchmarks-history.md, "The decode step as
// one call"). Other builds and head_dims take the plain loops of `attend_row`.
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kVectorRows = true;
#if defined(__AVX512F__)
using VF = __m512;
constexpr int64_t kLanes = 16;
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vset1(float x) { return _mm512_set1_ps(x); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
// 16 bfloat16 values as floats (a bfloat16 is a float's upper half).
inline VF vload_bf16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline VF vload(const c10::BFloat16* p) { return vload_bf16(p); }
// The sum of a vector's two 8-lane halves.
inline __m256 fold8(VF a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#else
using VF = __m256;
constexpr int64_t kLanes = 8;
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vset1(float x) { return _mm256_set1_ps(x); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vload_bf16(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline VF vload(const c10::BFloat16* p) { return vload_bf16(p); }
inline __m256 fold8(VF a) { return a; }
#endif

// Rows of a GQA group (query heads of one KV head, one token) share their keys: a key's vectors are
// loaded once for all of them, and their sums are independent chains. R rows at a time, as many
// as keep their accumulators in registers: R x kD / kLanes of them at most 16.
template <int64_t kD>
constexpr int kGroupRows = std::max<int64_t>(1, std::min<int64_t>(4, 16 / (kD / kLanes)));

// out[r * ld + j] = q_r . keys[j * stride] for R rows (q_r = q + r * kD) and 4 keys. Keys (and
// values below) are float32 rows, or bfloat16 ones converted as they are loaded.
template <int64_t kD, int R, typename K>
inline void dot4_rows(const float* q, const K* keys, int64_t stride, float* out, int64_t ld) {
  VF a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = vzero();
  for (int64_t d = 0; d < kD; d += kLanes) {
    VF k[4];
    for (int j = 0; j < 4; ++j) k[j] = vload(keys + j * stride + d);
    for (int r = 0; r < R; ++r) {
      const VF qd = vload(q + r * kD + d);
      for (int j = 0; j < 4; ++j) a[r][j] = vfma(qd, k[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    // [k0..k3's sums of lanes 0-3 | of lanes 4-7], then the halves added.
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold8(a[r][0]), fold8(a[r][1])),
                                    _mm256_hadd_ps(fold8(a[r][2]), fold8(a[r][3])));
    _mm_storeu_ps(out + r * ld,
                  _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// q . key.
template <int64_t kD, typename K>
inline float dot1(const float* q, const K* key) {
  VF a = vzero();
  for (int64_t d = 0; d < kD; d += kLanes) a = vfma(vload(q + d), vload(key + d), a);
  const __m256 f = fold8(a);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// For R rows: acc_r = acc_r * correction[r] + sum over keys lo..hi of p[r * ld + i] * values[i].
template <int64_t kD, int R, typename V>
inline void accumulate_rows(float* acc, const float* correction, const float* p, int64_t ld,
                            const V* values, int64_t stride, int64_t lo, int64_t hi) {
  constexpr int kChunks = kD / kLanes;
  VF a[R][kChunks];
  for (int r = 0; r < R; ++r) {
    const VF c = vset1(correction[r]);
    for (int j = 0; j < kChunks; ++j) a[r][j] = vmul(vload(acc + r * kD + kLanes * j), c);
  }
  for (int64_t i = lo; i <= hi; ++i) {
    VF v[kChunks];
    for (int j = 0; j < kChunks; ++j) v[j] = vload(values + i * stride + kLanes * j);
    for (int r = 0; r < R; ++r) {
      const VF pr = vset1(p[r * ld + i]);
      for (int j = 0; j < kChunks; ++j) a[r][j] = vfma(pr, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kChunks; ++j) vstore(acc + r * kD + kLanes * j, a[r][j]);
}

// Rows start..end-1 of kD bfloat16 values each (`stride` apart) as float rows of `buf`.
template <int64_t kD>
inline void bf16_rows_as_float(const c10::BFloat16* src, int64_t stride, int64_t start,
                               int64_t end, float* buf) {
  for (int64_t i = start; i < end; ++i)
    for (int64_t d = 0; d < kD; d += kLanes)
      vstore(buf + i * kD + d, vload_bf16(src + i * stride + d));
}
#else
constexpr bool kVectorRows = false;
template <int64_t kD>
constexpr int kGroupRows = 1;
template <int64_t kD, int R, typename K>
inline void dot4_rows(const float*, const K*, int64_t, float*, int64_t) {}
template <int64_t kD, typename K>
inline float dot1(const float*, const K*) { return 0.0f; }
template <int64_t kD, int R, typename V>
inline void accumulate_rows(float*, const float*, const float*, int64_t, const V*, int64_t,
                            int64_t, int64_t) {}
template <int64_t kD>
inline void bf16_rows_as_float(const c10::BFloat16*, int64_t, int64_t, int64_t, float*) {}
#endif

// A float32 row of D values (kD when a compile-time constant) from a row of T.
template <typename T, int64_t kD>
inline void row_as_float(const T* row, float* dst, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, row, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && kVectorRows && kD > 0 &&
                       kD % 16 == 0) {
    bf16_rows_as_float<kD>(row, 0, 0, 1, dst);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = load(row[d]);
  }
}

// Fetch slot i's keys and values of `heads` KV heads of a block (at the first one) ahead.
template <typename T>
inline void prefetch_slot(const T* keys, const T* values, const Geometry& g, int64_t heads,
                          int64_t i) {
  const int64_t slot_bytes = heads * g.head_dim * static_cast<int64_t>(sizeof(T));
  const char* k = reinterpret_cast<const char*>(keys + i * g.k_slot);
  const char* v = reinterpret_cast<const char*>(values + i * g.v_slot);
  for (int64_t offset = 0; offset < slot_bytes; offset += 64) {
    __builtin_prefetch(k + offset, 0, 2);
    __builtin_prefetch(v + offset, 0, 2);
  }
}

template <typename T>
inline void prefetch_block(const T* keys, const T* values, const Geometry& g, int64_t heads,
                           int64_t start, int64_t end) {
  for (int64_t i = start; i < end; ++i) prefetch_slot(keys, values, g, heads, i);
}

// Slots start..end-1 of a block's keys and values for `heads` KV heads (`keys` and `values` at the
// first one) as float32 rows of `kbuf` and `vbuf` ([heads][B][D]), read slot by slot, keys and
// values side by side: two streams in address order, which the hardware prefetcher follows and
// keeps in flight together; the same slot of the sequence's next block (`next_keys`, `next_values`,
// or null) is fetched meanwhile. Read a head at a time, keys then values, each block was crossed
// once per head, every third 128-byte run: decode attention from memory (64 sequences x 160 keys)
// took 1.4x the time, in float32 too, where this is a copy (docs/benchmarks-history.md, "Prefill
// attention on AMX tiles").
template <typename T, int64_t kD>
inline void block_as_float(const T* keys, const T* values, const Geometry& g, int64_t heads,
                           int64_t start, int64_t end, float* kbuf, float* vbuf,
                           const T* next_keys, const T* next_values) {
  const int64_t B = g.block_size, D = g.head_dim;
  for (int64_t i = start; i < end; ++i) {
    if (next_keys != nullptr) prefetch_slot(next_keys, next_values, g, heads, i);
    for (int64_t h = 0; h < heads; ++h) {
      row_as_float<T, kD>(keys + i * g.k_slot + h * g.k_head, kbuf + (h * B + i) * D, D);
      row_as_float<T, kD>(values + i * g.v_slot + h * g.v_head, vbuf + (h * B + i) * D, D);
    }
  }
}

// A row's scores pr[lo..hi] (soft-capped when softcap > 0) into their exponentials under the row's
// running max, which it updates with the row's sum (the online softmax); returns the factor the
// row's accumulator is rescaled by (0 for its first block).
// AVX-512 builds take 16 keys per instruction: the compiler leaves the plain loops below mostly
// scalar.
inline float online_softmax(float* pr, int64_t lo, int64_t hi, float softcap, float& row_max,
                            float& row_sum) {
  if (softcap > 0.0f)
    for (int64_t i = lo; i <= hi; ++i) pr[i] = softcap * std::tanh(pr[i] / softcap);
#if defined(__AVX512F__)
  const auto lanes = [&](int64_t i) {  // keys i..min(i + 15, hi)
    return static_cast<__mmask16>((1u << std::min<int64_t>(16, hi + 1 - i)) - 1);
  };
  __m512 top = _mm512_set1_ps(kNegInf);
  for (int64_t i = lo; i <= hi; i += 16)
    top = _mm512_mask_max_ps(top, lanes(i), top, _mm512_maskz_loadu_ps(lanes(i), pr + i));
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(top));
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = lo; i <= hi; i += 16) {
    const __m512 x = _mm512_maskz_loadu_ps(lanes(i), pr + i);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(x, shift));
    _mm512_mask_storeu_ps(pr + i, lanes(i), e);
    sum = _mm512_mask_add_ps(sum, lanes(i), sum, e);
  }
  const float correction = exp_nonpositive(row_max - new_max);
  row_sum = row_sum * correction + _mm512_reduce_add_ps(sum);
  row_max = new_max;
  return correction;
#else
  // Four running maxima: a chain of one would wait on each comparison.
  float m[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
  int64_t i = lo;
  for (; i + 3 <= hi; i += 4)
    for (int j = 0; j < 4; ++j) m[j] = std::max(m[j], pr[i + j]);
  for (; i <= hi; ++i) m[0] = std::max(m[0], pr[i]);
  const float new_max = std::max(row_max, std::max(std::max(m[0], m[1]), std::max(m[2], m[3])));
  const float correction = exp_nonpositive(row_max - new_max);
  float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
  for (int64_t k = lo; k <= hi; ++k) {
    pr[k] = exp_nonpositive(pr[k] - new_max);
    block_sum += pr[k];
  }
  row_sum = row_sum * correction + block_sum;
  row_max = new_max;
  return correction;
#endif
}

// R rows of one GQA group (q, acc, row_max, row_sum and p at their first row; p's rows ld apart)
// against keys lo..hi of a block: scores, online softmax, P @ V.
template <int64_t kD, int R, typename KV>
void attend_rows(const float* q, float* acc, float* row_max, float* row_sum, float* p, int64_t ld,
                 const KV* keys, int64_t k_stride, const KV* values, int64_t v_stride,
                 int64_t lo, int64_t hi, float softcap) {
  int64_t i = lo;
  for (; i + 3 <= hi; i += 4) dot4_rows<kD, R>(q, keys + i * k_stride, k_stride, p + i, ld);
  for (; i <= hi; ++i)
    for (int r = 0; r < R; ++r) p[r * ld + i] = dot1<kD>(q + r * kD, keys + i * k_stride);
  float correction[R];
  for (int r = 0; r < R; ++r)
    correction[r] = online_softmax(p + r * ld, lo, hi, softcap, row_max[r], row_sum[r]);
  accumulate_rows<kD, R>(acc, correction, p, ld, values, v_stride, lo, hi);
}

// The same for one row, in plain loops (any head_dim; builds without AVX2).
template <int64_t kD>
void attend_row(const float* qr, float* accr, float& row_max, float& row_sum, float* pr,
                const float* keys, int64_t k_stride, const float* values, int64_t v_stride,
                int64_t lo, int64_t hi, float softcap, int64_t D) {
  for (int64_t i = lo; i <= hi; ++i) {
    const float* key = keys + i * k_stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * key[d];
    pr[i] = dot;
  }
  const float correction = online_softmax(pr, lo, hi, softcap, row_max, row_sum);
  // P @ V with the row's accumulator in a local array.
  float a[kD ? kD : 1];
  float* ar = kD ? a : accr;
  if (kD) std::memcpy(a, accr, sizeof(float) * D);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
  for (int64_t i = lo; i <= hi; ++i) {
    const float pi = pr[i];
    const float* value = values + i * v_stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ar[d] += pi * value[d];
  }
  if (kD) std::memcpy(accr, a, sizeof(float) * D);
}

// Prefill and extend items in bfloat16 on CPUs with AMX (the build's flags and the process's
// permission, `amx_available`): the scores and P @ V as AMX bf16 tile products, flash-attention
// style, instead of vector dot products. The products are transposed so that a vector holds one
// key's 16 rows and the online softmax needs no reduction across lanes: per item and KV head,
// - rows (token-major, the GQA group's query heads within a token) go in tiles of 16, as Q^T:
//   pairs of dimensions by row, bf16, unscaled (the scale multiplies the float scores);
// - keys come in chunks of kAmxKeys positions, gathered through the block table once for all
//   the row tiles: keys as they are (rows of dimensions), values as V^T (dimensions by keys);
// - per row tile and chunk: S^T = K Q^T (2 product tiles), the softmax on its 32 key vectors in
//   float32 (masks by position: causal, window), P^T rounded to bf16 (the sums add the rounded
//   values, so each row's weights sum to 1), O^T = V^T P^T into head_dim / 16 product tiles, and
//   the accumulator (dimensions by row) rescaled by row and added to.
// The vector path spends 2 x head_dim / 16 multiply-adds per (row, key); here a (row, key) costs a
// share of its key vector's softmax and of the tile products. Measured in
// docs/benchmarks-history.md ("Prefill attention on AMX tiles").
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kAmxAttention = true;
constexpr int64_t kAmxKeys = 32;  // key positions per chunk: the K of an O^T tile product

// Lane 2 j takes element j of a's 16 bf16 values, lane 2 j + 1 element j of b's: a pair per lane
// for AMX's layout of B tiles and of V^T.
inline __m512i interleave16(__m256i a, __m256i b) {
  alignas(64) static constexpr uint16_t kOrder[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), _mm512_load_si512(kOrder),
                                   _mm512_castsi256_si512(b));
}

// What the tiles load and store is on whole cache lines (pagedserve_cpu::LineVector).
struct AmxScratch {
  pagedserve_cpu::LineVector<uint32_t> q_tiles;  // [row tiles][D / 32][16 pairs][16 rows]: Q^T
  pagedserve_cpu::LineVector<float> acc;         // [row tiles][D][16 rows]: O^T, unnormalised
  std::vector<float> row_max, row_sum;           // [row tiles][16]
  pagedserve_cpu::LineVector<c10::BFloat16> keys;  // [kAmxKeys][D]: a chunk's keys, 0s after
  pagedserve_cpu::LineVector<uint32_t> v_tiles;    // [D / 16][16 dims][16 pairs of keys]: V^T
  // Whether this thread configured the tiles: on its first item on tiles, so that a decode
  // step's threads never touch the tile state, and released at the end of the call.
  bool configured = false;

  ~AmxScratch() {
    if (configured) _tile_release();
  }
};

template <int64_t kD>
void attend_item_amx(const Item& item, const Geometry& g, const c10::BFloat16* q,
                     const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                     const int32_t* block_table, int64_t seq_len, int64_t q_start, int64_t q_len,
                     c10::BFloat16* out, AmxScratch& s) {
  using BF16 = c10::BFloat16;
  if (!s.configured) {
    pagedserve_cpu::load_full_tiles();
    s.configured = true;
  }
  const int64_t B = g.block_size, G = g.group, tokens = item.last - item.first;
  const int64_t rows = tokens * G, tiles = (rows + 15) / 16;
  const int64_t first_pos = seq_len - q_len + item.first, last_pos = first_pos + tokens - 1;
  const int64_t first_key = g.window > 0 ? std::max<int64_t>(0, first_pos - g.window + 1) : 0;
  s.q_tiles.resize(tiles * kD / 32 * 256);
  s.acc.resize(tiles * kD * 16);
  s.row_max.resize(tiles * 16);
  s.row_sum.resize(tiles * 16);
  s.keys.resize(kAmxKeys * kD);
  s.v_tiles.resize(kD / 16 * 256);
  alignas(64) float scores[kAmxKeys * 16];  // S^T: [key][row]
  alignas(64) uint32_t p_tile[256];         // P^T as a B tile: [pair of keys][row]
  alignas(64) float products[kD * 16];      // O^T of one chunk: [dim][row]
  alignas(64) BF16 padded[16 * kD];
  alignas(64) uint32_t pairs[256];
  const __m512 scale = _mm512_set1_ps(g.scale), neg_inf = _mm512_set1_ps(kNegInf);
  const __m512 zero = _mm512_setzero_ps();
  // Lane i of row tile t is row 16 t + i: its position, and its window's first (none: 0).
  std::vector<int32_t> positions(tiles * 16), lows(tiles * 16);
  for (int64_t r = 0; r < tiles * 16; ++r) {
    const int64_t pos = r < rows ? first_pos + r / G : -1;  // padding rows see no key
    positions[r] = static_cast<int32_t>(pos);
    lows[r] = static_cast<int32_t>(g.window > 0 ? pos - g.window + 1 : 0);
  }

  for (int64_t h = item.kv_head; h < item.kv_head + item.num_kv_heads; ++h) {
    for (int64_t t = 0; t < tiles; ++t) {
      std::memset(padded, 0, sizeof(padded));
      for (int64_t i = 0; i < 16 && 16 * t + i < rows; ++i) {
        const int64_t r = 16 * t + i, token = q_start + item.first + r / G, head = h * G + r % G;
        std::memcpy(padded + i * kD, q + token * g.q_token + head * g.q_head, kD * 2);
      }
      for (int64_t c = 0; c < kD / 32; ++c) {
        __m512 columns[16];
        pagedserve_cpu::transpose16(reinterpret_cast<const float*>(padded + 32 * c), kD / 2,
                                    columns);
        auto* tile = reinterpret_cast<float*>(s.q_tiles.data() + (t * kD / 32 + c) * 256);
        for (int p = 0; p < 16; ++p) _mm512_storeu_ps(tile + 16 * p, columns[p]);
      }
    }
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    std::fill(s.row_max.begin(), s.row_max.end(), kNegInf);
    std::fill(s.row_sum.begin(), s.row_sum.end(), 0.0f);
    for (int64_t c0 = first_key; c0 <= last_pos; c0 += kAmxKeys) {
      const int64_t count = std::min<int64_t>(kAmxKeys, last_pos + 1 - c0);
      const BF16* values[kAmxKeys];
      for (int64_t j = 0; j < kAmxKeys; ++j) {
        BF16* dst = s.keys.data() + j * kD;
        values[j] = nullptr;
        if (j >= count) {
          std::memset(dst, 0, kD * 2);
          continue;
        }
        const int64_t pos = c0 + j, physical = block_table[pos / B], slot = pos % B;
        std::memcpy(dst, k_cache + physical * g.k_block + slot * g.k_slot + h * g.k_head,
                    kD * 2);
        values[j] = v_cache + physical * g.v_block + slot * g.v_slot + h * g.v_head;
      }
      // V^T: keys 2 i and 2 i + 1 interleaved by dimension, then [pair][dim] transposed.
      for (int64_t d = 0; d < kD / 16; ++d) {
        for (int64_t i = 0; i < kAmxKeys / 2; ++i) {
          const auto load16 = [&](const BF16* row) {
            return row ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * d))
                       : _mm256_setzero_si256();
          };
          _mm512_store_si512(pairs + 16 * i, interleave16(load16(values[2 * i]),
                                                          load16(values[2 * i + 1])));
        }
        __m512 columns[16];
        pagedserve_cpu::transpose16(reinterpret_cast<const float*>(pairs), 16, columns);
        auto* tile = reinterpret_cast<float*>(s.v_tiles.data() + d * 256);
        for (int p = 0; p < 16; ++p) _mm512_storeu_ps(tile + 16 * p, columns[p]);
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = 16 * t, r_end = std::min(rows, r0 + 16);
        const int64_t lowest = first_pos + r0 / G, highest = first_pos + (r_end - 1) / G;
        if (c0 > highest) continue;  // every key of the chunk is after every row's position
        if (g.window > 0 && c0 + count - 1 < lowest - g.window + 1) continue;
        // S^T = K Q^T: tiles 0 (keys 0-15) and 1 (keys 16-31) by the tile's 16 rows.
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < kD / 32; ++c) {
          _tile_loadd(2, s.keys.data() + 32 * c, kD * 2);
          _tile_loadd(3, s.keys.data() + 16 * kD + 32 * c, kD * 2);
          _tile_loadd(4, s.q_tiles.data() + (t * kD / 32 + c) * 256, 64);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, scores, 64);
        _tile_stored(1, scores + 256, 64);
        if (g.softcap > 0.0f)
          for (int64_t e = 0; e < count * 16; ++e)
            scores[e] = g.softcap * std::tanh(scores[e] * g.scale / g.softcap) / g.scale;
        // The softmax, a key per vector: key j is visible to a row when low <= c0 + j <= pos.
        const __m512i pos = _mm512_loadu_si512(positions.data() + r0);
        const __m512i low = _mm512_loadu_si512(lows.data() + r0);
        __m512 v[kAmxKeys];
        __m512 chunk_max = neg_inf;
        for (int64_t j = 0; j < kAmxKeys; ++j) {
          if (j >= count) {
            v[j] = neg_inf;
            continue;
          }
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(c0 + j));
          const __mmask16 visible = _mm512_cmp_epi32_mask(key, pos, _MM_CMPINT_LE) &
                                    _mm512_cmp_epi32_mask(low, key, _MM_CMPINT_LE);
          v[j] = _mm512_mask_mul_ps(neg_inf, visible, _mm512_load_ps(scores + 16 * j), scale);
          chunk_max = _mm512_max_ps(chunk_max, v[j]);
        }
        float* max_r = s.row_max.data() + r0;
        float* sum_r = s.row_sum.data() + r0;
        const __m512 old_max = _mm512_loadu_ps(max_r);
        const __m512 new_max = _mm512_max_ps(old_max, chunk_max);
        // Rows that have seen no key yet keep -inf as their max: shift by 0 there (their
        // exponentials are 0) and leave their zero sums and accumulators as they are.
        const __mmask16 seen = _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_NEQ_OQ);
        const __m512 shift = _mm512_mask_mov_ps(zero, seen, new_max);
        const __m512 correction = _mm512_mask_mov_ps(
            _mm512_set1_ps(1.0f), seen, exp_nonpositive16(_mm512_sub_ps(old_max, shift)));
        __m512 sum = zero;
        for (int64_t i = 0; i < kAmxKeys / 2; ++i) {
          const __m512 a = exp_nonpositive16(_mm512_sub_ps(v[2 * i], shift));
          const __m512 b = exp_nonpositive16(_mm512_sub_ps(v[2 * i + 1], shift));
          const __m256i ra = (__m256i)_mm512_cvtneps_pbh(a), rb = (__m256i)_mm512_cvtneps_pbh(b);
          sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_cvtpbh_ps((__m256bh)ra),
                                                 _mm512_cvtpbh_ps((__m256bh)rb)));
          _mm512_store_si512(p_tile + 16 * i, interleave16(ra, rb));
        }
        _mm512_storeu_ps(sum_r, _mm512_fmadd_ps(_mm512_loadu_ps(sum_r), correction, sum));
        _mm512_storeu_ps(max_r, new_max);
        // O^T = V^T P^T: P^T in tile 2, V^T through tiles 0, 1 and 3, four products (4-7).
        _tile_loadd(2, p_tile, 64);
        for (int64_t d = 0; d < kD / 16; d += 4) {
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
          _tile_loadd(0, s.v_tiles.data() + (d + 0) * 256, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_loadd(1, s.v_tiles.data() + (d + 1) * 256, 64);
          _tile_dpbf16ps(5, 1, 2);
          _tile_loadd(3, s.v_tiles.data() + (d + 2) * 256, 64);
          _tile_dpbf16ps(6, 3, 2);
          _tile_loadd(0, s.v_tiles.data() + (d + 3) * 256, 64);
          _tile_dpbf16ps(7, 0, 2);
          _tile_stored(4, products + 16 * 16 * (d + 0), 64);
          _tile_stored(5, products + 16 * 16 * (d + 1), 64);
          _tile_stored(6, products + 16 * 16 * (d + 2), 64);
          _tile_stored(7, products + 16 * 16 * (d + 3), 64);
        }
        float* acc = s.acc.data() + t * kD * 16;
        for (int64_t d = 0; d < kD; ++d)
          _mm512_storeu_ps(acc + 16 * d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + 16 * d),
                                                         correction,
                                                         _mm512_load_ps(products + 16 * d)));
      }
    }
    // O = (O^T)^T / sums, a row at a time.
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t d0 = 0; d0 < kD; d0 += 16) {
        __m512 columns[16];
        pagedserve_cpu::transpose16(s.acc.data() + (t * kD + d0) * 16, 16, columns);
        for (int64_t i = 0; i < 16 && 16 * t + i < rows; ++i) {
          const int64_t r = 16 * t + i, token = q_start + item.first + r / G, head = h * G + r % G;
          BF16* dst = out + (token * g.num_heads + head) * kD + d0;
          const __m512 inv = _mm512_set1_ps(1.0f / s.row_sum[r]);  // every row sees its own key
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(columns[i], inv)));
        }
      }
    }
  }
}
#else
constexpr bool kAmxAttention = false;
struct AmxScratch {};
template <int64_t kD>
void attend_item_amx(const Item&, const Geometry&, const c10::BFloat16*, const c10::BFloat16*,
                     const c10::BFloat16*, const int32_t*, int64_t, int64_t, int64_t,
                     c10::BFloat16*, AmxScratch&) {}
#endif

// One item: tokens first..last-1 of one sequence, against one or more KV heads. kD is head_dim when
// it is a compile-time constant (64, 128: fully unrolled and vectorized loops), 0 for any other.
template <typename T, int64_t kD>
void attend_item(const Item& item, const Geometry& g, const T* q, const T* k_cache,
                 const T* v_cache, const int32_t* block_table, int64_t seq_len, int64_t q_start,
                 int64_t q_len, T* out, std::vector<float>& scratch, AmxScratch& amx_scratch,
                 float* partials) {
  float* partial = item.part >= 0 ? partials : nullptr;
  if constexpr (kAmxAttention && std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 64 == 0) {
    if (g.amx && (item.last - item.first) * g.group >= 16 && partial == nullptr) {
      attend_item_amx<kD>(item, g, q, k_cache, v_cache, block_table, seq_len, q_start, q_len, out,
                          amx_scratch);
      return;
    }
  }
  const int64_t D = kD ? kD : g.head_dim, B = g.block_size, G = g.group;
  const int64_t tokens = item.last - item.first;
  // Row r: KV head kv_head + r / per_head; within it, token first + (r % per_head) / G and query
  // head (kv_head + r / per_head) * G + r % G.
  const int64_t per_head = tokens * G;
  const int64_t rows = item.num_kv_heads * per_head;
  const int64_t heads = item.num_kv_heads;
  scratch.resize(rows * D * 2 + rows * 2 + rows * B + 2 * heads * B * D);
  float* qf = scratch.data();
  float* acc = qf + rows * D;
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  float* p = row_sum + rows;  // [rows][B]: scores, then probabilities
  float* kbuf = p + rows * B;  // [heads][B][D]: the block's keys as float32
  float* vbuf = kbuf + heads * B * D;  // [heads][B][D]: its values

  const int64_t first_pos = seq_len - q_len + item.first;  // position of the item's first token
  const int64_t last_pos = first_pos + tokens - 1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + item.first + (r % per_head) / G;
    const int64_t head = (item.kv_head + r / per_head) * G + r % G;
    const T* src = q + token * g.q_token + head * g.q_head;
    float* dst = qf + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = load(src[d]) * g.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
  }

  const int64_t first_key = std::max<int64_t>(
      item.key_lo, g.window > 0 ? std::max<int64_t>(0, first_pos - g.window + 1) : 0);
  const int64_t last_key = std::min<int64_t>(last_pos, item.key_hi);
  const int64_t last_block = last_key / B;
  // One token whose group's rows fit one pass (a decode): its keys and values are read straight
  // from the cache, converted to float32 as they are loaded, instead of through kbuf and vbuf (the
  // same floats in the same order; the buffers pay a store and a reload per row, and serve to
  // convert once for more rows or tokens). That reads a head at a time, which block_as_float
  // avoids; fetching the whole next block ahead kept decode from memory level
  // (docs/benchmarks-history.md, "Decode attention reads the cache in place").
  constexpr bool kDirect = kVectorRows && kD > 0 && kD % 16 == 0 &&
                           (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
  bool direct = false;
  if constexpr (kDirect) direct = tokens == 1 && G <= kGroupRows<kD>;
  for (int64_t block = first_key / B; block <= last_block; ++block) {
    const int64_t base = block * B;
    const int64_t start = std::max<int64_t>(first_key - base, 0);  // keys start..end-1 of this
    const int64_t end = std::min(B, last_key + 1 - base);             // block are seen by some row
    const int64_t physical = block_table[block];
    const int64_t next = block < last_block ? block_table[block + 1] : -1;
    const auto at = [&](const T* cache, int64_t b, int64_t block_stride, int64_t head_stride) {
      return b < 0 ? nullptr : cache + b * block_stride + item.kv_head * head_stride;
    };
    const T* block_keys = at(k_cache, physical, g.k_block, g.k_head);
    const T* block_values = at(v_cache, physical, g.v_block, g.v_head);
    if (direct) {
      if (next >= 0)
        prefetch_block<T>(at(k_cache, next, g.k_block, g.k_head),
                          at(v_cache, next, g.v_block, g.v_head), g, heads, start, end);
    } else {
      // The block's keys and values of the item's KV heads as float32 rows, converted once and
      // shared by each head's rows.
      block_as_float<T, kD>(block_keys, block_values, g, heads, start, end, kbuf, vbuf,
                            at(k_cache, next, g.k_block, g.k_head),
                            at(v_cache, next, g.v_block, g.v_head));
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t pos = first_pos + t;
        const int64_t lo = g.window > 0 ? std::max(start, pos - g.window + 1 - base) : start;
        const int64_t hi = std::min(end - 1, pos - base);  // visible keys: lo..hi
        if (lo > hi) continue;  // a window that ends before this block's keys, or starts after
        const int64_t r0 = h * per_head + t * G;  // the token's G rows of this head
        if constexpr (kVectorRows && kD > 0 && kD % 16 == 0) {
          // Rows r0 + c.. against keys (and values) `stride` elements apart.
          const auto pass = [&](int64_t c, const auto* keys, int64_t k_stride, const auto* values,
                                int64_t v_stride) {
            const int64_t r = r0 + c;
            const auto run = [&](auto rows_now) {
              attend_rows<kD, decltype(rows_now)::value>(
                  qf + r * D, acc + r * D, row_max + r, row_sum + r, p + r * B, B, keys,
                  k_stride, values, v_stride, lo, hi, g.softcap);
            };
            switch (std::min<int64_t>(kGroupRows<kD>, G - c)) {
              case 4: run(std::integral_constant<int, 4>{}); break;
              case 3: run(std::integral_constant<int, 3>{}); break;
              case 2: run(std::integral_constant<int, 2>{}); break;
              default: run(std::integral_constant<int, 1>{});
            }
          };
          if constexpr (kDirect) {
            if (direct) {
              pass(0, block_keys + h * g.k_head, g.k_slot, block_values + h * g.v_head, g.v_slot);
              continue;
            }
          }
          for (int64_t c = 0; c < G; c += kGroupRows<kD>)
            pass(c, kbuf + h * B * D, D, vbuf + h * B * D, D);
        } else {
          for (int64_t r = r0; r < r0 + G; ++r)
            attend_row<kD>(qf + r * D, acc + r * D, row_max[r], row_sum[r], p + r * B,
                           kbuf + h * B * D, D, vbuf + h * B * D, D, lo, hi, g.softcap, D);
        }
      }
    }
  }

  if (partial != nullptr) {  // a split decode item: its G rows' state, merged by merge_splits
    float* slot = partial + item.part * partial_floats(G, D);
    std::memcpy(slot, acc, sizeof(float) * rows * D);
    std::memcpy(slot + rows * D, row_max, sizeof(float) * rows);
    std::memcpy(slot + rows * D + rows, row_sum, sizeof(float) * rows);
    return;
  }
  const int64_t H = g.num_heads;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + item.first + (r % per_head) / G;
    const int64_t head = (item.kv_head + r / per_head) * G + r % G;
    T* dst = out + (token * H + head) * D;
    const float inv = 1.0f / row_sum[r];  // every row sees at least its own position's key
    const float* ar = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = pagedserve_cpu::store<T>(ar[d] * inv);
  }
}

// Keys per part of a split decode item, at least: below it a part's fixed costs outweigh what
// the threads gain.
constexpr int64_t kMinSplitKeys = 64;

// Too few items for the threads (one stream's decode: an item per KV head, 3 on 2 threads
// leaves one thread idle a third of the time): each decode item is split by keys, at block
// boundaries, into parts the threads take apart; their rows' running states (max, sum,
// unnormalized accumulators) are merged after (merge_splits). Returns the number of parts.
int64_t split_decodes(std::vector<Item>& items, const Geometry& g, int64_t threads,
                      const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& starts) {
  const int64_t count = static_cast<int64_t>(items.size());
  if (count == 0 || count >= 2 * threads) return 0;
  const int64_t want = (2 * threads + count - 1) / count;  // parts per item
  std::vector<Item> split;
  int64_t parts = 0;
  for (const Item& item : items) {
    const int64_t s = item.seq, last_pos = seq_lens[s] - 1;
    const int64_t first_key =
        g.window > 0 ? std::max<int64_t>(0, last_pos - g.window + 1) : 0;  // what it sees
    const int64_t keys = last_pos + 1 - first_key;
    const int64_t n = std::min<int64_t>(want, keys / kMinSplitKeys);
    if (starts[s + 1] - starts[s] != 1 || item.num_kv_heads != 1 || n < 2) {
      split.push_back(item);
      continue;
    }
    // n runs of keys, each ending at a block's end but the last.
    const int64_t per = (keys + n - 1) / n, B = g.block_size;
    for (int64_t lo = first_key; lo <= last_pos;) {
      const int64_t hi = std::min(last_pos, (lo + per + B - 1) / B * B - 1);
      Item part = item;
      part.key_lo = static_cast<int32_t>(lo);
      part.key_hi = static_cast<int32_t>(hi);
      part.cost = hi + 1 - lo;
      part.part = static_cast<int32_t>(parts++);
      split.push_back(part);
      lo = hi + 1;
    }
  }
  items.swap(split);
  return parts;
}

// The split items' parts merged into their rows of `out`: for each row, its parts' running
// states rescaled to their common max, summed, and normalized.
template <typename T>
void merge_splits(const std::vector<Item>& items, const Geometry& g, const float* partials,
                  const std::vector<int32_t>& starts, T* out) {
  const int64_t G = g.group, D = g.head_dim, floats = partial_floats(G, D);
  std::vector<const Item*> parts;
  for (const Item& item : items)
    if (item.part >= 0) parts.push_back(&item);
  std::stable_sort(parts.begin(), parts.end(), [](const Item* a, const Item* b) {
    return std::make_pair(a->seq, a->kv_head) < std::make_pair(b->seq, b->kv_head);
  });
  std::vector<float> acc(D);
  for (size_t first = 0; first < parts.size();) {
    size_t last = first;
    while (last < parts.size() && parts[last]->seq == parts[first]->seq &&
           parts[last]->kv_head == parts[first]->kv_head)
      ++last;
    const Item& item = *parts[first];
    for (int64_t r = 0; r < G; ++r) {
      float top = kNegInf;
      for (size_t i = first; i < last; ++i)
        top = std::max(top, partials[parts[i]->part * floats + G * D + r]);
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (size_t i = first; i < last; ++i) {
        const float* slot = partials + parts[i]->part * floats;
        if (slot[G * D + G + r] == 0.0f) continue;  // a part of no visible key
        const float weight = std::exp(slot[G * D + r] - top);
        sum += slot[G * D + G + r] * weight;
        for (int64_t d = 0; d < D; ++d) acc[d] += slot[r * D + d] * weight;
      }
      const int64_t token = starts[item.seq] + item.first;
      T* dst = out + (token * g.num_heads + item.kv_head * G + r) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = pagedserve_cpu::store<T>(acc[d] / sum);
    }
    first = last;
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const std::vector<int32_t>& seq_lens,
         const std::vector<int32_t>& starts, const Geometry& g, const bool* take,
         bool batch_variant, at::Tensor& out) {
  const int64_t num_seqs = static_cast<int64_t>(seq_lens.size());
  const int64_t threads_wanted = at::get_num_threads();
  // With enough sequences to keep every thread busy, an item takes all KV heads of its tokens, so
  // it reads each cache slot's [num_kv_heads, head_dim] keys contiguously (about 10% faster at 64
  // decodes over 200 keys than an item per head); otherwise one head per item, for the threads.
  const int64_t heads_per_item = num_seqs >= 4 * threads_wanted ? g.num_kv_heads : 1;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    if (take != nullptr && !take[s]) continue;  // the caller attends to it
    for (int64_t first = 0; first < q_len; first += kTileTokens) {
      const int64_t last = std::min(q_len, first + kTileTokens);
      const int64_t last_pos = seq_lens[s] - q_len + last - 1;
      const int64_t keys = g.window > 0 ? std::min<int64_t>(last_pos + 1, g.window + last - first)
                                        : last_pos + 1;
      for (int64_t h = 0; h < g.num_kv_heads; h += heads_per_item) {
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(first),
                         static_cast<int32_t>(last), static_cast<int32_t>(h),
                         static_cast<int32_t>(heads_per_item),
                         (last - first) * heads_per_item * keys});
      }
    }
  }
  const int64_t splits =
      batch_variant ? split_decodes(items, g, threads_wanted, seq_lens, starts) : 0;
  std::vector<float> partials(splits * partial_floats(g.group, g.head_dim));
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int threads = static_cast<int>(std::min<int64_t>(threads_wanted, num_items));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scratch;
    AmxScratch amx_scratch;  // released by its destructor, in this thread
    for (int64_t i = next++; i < num_items; i = next++) {
      const Item& item = items[i];
      const int64_t s = item.seq;
      const int32_t* table = tables + s * g.table_stride;
      const int64_t q_len = starts[s + 1] - starts[s];
      if (g.head_dim == 64) {
        attend_item<T, 64>(item, g, qp, kp, vp, table, seq_lens[s], starts[s], q_len, op, scratch,
                             amx_scratch, partials.data());
      } else if (g.head_dim == 128) {
        attend_item<T, 128>(item, g, qp, kp, vp, table, seq_lens[s], starts[s], q_len, op, scratch,
                             amx_scratch, partials.data());
      } else {
        attend_item<T, 0>(item, g, qp, kp, vp, table, seq_lens[s], starts[s], q_len, op, scratch,
                             amx_scratch, partials.data());
      }
    }
  }
  if (splits > 0) merge_splits(items, g, partials.data(), starts, op);
}

}  // namespace

namespace pagedserve_cpu {

// The Python wrapper (`kernels.cpu_ops.paged_attention`) has checked every argument with
// `kernels.validation`; these checks only guard the raw pointer arithmetic below.
void paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                     double softcap, const c10::optional<at::Tensor>& take, bool batch_variant,
                     at::Tensor out) {
  TORCH_CHECK(q_in.device().is_cpu(), "pagedserve CPU attention takes CPU tensors");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache head_dim must be dense");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt &&
                  (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
              "block_tables must be int32 with dense rows");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const auto lens_t = seq_lens.to(at::kInt).contiguous();
  const auto starts_t = query_start_loc.to(at::kInt).contiguous();
  const std::vector<int32_t> lens(lens_t.data_ptr<int32_t>(),
                                  lens_t.data_ptr<int32_t>() + lens_t.numel());
  const std::vector<int32_t> starts(starts_t.data_ptr<int32_t>(),
                                    starts_t.data_ptr<int32_t>() + starts_t.numel());
  TORCH_CHECK(!take || (take->scalar_type() == at::kBool && take->is_contiguous() &&
                        take->numel() == lens_t.numel()),
              "take must be a contiguous bool tensor of one flag per sequence");
  const bool* taken = take ? take->data_ptr<bool>() : nullptr;
  Geometry g{};
  g.num_heads = q.size(1);
  g.num_kv_heads = k_cache.size(2);
  g.group = g.num_heads / g.num_kv_heads;
  g.head_dim = q.size(2);
  g.block_size = k_cache.size(1);
  g.q_token = q.stride(0);
  g.q_head = q.stride(1);
  g.k_block = k_cache.stride(0);
  g.k_slot = k_cache.stride(1);
  g.k_head = k_cache.stride(2);
  g.v_block = v_cache.stride(0);
  g.v_slot = v_cache.stride(1);
  g.v_head = v_cache.stride(2);
  g.table_stride = block_tables.stride(0);
  g.window = sliding_window;
  g.scale = static_cast<float>(scale);
  g.softcap = static_cast<float>(softcap);
  g.amx = batch_variant && kAmxAttention && q.scalar_type() == at::kBFloat16 && amx_available();
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(q, k_cache, v_cache, block_tables, lens, starts, g, taken, batch_variant, out);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(q, k_cache, v_cache, block_tables, lens, starts, g, taken, batch_variant, out);
      break;
    case at::kHalf:
      run<c10::Half>(q, k_cache, v_cache, block_tables, lens, starts, g, taken, batch_variant, out);
      break;
    default:
      TORCH_CHECK(false, "pagedserve CPU attention takes float32, bfloat16 or float16, not ",
                  q.scalar_type());
  }
}

}  // namespace pagedserve_cpu

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, float softcap, "
      "Tensor? take, bool batch_variant, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("paged_attention", &pagedserve_cpu::paged_attention); }
