// linear_quant's tile for the AVX2 build in 8-lane intrinsics. GCC keeps the 64-byte vector types of
// quant_weight.h (two ymm registers each on AVX2) on the stack and moves them through general registers: the
// generic tile ran a Q4_1 decode step at 55x its memory bound on an AVX2-only EPYC (docs/benchmarks.md).
#pragma once

#include "quant_weight.h"
#include "vec256.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
namespace llmgw_quant::avx2 {

// the codes of w[n, k .. k + 32) in fp32 and their groups' scales: for a tile of few rows, which multiplies the
// codes with x and applies the scale once per group (the minimums' term comes after: mins_term)
template <int Bits, Group G>
inline void codes_and_scales(const QuantWeight& w, int64_t n, int64_t k, __m256 out[4], __m256& s0, __m256& s1) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const float* s = w.scales + n * w.groups;
  const int64_t g0 = G == kGroupRow ? 0 : G == kGroup16 ? k >> 4 : k >> 5;
  __builtin_prefetch(row + (Bits == 8 ? k : k / 2) + kPrefetchBytes);
  if constexpr (Bits == 8) {
    for (int q = 0; q < 4; ++q)
      out[q] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k + 8 * q))));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m256i lo = _mm256_cvtepu8_epi32(packed), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8));
    const __m256i nibble = _mm256_set1_epi32(15);
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, nibble));
    out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, nibble));
    out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  }
  s0 = _mm256_set1_ps(s[g0]);
  s1 = G == kGroup16 ? _mm256_set1_ps(s[g0 + 1]) : s0;
}

// w[n, k .. k + 32) in fp32, 8 weights a register, exactly as QuantWeight::widen gives them
template <int Bits, Group G>
inline void widen(const QuantWeight& w, int64_t n, int64_t k, __m256 out[4]) {
  __m256 s0, s1;
  codes_and_scales<Bits, G>(w, n, k, out, s0, s1);
  const float* m = w.mins ? w.mins + n * w.groups : nullptr;
  const int64_t g0 = G == kGroupRow ? 0 : G == kGroup16 ? k >> 4 : k >> 5;
  const __m256 m0 = _mm256_set1_ps(m ? m[g0] : 0.f), m1 = _mm256_set1_ps(m ? m[G == kGroup16 ? g0 + 1 : g0] : 0.f);
  out[0] = _mm256_fmadd_ps(out[0], s0, m0);
  out[1] = _mm256_fmadd_ps(out[1], s0, m0);
  out[2] = _mm256_fmadd_ps(out[2], s1, m1);
  out[3] = _mm256_fmadd_ps(out[3], s1, m1);
}

// outputs n0 .. n0 + out widened to fp32 into buf [out, k_total]: dequantize_quant's rows, and the weights a tile
// of many rows reads (tile_from_widened)
template <int Bits, Group G>
inline void widen_rows(const QuantWeight& w, int64_t n0, int64_t out, int64_t k_total, float* buf) {
  for (int64_t j = 0; j < out; ++j)
    for (int64_t k = 0; k < k_total; k += 32) {
      __m256 wv[4];
      widen<Bits, G>(w, n0 + j, k, wv);
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(buf + j * k_total + k + 8 * q, wv[q]);
    }
}

inline void widen_rows(const QuantWeight& w, int bits, Group g, int64_t n0, int64_t out, int64_t k_total,
                       float* buf) {
  if (bits == 4) widen_rows<4, kGroup32>(w, n0, out, k_total, buf);
  else if (g == kGroup16) widen_rows<8, kGroup16>(w, n0, out, k_total, buf);
  else if (g == kGroup32) widen_rows<8, kGroup32>(w, n0, out, k_total, buf);
  else widen_rows<8, kGroupRow>(w, n0, out, k_total, buf);
}

// Rows × Out sums of rows of x against weights widened once (widen_rows, [Out, k_total]) that every row block
// reads from L1/L2, where the in-register tile below widens them again for every 4 rows: one accumulator per
// (row, output), 12 independent fma chains. (Two partial sums each, as that tile keeps them, spill registers:
// 16 rows took 57 ms against 37, and one output at a time 97.)
constexpr int kWidenedOut = 3;
// from this many rows on: on the AVX2 EPYC, all of a Q4_1 step's matmuls at 16 rows took 37 ms against 55 ms in
// the in-register tile, 8 rows 23 against 28, while 3-6 rows were 5-10% slower (the widened weights' stores)
constexpr int kWidenedMinRows = 8;
template <int Out, int Rows>
inline void tile_from_widened(const float* wf, const float* x, int64_t k_total, float sums[kRows][kWidenedOut]) {
  __m256 acc[Rows][Out];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_total; k += 8) {
    __m256 wv[Out];
    for (int j = 0; j < Out; ++j) wv[j] = _mm256_loadu_ps(wf + j * k_total + k);
    for (int r = 0; r < Rows; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k_total + k);
      for (int j = 0; j < Out; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = sum8(acc[r][j]);
}

template <int Out>
inline void tile_from_widened(int rows, const float* wf, const float* x, int64_t k_total,
                              float sums[kRows][kWidenedOut]) {
  static_assert(kRows == 4);
  switch (rows) {
    case 1: return tile_from_widened<Out, 1>(wf, x, k_total, sums);
    case 2: return tile_from_widened<Out, 2>(wf, x, k_total, sums);
    case 3: return tile_from_widened<Out, 3>(wf, x, k_total, sums);
    default: return tile_from_widened<Out, 4>(wf, x, k_total, sums);
  }
}

inline void tile_from_widened(int out, int rows, const float* wf, const float* x, int64_t k_total,
                              float sums[kRows][kWidenedOut]) {
  if (out == 1) tile_from_widened<1>(rows, wf, x, k_total, sums);
  else if (out == 2) tile_from_widened<2>(rows, wf, x, k_total, sums);
  else tile_from_widened<3>(rows, wf, x, k_total, sums);
}

// Tiles of up to this many rows apply each scale once per group and leave the minimums' term to mins_term: 5
// fewer vector ops per 32 weights for one row; more rows share one widening of the weights instead. Their arithmetic
// per row is the same for 1, 2 or 3 rows, so a row's sums are its 1-row sums to the bit: a step of few rows (a
// speculative verify pass) runs in blocks of this many, and drafts do not move greedy output.
constexpr int kFoldRows = 3;
inline bool folds(int rows) { return rows <= kFoldRows; }

// Σ_g min[n, g] · (Σ of x over group g): the minimums' term of a folded tile's sum
inline float mins_term(const QuantWeight& w, int64_t n, const float* x_group_sums) {
  const float* m = w.mins + n * w.groups;
  float sum = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) sum += m[g] * x_group_sums[g];
  return sum;
}

// Rows × Out sums one output at a time: `one_output(n, sums)` fills column 0 of sums for output n. For tiles of 3-4
// rows, whose partial sums for two outputs at once do not fit 16 registers
template <int Out, int Rows, typename OneOutput>
inline void output_by_output(int64_t n0, float sums[kRows][kOut], OneOutput one_output) {
  for (int j = 0; j < Out; ++j) {
    float one[kRows][kOut];
    one_output(n0 + j, one);
    for (int r = 0; r < Rows; ++r) sums[r][j] = one[r][0];
  }
}

// Rows × Out sums: rows of x (fp32, k contiguous) against outputs n0 .. n0 + Out; without the minimums' term for
// Rows <= kFoldRows. One row, and each output of 4 rows, keeps two accumulators, so that its fmas are not one
// serial chain.
template <int Bits, Group G, int Out, int Rows>
void tile(const QuantWeight& w, int64_t n0, const float* x, int64_t k_total, float sums[kRows][kOut]) {
  if constexpr (Rows > 2 && Out > 1) {
    // one output at a time, with two partial sums a row: with two outputs and one sum, GCC kept x's vectors for
    // both outputs and spilled the accumulators, a store and a load in every chain of 4 fmas (int8 at 4 rows:
    // 15.1 -> 11.5 ms for a step's matmuls on the AVX2 EPYC)
    output_by_output<Out, Rows>(n0, sums, [&](int64_t n, float (*one)[kOut]) {
      tile<Bits, G, 1, Rows>(w, n, x, k_total, one);
    });
    return;
  }
  // a folded tile's groups of 16 keep their two halves' sums apart as one row does
  constexpr int kAcc = Rows == 1 || Rows > kFoldRows || G == kGroup16 ? 2 : 1;
  __m256 acc[Rows][Out][kAcc];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j)
      for (int a = 0; a < kAcc; ++a) acc[r][j][a] = _mm256_setzero_ps();
  if constexpr (Rows <= kFoldRows) {
    for (int64_t k = 0; k < k_total; k += 32)
      for (int j = 0; j < Out; ++j) {
        __m256 cv[4], s0, s1;
        codes_and_scales<Bits, G>(w, n0 + j, k, cv, s0, s1);
        for (int r = 0; r < Rows; ++r) {
          const float* xr = x + r * k_total + k;
          const __m256 t0 =
              _mm256_fmadd_ps(cv[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(cv[0], _mm256_loadu_ps(xr)));
          const __m256 t1 =
              _mm256_fmadd_ps(cv[3], _mm256_loadu_ps(xr + 24), _mm256_mul_ps(cv[2], _mm256_loadu_ps(xr + 16)));
          if constexpr (G == kGroup16) {
            acc[r][j][0] = _mm256_fmadd_ps(t0, s0, acc[r][j][0]);
            acc[r][j][kAcc - 1] = _mm256_fmadd_ps(t1, s1, acc[r][j][kAcc - 1]);
          } else {
            acc[r][j][0] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), s0, acc[r][j][0]);
          }
        }
      }
  } else {
    for (int64_t k = 0; k < k_total; k += 32)
      for (int j = 0; j < Out; ++j) {
        __m256 wv[4];
        widen<Bits, G>(w, n0 + j, k, wv);
        for (int r = 0; r < Rows; ++r)
          for (int q = 0; q < 4; ++q)
            acc[r][j][q % kAcc] =
                _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(x + r * k_total + k + 8 * q), acc[r][j][q % kAcc]);
      }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j)
      sums[r][j] = sum8(kAcc == 2 ? _mm256_add_ps(acc[r][j][0], acc[r][j][kAcc - 1]) : acc[r][j][0]);
}

// The 4-bit tile reads 64 codes (two groups) as eight 32-bit lanes and takes nibble t of every lane at once: an
// and with 15 << 4t (t = 7: a shift right by 28) leaves code · 2^4t in each lane, exactly an fp32 after the
// conversion. x comes permuted to the codes' order and scaled by 2^-4t (permute_x_q4), so each product is
// code · x to the bit, for 3 vector ops per 8 weights instead of 5 (no widening shuffle, no shift).
// Lane i holds the bytes 4i .. 4i + 3 of the 32: group i / 4, its bytes 4 (i % 4) + s, s = 0 .. 3, each the codes
// j and j + 16 of its group (GGUF's order): nibble t is code 4 (i % 4) + t / 2 + 16 (t % 2).
inline int64_t q4_source(int64_t t, int64_t i) { return 32 * (i >> 2) + 4 * (i & 3) + (t >> 1) + 16 * (t & 1); }

// x's rows in the order and scale tile_q4 reads them: each 64 inputs by q4_source, a last 32 as they are
inline void permute_x_q4(const float* x, int64_t rows, int64_t k, float* out) {
  const int64_t k64 = k & ~int64_t{63};
  for (int64_t r = 0; r < rows; ++r, x += k, out += k) {
    for (int64_t b = 0; b < k64; b += 64)
      for (int t = 0; t < 8; ++t) {
        const float scale = t == 7 ? 1.f : 1.f / static_cast<float>(1 << (4 * t));  // a power of 2: exact
        for (int i = 0; i < 8; ++i) out[b + 8 * t + i] = x[b + q4_source(t, i)] * scale;
      }
    std::memcpy(out + k64, x + k64, (k - k64) * sizeof(float));
  }
}

// Rows × Out sums over 4-bit codes without the minimums' term (mins_term), x from permute_x_q4
template <int Out, int Rows>
void tile_q4(const QuantWeight& w, int64_t n0, const float* xp, int64_t k_total, float sums[kRows][kOut]) {
  if constexpr (Rows > 2 && Out > 1) {  // two partial sums a row for 3 rows fit 16 registers for one output (4 spill)
    output_by_output<Out, Rows>(n0, sums, [&](int64_t n, float (*one)[kOut]) {
      tile_q4<1, Rows>(w, n, xp, k_total, one);
    });
    return;
  }
  constexpr int kPart = 2;  // partial sums a row and output: fewer serial fmas, and the same sums for 1-3 rows
  const int64_t k64 = k_total & ~int64_t{63};
  const __m256i group_of_lane = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
  __m256 acc[Rows][Out];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k64; k += 64)
    for (int j = 0; j < Out; ++j) {
      const uint8_t* codes = w.codes + (n0 + j) * w.row_bytes + k / 2;
      __builtin_prefetch(codes + kPrefetchBytes);
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      const __m128i scale_pair = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.scales + (n0 + j) * w.groups + k / 32));
      const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(scale_pair)), group_of_lane);
      __m256 part[Rows][kPart];
      for (int t = 0; t < 8; ++t) {
        const __m256 c = _mm256_cvtepi32_ps(t == 7 ? _mm256_srli_epi32(lanes, 28)
                                                   : _mm256_and_si256(lanes, _mm256_set1_epi32(15 << (4 * t))));
        for (int r = 0; r < Rows; ++r) {
          const __m256 xv = _mm256_loadu_ps(xp + r * k_total + k + 8 * t);
          __m256& sum = part[r][t % kPart];
          sum = t < kPart ? _mm256_mul_ps(c, xv) : _mm256_fmadd_ps(c, xv, sum);
        }
      }
      for (int r = 0; r < Rows; ++r)
        acc[r][j] = _mm256_fmadd_ps(_mm256_add_ps(part[r][0], part[r][1]), scale, acc[r][j]);
    }
  if (k64 < k_total)  // a last group of 32, in GGUF's order
    for (int j = 0; j < Out; ++j) {
      __m256 cv[4], s0, s1;
      codes_and_scales<4, kGroup32>(w, n0 + j, k64, cv, s0, s1);
      for (int r = 0; r < Rows; ++r) {
        const float* xr = xp + r * k_total + k64;
        __m256 t = _mm256_mul_ps(cv[0], _mm256_loadu_ps(xr));
        for (int q = 1; q < 4; ++q) t = _mm256_fmadd_ps(cv[q], _mm256_loadu_ps(xr + 8 * q), t);
        acc[r][j] = _mm256_fmadd_ps(t, s0, acc[r][j]);
      }
    }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = sum8(acc[r][j]);
}

}  // namespace llmgw_quant::avx2
#endif
