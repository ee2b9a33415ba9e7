// The quantized linear layer for bf16 activations on a CPU with AVX-512 BF16 (linear_quant.cpp dispatches here).
// A weight is scale · code + min, and its codes are small integers, exact in bf16: vdpbf16ps takes them as they
// are against the bf16 activations, and each group's scale multiplies its partial sums in fp32,
//     y[n] = Σ_g scale[n, g] · Σ_{k ∈ g} code[n, k] · x[k]  +  Σ_g min[n, g] · Σ_{k ∈ g} x[k],
// the mins' term over the activations' group sums, made once a call. Every product is exact and every sum fp32:
// the weights exactly as the format defines them, nothing rounded to bf16, and a third of the instructions per
// weight of widening each weight to fp32 and scaling it (4-bit codes: a broadcast load, a widen, a shift and a
// table lookup per 32). A tile of kOut outputs keeps its sums for kRows rows in registers; with more rows, 8-bit
// codes are decoded once into an L1 buffer that each block of kRows rows then reads, and 4-bit ones are decoded
// again for each block (5 instructions per 64 weights and output, cheaper than the buffer's stores and loads: a
// layer's 4-bit matmuls at 5 / 6 / 8 / 10 / 16 rows took 1.28x / 1.21x / 1.15x / 1.09x / 1.07x as long through the
// buffer, Zen 4 EPYC, `benchmarks/quant_kernel_rates.py --against`; 8-bit ones gained nothing). 4-bit codes go two groups
// at a time (tile_pairs): 32 bytes widened once give both groups' low codes and, shifted, their high codes,
// against the activations permuted once a call to that order (pair_order); one fma applies both groups' scales.
// That is 8 instructions per 64 weights and row instead of 12.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "quant_weight.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
namespace llmgw_quant {
namespace {

// how far ahead a tile asks for its weights' bytes while it computes: a later tile's (the same column, 4 KiB or
// more on). One tile ahead is too late for int8 rows, whose reads then take twice as long; and the decode of a
// step of 5-16 rows into an L1 buffer without it waited on every read (a 6-row verify pass cost 2.6x one row)
inline int64_t prefetch_distance(const QuantWeight& w) {
  const int64_t tile_bytes = kOut * w.row_bytes;
  return tile_bytes * ((4096 + tile_bytes - 1) / tile_bytes);
}

// the scales of a 32-block by vdpbf16ps lane: lane i sums elements 2i and 2i + 1, so lanes 0-7 hold the first 16
template <Group G>
inline __m512 block_scales(const float* s, int64_t k) {
  if constexpr (G == kGroup16) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[k >> 4]), _mm512_set1_ps(s[(k >> 4) + 1]));
  } else {
    return _mm512_set1_ps(s[k >> 5]);
  }
}

// two groups' 4-bit codes (32 bytes) as bf16: `low` word i is byte i's low nibble (code i % 16 of group i / 16),
// `high` its high nibble (code 16 + i % 16), the order pair_order gives the activations
inline void pair_codes(const uint8_t* codes, __m512i table, __m512bh& low, __m512bh& high) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  low = (__m512bh)_mm512_permutexvar_epi16(bytes, table);  // the index is a word's low 5 bits: the table is doubled
  high = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
}

// lanes 0-7 s[0], lanes 8-15 s[1]: two groups' scales, as vdpbf16ps sums tile_pairs' order
inline __m512 pair_scales(const float* s, __m512i pair) {
  return _mm512_permutexvar_ps(pair, _mm512_castpd_ps(_mm512_castpd128_pd512(
                                         _mm_load_sd(reinterpret_cast<const double*>(s)))));
}

// acc[r][j] += Σ_g min[n0 + j, g] · x_sums[r, g]: the mins' term, 16 groups an instruction, before the sums
// are reduced
template <int Out, int Rows>
inline void add_mins(const QuantWeight& w, int64_t n0, const float* x_sums, __m512 acc[Rows][Out]) {
  for (int64_t g = 0; g < w.groups; g += 16) {
    const __mmask16 m = w.groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (w.groups - g)) - 1);
    for (int j = 0; j < Out; ++j) {
      const __m512 mins = _mm512_maskz_loadu_ps(m, w.mins + (n0 + j) * w.groups + g);
      for (int r = 0; r < Rows; ++r)
        acc[r][j] = _mm512_fmadd_ps(mins, _mm512_maskz_loadu_ps(m, x_sums + r * w.groups + g), acc[r][j]);
    }
  }
}

// Rows × Out sums of 4-bit codes, two groups (64 inputs) a step: `x` in pair_order for its first k_pairs inputs
template <int Out, int Rows>
void tile_pairs(const QuantWeight& w, int64_t n0, const uint16_t* x, int64_t x_stride,
                int64_t k_pairs, int64_t k_total, const float* x_sums, float sums[kRows][kOut]) {
  const __m512i table = _mm512_loadu_si512(kNibbleBf16);
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const CodeDecoder decode;
  const int64_t ahead = prefetch_distance(w);
  __m512 acc[Rows][Out];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_pairs; k += 64) {
    __m512bh lo[Rows], hi[Rows];
    for (int r = 0; r < Rows; ++r) {
      lo[r] = (__m512bh)_mm512_loadu_si512(x + r * x_stride + k);
      hi[r] = (__m512bh)_mm512_loadu_si512(x + r * x_stride + k + 32);
    }
    for (int j = 0; j < Out; ++j) {
      __m512bh low, high;
      const uint8_t* codes = w.codes + (n0 + j) * w.row_bytes + k / 2;
      __builtin_prefetch(codes + ahead);
      pair_codes(codes, table, low, high);
      const __m512 s = pair_scales(w.scales + (n0 + j) * w.groups + k / 32, pair);
      for (int r = 0; r < Rows; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), low, lo[r]), high, hi[r]),
                                    s, acc[r][j]);
    }
  }
  for (int64_t k = k_pairs; k < k_total; k += 32) {  // an odd last group, in natural order
    __m512bh xr[Rows];
    for (int r = 0; r < Rows; ++r) xr[r] = (__m512bh)_mm512_loadu_si512(x + r * x_stride + k);
    for (int j = 0; j < Out; ++j) {
      const __m512bh c = (__m512bh)decode.bf16<4>(w.codes + (n0 + j) * w.row_bytes + k / 2);
      const __m512 s = _mm512_set1_ps(w.scales[(n0 + j) * w.groups + k / 32]);
      for (int r = 0; r < Rows; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), c, xr[r]), s, acc[r][j]);
    }
  }
  if (x_sums) add_mins<Out, Rows>(w, n0, x_sums, acc);
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

// `decoded`: the tile's codes already as bf16 ([Out, k_total]), or nullptr to decode them here
template <int Bits, Group G, int Out, int Rows>
void tile(const QuantWeight& w, int64_t n0, const uint16_t* decoded, const uint16_t* x, int64_t x_stride,
          int64_t k_total, const float* x_sums, float sums[kRows][kOut]) {
  const CodeDecoder decode;
  const int64_t ahead = prefetch_distance(w);  // a decode step streams each weight once
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
  if constexpr (G == kGroupRow) {  // one scale a row (int8, no mins)
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < Out; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]) * w.scales[n0 + j];
  } else {
    if (x_sums) add_mins<Out, Rows>(w, n0, x_sums, acc);
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < Out; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

// `decoded`: an 8-bit tile's codes from decode_tile's buffer, or nullptr (4-bit tiles decode their own)
template <int Bits, Group G, int Out>
void tile_rows(int rows, const QuantWeight& w, int64_t n0, const uint16_t* decoded, const uint16_t* x,
               int64_t x_stride, int64_t k_pairs, int64_t k, const float* x_sums, float sums[kRows][kOut]) {
  if constexpr (Bits == 4) {
    switch (rows) {
      case 1: return tile_pairs<Out, 1>(w, n0, x, x_stride, k_pairs, k, x_sums, sums);
      case 2: return tile_pairs<Out, 2>(w, n0, x, x_stride, k_pairs, k, x_sums, sums);
      case 3: return tile_pairs<Out, 3>(w, n0, x, x_stride, k_pairs, k, x_sums, sums);
      default: return tile_pairs<Out, kRows>(w, n0, x, x_stride, k_pairs, k, x_sums, sums);
    }
  } else {
    switch (rows) {
      case 1: return tile<Bits, G, Out, 1>(w, n0, decoded, x, x_stride, k, x_sums, sums);
      case 2: return tile<Bits, G, Out, 2>(w, n0, decoded, x, x_stride, k, x_sums, sums);
      case 3: return tile<Bits, G, Out, 3>(w, n0, decoded, x, x_stride, k, x_sums, sums);
      default: return tile<Bits, G, Out, kRows>(w, n0, decoded, x, x_stride, k, x_sums, sums);
    }
  }
}

// x's rows with each 64 inputs as tile_pairs reads them: [0, 16) [32, 48) then [16, 32) [48, 64); a last odd
// group stays as it is
void pair_order(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k, uint16_t* out) {
  const __m512i first = _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 15, 14, 13,
                                         12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = x + r * x_stride;
    uint16_t* dst = out + r * k;
    int64_t c = 0;
    for (; c + 64 <= k; c += 64) {
      const __m512i a = _mm512_loadu_si512(src + c), b = _mm512_loadu_si512(src + c + 32);
      _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(a, first, b));
      _mm512_storeu_si512(dst + c + 32, _mm512_permutex2var_epi16(a, second, b));
    }
    std::memcpy(dst + c, src + c, (k - c) * sizeof(uint16_t));
  }
}

// a tile's 8-bit codes as bf16, [out, k_total], for its blocks of kRows rows to read
template <int Bits>
void decode_tile(const QuantWeight& w, int64_t n0, int out, int64_t k_total, uint16_t* buffer) {
  const CodeDecoder decode;
  const int64_t ahead = prefetch_distance(w);
  for (int j = 0; j < out; ++j)
    for (int64_t k = 0; k < k_total; k += 32) {
      const uint8_t* codes = w.codes + (n0 + j) * w.row_bytes + (Bits == 8 ? k : k / 2);
      __builtin_prefetch(codes + ahead);
      _mm512_storeu_si512(buffer + j * k_total + k, decode.bf16<Bits>(codes));
    }
}

template <typename T>
void run_tiles(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
               int64_t k, int64_t n, T* y, int64_t y_stride, const float* bias) {
  std::vector<float> x_sums(w.mins ? rows * w.groups : 0);  // [rows, groups]
  if (w.mins) group_sums(x, x_stride, rows, k, w.groups, x_sums.data(), w.groups, 1);
  // 4-bit codes: tile_pairs, over x in its order
  const bool pairs = bits == 4;
  const int64_t k_pairs = pairs ? k / 64 * 64 : 0;
  std::vector<uint16_t> x_pairs(pairs ? rows * k : 0);
  if (pairs) {
    pair_order(x, x_stride, rows, k, x_pairs.data());
    x = x_pairs.data();
    x_stride = k;
  }
  // the mins' term in the tile's registers for every row count: a row's sums then do not depend on how many rows
  // its step has, so a verify pass of k + 1 rows gives each row what a 1-row step gives it (exact speculation)
  const bool mins_in_tile = w.mins && group != kGroupRow;
  auto emit = [&](float sums[kRows][kOut], int64_t n0, int out, int64_t r0, int r) {
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < out; ++j) {
        float v = sums[i][j] + (bias ? bias[n0 + j] : 0.f);
        if (w.mins && !mins_in_tile) {
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
    const bool buffered = bits == 8 && rows > kRows;  // see the top of this file
    std::vector<uint16_t> buffer(buffered ? kOut * k : 0);
    float sums[kRows][kOut];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t first = t * kOut;
      // a tile of kOut outputs; the last outputs one at a time; and where the codes come straight from memory (1-4
      // rows), fewer outputs side by side, so that they are read as fewer streams. 4 outputs' int8 codes read side
      // by side streamed at 15-17 GB/s on a Zen 4 EPYC whose sequential reads reach 25-32: one output at a time
      // made a step's int8 matmuls 1.3-1.4x faster at 1-2 rows, and two at a time the 4-bit ones ~1.05x (issue 31,
      // docs/benchmarks.md). A row's sums are the same either way: one chain over k per row and output.
      const int direct_out = bits == 4 ? 2 : 1;
      const int out = n - first < kOut ? 1 : rows > kRows ? kOut : direct_out;
      for (int64_t n0 = first; n0 < std::min(first + kOut, n); n0 += out) {
        const uint16_t* decoded = nullptr;
        if (buffered) {
          decode_tile<8>(w, n0, out, k, buffer.data());
          decoded = buffer.data();
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          const uint16_t* xr = x + r0 * x_stride;
          const float* xs = mins_in_tile ? x_sums.data() + r0 * w.groups : nullptr;
#define LLMGW_TILE(B, G)                                                                        \
  if (out == kOut) tile_rows<B, G, kOut>(r, w, n0, decoded, xr, x_stride, k_pairs, k, xs, sums); \
  else if (out == 2) tile_rows<B, G, 2>(r, w, n0, decoded, xr, x_stride, k_pairs, k, xs, sums); \
  else tile_rows<B, G, 1>(r, w, n0, decoded, xr, x_stride, k_pairs, k, xs, sums);
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
