// y = x · Wᵀ (+ bias) in bf16 with AVX-512 BF16, over a weight packed once at load time.
//
// The packed layout is oneDNN's VNNI idea made explicit: packed[nb][k2][j][t] = W[16·nb + j][2·k2 + t], so
// one 64-byte vector holds 16 output columns × 2 inputs, and `vdpbf16ps` against a broadcast pair of x
// accumulates 16 outputs at once, in fp32, with no horizontal sums. Each output block reads its weights
// once for all the rows of a decode step (up to 8 at a time), so a decode step streams the weights at about
// the memory's bandwidth: a step's matmuls take 0.6x oneDNN's time (on its prepacked weight) at 1-2 rows
// and 0.8x at 4-16 on two threads (benchmarks/linear_kernel.py); from 17 rows up two output blocks share
// each broadcast, level with oneDNN at prefill sizes. Up to 16 rows a row's sums are the same whatever the
// step's other rows (a speculative verify pass scores a position as a 1-row step does). On a CPU with AMX,
// 2 rows and more run on its tiles over the same layout (linear_bf16_amx.cpp). The packing
// (`engine_core/models/layers/linear.py`) pads N to 16 with zero rows; K must be even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "bf16_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
bool linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks,
                     int64_t k2s, float* y, int64_t n, const float* bias);
bool linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks,
                     int64_t k2s, uint16_t* y, int64_t n, const float* bias);

namespace {

constexpr int64_t kAmxRows = 2;  // from here AMX where there is: one row streams the weight as fast on vdpbf16ps
using namespace bf16_tiles;

template <typename T>
void run(const uint16_t* xp, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks, int64_t k2s,
         T* yp, int64_t out_features, const float* bp, bool batch_tiles) {
  // more than one row: the AMX tiles, where this CPU has them (linear_bf16_amx.cpp)
  if (rows >= kAmxRows && linear_bf16_amx(xp, x_stride, rows, wp, blocks, k2s, yp, out_features, bp)) return;
  const int64_t block_elems = k2s * 32;
  if (rows <= 2 * kRows && !batch_tiles) {  // decode: every block once, all rows against it
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t r = 0; r < rows; r += kRows)
          rows_x_block_any(static_cast<int>(std::min<int64_t>(rows - r, kRows)), xp + r * x_stride, x_stride,
                           wp + nb * block_elems, k2s, yp + r * out_features, out_features, out_features, nb, bp);
    });
    return;
  }
  // prefill: pairs of blocks (hot in cache) against every 8 rows in turn
  at::parallel_for(0, (blocks + 1) / 2, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = 2 * p;
      const bool two = nb + 1 < blocks;
      int64_t r = 0;
      for (; two && r + kRows <= rows; r += kRows)
        rows_x_two_blocks(xp + r * x_stride, x_stride, wp + nb * block_elems, k2s, yp + r * out_features,
                          out_features, out_features, nb, bp);
      for (; r < rows; r += kRows)
        for (int64_t b = nb; b < std::min(nb + 2, blocks); ++b)
          rows_x_block_any(static_cast<int>(std::min<int64_t>(rows - r, kRows)), xp + r * x_stride, x_stride,
                           wp + b * block_elems, k2s, yp + r * out_features, out_features, out_features, b, bp);
    }
  });
}

}  // namespace

// x [M, K] bf16 (rows contiguous), packed [ceil(N/16), K/2, 16, 2] bf16, bias [N] or none → y [M, N] bf16, or
// fp32 with out_fp32 (the LM head: logits keep the fp32 sums). batch_tiles: a step of up to 16 rows whose rows need
// not get their 1-row sums (no verify pass in it) runs the prefill's tiles, two blocks a broadcast and one sum a
// row: 8-16 rows of a step's weights in 0.82-0.87x the time (docs/benchmarks.md).
at::Tensor linear_bf16(at::Tensor x, at::Tensor packed, int64_t out_features,
                          c10::optional<at::Tensor> bias, bool out_fp32, bool batch_tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: [M, K] bf16, rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "packed: [N/16, K/2, 16, 2] bf16, contiguous");
  const int64_t rows = x.size(0), k = x.size(1), blocks = packed.size(0), k2s = packed.size(1);
  TORCH_CHECK(2 * k2s == k, "x has ", k, " inputs, the packed weight ", 2 * k2s);
  TORCH_CHECK(out_features > 16 * (blocks - 1) && out_features <= 16 * blocks, "out_features ", out_features,
              " does not match ", blocks, " blocks of 16");
  at::Tensor bias_f32;
  if (bias) {
    TORCH_CHECK(bias->numel() == out_features, "bias: [", out_features, "]");
    bias_f32 = bias->to(at::kFloat).contiguous();  // no copy for the fp32 bias Linear keeps
  }
  auto y = at::empty({rows, out_features}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (rows == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias_f32.data_ptr<float>() : nullptr;
  if (out_fp32)
    run(xp, x.stride(0), rows, wp, blocks, k2s, y.data_ptr<float>(), out_features, bp, batch_tiles);
  else
    run(xp, x.stride(0), rows, wp, blocks, k2s, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
        out_features, bp, batch_tiles);
  return y;
}
#endif
