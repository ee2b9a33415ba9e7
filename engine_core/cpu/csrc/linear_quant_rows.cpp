// A quantized linear layer for a prefill-sized step (more rows than linear_quant's register tiles serve well) on a
// CPU with AVX-512 BF16 and no AMX. Each pair of 16-output blocks is dequantized to bf16 (to the bit the weight
// `dequantize_quant` gives) into linear_bf16's packed layout in a buffer that stays in cache,
// and linear_bf16's register tiles run every row against it. Dequantizing the whole weight and handing it to oneDNN
// instead made oneDNN pack it again in every call: a 100-token prefill took 1.7x the time of the same GEMM on a
// weight packed once (docs/benchmarks.md, issue 31).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "bf16_tiles.h"
#include "quant_weight.h"

#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
namespace llmgw_quant {
namespace {

// 32 weights in fp32 → their bf16 (rounded to nearest even, as torch's casts round) as 16 dwords, dword i holding
// the pair (2i, 2i + 1): one row of a 16 × 16 block of the packed layout. vcvtne2ps2bf16 flushes fp32 denormals
// to zero where torch keeps them: no format here makes a weight below 2^-126 but zero (a GGUF's fp16 scales are
// 2^-24 or more, int8 / int4 scales a row's or group's largest weight over the code range)
inline __m512i bf16_pairs(floats16 w0, floats16 w1) {
  __m512 a, b;
  std::memcpy(&a, &w0, sizeof a);
  std::memcpy(&b, &w1, sizeof b);
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}

// r[j] dword p → r[p] dword j, in registers: 64 shuffles where a gather per dword pair cost several times that
inline void transpose16(__m512i r[16]) {
  __m512i t[16], s[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // s[i + q], 128-bit lane L: rows i .. i + 3 of column 4L + q
    s[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    s[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    s[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    s[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int q = 0; q < 4; ++q) {  // the 4 × 4 transpose of 128-bit lanes
    const __m512i a = _mm512_shuffle_i32x4(s[q], s[4 + q], 0x44), b = _mm512_shuffle_i32x4(s[q], s[4 + q], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(s[8 + q], s[12 + q], 0x44);
    const __m512i d = _mm512_shuffle_i32x4(s[8 + q], s[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// outputs n0 .. n0 + 16 of w dequantized to bf16 in the packed layout [k/2][16][2]; outputs from n on are zero.
// Each 32 inputs of the 16 outputs are widened in registers and transposed there: a scratch copy of the rows and a
// gather per pair made the packing a quarter of a 100-token prefill's layer time (docs/benchmarks.md, issue 31)
template <int Bits, Group G>
void pack_dequantized(const QuantWeight& w, int64_t n0, int64_t n, int64_t k, uint16_t* packed) {
  for (int64_t c = 0; c < k; c += 32) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) {
      if (n0 + j >= n) {
        r[j] = _mm512_setzero_si512();
        continue;
      }
      floats16 w0, w1;
      w.widen<Bits, G>(n0 + j, c, w0, w1);
      r[j] = bf16_pairs(w0, w1);
    }
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(packed + (c / 2 + p) * 32, r[p]);
  }
}

void pack_dequantized(const QuantWeight& w, int bits, Group group, int64_t n0, int64_t n, int64_t k,
                      uint16_t* packed) {
  if (bits == 4) pack_dequantized<4, kGroup32>(w, n0, n, k, packed);
  else if (group == kGroup16) pack_dequantized<8, kGroup16>(w, n0, n, k, packed);
  else if (group == kGroup32) pack_dequantized<8, kGroup32>(w, n0, n, k, packed);
  else pack_dequantized<8, kGroupRow>(w, n0, n, k, packed);
}

template <typename T>
void run(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k,
         int64_t n, T* y, int64_t y_stride, const float* bias) {
  using bf16_tiles::kRows;
  const int64_t k2s = k / 2, block_elems = k2s * 32;
  at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> packed(2 * block_elems);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = 2 * p;  // the first of the pair's blocks of 16 outputs
      const int blocks = 16 * nb + 16 < n ? 2 : 1;
      for (int b = 0; b < blocks; ++b)
        pack_dequantized(w, bits, group, 16 * (nb + b), n, k, packed.data() + b * block_elems);
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
