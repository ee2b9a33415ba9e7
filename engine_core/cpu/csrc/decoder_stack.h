// A whole stack of Llama-shaped decoder layers (Llama, SmolLM, Mistral, Qwen2/3) in one call, for the fp32 or
// bf16 forward of small steps: the same kernels the Python layers call (layer_ops_f32.cpp or layer_ops.cpp,
// linear_quant.cpp, paged_decode.cpp, at::linear for a plain fp32 weight, linear_bf16 for a packed bf16 one) in
// the same order on the same tensors, so the result is bit for bit the Python path's. What it saves is the glue:
// at batch 1 a layer makes ~9 kernel calls and a dozen views from Python, ~2 us each, about 1.3 ms of a 10 ms
// step on a small model (docs/benchmarks.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

// One matmul: a plain fp32 weight (at::linear), a bf16 weight packed for linear_bf16, or parts kept quantized,
// each writing its columns of the output (in the activations' dtype).
class StackProjection {
 public:
  explicit StackProjection(int64_t out_features) : out_features_(out_features) {}
  void set_dense(at::Tensor weight, c10::optional<at::Tensor> bias);
  void set_packed(at::Tensor blocks, c10::optional<at::Tensor> bias);  // linear_bf16's blocks, an fp32 bias
  void add_quant_part(int64_t col0, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t bits,
                      int64_t group, c10::optional<at::Tensor> bias);
  // From this many rows (0: never), a step that may round (no verify pass in it) runs the parts with scale groups
  // on linear_quant_rows_, the weights rounded to bf16 a block at a time as a prefill's are (faster from 12 rows
  // for 4-bit codes), and a packed bf16 weight on linear_bf16's prefill tiles. A verify pass keeps the exact
  // kernels, whose rows get their 1-row sums to the bit.
  void set_rounded_min_rows(int64_t rows) { rounded_min_rows_ = rows; }
  at::Tensor operator()(const at::Tensor& x, bool may_round) const;

 private:
  struct QuantPart {
    int64_t col0;
    at::Tensor codes, scales;
    c10::optional<at::Tensor> mins;
    int64_t bits, group;
    c10::optional<at::Tensor> bias;
  };
  int64_t out_features_;
  int64_t rounded_min_rows_ = 0;
  at::Tensor weight_;  // defined for a plain weight
  at::Tensor packed_;  // defined for a packed bf16 weight
  c10::optional<at::Tensor> bias_;
  std::vector<QuantPart> parts_;
};

class DecoderStack {
 public:
  // bf16: the activations are bf16 and the layers call the bf16 kernels (an AVX-512 BF16 build), as FusedLayerOps
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, bool gelu, bool bf16)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), gelu_(gelu), bf16_(bf16) {}
  // Layers in order; a layer's output norm is the next layer's input norm, the last one's `final_norm`.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, StackProjection qkv, StackProjection o,
                 StackProjection gate_up, StackProjection down, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, at::Tensor cos, at::Tensor sin, double scale, int64_t window,
                 double softcap);
  void set_final_norm(at::Tensor weight) { final_norm_ = weight; }
  // h: the residual stream [T, hidden] (updated in place), x: its input-normed copy; returns (h, x) after the
  // last layer, x normed by the final norm. This step's keys and values are written to `slots` of each cache.
  // exact: the step holds a verify pass, and every projection keeps the exact kernel (set_rounded_min_rows).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, at::Tensor x, at::Tensor positions,
                                             std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                             at::Tensor block_table, at::Tensor key_counts, at::Tensor slots,
                                             bool exact) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_attention_norm;
    StackProjection qkv, o, gate_up, down;
    c10::optional<at::Tensor> q_norm, k_norm;
    at::Tensor cos, sin;
    double scale;
    int64_t window;
    double softcap;
  };
  at::Tensor norm(const at::Tensor& residual, c10::optional<at::Tensor> delta, const at::Tensor& weight) const;
  at::Tensor attention(const Layer& layer, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& key_counts,
                       const at::Tensor& slots, bool may_round) const;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  bool gelu_, bf16_;
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
};
