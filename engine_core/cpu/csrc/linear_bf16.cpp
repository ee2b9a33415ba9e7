// y = x · Wᵀ (+ bias) in bf16 with AVX-512 BF16, over a weight packed once at load time.
//
// The packed layout is oneDNN's VNNI idea made explicit: packed[nb][k2][j][t] = W[16·nb + j][2·k2 + t], so
// one 64-byte vector holds 16 output columns × 2 inputs, and `vdpbf16ps` against a broadcast pair of x
// accumulates 16 outputs at once, in fp32, with no horizontal sums. Each output block reads its weights
// once for all the rows of a decode step (up to 8 at a time), so a decode step streams the weights at about
// the memory's bandwidth: a step's matmuls take 0.6x oneDNN's time (on its prepacked weight) at 1-2 rows
// and 0.8x at 4-16 on two threads (benchmarks/linear_kernel.py); from 16 rows up two output blocks share
// each broadcast, level with oneDNN at prefill sizes. On a CPU with AMX, 2 rows and more run on its tiles over
// the same layout (linear_bf16_amx.cpp). The packing (`engine_core/models/layers/linear.py`) pads N to 16 with
// zero rows; K must be even.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
bool linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks,
                     int64_t k2s, float* y, int64_t n, const float* bias);
bool linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks,
                     int64_t k2s, uint16_t* y, int64_t n, const float* bias);

namespace {

constexpr int kRows = 8;  // rows of x per block: 8 accumulators (16 with the two-block kernel) stay in registers
constexpr int64_t kAmxRows = 2;  // from here AMX where there is: one row streams the weight as fast on vdpbf16ps

inline __m512bh pair(const uint16_t* x) {  // x[0], x[1] broadcast to all 16 lanes
  int32_t bits;
  std::memcpy(&bits, x, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

inline __mmask16 columns_left(int64_t n_total, int64_t first) {
  return tail_mask(std::max<int64_t>(0, n_total - first));
}

inline void store_row(uint16_t* y, __m512 acc, const float* bias, __mmask16 mask) {
  if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias));
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(acc));
}

inline void store_row(float* y, __m512 acc, const float* bias, __mmask16 mask) {  // the LM head's fp32 logits
  if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(y, mask, acc);
}

// R (<= kRows) rows × one block of 16 columns. Two accumulators per row over alternate input pairs, so that
// a single row is not one serial chain of dot-product latencies.
template <int R, typename T>
void rows_x_block(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k2s, T* y,
                  int64_t n_total, int64_t nb, const float* bias) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t k2 = 0;
  for (; k2 + 1 < k2s; k2 += 2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + k2 * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(block + k2 * 32 + 32);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], pair(x + r * x_stride + 2 * k2), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], pair(x + r * x_stride + 2 * k2 + 2), w1);
    }
  }
  if (k2 < k2s) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + k2 * 32);
    for (int r = 0; r < R; ++r) even[r] = _mm512_dpbf16_ps(even[r], pair(x + r * x_stride + 2 * k2), w0);
  }
  const __mmask16 mask = columns_left(n_total, 16 * nb);
  for (int r = 0; r < R; ++r)
    store_row(y + r * n_total + 16 * nb, _mm512_add_ps(even[r], odd[r]), bias ? bias + 16 * nb : nullptr, mask);
}

// kRows rows × two blocks of 16 columns: each broadcast pair of x feeds two weight vectors (prefill sizes).
template <typename T>
void rows_x_two_blocks(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k2s, T* y,
                       int64_t n_total, int64_t nb, const float* bias) {
  __m512 a0[kRows], a1[kRows];
  for (int r = 0; r < kRows; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const uint16_t* next = block + k2s * 32;
  for (int64_t k2 = 0; k2 < k2s; ++k2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + k2 * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(next + k2 * 32);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xr = pair(x + r * x_stride + 2 * k2);
      a0[r] = _mm512_dpbf16_ps(a0[r], xr, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xr, w1);
    }
  }
  const __mmask16 m0 = columns_left(n_total, 16 * nb), m1 = columns_left(n_total, 16 * nb + 16);
  for (int r = 0; r < kRows; ++r) {
    store_row(y + r * n_total + 16 * nb, a0[r], bias ? bias + 16 * nb : nullptr, m0);
    if (m1) store_row(y + r * n_total + 16 * nb + 16, a1[r], bias ? bias + 16 * nb + 16 : nullptr, m1);
  }
}

template <typename T>
void rows_x_block_any(int rows, const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k2s, T* y,
                      int64_t n_total, int64_t nb, const float* bias) {
  switch (rows) {
    case 1: return rows_x_block<1, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    case 2: return rows_x_block<2, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    case 3: return rows_x_block<3, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    case 4: return rows_x_block<4, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    case 5: return rows_x_block<5, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    case 6: return rows_x_block<6, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    case 7: return rows_x_block<7, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
    default: return rows_x_block<8, T>(x, x_stride, block, k2s, y, n_total, nb, bias);
  }
}

template <typename T>
void run(const uint16_t* xp, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks, int64_t k2s,
         T* yp, int64_t out_features, const float* bp) {
  // more than one row: the AMX tiles, where this CPU has them (linear_bf16_amx.cpp)
  if (rows >= kAmxRows && linear_bf16_amx(xp, x_stride, rows, wp, blocks, k2s, yp, out_features, bp)) return;
  const int64_t block_elems = k2s * 32;
  if (rows < 2 * kRows) {  // decode: every block once, all rows against it
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t r = 0; r < rows; r += kRows)
          rows_x_block_any(static_cast<int>(std::min<int64_t>(rows - r, kRows)), xp + r * x_stride, x_stride,
                           wp + nb * block_elems, k2s, yp + r * out_features, out_features, nb, bp);
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
                          out_features, nb, bp);
      for (; r < rows; r += kRows)
        for (int64_t b = nb; b < std::min(nb + 2, blocks); ++b)
          rows_x_block_any(static_cast<int>(std::min<int64_t>(rows - r, kRows)), xp + r * x_stride, x_stride,
                           wp + b * block_elems, k2s, yp + r * out_features, out_features, b, bp);
    }
  });
}

}  // namespace

// x [M, K] bf16 (rows contiguous), packed [ceil(N/16), K/2, 16, 2] bf16, bias [N] or none → y [M, N] bf16, or
// fp32 with out_fp32 (the LM head: logits keep the fp32 sums).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: [M, K] bf16, rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "packed: [N/16, K/2, 16, 2] bf16, contiguous");
  const int64_t rows = x.size(0), k = x.size(1), blocks = packed.size(0), k2s = packed.size(1);
  TORCH_CHECK(2 * k2s == k, "x has ", k, " inputs, the packed weight ", 2 * k2s);
  TORCH_CHECK(out_features > 16 * (blocks - 1) && out_features <= 16 * blocks, "out_features ", out_features,
              " does not match ", blocks, " blocks of 16");
  torch::Tensor bias_f32;
  if (bias) {
    TORCH_CHECK(bias->numel() == out_features, "bias: [", out_features, "]");
    bias_f32 = bias->to(at::kFloat).contiguous();  // no copy for the fp32 bias Linear keeps
  }
  auto y = torch::empty({rows, out_features}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (rows == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias_f32.data_ptr<float>() : nullptr;
  if (out_fp32)
    run(xp, x.stride(0), rows, wp, blocks, k2s, y.data_ptr<float>(), out_features, bp);
  else
    run(xp, x.stride(0), rows, wp, blocks, k2s, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
        out_features, bp);
  return y;
}
#endif
