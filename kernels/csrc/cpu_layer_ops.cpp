// The decoder layer's ops besides attention and the matmuls, for pagedserve's cpu backend
// (`kernels.cpu_ops`): RMSNorm, residual add + RMSNorm, SiLU-and-multiply, and rotary embedding +
// KV-cache write (and, at the end, the sampler's greedy pick). Same contracts and the same
// roundings as `kernels/reference.py`, the oracle (its docstrings say where each rounds); one call
// each instead of the reference's 3 to 20 torch ops, whose per-op cost (~5 us each on the dev VM)
// made up a large share of a decode step of one stream (docs/benchmarks-history.md, "Quantized
// weights on CPU").
//
// Rows (tokens) are split over torch's threads only when a call holds more than kGrainElements
// elements, so a decode step's calls run on the calling thread without waking the others.
// Rows may be strided; their elements must be contiguous.

// The Tensor class alone, not <ATen/ATen.h> (every op's declaration): each source then compiles
// in about two thirds of the time, which a user waits through on first start.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_math.h"

namespace {

using pagedserve_cpu::exp_nonpositive;
using pagedserve_cpu::load;
using pagedserve_cpu::round_as;
using pagedserve_cpu::store;

constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be a 2-D tensor whose rows are contiguous");
}

#define PAGEDSERVE_DISPATCH_FLOATS(dtype, NAME, ...)                                    \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, NAME, __VA_ARGS__)

// weight * (x / rms(x)): normalised in float32 and rounded to T before the weight multiplies
// (the product rounded again), or with unit_offset (Gemma) multiplied by 1 + weight in float32
// and rounded once.
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t h, float eps,
                     bool unit_offset) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += load(x[i]) * load(x[i]);
  const float inv = 1.f / std::sqrt(sum / float(h) + eps);
  if (unit_offset) {
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) out[i] = store<T>(load(x[i]) * inv * (load(weight[i]) + 1.f));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) out[i] = store<T>(round_as<T>(load(x[i]) * inv) * load(weight[i]));
  }
}

// residual += x, rounded to T as torch's in-place add rounds.
template <typename T>
inline void add_row(const T* x, T* residual, int64_t h) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) residual[i] = store<T>(load(x[i]) + load(residual[i]));
}

// silu(gate) = gate * sigmoid(gate), rounded to T, times up, rounded again. sigmoid through
// e = exp(-|gate|) <= 1 (no overflow): 1 / (1 + e) for gate >= 0, e / (1 + e) below.
template <typename T>
inline void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t inter) {
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) {
    const float g = load(gate[i]);
    const float e = exp_nonpositive(-std::fabs(g));
    const float silu = g * (g >= 0.f ? 1.f : e) / (1.f + e);
    out[i] = store<T>(round_as<T>(silu) * load(up[i]));
  }
}

// x * cos + rot(x) * sin with rot([x1 | x2]) = [-x2 | x1], the tables' values rounded to T first,
// rot(x) * sin rounded to T, then the sum rounded (the reference's mul_ then addcmul_).
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(x[i]), x2 = load(x[i + half]);
    const float r1 = round_as<T>(-x2 * load(sin[i]));
    const float r2 = round_as<T>(x1 * load(sin[i + half]));
    out[i] = store<T>(r1 + x1 * load(cos[i]));
    out[i + half] = store<T>(r2 + x2 * load(cos[i + half]));
  }
}

}  // namespace

namespace pagedserve_cpu {

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset,
              at::Tensor& out) {
  check_rows(x, "x");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.dtype() == x.dtype() &&
                  weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.dtype() == x.dtype(),
              "rms_norm: out must be contiguous like x, weight [hidden] in x's dtype");
  const int64_t n = x.size(0), h = x.size(1), stride = x.stride(0);
  PAGEDSERVE_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row(xp + r * stride, wp, op + r * h, h, float(eps), unit_offset);
    });
  });
}

void fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, bool unit_offset, at::Tensor& out) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.dtype() == x.dtype() &&
                  out.is_contiguous() && out.sizes() == x.sizes() && out.dtype() == x.dtype() &&
                  weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.dtype() == x.dtype(),
              "fused_add_rms_norm: residual and out like x, weight [hidden] in x's dtype");
  const int64_t n = x.size(0), h = x.size(1);
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  PAGEDSERVE_DISPATCH_FLOATS(x.scalar_type(), "fused_add_rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    auto* rp = residual.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(xp + r * x_stride, rp + r * r_stride, h);
        norm_row(rp + r * r_stride, wp, op + r * h, h, float(eps), unit_offset);
      }
    });
  });
}

void head_rms_norm(at::Tensor& x, int64_t offset, int64_t heads, int64_t head_dim,
                   const at::Tensor& weight, double eps, bool unit_offset) {
  check_rows(x, "x");
  TORCH_CHECK(offset >= 0 && offset + heads * head_dim <= x.size(1) && weight.is_contiguous() &&
                  weight.numel() == head_dim && weight.dtype() == x.dtype(),
              "head_rms_norm: the heads must lie within x's rows, weight [head_dim] in x's dtype");
  const int64_t n = x.size(0), stride = x.stride(0);
  PAGEDSERVE_DISPATCH_FLOATS(x.scalar_type(), "head_rms_norm", [&] {
    auto* xp = x.data_ptr<scalar_t>() + offset;
    const auto* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, n * heads, grain_rows(head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* row = xp + (i / heads) * stride + (i % heads) * head_dim;
        norm_row(row, wp, row, head_dim, float(eps), unit_offset);
      }
    });
  });
}

void silu_and_mul(const at::Tensor& gate_up, at::Tensor& out) {
  check_rows(gate_up, "gate_up");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && out.is_contiguous() && out.size(0) == n &&
                  out.size(1) == inter && out.dtype() == gate_up.dtype(),
              "silu_and_mul: out must be contiguous [tokens, ", inter, "] in gate_up's dtype");
  PAGEDSERVE_DISPATCH_FLOATS(gate_up.scalar_type(), "silu_and_mul", [&] {
    const auto* gp = gate_up.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_and_mul_row(gp + r * stride, gp + r * stride + inter, op + r * inter, inter);
    });
  });
}

void rotary_and_cache(const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& cos_table, const at::Tensor& sin_table,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor& q) {
  check_rows(qkv, "qkv");
  const int64_t n = qkv.size(0), table_rows = cos_table.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rotary_and_cache: qkv must be [tokens, (heads + 2 kv heads) x head_dim]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() &&
                  cos_table.sizes() == sin_table.sizes() && cos_table.size(1) == head_dim,
              "rotary_and_cache: cos and sin tables must be contiguous float32 [positions, ",
              head_dim, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == n && slot_mapping.numel() == n,
              "rotary_and_cache: positions and slot_mapping must be contiguous int64 [tokens]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.dtype() == qkv.dtype() && v_cache.dtype() == qkv.dtype(),
              "rotary_and_cache: caches must be [blocks, block_size, kv heads, head_dim] in "
              "qkv's dtype");
  TORCH_CHECK(q.is_contiguous() && q.numel() == n * num_heads * head_dim &&
                  q.dtype() == qkv.dtype(),
              "rotary_and_cache: q must be contiguous [tokens, heads, head_dim]");
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // Checked before anything is written, as the reference checks.
  int64_t highest = -1;
  for (int64_t t = 0; t < n; ++t) {
    highest = std::max(highest, slots[t]);
    TORCH_CHECK_INDEX(pos[t] >= -table_rows && pos[t] < table_rows, "index ", pos[t],
                      " is out of bounds for dimension 0 with size ", table_rows);
  }
  TORCH_CHECK_VALUE(highest < num_slots, "slot_mapping holds slot ", highest,
                    ", but the cache has only ", num_slots, " slots (", k_cache.size(0),
                    " blocks x ", block_size, ")");
  const int64_t row_stride = qkv.stride(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  PAGEDSERVE_DISPATCH_FLOATS(qkv.scalar_type(), "rotary_and_cache", [&] {
    using T = scalar_t;
    const T* src = qkv.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    const float* cos_all = cos_table.data_ptr<float>();
    const float* sin_all = sin_table.data_ptr<float>();
    const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
    const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
    at::parallel_for(0, n, grain_rows(qkv.size(1)), [&](int64_t begin, int64_t end) {
      std::vector<T> cos(head_dim), sin(head_dim);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = pos[t] < 0 ? pos[t] + table_rows : pos[t];
        for (int64_t i = 0; i < head_dim; ++i) {
          cos[i] = store<T>(cos_all[p * head_dim + i]);
          sin[i] = store<T>(sin_all[p * head_dim + i]);
        }
        const T* row = src + t * row_stride;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate_head(row + h * head_dim, cos.data(), sin.data(),
                      qp + (t * num_heads + h) * head_dim, half);
        const int64_t slot = slots[t];
        if (slot < 0) continue;  // padding
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          rotate_head(row + q_size + h * head_dim, cos.data(), sin.data(),
                      kc + block * kb + offset * ks + h * kh, half);
          std::copy_n(row + q_size + kv_size + h * head_dim, head_dim,
                      vc + block * vb + offset * vs + h * vh);
        }
      }
    });
  });
}

// A row's largest value in `top`; returns whether the row is all finite (x * 0 is NaN only for a
// NaN or an infinity), in one pass.
inline bool max_and_finite(const float* row, int64_t vocab, float& top) {
  float high = -std::numeric_limits<float>::infinity(), zero = 0.0f;
#pragma omp simd reduction(max : high) reduction(+ : zero)
  for (int64_t i = 0; i < vocab; ++i) {
    high = row[i] > high ? row[i] : high;
    zero += row[i] * 0.0f;
  }
  top = high;
  return zero == 0.0f;
}

// The sampler's greedy pick over float32 logits [rows, vocab] (rows contiguous): each row's first
// index of its largest value, and whether the row is all finite (a NaN or an infinity anywhere:
// false, and id 0, as the sampler's torch path gives). One pass finds the max and checks (x * 0 is
// NaN only for a NaN or an infinity), a second stops at the max's first index: torch's max(dim),
// amax and amin read a decode step's [64, 49152] three times (docs/benchmarks-history.md, "Prefill
// attention on AMX tiles").
void greedy_pick(const at::Tensor& logits, at::Tensor& ids, at::Tensor& finite) {
  check_rows(logits, "logits");
  const int64_t n = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(logits.scalar_type() == at::kFloat && vocab > 0,
              "greedy_pick: logits must be float32 [rows, vocab] with vocab > 0");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == n &&
                  finite.scalar_type() == at::kBool && finite.is_contiguous() &&
                  finite.numel() == n,
              "greedy_pick: ids must be int64 [rows], finite bool [rows]");
  const float* x = logits.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  at::parallel_for(0, n, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      float top;
      ok[r] = max_and_finite(row, vocab, top);
      int64_t first = 0;
      if (ok[r])
        while (row[first] != top) ++first;  // every value is finite: top is one of them
      id[r] = first;
    }
  });
}

// The sampler's draw for rows that sample by temperature alone (no top-k, top-p, min-p, rule,
// penalty or grammar), as `inverse_cdf_sample` draws from softmax(x / T): the first token whose
// running weight passes u times the row's total, the weights exp((x - max) / T), summed per chunk
// of 1024 in float32, the chunks' sums in double, then the chosen chunk's tokens in double. Its
// passes: the max and finite check, the chunk sums, the chunk; torch's path makes the
// probabilities, their chunk sums and cumulative sums, and two searches (0.3 ms of a decode token
// of one stream: docs/benchmarks-history.md, "Rows interleaved by 8"). A row not all finite
// gets id 0.
void temperature_pick(const at::Tensor& logits, const at::Tensor& temperatures,
                      const at::Tensor& uniforms, at::Tensor& ids, at::Tensor& finite) {
  check_rows(logits, "logits");
  const int64_t n = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(logits.scalar_type() == at::kFloat && vocab > 0,
              "temperature_pick: logits must be float32 [rows, vocab] with vocab > 0");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == n && uniforms.scalar_type() == at::kDouble &&
                  uniforms.is_contiguous() && uniforms.numel() == n,
              "temperature_pick: temperatures must be float32 [rows], uniforms float64 [rows]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == n &&
                  finite.scalar_type() == at::kBool && finite.is_contiguous() &&
                  finite.numel() == n,
              "temperature_pick: ids must be int64 [rows], finite bool [rows]");
  constexpr int64_t kChunk = 1024;  // inverse_cdf_sample's
  const float* x = logits.data_ptr<float>();
  const float* temps = temperatures.data_ptr<float>();
  const double* us = uniforms.data_ptr<double>();
  int64_t* id = ids.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(temps[r] > 0.0f, "temperature_pick: temperatures must be positive");
  at::parallel_for(0, n, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    std::vector<double> mass((vocab + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      float top;
      ok[r] = max_and_finite(row, vocab, top);
      id[r] = 0;
      if (!ok[r]) continue;
      const float inverse = 1.0f / temps[r];
      double total = 0.0;
      for (size_t c = 0; c < mass.size(); ++c) {
        const int64_t lo = static_cast<int64_t>(c) * kChunk, hi = std::min(vocab, lo + kChunk);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = lo; i < hi; ++i) sum += exp_nonpositive((row[i] - top) * inverse);
        mass[c] = sum;
        total += sum;
      }
      const double target = us[r] * total;
      size_t c = 0;
      double before = 0.0;
      for (; c + 1 < mass.size() && before + mass[c] <= target; ++c) before += mass[c];
      const int64_t lo = static_cast<int64_t>(c) * kChunk, hi = std::min(vocab, lo + kChunk);
      const double remaining = target - before;
      double running = 0.0;
      int64_t pick = -1, last_nonzero = lo;
      for (int64_t i = lo; i < hi; ++i) {
        const float w = exp_nonpositive((row[i] - top) * inverse);
        if (w > 0.0f) last_nonzero = i;
        running += w;
        if (pick < 0 && running > remaining) pick = i;
      }
      // Rounding can leave `remaining` at or past the chunk's total: its last token of weight.
      id[r] = pick >= 0 ? pick : last_nonzero;
    }
  });
}

}  // namespace pagedserve_cpu

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("greedy_pick(Tensor logits, Tensor(a!) ids, Tensor(b!) finite) -> ()");
  m.def(
      "temperature_pick(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor(a!) ids, "
      "Tensor(b!) finite) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset, Tensor(a!) out) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
      "bool unit_offset, Tensor(b!) out) -> ()");
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def(
      "rotary_and_cache(Tensor qkv, Tensor positions, Tensor cos_table, Tensor sin_table, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, "
      "int num_kv_heads, int head_dim, Tensor(c!) q) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &pagedserve_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &pagedserve_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &pagedserve_cpu::silu_and_mul);
  m.impl("rotary_and_cache", &pagedserve_cpu::rotary_and_cache);
  m.impl("greedy_pick", &pagedserve_cpu::greedy_pick);
  m.impl("temperature_pick", &pagedserve_cpu::temperature_pick);
}
