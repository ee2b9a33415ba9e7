// The fused per-layer ops of layer_ops.cpp for the fp32 forward (what `dtype = "auto"` serves on AVX2-only
// CPUs): RMSNorm with the residual add folded in, rotary embeddings in place, silu(gate) * up. Plain C++
// loops, so the compiler vectorizes them for whatever -march the build targets (x86-64-v3 for AVX2 + FMA,
// x86-64-v4 and up for AVX-512). As for bf16, at batch 1 torch spends more on dispatching these (a dozen
// ops per layer) than on the arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be a float32 CPU tensor");
}

// e^x as 2^n · P(r), n = round(x·log2 e), r = x − n·ln 2 (Cephes' expf polynomial, as exp16 in vec512.h);
// written without libm calls so the loops around it vectorize.
inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.3f), 88.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace

// y = residual / rms(residual) * weight per row of a contiguous [T, H] residual; with delta, first
// residual += delta in place.
at::Tensor rms_norm_f32(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight,
                           double eps) {
  check_f32(residual, "residual");
  check_f32(weight, "weight");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be contiguous [T, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "weight must be [H]");
  at::Tensor added;
  if (delta.has_value()) {
    added = delta->contiguous();
    check_f32(added, "delta");
    TORCH_CHECK(added.sizes() == residual.sizes(), "delta and residual differ in shape");
  }
  auto out = at::empty_like(residual);
  const int64_t hidden = residual.size(1);
  float* r = residual.data_ptr<float>();
  const float* d = added.defined() ? added.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, residual.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* x = r + row * hidden;
      if (d != nullptr) {
        const float* dx = d + row * hidden;
        for (int64_t i = 0; i < hidden; ++i) x[i] += dx[i];
      }
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += x[i] * x[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsilon);
      float* y = o + row * hidden;
      for (int64_t i = 0; i < hidden; ++i) y[i] = x[i] * inv * w[i];
    }
  });
  return out;
}

// In place, HF's rotate-half layout (see rotary_ in layer_ops.cpp): x [T, H, D] with contiguous heads at
// any row stride; cos, sin [max_positions, D].
void rotary_f32_(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x must be [T, H, D] with contiguous heads and D even");
  const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "cos and sin must be [max_positions, D]");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == x.size(0), "one position per token");
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t row_stride = x.stride(0), max_positions = cos.size(0);
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < max_positions, "position ", p[t], " outside the rotary tables");
  float* base = x.data_ptr<float>();
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_table + p[t] * dim;
      const float* s = sin_table + p[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = base + t * row_stride + h * dim;
        for (int64_t i = 0; i < half; ++i) {  // the tables repeat after D/2
          const float a = v[i], b = v[half + i];
          v[i] = a * c[i] - b * s[i];
          v[half + i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// act(gate) · up for the fused gate|up projection [T, 2I] → [T, I], in one pass.
template <typename Activation>
at::Tensor gated_f32(const at::Tensor& gate_up, Activation act) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [T, 2I]");
  const int64_t width = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = in + row * 2 * width;
      const float* up = gate + width;
      float* y = o + row * width;
      for (int64_t i = 0; i < width; ++i) y[i] = act(gate[i]) * up[i];
    }
  });
  return out;
}

at::Tensor silu_and_mul_f32(at::Tensor gate_up) {
  return gated_f32(gate_up, [](float g) { return g / (1.f + exp_approx(-g)); });
}

// tanh-GELU as x · sigmoid(2u), u = sqrt(2/π)·(x + 0.044715·x³): 0.5·(1 + tanh(u)) = sigmoid(2u)
at::Tensor gelu_tanh_and_mul_f32(at::Tensor gate_up) {
  return gated_f32(gate_up, [](float g) {
    return g / (1.f + exp_approx(-1.5957691216057308f * (g + 0.044715f * g * g * g)));
  });
}
