// linear_bf16 on AMX tiles for 2 rows and more: its packed layout (packed[nb][k2][j][t] = W[16·nb + j][2·k2 + t])
// is already what a tile's B operand wants, 16 pairs of inputs × 16 outputs in 1 KiB, so the weights are read as
// they lie and the activations are A (16 rows × 32 inputs). Each pass keeps 2 × 2 tiles of 16 × 16 fp32 sums
// (two blocks of rows by two blocks of outputs), so each tile load feeds two TDPBF16PS. One layout serves every
// step: a lone decode row stays on the vdpbf16ps kernel (linear_bf16.cpp), and oneDNN's copy is not needed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kTile = 16;  // rows of x, or outputs, per tile

// tiles 0-3: C (row block r, output block o) at 2r + o; 4, 5: A for row blocks 0, 1; 6, 7: B for output blocks
const llmgw_amx::TileConfig kConfig = llmgw_amx::uniform_config(8);

template <typename T>
inline void store_rows(const float* c, int64_t rows, T* y, int64_t y_stride, int64_t n0, int64_t n,
                       const float* bias) {
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kTile, n - n0)) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * kTile), b);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(y + r * y_stride + n0, mask, v);
    } else {
      _mm256_mask_storeu_epi16(y + r * y_stride + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// rows [m0, m0 + 32) of the padded x against output blocks nb, nb + 1 (`two`), over all k
template <typename T>
LLMGW_AMX void pass(const uint16_t* xp, int64_t k, int64_t m0, int64_t rows, const uint16_t* wp, int64_t nb,
                    bool two, int64_t block_elems, T* y, int64_t y_stride, int64_t n, const float* bias,
                    float* c) {
  const bool second_rows = m0 + kTile < rows;
  const uint16_t* a0 = xp + m0 * k;
  const uint16_t* a1 = a0 + kTile * k;
  const uint16_t* b0 = wp + nb * block_elems;
  const uint16_t* b1 = b0 + block_elems;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kk = 0; kk < k; kk += 32) {
    _tile_loadd(4, a0 + kk, k * 2);
    _tile_loadd(6, b0 + kk * 16, 64);  // 16 pairs from pair kk / 2: 32 · kk / 2 elements in
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(7, b1 + kk * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (second_rows) {
      _tile_loadd(5, a1 + kk, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t n0 = nb * kTile, rows0 = std::min(kTile, rows - m0);
  _tile_stored(0, c, 64);
  store_rows(c, rows0, y + m0 * y_stride, y_stride, n0, n, bias);
  if (two) {
    _tile_stored(1, c, 64);
    store_rows(c, rows0, y + m0 * y_stride, y_stride, n0 + kTile, n, bias);
  }
  if (second_rows) {
    const int64_t rows1 = std::min(kTile, rows - m0 - kTile);
    _tile_stored(2, c, 64);
    store_rows(c, rows1, y + (m0 + kTile) * y_stride, y_stride, n0, n, bias);
    if (two) {
      _tile_stored(3, c, 64);
      store_rows(c, rows1, y + (m0 + kTile) * y_stride, y_stride, n0 + kTile, n, bias);
    }
  }
}

// tasks t0 .. t1: output block pairs outer, so a pair of weight blocks stays hot for all the rows
template <typename T>
LLMGW_AMX void tasks(const uint16_t* xp, int64_t k, int64_t rows, int64_t row_pairs, const uint16_t* wp,
                     int64_t blocks, int64_t block_elems, T* y, int64_t n, const float* bias, int64_t t0, int64_t t1) {
  alignas(64) float c[kTile * kTile];
  _tile_loadconfig(&kConfig);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t nb = (t / row_pairs) * 2, m0 = (t % row_pairs) * 2 * kTile;
    pass(xp, k, m0, rows, wp, nb, nb + 1 < blocks, block_elems, y, n, n, bias, c);
  }
  _tile_release();
}

template <typename T>
bool run(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks, int64_t k2s,
         T* y, int64_t n, const float* bias) {
  const int64_t k = 2 * k2s;
  if (k % 32 != 0 || !llmgw_amx::usable()) return false;
  // A wants whole tiles of 16 rows: x copied once into a zero-padded buffer (a decode step's few rows, or a
  // prefill's, against a GEMM that reads every weight)
  const int64_t padded_rows = (rows + 2 * kTile - 1) / (2 * kTile) * (2 * kTile);
  std::vector<uint16_t> xp(padded_rows * k, 0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(xp.data() + r * k, x + r * x_stride, k * 2);
  const int64_t block_elems = k2s * 32, row_pairs = padded_rows / (2 * kTile), block_pairs = (blocks + 1) / 2;
  at::parallel_for(0, row_pairs * block_pairs, 1, [&](int64_t t0, int64_t t1) {
    tasks(xp.data(), k, rows, row_pairs, wp, blocks, block_elems, y, n, bias, t0, t1);
  });
  return true;
}

}  // namespace

bool linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks,
                     int64_t k2s, float* y, int64_t n, const float* bias) {
  return run(x, x_stride, rows, wp, blocks, k2s, y, n, bias);
}

bool linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* wp, int64_t blocks,
                     int64_t k2s, uint16_t* y, int64_t n, const float* bias) {
  return run(x, x_stride, rows, wp, blocks, k2s, y, n, bias);
}
#endif
