// The quantized linear layer for 5 to 16 bf16 rows (a batch of decodes) on a CPU with AMX. As on the vdpbf16ps
// path (linear_quant_bf16.cpp) the codes are exact in bf16 and the scales multiply partial sums in fp32, but here
// one TDPBF16PS sums a group's 16 outputs × 32 inputs × 16 rows: A holds the codes (decoded in registers), B the
// activations, transposed once a call, and each group's 16 × 16 sums leave the tile to be scaled into fp32
// accumulators, one fma per output for all the rows at once. That path spends two instructions per 32 weights
// per row; here the rows are nearly free, and a step costs the decode and the read. The weights are the format's,
// nothing rounded: every row count computes the same products.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "quant_weight.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
namespace llmgw_quant {
namespace {

constexpr int kTileRows = 16;  // outputs per A tile, rows of x per B tile

// tiles 0 and 3 (C), 1 and 4 (A), 2 and 5 (B)
const llmgw_amx::TileConfig kTileConfig = llmgw_amx::uniform_config(6);

// `xb`: B per scale group, 16 pairs of inputs × 16 rows (a group of 16 fills the half of its 32-block);
// `x_sums`: per group, the rows' sums of its inputs (16 lanes), for the mins
template <int Bits, Group G, typename T>
LLMGW_AMX void run_blocks(const QuantWeight& w, const uint32_t* xb, const float* x_sums, int64_t rows, int64_t k,
                          int64_t n, int64_t b0, int64_t b1, T* y, int64_t y_stride, const float* bias) {
  alignas(64) uint16_t a0[kTileRows * 32], a1[kTileRows * 32];
  alignas(64) float c0[kTileRows * kTileRows], c1[kTileRows * kTileRows];
  const CodeDecoder decode;
  _tile_loadconfig(&kTileConfig);
  for (int64_t block = b0; block < b1; ++block) {
    const int64_t n0 = block * kTileRows;
    const int valid = static_cast<int>(std::min<int64_t>(kTileRows, n - n0));
    // an output past n reads the last one's scales (its sums are zero and never written): the loops stay 16 long
    // and the accumulators in registers
    const float* scales[kTileRows];
    const float* mins[kTileRows];
    for (int i = 0; i < kTileRows; ++i) {
      scales[i] = w.scales + (n0 + std::min(i, valid - 1)) * w.groups;
      mins[i] = w.mins ? w.mins + (n0 + std::min(i, valid - 1)) * w.groups : nullptr;
    }
    __m512 acc[kTileRows];  // output n0 + i, lanes: rows
    for (int i = 0; i < kTileRows; ++i) acc[i] = _mm512_setzero_ps();
    auto decode_a = [&](int64_t kk, uint16_t* a) {  // the 16 outputs' codes for inputs kk .. kk + 32
      for (int i = 0; i < kTileRows; ++i) {
        __m512i codes = _mm512_setzero_si512();
        if (i < valid) {
          const uint8_t* p = w.codes + (n0 + i) * w.row_bytes + (Bits == 8 ? kk : kk / 2);
          __builtin_prefetch(p + kPrefetchBytes);
          codes = decode.bf16<Bits>(p);
        }
        _mm512_store_si512(a + i * 32, codes);
      }
    };
    auto scale_into = [&](const float* c, int64_t g) {  // group g's sums, scaled, and its mins' term
      for (int i = 0; i < kTileRows; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c + i * kTileRows), _mm512_set1_ps(scales[i][g]), acc[i]);
      if (w.mins) {
        const __m512 sums = _mm512_loadu_ps(x_sums + g * kTileRows);
        for (int i = 0; i < kTileRows; ++i) acc[i] = _mm512_fmadd_ps(sums, _mm512_set1_ps(mins[i][g]), acc[i]);
      }
    };
    constexpr int64_t kTile = kTileRows * kTileRows;
    if constexpr (G == kGroupRow) {  // one scale a row: the tile sums every input, scaled at the end
      _tile_zero(0);
      for (int64_t kk = 0; kk < k; kk += 32) {
        decode_a(kk, a0);
        _tile_loadd(1, a0, 64);
        _tile_loadd(2, xb + (kk / 32) * kTile, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c0, 64);
      for (int i = 0; i < kTileRows; ++i) {
        acc[i] = _mm512_mul_ps(_mm512_load_ps(c0 + i * kTileRows), _mm512_set1_ps(scales[i][0]));
        if (w.mins) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x_sums), _mm512_set1_ps(mins[i][0]), acc[i]);
      }
    } else {
      // two scale groups a pass, in tiles (C, A, B) 0, 1, 2 and 3, 4, 5 (a group of 16: one A, each B half of
      // its 32-block). The sums leave the tiles through memory, and reading a tile's store at once stalls until
      // it lands: they are scaled a pass later, after the next pass's decode.
      constexpr int64_t kPass = G == kGroup16 ? 32 : 64;  // inputs a pass
      int64_t pending = -1;  // the first group whose sums wait in c0 (and c1)
      bool pending_pair = false;
      for (int64_t kk = 0; kk < k; kk += kPass) {
        const int64_t g = kk / (kPass / 2);
        const bool pair = G == kGroup16 || kk + 32 < k;
        decode_a(kk, a0);
        if (G != kGroup16 && pair) decode_a(kk + 32, a1);
        if (pending >= 0) {
          scale_into(c0, pending);
          if (pending_pair) scale_into(c1, pending + 1);
        }
        _tile_loadd(1, a0, 64);
        _tile_loadd(2, xb + g * kTile, 64);
        _tile_zero(0);
        _tile_dpbf16ps(0, 1, 2);
        if (pair) {
          if constexpr (G == kGroup16) {
            _tile_loadd(5, xb + (g + 1) * kTile, 64);
            _tile_zero(3);
            _tile_dpbf16ps(3, 1, 5);
          } else {
            _tile_loadd(4, a1, 64);
            _tile_loadd(5, xb + (g + 1) * kTile, 64);
            _tile_zero(3);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
        _tile_stored(0, c0, 64);
        if (pair) _tile_stored(3, c1, 64);
        pending = g;
        pending_pair = pair;
      }
      scale_into(c0, pending);
      if (pending_pair) scale_into(c1, pending + 1);
    }
    // out: row r's 16 outputs are lane r of each accumulator, gathered from L1
    for (int i = 0; i < kTileRows; ++i) _mm512_store_ps(c0 + i * kTileRows, acc[i]);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b16 = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    const __m512i column = lanes_times(kTileRows);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c0 + r, 4), b16);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(y + r * y_stride + n0, mask, v);
      } else {  // rounded to nearest even, as torch's casts do
        _mm256_mask_storeu_epi16(y + r * y_stride + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
  _tile_release();
}

}  // namespace

template <typename T>
bool run_amx_impl(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
                  int64_t k, int64_t n, T* y, int64_t y_stride, const float* bias) {
  if (rows > kTileRows || x_stride % 2 != 0 || !llmgw_amx::usable()) return false;
  // B per scale group: pairs (k, k + 1) × 16 rows, as the tile wants them; rows past `rows`, and in a group of
  // 16 the pairs of the other half, are zero
  const int64_t group_size = group == kGroup16 ? 16 : 32;
  const int64_t tiles = k / group_size;
  std::vector<uint32_t> xb(tiles * kTileRows * kTileRows);
  const __mmask16 present = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i row_starts = lanes_times(static_cast<int>(x_stride / 2));
  const auto* x_pairs = reinterpret_cast<const int*>(x);  // x_stride is even: the rows are whole pairs
  for (int64_t t = 0; t < tiles; ++t)
    for (int p = 0; p < kTileRows; ++p) {  // pair p of the tile's 32-block: lane m, row m's
      const int64_t pair = (t * group_size) / 32 * 16 + p;
      const bool in_group = group_size == 32 || (p / 8) == t % 2;
      const __m512i v = in_group ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, row_starts,
                                                                x_pairs + pair, 4)
                                 : _mm512_setzero_si512();
      _mm512_storeu_si512(xb.data() + (t * kTileRows + p) * kTileRows, v);
    }
  std::vector<float> x_sums(w.groups * kTileRows, 0.f);  // per scale group, lane m: row m's sum of its inputs
  if (w.mins) group_sums(x, x_stride, rows, k, w.groups, x_sums.data(), 1, kTileRows);
  const int64_t blocks = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const uint32_t* xp = xb.data();
    const float* sp = x_sums.data();
    if (bits == 4) run_blocks<4, kGroup32>(w, xp, sp, rows, k, n, b0, b1, y, y_stride, bias);
    else if (group == kGroup16) run_blocks<8, kGroup16>(w, xp, sp, rows, k, n, b0, b1, y, y_stride, bias);
    else if (group == kGroup32) run_blocks<8, kGroup32>(w, xp, sp, rows, k, n, b0, b1, y, y_stride, bias);
    else run_blocks<8, kGroupRow>(w, xp, sp, rows, k, n, b0, b1, y, y_stride, bias);
  });
  return true;
}

bool run_amx(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
             int64_t k, int64_t n, float* y, int64_t y_stride, const float* bias) {
  return run_amx_impl(w, bits, group, x, x_stride, rows, k, n, y, y_stride, bias);
}

bool run_amx(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
             int64_t k, int64_t n, at::BFloat16* y, int64_t y_stride, const float* bias) {
  return run_amx_impl(w, bits, group, x, x_stride, rows, k, n, y, y_stride, bias);
}

}  // namespace llmgw_quant
#endif
