// The quantized linear layer for bf16 activations on a CPU with AVX-512 BF16 (linear_quant.cpp dispatches here).
// A weight is scale · code + min, and its codes are small integers, exact in bf16: vdpbf16ps takes them as they
// are against the bf16 activations, and each group's scale multiplies its partial sums in fp32,
//     y[n] = Σ_g scale[n, g] · Σ_{k ∈ g} code[n, k] · x[k]  +  Σ_g min[n, g] · Σ_{k ∈ g} x[k],
// the mins' term over the activations' group sums, made once a call. Every product is exact and every sum fp32:
// the weights exactly as the format defines them, nothing rounded to bf16, and a third of the instructions per
// weight of widening each weight to fp32 and scaling it (4-bit codes: a broadcast load, a widen, a shift and a
// table lookup per 32). A tile of kOut outputs keeps its sums for kRows rows in registers; with more rows its
// codes are decoded once into an L1 buffer that each block of kRows rows then reads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "quant_weight.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__)
namespace llmgw_quant {
namespace {

// the scales of a 32-block by vdpbf16ps lane: lane i sums elements 2i and 2i + 1, so lanes 0-7 hold the first 16
template <Group G>
inline __m512 block_scales(const float* s, int64_t k) {
  if constexpr (G == kGroup16) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[k >> 4]), _mm512_set1_ps(s[(k >> 4) + 1]));
  } else {
    return _mm512_set1_ps(s[k >> 5]);
  }
}

// `decoded`: the tile's codes already as bf16 ([Out, k_total]), or nullptr to decode them here
template <int Bits, Group G, int Out, int Rows>
void tile(const QuantWeight& w, int64_t n0, const uint16_t* decoded, const uint16_t* x, int64_t x_stride,
          int64_t k_total, float sums[kRows][kOut]) {
  const CodeDecoder decode;
  // a decode step streams each weight once: ask for a later tile's bytes (the same column, 4 KiB or more on)
  // while this one computes; one tile ahead is too late for int8 rows, whose reads then take twice as long
  const int64_t tile_bytes = kOut * w.row_bytes, ahead = tile_bytes * ((4096 + tile_bytes - 1) / tile_bytes);
  __m512 acc[Rows][Out];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_total; k += 32) {
    __m512bh xr[Rows];
    for (int r = 0; r < Rows; ++r) xr[r] = (__m512bh)_mm512_loadu_si512(x + r * x_stride + k);
    for (int j = 0; j < Out; ++j) {
      __m512bh c;
      if (decoded) {
        c = (__m512bh)_mm512_loadu_si512(decoded + j * k_total + k);
      } else {
        const uint8_t* codes = w.codes + (n0 + j) * w.row_bytes + (Bits == 8 ? k : k / 2);
        __builtin_prefetch(codes + ahead);
        c = (__m512bh)decode.bf16<Bits>(codes);
      }
      if constexpr (G == kGroupRow) {  // one scale a row: applied to the sums at the end
        for (int r = 0; r < Rows; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], c, xr[r]);
      } else {
        const __m512 s = block_scales<G>(w.scales + (n0 + j) * w.groups, k);
        for (int r = 0; r < Rows; ++r)
          acc[r][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), c, xr[r]), s, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j)
      sums[r][j] = _mm512_reduce_add_ps(acc[r][j]) * (G == kGroupRow ? w.scales[n0 + j] : 1.f);
}

template <int Bits, Group G, int Out>
void tile_rows(int rows, const QuantWeight& w, int64_t n0, const uint16_t* decoded, const uint16_t* x,
               int64_t x_stride, int64_t k, float sums[kRows][kOut]) {
  switch (rows) {
    case 1: return tile<Bits, G, Out, 1>(w, n0, decoded, x, x_stride, k, sums);
    case 2: return tile<Bits, G, Out, 2>(w, n0, decoded, x, x_stride, k, sums);
    case 3: return tile<Bits, G, Out, 3>(w, n0, decoded, x, x_stride, k, sums);
    default: return tile<Bits, G, Out, kRows>(w, n0, decoded, x, x_stride, k, sums);
  }
}

template <int Bits>
void decode_tile(const QuantWeight& w, int64_t n0, int out, int64_t k_total, uint16_t* buffer) {
  const CodeDecoder decode;
  for (int j = 0; j < out; ++j)
    for (int64_t k = 0; k < k_total; k += 32) {
      const uint8_t* codes = w.codes + (n0 + j) * w.row_bytes + (Bits == 8 ? k : k / 2);
      _mm512_storeu_si512(buffer + j * k_total + k, decode.bf16<Bits>(codes));
    }
}

template <typename T>
void run_tiles(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
               int64_t k, int64_t n, T* y, int64_t y_stride, const float* bias) {
  std::vector<float> x_sums(w.mins ? rows * w.groups : 0);  // [rows, groups]
  if (w.mins) group_sums(x, x_stride, rows, k, w.groups, x_sums.data(), w.groups, 1);
  auto emit = [&](float sums[kRows][kOut], int64_t n0, int out, int64_t r0, int r) {
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < out; ++j) {
        float v = sums[i][j] + (bias ? bias[n0 + j] : 0.f);
        if (w.mins) {
          const float* m = w.mins + (n0 + j) * w.groups;
          const float* xs = x_sums.data() + (r0 + i) * w.groups;
          for (int64_t g = 0; g < w.groups; ++g) v += m[g] * xs[g];
        }
        y[(r0 + i) * y_stride + n0 + j] = static_cast<T>(v);
      }
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
        const uint16_t* decoded = nullptr;
        if (rows > kRows) {
          if (bits == 4) decode_tile<4>(w, n0, out, k, buffer.data());
          else decode_tile<8>(w, n0, out, k, buffer.data());
          decoded = buffer.data();
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          const uint16_t* xr = x + r0 * x_stride;
#define LLMGW_TILE(B, G)                                                 \
  if (out == kOut) tile_rows<B, G, kOut>(r, w, n0, decoded, xr, x_stride, k, sums); \
  else tile_rows<B, G, 1>(r, w, n0, decoded, xr, x_stride, k, sums);
          if (bits == 4) { LLMGW_TILE(4, kGroup32) }
          else if (group == kGroup16) { LLMGW_TILE(8, kGroup16) }
          else if (group == kGroup32) { LLMGW_TILE(8, kGroup32) }
          else { LLMGW_TILE(8, kGroupRow) }
#undef LLMGW_TILE
          emit(sums, n0, out, r0, r);
        }
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
