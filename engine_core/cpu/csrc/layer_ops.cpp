// Fused per-layer ops for the bf16 CPU forward: RMSNorm with the residual add folded in, rotary
// embeddings applied in place, and the MLP's silu(gate) * up. At batch 1 the torch versions cost more
// in dispatch than in arithmetic (F.rms_norm alone is seven ops); each of these is one call, with fp32
// arithmetic rounded once.
// AVX-512 with BF16 only: elsewhere the module leaves them out and the model keeps the torch ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec512.h"

#include <cmath>

#if defined(__AVX512BF16__)
namespace {

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a bf16 CPU tensor");
}

}  // namespace

// y = residual / rms(residual) * weight, row by row, for a contiguous [T, H] residual with H % 16 == 0.
// With delta, first residual += delta in place, rounded to bf16 as `h = h + delta` rounds. The weight is bf16,
// or fp32 for Gemma's (1 + w), whose product transformers computes in fp32 before its one cast: so does this.
at::Tensor rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight,
                       double eps) {
  check_bf16(residual, "residual");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "weight must be bf16 or fp32");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.size(1) % 16 == 0,
              "residual must be contiguous [T, H] with H a multiple of 16");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "weight must be [H]");
  at::Tensor added;
  if (delta.has_value()) {
    added = delta->contiguous();
    check_bf16(added, "delta");
    TORCH_CHECK(added.sizes() == residual.sizes(), "delta and residual differ in shape");
  }
  auto out = at::empty_like(residual);
  const int64_t hidden = residual.size(1);
  at::BFloat16* r = residual.data_ptr<at::BFloat16>();
  const at::BFloat16* d = added.defined() ? added.data_ptr<at::BFloat16>() : nullptr;
  const bool w32 = weight.scalar_type() == at::kFloat;
  const at::BFloat16* w = w32 ? nullptr : weight.data_ptr<at::BFloat16>();
  const float* wf = w32 ? weight.data_ptr<float>() : nullptr;
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, residual.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      at::BFloat16* rr = r + row * hidden;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < hidden; i += 16) {
        __m512 x = load16(rr + i);
        if (d != nullptr) {
          store16(rr + i, _mm512_add_ps(x, load16(d + row * hidden + i)));
          x = load16(rr + i);  // the rounded sum is what the norm sees
        }
        squares = _mm512_fmadd_ps(x, x, squares);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(hidden) +
                                        static_cast<float>(eps));
      const __m512 scale = _mm512_set1_ps(inv);
      for (int64_t i = 0; i < hidden; i += 16)
        store16(o + row * hidden + i,
                _mm512_mul_ps(_mm512_mul_ps(load16(rr + i), scale), w32 ? load16(wf + i) : load16(w + i)));
    }
  });
  return out;
}

// In place, HF's rotate-half layout: for i < D/2, (a, b) = (x[i], x[i + D/2]) becomes
// (a·cos − b·sin, b·cos + a·sin) at each token's position. x: [T, H, D] with rows at any stride (the
// q and k heads inside the fused qkv output); cos, sin: [max_positions, D] tables; D/2 % 16 == 0.
void rotary_(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == dim && half % 16 == 0,
              "x must be [T, H, D] with contiguous heads and D a multiple of 32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "cos and sin must be [max_positions, D]");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == x.size(0), "one position per token");
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t row_stride = x.stride(0), max_positions = cos.size(0);
  at::BFloat16* base = x.data_ptr<at::BFloat16>();
  const at::BFloat16* cos_table = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* sin_table = sin.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < max_positions, "position ", p[t], " outside the rotary tables");
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* c = cos_table + p[t] * dim;
      const at::BFloat16* s = sin_table + p[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        at::BFloat16* v = base + t * row_stride + h * dim;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 a = load16(v + i), b = load16(v + half + i);
          const __m512 cv = load16(c + i), sv = load16(s + i);  // the tables repeat after D/2
          store16(v + i, _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv)));
          store16(v + half + i, _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv)));
        }
      }
    }
  });
}
// act(gate) · up for the fused gate|up projection [T, 2I] → [T, I]; one rounding instead of torch's
// three (the activation, then the product), and one pass instead of two over a non-contiguous half.
template <typename Activation>
at::Tensor gated(const at::Tensor& gate_up, Activation act) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 32 == 0,
              "gate_up must be contiguous [T, 2I] with I a multiple of 16");
  const int64_t width = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), width}, gate_up.options());
  const at::BFloat16* in = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, gate_up.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const at::BFloat16* gate = in + row * 2 * width;
      for (int64_t i = 0; i < width; i += 16)
        store16(o + row * width + i, _mm512_mul_ps(act(load16(gate + i)), load16(gate + width + i)));
    }
  });
  return out;
}

// x · sigmoid(k·x): silu with k = 1; tanh-GELU with k·x = 2·sqrt(2/π)·(x + 0.044715·x³), since
// 0.5·(1 + tanh(u)) = sigmoid(2u)
inline __m512 x_sigmoid(__m512 x, __m512 kx) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), kx))));
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  return gated(gate_up, [](__m512 g) { return x_sigmoid(g, g); });
}

at::Tensor gelu_tanh_and_mul(at::Tensor gate_up) {
  return gated(gate_up, [](__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_fmadd_ps(cube, _mm512_set1_ps(0.044715f), g);
    return x_sigmoid(g, _mm512_mul_ps(u, _mm512_set1_ps(1.5957691216057308f)));  // 2·sqrt(2/π)
  });
}
#endif
