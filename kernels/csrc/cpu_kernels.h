// The entry points of pagedserve's CPU kernels, as the torch ops `pagedserve_cpu::<name>` run them
// (each source registers its own) and as the compiled decoder step (cpu_decoder.cpp) calls them
// directly, without a trip through Python or the dispatcher. Each is defined, with its contract,
// in the source named beside it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedserve_cpu {

// cpu_attention.cpp: `kernels.reference.paged_attention` for the sequences `take` flags (all when
// it is not given); sliding_window 0 and softcap 0 mean none; `batch_variant` allows the faster
// paths whose results depend on the batch.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                     double softcap, const c10::optional<at::Tensor>& take, bool batch_variant,
                     at::Tensor out);

// cpu_layer_ops.cpp: the reference's rms_norm, fused_add_rms_norm, silu_and_mul and
// rotary_and_cache, writing into the given outputs.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset,
              at::Tensor& out);
void fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, bool unit_offset, at::Tensor& out);
void silu_and_mul(const at::Tensor& gate_up, at::Tensor& out);
// In place: rms_norm over each of `heads` heads of head_dim values from column `offset` of x's
// rows (Qwen3's and Gemma 3's q/k norms), each head as the rms_norm of one row.
void head_rms_norm(at::Tensor& x, int64_t offset, int64_t heads, int64_t head_dim,
                   const at::Tensor& weight, double eps, bool unit_offset);
void rotary_and_cache(const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& cos_table, const at::Tensor& sin_table,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor& q);

// cpu_gguf.cpp: out (rows may be strided) = x @ W^T for W a GGUF file's blocks of `qtype`, by
// integer dot products of the blocks (block_linear; out of x's dtype or float32) or by AMX bf16
// tiles (amx_linear; out of x's dtype).
void gguf_block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                       at::Tensor& out);
void gguf_amx_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                     at::Tensor& out);
// out = W's values, all rows or rows `rows` (int64 ids).
void gguf_block_dequantize(const at::Tensor& weight, int64_t qtype, at::Tensor& out,
                           const c10::optional<at::Tensor>& rows);
// W's N (`qtype` may be a Q4 type with rows interleaved by 8: its tensor holds N / 8 rows).
int64_t gguf_weight_rows(const at::Tensor& weight, int64_t qtype);
// Whether this build has AMX's bf16 tiles and the process may use them (Linux grants the tile
// state on request, once per process); cpu_attention.cpp's prefill tiles use them too.
bool amx_available();

}  // namespace pagedserve_cpu
