// One extension module for the CPU kernels: paged decode attention, the grammar bitmask, the LoRA delta and the
// fp32 fused layer ops and the quantized linear always, the bf16 fused layer ops and linear where the CPU has AVX-512 BF16 (Python checks for them by name).
#include <torch/extension.h>

#include "decoder_stack.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                           torch::Tensor key_counts, double scale, int64_t window, double softcap,
                           c10::optional<torch::Tensor> k, c10::optional<torch::Tensor> v,
                           c10::optional<torch::Tensor> slots);
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, std::vector<int64_t> rows);
torch::Tensor rms_norm_f32(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps);
void rotary_f32_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul_f32(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul_f32(torch::Tensor gate_up);
void linear_quant_(torch::Tensor out, int64_t col0, torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                   c10::optional<torch::Tensor> mins, int64_t bits, int64_t group, c10::optional<torch::Tensor> bias);
torch::Tensor dequantize_quant(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                               int64_t bits, int64_t group, int64_t k, at::ScalarType dtype);
void lora_delta_(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
                 int64_t rank, std::vector<int64_t> bounds);
#if defined(__AVX512BF16__)
void linear_quant_rows_(torch::Tensor out, int64_t col0, torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        c10::optional<torch::Tensor> mins, int64_t bits, int64_t group,
                        c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, bool out_fp32, bool batch_tiles);
#endif

// The widest vector path this build was compiled for; Python refuses a build its CPU cannot run.
static const char* compiled_isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// The GIL is released while a kernel runs, so the server's event loop runs beside it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("compiled_isa", &compiled_isa, "the vector ISA this build targets");
  m.def("paged_decode", &paged_decode,
        "paged attention over a block-paged KV cache, one query a row, optional sliding window and soft-cap (CPU); "
        "with k, v and slots, this step's keys and values are written to their slots first",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_table"),
        pybind11::arg("key_counts"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("k") = pybind11::none(), pybind11::arg("v") = pybind11::none(),
        pybind11::arg("slots") = pybind11::none(), release());
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "a grammar's token bitmask applied to rows of logits",
        release());
  m.def("rms_norm_f32", &rms_norm_f32, "RMSNorm, with an optional residual add in place (fp32)", release());
  m.def("rotary_f32_", &rotary_f32_, "rotary embeddings in place, rotate-half layout (fp32)", release());
  m.def("silu_and_mul_f32", &silu_and_mul_f32, "silu(gate) * up over a fused [T, 2I] projection (fp32)",
        release());
  m.def("gelu_tanh_and_mul_f32", &gelu_tanh_and_mul_f32,
        "gelu_tanh(gate) * up over a fused [T, 2I] projection (fp32)", release());
  m.def("linear_quant_", &linear_quant_,
        "out[:, col0:col0+N] = x · Wᵀ (+ bias) over int8/int4 codes with a scale (and min) per group (fp32 sums)",
        pybind11::arg("out"), pybind11::arg("col0"), pybind11::arg("x"), pybind11::arg("codes"),
        pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("bits"), pybind11::arg("group"),
        pybind11::arg("bias"), release());
  m.def("dequantize_quant", &dequantize_quant, "a quantized weight dequantized to [N, K] fp32 or bf16", release());
  m.def("lora_delta_", &lora_delta_, "each row's LoRA adapter delta added to a projection in place (fp32, bf16)",
        release());
  // module_local: each ISA level's build registers its own classes, so two builds load in one process (the
  // image's import check and the kernel tests load every level this CPU runs)
  pybind11::class_<StackProjection>(m, "StackProjection", pybind11::module_local(),
                                    "one matmul of a DecoderStack: plain fp32, packed bf16 or quantized parts")
      .def(pybind11::init<int64_t>(), pybind11::arg("out_features"))
      .def("set_dense", &StackProjection::set_dense, pybind11::arg("weight"), pybind11::arg("bias"))
      .def("set_packed", &StackProjection::set_packed, pybind11::arg("blocks"), pybind11::arg("bias"))
      .def("add_quant_part", &StackProjection::add_quant_part, pybind11::arg("col0"), pybind11::arg("codes"),
           pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("bits"), pybind11::arg("group"),
           pybind11::arg("bias"))
      .def("set_rounded_min_rows", &StackProjection::set_rounded_min_rows, pybind11::arg("rows"));
  pybind11::class_<DecoderStack>(m, "DecoderStack", pybind11::module_local(),
                                 "Llama-shaped fp32 or bf16 decoder layers run in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, bool, bool>(), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("gelu"),
           pybind11::arg("bf16") = false)
      .def("add_layer", &DecoderStack::add_layer, pybind11::arg("input_norm"), pybind11::arg("post_attention_norm"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("softcap"))
      .def("set_final_norm", &DecoderStack::set_final_norm)
      .def("forward", &DecoderStack::forward, "(h, x) after every layer; h is updated in place",
           pybind11::arg("h"), pybind11::arg("x"), pybind11::arg("positions"), pybind11::arg("k_caches"),
           pybind11::arg("v_caches"), pybind11::arg("block_table"), pybind11::arg("key_counts"),
           pybind11::arg("slots"), pybind11::arg("exact") = true, release());
#if defined(__AVX512BF16__)
  m.def("rms_norm", &rms_norm, "RMSNorm, with an optional residual add in place (bf16)", release());
  m.def("rotary_", &rotary_, "rotary embeddings in place, rotate-half layout (bf16)", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused [T, 2I] projection (bf16)", release());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up over a fused [T, 2I] projection (bf16)",
        release());
  m.def("linear_quant_rows_", &linear_quant_rows_,
        "linear_quant_ for prefill-sized steps: the weight rounded to bf16 a block at a time, linear_bf16's tiles",
        pybind11::arg("out"), pybind11::arg("col0"), pybind11::arg("x"), pybind11::arg("codes"),
        pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("bits"), pybind11::arg("group"),
        pybind11::arg("bias"), release());
  m.def("linear_bf16", &linear_bf16, "x · Wᵀ (+ bias) over a weight packed in blocks of 16 columns (bf16 in, bf16 or "
        "fp32 out)", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("bias"),
        pybind11::arg("out_fp32") = false, pybind11::arg("batch_tiles") = false, release());
#endif
}
