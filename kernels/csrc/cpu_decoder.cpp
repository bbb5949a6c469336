// The compiled decoder step: a whole stack of decoder layers run as one call, for the steps the
// attention kernel takes whole (decodes, verifies, short prompts) of a model whose matmul weights
// are kept as a GGUF file's blocks. `engine/models/compiled_step.py` builds it from a loaded model
// and says which models and steps it takes.
//
// Why: run layer by layer from Python, a decode step of one stream on a 2-core VM spent as long
// between the ops as in them, and the weights' cache lines and the cores went cold in the gaps,
// slowing the matmuls themselves by 1.7x (docs/benchmarks-history.md, "The decode step as one
// call"). Here the ops are the same functions the torch ops run (cpu_kernels.h), called back to
// back in C++, in the same order on the same buffers as `engine/models/model.py` calls them: the
// hidden states equal the Python path's bit for bit.
//
// A layer (the Llama family's, with Qwen2's q/k/v bias and Mistral's window):
//   h, r = add_rms_norm(h, r)            (layer 0: r = h, h = rms_norm(h))
//   qkv = h @ Wqkv^T (+ bias); q = rope(q), k = rope(k) written with v to the cache
//   h = attention(q, cache) @ Wo^T
//   h, r = add_rms_norm(h, r)
//   h = (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
// and after the last layer h, _ = add_rms_norm(h, r) with the final norm. Gemma's layers add
// per-head q/k norms before the rotation (Qwen3's too), a norm of the attention's output before
// the residual add and one of the MLP's output (`sandwich`), GELU-tanh for SiLU, norms that
// multiply by 1 + weight, and soft-capped attention scores (Gemma 2).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

// A matmul weight as the blocks of one or more parts (a fused q/k/v weight whose parts come in
// different block types), each multiplied into its own output columns.
struct Matmul {
  std::vector<at::Tensor> parts;  // uint8 [rows, blocks' bytes], in output order
  std::vector<int64_t> qtypes;    // each part's GGML type id
  int64_t out_features = 0;

  Matmul() = default;
  Matmul(std::vector<at::Tensor> blocks, std::vector<int64_t> types)
      : parts(std::move(blocks)), qtypes(std::move(types)) {
    TORCH_CHECK(!parts.empty() && parts.size() == qtypes.size(),
                "a matmul weight needs one block type per part");
    for (size_t i = 0; i < parts.size(); ++i)
      out_features += pagedserve_cpu::gguf_weight_rows(parts[i], qtypes[i]);
  }

  // out [rows, out_features] = x @ W^T, by the AMX tiles or the blocks' dot products.
  void operator()(const at::Tensor& x, at::Tensor& out, bool amx) const {
    const auto run = amx ? pagedserve_cpu::gguf_amx_linear : pagedserve_cpu::gguf_block_linear;
    if (parts.size() == 1) {
      run(x, parts[0], qtypes[0], out);
      return;
    }
    int64_t start = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t rows = pagedserve_cpu::gguf_weight_rows(parts[i], qtypes[i]);
      at::Tensor columns = out.narrow(1, start, rows);
      run(x, parts[i], qtypes[i], columns);
      start += rows;
    }
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  // Gemma's norms of the attention's and the MLP's outputs (`post_attention_norm` is then the
  // one of the attention's output, `pre_feedforward_norm` the residual add's).
  c10::optional<at::Tensor> pre_feedforward_norm, post_feedforward_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // per head, before the rotation
  Matmul qkv, o, gate_up, down;
  c10::optional<at::Tensor> qkv_bias;
  at::Tensor cos, sin;  // float32 [positions, head_dim] rotary tables
  int64_t window = 0;   // sliding window, 0: none
  int64_t kv_group = 0; // which of the step's slot mappings and block tables it uses
};

class DecoderLayers : public torch::CustomClassHolder {
 public:
  // unit_offset: Gemma's norms (1 + weight); softcap 0: none; gelu: GELU-tanh, else SiLU.
  DecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                double scale, at::Tensor final_norm, bool unit_offset, double softcap, bool gelu)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), final_norm_(std::move(final_norm)), unit_offset_(unit_offset),
        softcap_(softcap), gelu_(gelu) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm,
                 std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_types,
                 c10::optional<at::Tensor> qkv_bias, std::vector<at::Tensor> o,
                 std::vector<int64_t> o_types, std::vector<at::Tensor> gate_up,
                 std::vector<int64_t> gate_up_types, std::vector<at::Tensor> down,
                 std::vector<int64_t> down_types, at::Tensor cos, at::Tensor sin,
                 int64_t window, int64_t kv_group, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, c10::optional<at::Tensor> pre_feedforward_norm,
                 c10::optional<at::Tensor> post_feedforward_norm) {
    Layer layer;
    layer.input_norm = std::move(input_norm);
    layer.post_attention_norm = std::move(post_attention_norm);
    layer.pre_feedforward_norm = std::move(pre_feedforward_norm);
    layer.post_feedforward_norm = std::move(post_feedforward_norm);
    layer.q_norm = std::move(q_norm);
    layer.k_norm = std::move(k_norm);
    TORCH_CHECK(layer.pre_feedforward_norm.has_value() == layer.post_feedforward_norm.has_value() &&
                    layer.q_norm.has_value() == layer.k_norm.has_value(),
                "decoder layer ", layers_.size(), ": norms come in pairs");
    layer.qkv = Matmul(std::move(qkv), std::move(qkv_types));
    layer.o = Matmul(std::move(o), std::move(o_types));
    layer.gate_up = Matmul(std::move(gate_up), std::move(gate_up_types));
    layer.down = Matmul(std::move(down), std::move(down_types));
    layer.qkv_bias = std::move(qkv_bias);
    layer.cos = std::move(cos);
    layer.sin = std::move(sin);
    layer.window = window;
    layer.kv_group = kv_group;
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK(layer.qkv.out_features == q_size + 2 * kv_size &&
                    layer.o.out_features == final_norm_.numel() &&
                    layer.gate_up.out_features % 2 == 0 &&
                    layer.down.out_features == final_norm_.numel(),
                "decoder layer ", layers_.size(), ": its weights' shapes do not fit the model's");
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The final normed hidden states [tokens, hidden] of the step's tokens, `x` their embeddings
  // (used as the residual stream, so changed in place). `amx`: the matmuls take the AMX tiles
  // (bfloat16 steps of their rows: `quantized_linear.route`), else the blocks' dot products;
  // `batch_variant`: the attention may take its paths whose results depend on the batch.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions,
                     const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, bool amx, bool batch_variant) {
    TORCH_CHECK(!layers_.empty(), "the compiled decoder has no layers");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == final_norm_.numel(),
                "x must be contiguous [tokens, hidden]");
    const int64_t n = x.size(0), hidden = x.size(1);
    const auto opts = x.options();
    const int64_t qkv_size = layers_[0].qkv.out_features;
    const int64_t inter2 = layers_[0].gate_up.out_features;
    // One buffer per intermediate, reused by every layer (as the Python path's fresh tensors, but
    // warm in the caches).
    at::Tensor normed = at::empty({n, hidden}, opts);
    at::Tensor branch = at::empty({n, hidden}, opts);
    at::Tensor sandwich = at::empty({n, hidden}, opts);  // a Gemma branch before its norm
    at::Tensor qkv = at::empty({n, qkv_size}, opts);
    at::Tensor q = at::empty({n, num_heads_, head_dim_}, opts);
    at::Tensor attn = at::empty({n, num_heads_, head_dim_}, opts);
    at::Tensor attn_rows = attn.view({n, num_heads_ * head_dim_});
    at::Tensor gate_up = at::empty({n, inter2}, opts);
    at::Tensor act = at::empty({n, inter2 / 2}, opts);
    std::vector<at::Tensor> slots, tables;
    for (int64_t g = 0; g < slot_mapping.size(0); ++g) {
      slots.push_back(slot_mapping.select(0, g));
      tables.push_back(block_tables.select(0, g));
    }
    at::Tensor& residual = x;
    const bool unit = unit_offset_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      TORCH_CHECK(layer.kv_group < static_cast<int64_t>(slots.size()),
                  "the step has no slot mapping for KV group ", layer.kv_group);
      if (i == 0)
        pagedserve_cpu::rms_norm(x, layer.input_norm, eps_, unit, normed);
      else
        pagedserve_cpu::fused_add_rms_norm(branch, residual, layer.input_norm, eps_, unit,
                                           normed);
      layer.qkv(normed, qkv, amx);
      if (layer.qkv_bias) qkv.add_(*layer.qkv_bias);
      if (layer.q_norm) {
        const int64_t q_size = num_heads_ * head_dim_;
        pagedserve_cpu::head_rms_norm(qkv, 0, num_heads_, head_dim_, *layer.q_norm, eps_, unit);
        pagedserve_cpu::head_rms_norm(qkv, q_size, num_kv_heads_, head_dim_, *layer.k_norm, eps_,
                                      unit);
      }
      at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
      pagedserve_cpu::rotary_and_cache(qkv, positions, layer.cos, layer.sin, k_cache, v_cache,
                                       slots[layer.kv_group], num_heads_, num_kv_heads_,
                                       head_dim_, q);
      pagedserve_cpu::paged_attention(q, k_cache, v_cache, tables[layer.kv_group], seq_lens,
                                      query_start_loc, scale_, layer.window, softcap_,
                                      c10::nullopt, batch_variant, attn);
      layer.o(attn_rows, branch, amx);
      if (layer.pre_feedforward_norm) {  // Gemma: norm the attention's output, then add
        pagedserve_cpu::rms_norm(branch, layer.post_attention_norm, eps_, unit, sandwich);
        pagedserve_cpu::fused_add_rms_norm(sandwich, residual, *layer.pre_feedforward_norm, eps_,
                                           unit, normed);
      } else {
        pagedserve_cpu::fused_add_rms_norm(branch, residual, layer.post_attention_norm, eps_,
                                           unit, normed);
      }
      layer.gate_up(normed, gate_up, amx);
      if (gelu_)  // as kernels.reference.gelu_tanh_and_mul: the same ATen ops
        at::gelu_out(act, gate_up.narrow(1, 0, inter2 / 2), "tanh")
            .mul_(gate_up.narrow(1, inter2 / 2, inter2 / 2));
      else
        pagedserve_cpu::silu_and_mul(gate_up, act);
      if (layer.post_feedforward_norm) {
        layer.down(act, sandwich, amx);
        pagedserve_cpu::rms_norm(sandwich, *layer.post_feedforward_norm, eps_, unit, branch);
      } else {
        layer.down(act, branch, amx);
      }
    }
    pagedserve_cpu::fused_add_rms_norm(branch, residual, final_norm_, eps_, unit, normed);
    return normed;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor final_norm_;
  bool unit_offset_;
  double softcap_;
  bool gelu_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, bool, double, bool>())
      .def("add_layer", &DecoderLayers::add_layer)
      .def("num_layers", &DecoderLayers::num_layers)
      .def("forward", &DecoderLayers::forward);
}
