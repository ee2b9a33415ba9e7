// y = x · Wᵀ (+ bias) over a weight kept quantized (the layout: quant_weight.h): int8 / int4 made at load, and
// GGUF's block formats decoded once into the same two layouts. A weight is widened to fp32 in registers with one
// fma (w exactly as the torch reference dequantizes it, up to fp32 rounding) and multiplied with fp32
// activations: no rounding beyond the format's own, and fp32 out where asked (the LM head). bf16 activations on
// a CPU with AVX-512 BF16 take linear_quant_bf16.cpp's path instead: the same exact weights, its codes in
// vdpbf16ps. A tile of kOut outputs × kRows rows keeps its sums in registers, so a decode step reads each weight
// once for all its rows. K must be a multiple of 32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "quant_tile_avx2.h"
#include "quant_weight.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace llmgw_quant;

// Rows × Out sums of one tile: rows of x (fp32, k contiguous) against outputs n0 .. n0 + Out.
template <int Bits, Group G, int Out, int Rows>
void tile(const QuantWeight& w, int64_t n0, const float* x, int64_t k_total, float sums[kRows][kOut]) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (Bits == 4 && Rows <= avx2::kFoldRows) avx2::tile_q4<Out, Rows>(w, n0, x, k_total, sums);
  else avx2::tile<Bits, G, Out, Rows>(w, n0, x, k_total, sums);
#else
  floats16 acc[Rows][Out] = {};
  for (int64_t k = 0; k < k_total; k += 32) {
    floats16 x0[Rows], x1[Rows];  // loaded once for the tile's outputs
    for (int r = 0; r < Rows; ++r) {
      x0[r] = load_floats(x + r * k_total + k);
      x1[r] = load_floats(x + r * k_total + k + 16);
    }
    for (int j = 0; j < Out; ++j) {
      floats16 w0, w1;
      w.widen<Bits, G>(n0 + j, k, w0, w1);
      for (int r = 0; r < Rows; ++r) acc[r][j] += w0 * x0[r] + w1 * x1[r];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = sum_lanes(acc[r][j]);
#endif
}

template <int Bits, Group G, int Out>
void tile_rows(int rows, const QuantWeight& w, int64_t n0, const float* x, int64_t k, float sums[kRows][kOut]) {
  switch (rows) {
    case 1: return tile<Bits, G, Out, 1>(w, n0, x, k, sums);
#if defined(__AVX512F__) || defined(__AVX2__)
    case 2: return tile<Bits, G, Out, 2>(w, n0, x, k, sums);
    case 3: return tile<Bits, G, Out, 3>(w, n0, x, k, sums);
#endif
    default: return tile<Bits, G, Out, kRows>(w, n0, x, k, sums);
  }
}

template <typename T>
void run(const QuantWeight& w, int bits, Group group, const float* x, int64_t rows, int64_t k, int64_t n,
         T* y, int64_t y_stride, const float* bias) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // the AVX2 tiles of few rows leave the minimums' term out: it comes from x's group sums
  std::vector<float> x_group_sums;  // [rows, groups]
  if (w.mins) {
    const int64_t size = k / w.groups;
    x_group_sums.resize(rows * w.groups);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < w.groups; ++g) {
        float sum = 0.f;
        for (int64_t i = g * size; i < (g + 1) * size; ++i) sum += x[r * k + i];
        x_group_sums[r * w.groups + g] = sum;
      }
  }
  // a step of few rows (a speculative verify pass) runs in blocks of the folded tiles' rows, which give each row its
  // 1-row sums to the bit; each block after the first reads the tile's codes from L1. Against blocks of 4 widened
  // rows its 4-bit matmuls take about 1.2x the time at 6-7 rows, 1.4x at 4 (docs/benchmarks.md, issue 32)
  const int64_t row_block = rows < avx2::kWidenedMinRows ? avx2::kFoldRows : kRows;
  std::vector<float> x_q4;  // x as the 4-bit tile of few rows reads it (tile_q4), where a tile has few rows
  if (bits == 4 && (rows < avx2::kWidenedMinRows || rows % kRows != 0)) {
    x_q4.resize(rows * k);
    avx2::permute_x_q4(x, rows, k, x_q4.data());
  }
  auto x_of_tile = [&](int r) { return bits == 4 && avx2::folds(r) ? x_q4.data() : x; };
#else
  constexpr int64_t row_block = kRows;
  auto x_of_tile = [&](int) { return x; };
#endif
  auto one_tile = [&](int64_t n0, int out, int64_t r0, int r) {
    float sums[kRows][kOut];
    const float* xr = x_of_tile(r) + r0 * k;
#define LLMGW_TILE(B, G)                                                   \
  if (out == kOut) tile_rows<B, G, kOut>(r, w, n0, xr, k, sums); \
  else tile_rows<B, G, 1>(r, w, n0, xr, k, sums);
    if (bits == 4) { LLMGW_TILE(4, kGroup32) }
    else if (group == kGroup16) { LLMGW_TILE(8, kGroup16) }
    else if (group == kGroup32) { LLMGW_TILE(8, kGroup32) }
    else { LLMGW_TILE(8, kGroupRow) }
#undef LLMGW_TILE
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (w.mins && avx2::folds(r))
      for (int i = 0; i < r; ++i)
        for (int j = 0; j < out; ++j)
          sums[i][j] += avx2::mins_term(w, n0 + j, x_group_sums.data() + (r0 + i) * w.groups);
#endif
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < out; ++j)
        y[(r0 + i) * y_stride + n0 + j] = static_cast<T>(sums[i][j] + (bias ? bias[n0 + j] : 0.f));
  };
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (rows >= avx2::kWidenedMinRows) {
    // blocks of kRows rows read weights widened once per span of outputs; a last 1-3 rows (kFoldRows) take the
    // folded tile, as a step of that many rows does
    static_assert(kRows - 1 <= avx2::kFoldRows);
    const int64_t widened_rows = rows - rows % kRows;
    constexpr int64_t kSpan = 2 * avx2::kWidenedOut;
    const int64_t spans = (n + kSpan - 1) / kSpan;
    at::parallel_for(0, spans, std::max<int64_t>(1, 16384 / (kSpan * k)), [&](int64_t s0, int64_t s1) {
      std::vector<float> widened(kSpan * k);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t n0 = s * kSpan, span = std::min(kSpan, n - n0);
        avx2::widen_rows(w, bits, group, n0, span, k, widened.data());
        for (int64_t r0 = 0; r0 < widened_rows; r0 += kRows) {
          const int r = static_cast<int>(std::min<int64_t>(kRows, widened_rows - r0));
          for (int64_t j0 = 0; j0 < span; j0 += avx2::kWidenedOut) {
            const int out = static_cast<int>(std::min<int64_t>(avx2::kWidenedOut, span - j0));
            float sums[kRows][avx2::kWidenedOut];
            avx2::tile_from_widened(out, r, widened.data() + j0 * k, x + r0 * k, k, sums);
            for (int i = 0; i < r; ++i)
              for (int j = 0; j < out; ++j)
                y[(r0 + i) * y_stride + n0 + j0 + j] =
                    static_cast<T>(sums[i][j] + (bias ? bias[n0 + j0 + j] : 0.f));
          }
        }
        if (widened_rows < rows)
          for (int64_t j = n0; j < n0 + span;) {
            const int out = n0 + span - j >= kOut ? kOut : 1;
            one_tile(j, out, widened_rows, static_cast<int>(rows - widened_rows));
            j += out;
          }
      }
    });
    return;
  }
#endif
  const int64_t tiles = (n + kOut - 1) / kOut;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kOut * k));  // a few thousand weights a task at least
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kOut;
      const int out = n - n0 >= kOut ? kOut : 1;
      // the tile's weights stay in L1 for its rows after the first
      for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
        const int r = static_cast<int>(std::min<int64_t>(row_block, rows - r0));
        if (out == kOut) {
          one_tile(n0, kOut, r0, r);
        } else {
          for (int64_t j = n0; j < n; ++j) one_tile(j, 1, r0, r);
        }
      }
    }
  });
}

Group group_of(int64_t group, int64_t k, int64_t bits) {
  if (bits == 4) {
    TORCH_CHECK(group == 32, "4-bit codes come in groups of 32, not ", group);
    return kGroup32;
  }
  if (group == 16) return kGroup16;
  if (group == 32) return kGroup32;
  TORCH_CHECK(group == k, "8-bit codes come in groups of 16, 32 or the whole row (", k, "), not ", group);
  return kGroupRow;
}

QuantWeight weight_of(const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, int64_t n, int64_t k, int64_t bits,
                      int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8, not ", bits);
  TORCH_CHECK(k % 32 == 0 && k > 0, "the inputs (", k, ") must be a multiple of 32");
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.dim() == 2 && codes.size(0) == n &&
                  codes.size(1) == (bits == 8 ? k : k / 2),
              "codes: [", n, ", ", bits == 8 ? k : k / 2, "] bytes, contiguous");
  const int64_t groups = k / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n * groups,
              "scales: [", n, ", ", groups, "] fp32, contiguous");
  if (mins)
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == n * groups,
                "mins: [", n, ", ", groups, "] fp32, contiguous");
  return QuantWeight{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1), scales.data_ptr<float>(),
                     mins ? mins->data_ptr<float>() : nullptr, groups};
}

// One call's checked arguments: the weight, its group kind and the bias in fp32.
struct Call {
  QuantWeight w;
  Group g;
  at::Tensor bias_f32;
  int64_t rows, k, n;
  const float* bias() const { return bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr; }
};

Call check(const at::Tensor& out, int64_t col0, const at::Tensor& x, const at::Tensor& codes,
           const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1,
              "x: [M, K], out: [M, N'] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(col0 >= 0 && col0 + n <= out.size(1), "columns ", col0, "..", col0 + n, " outside out");
  Call call{weight_of(codes, scales, mins, n, k, bits, group), group_of(group, k, bits), {}, rows, k, n};
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "bias: [", n, "]");
    call.bias_f32 = bias->to(at::kFloat).contiguous();
  }
  return call;
}

}  // namespace

// out[:, col0 : col0 + N] = x · Wᵀ (+ bias). out: [M, ≥ col0 + N] fp32 or bf16, rows contiguous; x: [M, K] any
// float dtype (widened to fp32 once); several parts of one fused projection (q|k|v stored in different formats)
// write their columns of one output.
void linear_quant_(at::Tensor out, int64_t col0, at::Tensor x, at::Tensor codes, at::Tensor scales,
                   c10::optional<at::Tensor> mins, int64_t bits, int64_t group, c10::optional<at::Tensor> bias) {
  const Call call = check(out, col0, x, codes, scales, mins, bits, group, bias);
  const QuantWeight& w = call.w;
  const Group g = call.g;
  const int64_t rows = call.rows, k = call.k, n = call.n;
  const float* bp = call.bias();
  if (rows == 0) return;
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    auto run = [&](auto* yp) {  // more rows than a register tile: AMX where there is
      if (rows <= kRows || !run_amx(w, bits, g, xp, x.stride(0), rows, k, n, yp, out.stride(0), bp))
        run_bf16(w, bits, g, xp, x.stride(0), rows, k, n, yp, out.stride(0), bp);
    };
    if (out.scalar_type() == at::kFloat) run(out.data_ptr<float>() + col0);
    else run(out.data_ptr<at::BFloat16>() + col0);
    return;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
  const float* xp = xf.data_ptr<float>();
  if (out.scalar_type() == at::kFloat) {
    float* yp = out.data_ptr<float>() + col0;
    run(w, bits, g, xp, rows, k, n, yp, out.stride(0), bp);
  } else {
    at::BFloat16* yp = out.data_ptr<at::BFloat16>() + col0;
    run(w, bits, g, xp, rows, k, n, yp, out.stride(0), bp);
  }
}

#if defined(__AVX512BF16__)
// linear_quant_ for prefill-sized steps on a CPU with AVX-512 BF16 and no AMX: the weight rounded to bf16 a block at
// a time (as the dequantize-then-GEMM path rounds it) and linear_bf16's tiles; x bf16.
void linear_quant_rows_(at::Tensor out, int64_t col0, at::Tensor x, at::Tensor codes, at::Tensor scales,
                        c10::optional<at::Tensor> mins, int64_t bits, int64_t group,
                        c10::optional<at::Tensor> bias) {
  const Call call = check(out, col0, x, codes, scales, mins, bits, group, bias);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bf16, rows contiguous");
  if (call.rows == 0) return;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (out.scalar_type() == at::kFloat)
    run_rows(call.w, bits, call.g, xp, x.stride(0), call.rows, call.k, call.n, out.data_ptr<float>() + col0,
             out.stride(0), call.bias());
  else
    run_rows(call.w, bits, call.g, xp, x.stride(0), call.rows, call.k, call.n, out.data_ptr<at::BFloat16>() + col0,
             out.stride(0), call.bias());
}
#endif

// The whole weight dequantized, [N, K] in `dtype` (fp32 or bf16): for prefill-sized steps, whose matmul then
// runs on the dtype's GEMM (AMX or AVX-512 for bf16).
at::Tensor dequantize_quant(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                               int64_t bits, int64_t group, int64_t k, at::ScalarType dtype) {
  const int64_t n = codes.size(0);
  const QuantWeight w = weight_of(codes, scales, mins, n, k, bits, group);
  const Group g = group_of(group, k, bits);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: fp32 or bf16");
  auto y = at::empty({n, k}, codes.options().dtype(dtype));
  auto fill = [&](auto* yp) {
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
#if defined(__AVX2__) && !defined(__AVX512F__)
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(yp)>, float>) {
        avx2::widen_rows(w, bits, g, r0, r1 - r0, k, yp + r0 * k);
        return;
      }
#endif
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < k; c += 32) {
          floats16 w0, w1;
          if (bits == 4) w.widen<4, kGroup32>(r, c, w0, w1);
          else if (g == kGroup16) w.widen<8, kGroup16>(r, c, w0, w1);
          else if (g == kGroup32) w.widen<8, kGroup32>(r, c, w0, w1);
          else w.widen<8, kGroupRow>(r, c, w0, w1);
          store(yp + r * k + c, w0);
          store(yp + r * k + c + 16, w1);
        }
    });
  };
  if (dtype == at::kFloat) fill(y.data_ptr<float>());
  else fill(y.data_ptr<at::BFloat16>());
  return y;
}
