// linear_bf16's register tiles over its packed layout, packed[nb][k2][j][t] = W[16·nb + j][2·k2 + t]: one
// 64-byte vector holds 16 output columns × 2 inputs, and `vdpbf16ps` against a broadcast pair of x accumulates
// 16 outputs at once in fp32. Shared by linear_bf16.cpp (a weight packed at load) and linear_quant_rows.cpp (a
// quantized weight dequantized into this layout a block at a time). y: rows y_stride apart, n_total columns.
#pragma once

#include "vec512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
namespace bf16_tiles {

constexpr int kRows = 8;  // rows of x per block: 8 accumulators (16 with the two-block kernel) stay in registers

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
void rows_x_block(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k2s, T* y, int64_t y_stride,
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
    store_row(y + r * y_stride + 16 * nb, _mm512_add_ps(even[r], odd[r]), bias ? bias + 16 * nb : nullptr, mask);
}

// kRows rows × two blocks of 16 columns: each broadcast pair of x feeds two weight vectors (prefill sizes).
template <typename T>
void rows_x_two_blocks(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k2s, T* y,
                       int64_t y_stride, int64_t n_total, int64_t nb, const float* bias) {
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
    store_row(y + r * y_stride + 16 * nb, a0[r], bias ? bias + 16 * nb : nullptr, m0);
    if (m1) store_row(y + r * y_stride + 16 * nb + 16, a1[r], bias ? bias + 16 * nb + 16 : nullptr, m1);
  }
}

template <typename T>
void rows_x_block_any(int rows, const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k2s, T* y,
                      int64_t y_stride, int64_t n_total, int64_t nb, const float* bias) {
  switch (rows) {
    case 1: return rows_x_block<1, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    case 2: return rows_x_block<2, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    case 3: return rows_x_block<3, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    case 4: return rows_x_block<4, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    case 5: return rows_x_block<5, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    case 6: return rows_x_block<6, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    case 7: return rows_x_block<7, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
    default: return rows_x_block<8, T>(x, x_stride, block, k2s, y, y_stride, n_total, nb, bias);
  }
}

}  // namespace bf16_tiles
#endif
