// A quantized linear layer for a prefill-sized step (more rows than linear_quant's register tiles serve well) on a
// CPU with AVX-512 BF16 and no AMX. Each pair of 16-output blocks is dequantized to bf16, rounded as
// `QuantizedTensor.dequantize(bf16)` rounds it, into linear_bf16's packed layout in a buffer that stays in cache,
// and linear_bf16's register tiles run every row against it. Dequantizing the whole weight and handing it to oneDNN
// instead made oneDNN pack it again in every call: a 100-token prefill took 1.7x the time of the same GEMM on a
// weight packed once (docs/benchmarks.md, issue 31).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "bf16_tiles.h"
#include "quant_weight.h"

#include <vector>

#if defined(__AVX512BF16__)
namespace llmgw_quant {
namespace {

// outputs n0 .. n0 + 16 · blocks of w, bf16, in the packed layout [blocks][k/2][16][2]; outputs from n on are zero.
// `rows`: a [16 · blocks, k] scratch buffer for the outputs dequantized in order.
void pack_dequantized(const QuantWeight& w, int bits, Group group, int64_t n0, int64_t n, int64_t k, int blocks,
                      uint16_t* rows, uint16_t* packed) {
  for (int j = 0; j < 16 * blocks; ++j) {
    at::BFloat16* row = reinterpret_cast<at::BFloat16*>(rows + j * k);
    if (n0 + j >= n) {
      std::memset(row, 0, k * sizeof(uint16_t));
      continue;
    }
    for (int64_t c = 0; c < k; c += 32) {
      floats16 w0, w1;
      if (bits == 4) w.widen<4, kGroup32>(n0 + j, c, w0, w1);
      else if (group == kGroup16) w.widen<8, kGroup16>(n0 + j, c, w0, w1);
      else if (group == kGroup32) w.widen<8, kGroup32>(n0 + j, c, w0, w1);
      else w.widen<8, kGroupRow>(n0 + j, c, w0, w1);
      store(row + c, w0);
      store(row + c + 16, w1);
    }
  }
  // packed[b][k2][j] (a pair of bf16 as 32 bits) = rows[16 b + j][k2]: a gather of 16 rows' pair k2
  const int64_t k2s = k / 2;
  const __m512i offsets = lanes_times(static_cast<int>(k2s));
  for (int b = 0; b < blocks; ++b) {
    const int32_t* base = reinterpret_cast<const int32_t*>(rows) + 16 * b * k2s;
    for (int64_t k2 = 0; k2 < k2s; ++k2)
      _mm512_storeu_si512(packed + (b * k2s + k2) * 32, _mm512_i32gather_epi32(offsets, base + k2, 4));
  }
}

template <typename T>
void run(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k,
         int64_t n, T* y, int64_t y_stride, const float* bias) {
  using bf16_tiles::kRows;
  const int64_t k2s = k / 2, block_elems = k2s * 32;
  at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> scratch(32 * k), packed(2 * block_elems);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = 2 * p;  // the first of the pair's blocks of 16 outputs
      const int blocks = 16 * nb + 16 < n ? 2 : 1;
      pack_dequantized(w, bits, group, 16 * nb, n, k, blocks, scratch.data(), packed.data());
      int64_t r = 0;
      for (; blocks == 2 && r + kRows <= rows; r += kRows)
        bf16_tiles::rows_x_two_blocks(x + r * x_stride, x_stride, packed.data(), k2s, y + r * y_stride, y_stride,
                                      n, nb, bias);
      for (; r < rows; r += kRows)
        for (int b = 0; b < blocks; ++b)
          bf16_tiles::rows_x_block_any(static_cast<int>(std::min<int64_t>(rows - r, kRows)), x + r * x_stride,
                                       x_stride, packed.data() + b * block_elems, k2s, y + r * y_stride, y_stride,
                                       n, nb + b, bias);
    }
  });
}

}  // namespace

void run_rows(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, float* y, int64_t y_stride, const float* bias) {
  run(w, bits, group, x, x_stride, rows, k, n, y, y_stride, bias);
}

void run_rows(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, at::BFloat16* y, int64_t y_stride, const float* bias) {
  run(w, bits, group, x, x_stride, rows, k, n, reinterpret_cast<uint16_t*>(y), y_stride, bias);
}

}  // namespace llmgw_quant
#endif
