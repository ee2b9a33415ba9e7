// DecoderStack (decoder_stack.h): the Python layers' forward (engine_core/models/llama.py with
// layers/attention.py and layers/mlp.py over FusedLayerOps), step for step, in C++: fp32 or bf16 activations, each
// with FusedLayerOps' kernels for that dtype.
#include "decoder_stack.h"

#include <utility>

// the kernels it calls, from their own translation units
at::Tensor rms_norm_f32(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
void rotary_f32_(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul_f32(at::Tensor gate_up);
at::Tensor gelu_tanh_and_mul_f32(at::Tensor gate_up);
void linear_quant_(at::Tensor out, int64_t col0, at::Tensor x, at::Tensor codes, at::Tensor scales,
                   c10::optional<at::Tensor> mins, int64_t bits, int64_t group, c10::optional<at::Tensor> bias);
#if defined(__AVX512BF16__)
void linear_quant_rows_(at::Tensor out, int64_t col0, at::Tensor x, at::Tensor codes, at::Tensor scales,
                        c10::optional<at::Tensor> mins, int64_t bits, int64_t group, c10::optional<at::Tensor> bias);
#else  // Python sets no rounded rows where the build lacks it
static void linear_quant_rows_(at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                               int64_t, int64_t, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "this kernel build has no linear_quant_rows_");
}
#endif
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                        at::Tensor key_counts, double scale, int64_t window, double softcap,
                        c10::optional<at::Tensor> k, c10::optional<at::Tensor> v, c10::optional<at::Tensor> slots);
#if defined(__AVX512BF16__)
at::Tensor rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
void rotary_(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up);
at::Tensor linear_bf16(at::Tensor x, at::Tensor packed, int64_t out_features, c10::optional<at::Tensor> bias,
                       bool out_fp32, bool batch_tiles);
#else  // the bf16 kernels exist in AVX-512 BF16 builds only, and Python builds a bf16 stack only where they do
[[noreturn]] static void no_bf16() { TORCH_CHECK(false, "this kernel build has no bf16 layer kernels"); }
static at::Tensor rms_norm(at::Tensor, c10::optional<at::Tensor>, at::Tensor, double) { no_bf16(); }
static void rotary_(at::Tensor, at::Tensor, at::Tensor, at::Tensor) { no_bf16(); }
static at::Tensor silu_and_mul(at::Tensor) { no_bf16(); }
static at::Tensor gelu_tanh_and_mul(at::Tensor) { no_bf16(); }
static at::Tensor linear_bf16(at::Tensor, at::Tensor, int64_t, c10::optional<at::Tensor>, bool, bool) { no_bf16(); }
#endif

void StackProjection::set_dense(at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(parts_.empty() && weight.scalar_type() == at::kFloat && weight.size(0) == out_features_,
              "a plain projection takes one fp32 [N, K] weight");
  weight_ = std::move(weight);
  bias_ = std::move(bias);
}

void StackProjection::set_packed(at::Tensor blocks, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(parts_.empty() && !weight_.defined(), "a projection has one weight");
  packed_ = std::move(blocks);
  bias_ = std::move(bias);
}

void StackProjection::add_quant_part(int64_t col0, at::Tensor codes, at::Tensor scales,
                                     c10::optional<at::Tensor> mins, int64_t bits, int64_t group,
                                     c10::optional<at::Tensor> bias) {
  TORCH_CHECK(!weight_.defined() && !packed_.defined(), "a projection is plain or quantized, not both");
  parts_.push_back({col0, std::move(codes), std::move(scales), std::move(mins), bits, group, std::move(bias)});
}

at::Tensor StackProjection::operator()(const at::Tensor& x, bool may_round) const {
  if (weight_.defined()) return at::linear(x, weight_, bias_);  // what F.linear runs
  const bool round = may_round && rounded_min_rows_ > 0 && x.size(0) >= rounded_min_rows_;
  if (packed_.defined()) return linear_bf16(x, packed_, out_features_, bias_, false, round);
  auto out = at::empty({x.size(0), out_features_}, x.options());  // QuantLinear's: the model's dtype
  for (const QuantPart& p : parts_) {
    // one scale a row (int8): its exact kernel is as fast as the rounded one, and stays
    const auto matmul = round && p.group != x.size(1) ? linear_quant_rows_ : linear_quant_;
    matmul(out, p.col0, x, p.codes, p.scales, p.mins, p.bits, p.group, p.bias);
  }
  return out;
}

void DecoderStack::add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, StackProjection qkv,
                             StackProjection o, StackProjection gate_up, StackProjection down,
                             c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, at::Tensor cos,
                             at::Tensor sin, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms go together");
  layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                     std::move(gate_up), std::move(down), std::move(q_norm), std::move(k_norm), std::move(cos),
                     std::move(sin), scale, window, softcap});
}

at::Tensor DecoderStack::norm(const at::Tensor& residual, c10::optional<at::Tensor> delta,
                               const at::Tensor& weight) const {
  return bf16_ ? rms_norm(residual, std::move(delta), weight, eps_)
               : rms_norm_f32(residual, std::move(delta), weight, eps_);
}

at::Tensor DecoderStack::attention(const Layer& layer, const at::Tensor& x, const at::Tensor& positions,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, const at::Tensor& key_counts,
                                   const at::Tensor& slots, bool may_round) const {
  const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const at::Tensor qkv = layer.qkv(x, may_round);
  at::Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({-1, heads_ + kv_heads_, head_dim_});
  if (layer.q_norm) {  // Qwen3: per-head RMSNorm before RoPE
    const at::Tensor q =
        norm(qk.slice(1, 0, heads_).reshape({-1, head_dim_}).contiguous(), c10::nullopt, *layer.q_norm);
    const at::Tensor k = norm(qk.slice(1, heads_).reshape({-1, head_dim_}).contiguous(), c10::nullopt, *layer.k_norm);
    qk = at::cat({q.view({-1, heads_, head_dim_}), k.view({-1, kv_heads_, head_dim_})}, 1);
  }
  if (bf16_) rotary_(qk, positions, layer.cos, layer.sin);
  else rotary_f32_(qk, positions, layer.cos, layer.sin);
  const at::Tensor v = qkv.slice(1, q_size + kv_size).view({-1, kv_heads_, head_dim_});
  const at::Tensor o = paged_decode(qk.slice(1, 0, heads_), k_cache, v_cache, block_table, key_counts, layer.scale,
                                    layer.window, layer.softcap, qk.slice(1, heads_), v, slots);
  return layer.o(o.reshape({-1, q_size}), may_round);
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(at::Tensor h, at::Tensor x, at::Tensor positions,
                                                         std::vector<at::Tensor> k_caches,
                                                         std::vector<at::Tensor> v_caches, at::Tensor block_table,
                                                         at::Tensor key_counts, at::Tensor slots,
                                                         bool exact) const {
  TORCH_CHECK(final_norm_.defined(), "set_final_norm first");
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one cache per layer");
  // once per step rather than in every layer's attention call
  block_table = block_table.to(at::kLong).contiguous();
  key_counts = key_counts.to(at::kLong).contiguous();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    const at::Tensor& next_norm = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
    const at::Tensor attn =
        attention(layer, x, positions, k_caches[i], v_caches[i], block_table, key_counts, slots, !exact);
    x = norm(h, attn, layer.post_attention_norm);  // h += attn in place
    const at::Tensor gate_up = layer.gate_up(x, !exact);
    const at::Tensor act = bf16_ ? (gelu_ ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up))
                                 : (gelu_ ? gelu_tanh_and_mul_f32(gate_up) : silu_and_mul_f32(gate_up));
    x = norm(h, layer.down(act, !exact), next_norm);
  }
  return {h, x};
}
