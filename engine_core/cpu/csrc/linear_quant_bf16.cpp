// The quantized linear layer of a bf16 model on a CPU with AVX-512 BF16 (linear_quant.cpp dispatches here): each
// weight rounded to bf16 in registers (one vcvtne2ps2bf16 per 32) meets the bf16 activations in vdpbf16ps, two
// products per lane, half the instructions of the fp32 path. With more rows than one register tile, the tile's
// weights are decoded once into an L1 buffer that every block of rows then reads, as linear_bf16 reads its packed
// weight.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "quant_weight.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__)
namespace llmgw_quant {
namespace {

inline __m512bh to_bf16(floats16 w0, floats16 w1) {
  __m512 a, b;
  std::memcpy(&a, &w0, sizeof a);
  std::memcpy(&b, &w1, sizeof b);
  return _mm512_cvtne2ps_pbh(b, a);  // w0 in the low half: the 32 weights in order
}

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int Bits, Group G, int Out, int Rows>
void tile_bf16(const QuantWeight& w, int64_t n0, const uint16_t* x, int64_t x_stride, int64_t k_total,
               float sums[kRows][kOut]) {
  __m512 acc[Rows][Out];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_total; k += 32) {
    __m512bh xr[Rows];
    for (int r = 0; r < Rows; ++r) xr[r] = load_bf16(x + r * x_stride + k);
    for (int j = 0; j < Out; ++j) {
      floats16 w0, w1;
      w.widen<Bits, G>(n0 + j, k, w0, w1);
      const __m512bh wb = to_bf16(w0, w1);
      for (int r = 0; r < Rows; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wb, xr[r]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int Out, int Rows>
void buffered_bf16(const uint16_t* weights, const uint16_t* x, int64_t x_stride, int64_t k_total,
                   float sums[kRows][kOut]) {
  __m512 acc[Rows][Out];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_total; k += 32) {
    __m512bh xr[Rows];
    for (int r = 0; r < Rows; ++r) xr[r] = load_bf16(x + r * x_stride + k);
    for (int j = 0; j < Out; ++j) {
      const __m512bh wb = load_bf16(weights + j * k_total + k);
      for (int r = 0; r < Rows; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wb, xr[r]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int Bits, Group G, int Out>
void decode_tile(const QuantWeight& w, int64_t n0, int64_t k_total, uint16_t* buffer) {
  for (int j = 0; j < Out; ++j)
    for (int64_t k = 0; k < k_total; k += 32) {
      floats16 w0, w1;
      w.widen<Bits, G>(n0 + j, k, w0, w1);
      _mm512_storeu_si512(buffer + j * k_total + k, (__m512i)to_bf16(w0, w1));
    }
}

template <int Bits, Group G, int Out>
void tile_bf16_rows(int rows, const QuantWeight& w, int64_t n0, const uint16_t* x, int64_t x_stride, int64_t k,
                    float sums[kRows][kOut]) {
  switch (rows) {
    case 1: return tile_bf16<Bits, G, Out, 1>(w, n0, x, x_stride, k, sums);
    case 2: return tile_bf16<Bits, G, Out, 2>(w, n0, x, x_stride, k, sums);
    case 3: return tile_bf16<Bits, G, Out, 3>(w, n0, x, x_stride, k, sums);
    default: return tile_bf16<Bits, G, Out, kRows>(w, n0, x, x_stride, k, sums);
  }
}

template <int Out>
void buffered_rows(int rows, const uint16_t* weights, const uint16_t* x, int64_t x_stride, int64_t k,
                   float sums[kRows][kOut]) {
  switch (rows) {
    case 1: return buffered_bf16<Out, 1>(weights, x, x_stride, k, sums);
    case 2: return buffered_bf16<Out, 2>(weights, x, x_stride, k, sums);
    case 3: return buffered_bf16<Out, 3>(weights, x, x_stride, k, sums);
    default: return buffered_bf16<Out, kRows>(weights, x, x_stride, k, sums);
  }
}

template <typename T>
void run_tiles(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, T* y, int64_t y_stride, const float* bias) {
  auto emit = [&](float sums[kRows][kOut], int64_t n0, int out, int64_t r0, int r) {
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < out; ++j)
        y[(r0 + i) * y_stride + n0 + j] = static_cast<T>(sums[i][j] + (bias ? bias[n0 + j] : 0.f));
  };
  const int64_t tiles = (n + kOut - 1) / kOut;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kOut * k));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<uint16_t> buffer(rows > kRows ? kOut * k : 0);
    float sums[kRows][kOut];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t first = t * kOut;
      // a tile of kOut outputs, or the last outputs one at a time
      for (int64_t n0 = first; n0 < std::min(first + kOut, n); n0 += (n - first >= kOut ? kOut : 1)) {
        const int out = n - first >= kOut ? kOut : 1;
#define LLMGW_DISPATCH(CALL)                                  \
  if (bits == 4) { CALL(4, kGroup32) }                        \
  else if (group == kGroup16) { CALL(8, kGroup16) }           \
  else if (group == kGroup32) { CALL(8, kGroup32) }           \
  else { CALL(8, kGroupRow) }
        if (rows <= kRows) {
#define LLMGW_DIRECT(B, G)                                                                         \
  if (out == kOut) tile_bf16_rows<B, G, kOut>(static_cast<int>(rows), w, n0, x, x_stride, k, sums); \
  else tile_bf16_rows<B, G, 1>(static_cast<int>(rows), w, n0, x, x_stride, k, sums);
          LLMGW_DISPATCH(LLMGW_DIRECT)
          emit(sums, n0, out, 0, static_cast<int>(rows));
          continue;
        }
#define LLMGW_DECODE(B, G)                                       \
  if (out == kOut) decode_tile<B, G, kOut>(w, n0, k, buffer.data()); \
  else decode_tile<B, G, 1>(w, n0, k, buffer.data());
        LLMGW_DISPATCH(LLMGW_DECODE)
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          if (out == kOut) buffered_rows<kOut>(r, buffer.data(), x + r0 * x_stride, x_stride, k, sums);
          else buffered_rows<1>(r, buffer.data(), x + r0 * x_stride, x_stride, k, sums);
          emit(sums, n0, out, r0, r);
        }
#undef LLMGW_DECODE
#undef LLMGW_DIRECT
#undef LLMGW_DISPATCH
      }
    }
  });
}

}  // namespace

void run_bf16(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, float* y, int64_t y_stride, const float* bias) {
  run_tiles(w, bits, group, x, x_stride, rows, k, n, y, y_stride, bias);
}

void run_bf16(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, at::BFloat16* y, int64_t y_stride, const float* bias) {
  run_tiles(w, bits, group, x, x_stride, rows, k, n, y, y_stride, bias);
}

}  // namespace llmgw_quant
#endif
