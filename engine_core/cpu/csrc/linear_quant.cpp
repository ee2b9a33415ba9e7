// y = x · Wᵀ (+ bias) over a weight kept quantized: the int8 / int4 formats made at load, and GGUF's block formats
// decoded once into the same two layouts (engine_core/models/layers/quant.py). Each weight is
//     w[n, k] = scale[n, g] · code[n, k] + min[n, g]        (g: k's group; no mins: min = 0)
// - 8 bits: codes int8 [N, K], groups of 16 (Q6_K), 32 (Q8_0, Q5_0) or the whole row (int8 per output channel);
// - 4 bits: codes uint8 [N, K/2], groups of 32; byte j of a group holds code[j] | code[j + 16] << 4, GGUF's
//   Q4_0 / Q4_1 byte order (Q4_K is repacked to it at load).
// A weight is widened to fp32 in registers with one fma (w exactly as the torch reference dequantizes it, up to
// fp32 rounding) and multiplied with fp32 activations: no rounding beyond the format's own, and fp32 out where
// asked (the LM head). A bf16 model rounds each weight to bf16 first (`round_bf16`), as its prefill-sized steps
// do (they dequantize to bf16 for the GEMM): a token then gets the same products whichever path computed it. A tile of kOut outputs × kRows rows keeps its sums in registers, so a decode step reads
// each weight once for all its rows, at the memory's bandwidth. Written with GCC vector types: the one source
// gives the AVX-512, AVX2 and scalar builds. K must be a multiple of 32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float floats16 __attribute__((vector_size(64)));
typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef int32_t ints16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kOut = 4, kRows = 4;  // 16 accumulators: half the zmm registers
#else
constexpr int kOut = 2, kRows = 2;  // a floats16 is two ymm registers on AVX2
#endif

enum Group { kGroup16, kGroup32, kGroupRow };

#ifndef LLMGW_PREFETCH_BYTES
#define LLMGW_PREFETCH_BYTES 512
#endif
constexpr int64_t kPrefetchBytes = LLMGW_PREFETCH_BYTES;

inline floats16 load_floats(const float* p) {
  floats16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bytes widened to 16 int32 lanes (sign- or zero-extended); GCC's vector conversions do this one lane at a
// time for 8-bit elements, the intrinsics in one or two instructions
template <bool Signed>
inline ints16 widen_bytes(bytes16 b) {
  ints16 out;
#if defined(__AVX512F__)
  const __m128i raw = (__m128i)b;
  const __m512i wide = Signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
  std::memcpy(&out, &wide, sizeof out);
#elif defined(__AVX2__)
  const __m128i raw = (__m128i)b;
  const __m256i lo = Signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  const __m256i hi = Signed ? _mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)) : _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
#else
  for (int i = 0; i < 16; ++i) out[i] = Signed ? static_cast<int8_t>(b[i]) : b[i];
#endif
  return out;
}

inline floats16 round_to_bf16(floats16 w) {  // round to nearest even, kept in fp32 lanes
  ints16 bits;
  std::memcpy(&bits, &w, sizeof bits);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & static_cast<int32_t>(0xFFFF0000u);
  std::memcpy(&w, &bits, sizeof w);
  return w;
}

inline void store(float* p, floats16 w) { std::memcpy(p, &w, sizeof w); }

inline void store(at::BFloat16* p, floats16 w) {  // rounded to nearest even, as torch's casts do
  const floats16 rounded = round_to_bf16(w);
  ints16 bits;
  std::memcpy(&bits, &rounded, sizeof bits);
#if defined(__AVX512F__)
  __m512i wide;
  std::memcpy(&wide, &bits, sizeof wide);
  const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(wide, 16));
  std::memcpy(p, &halves, sizeof halves);
#else
  for (int i = 0; i < 16; ++i) {
    const uint16_t half = static_cast<uint16_t>(static_cast<uint32_t>(bits[i]) >> 16);
    std::memcpy(p + i, &half, sizeof half);
  }
#endif
}

inline float sum_lanes(floats16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

struct QuantWeight {
  const uint8_t* codes;
  int64_t row_bytes;
  const float* scales;
  const float* mins;  // nullptr: none
  int64_t groups;  // per row

  // the 32 weights w[n, k .. k + 32) in fp32
  template <int Bits, Group G, bool RoundBf16 = false>
  inline void widen(int64_t n, int64_t k, floats16& w0, floats16& w1) const {
    const uint8_t* row = codes + n * row_bytes;
    const float* s = scales + n * groups;
    const float* m = mins ? mins + n * groups : nullptr;
    const int64_t g0 = G == kGroupRow ? 0 : G == kGroup16 ? k >> 4 : k >> 5;
    const int64_t g1 = G == kGroup16 ? g0 + 1 : g0;
    // a decode step streams each weight once: ask for the bytes ahead (into the next rows at a row's end) so
    // the memory works while the registers do; one thread alone reads ~2x slower without
    __builtin_prefetch(row + (Bits == 8 ? k : k / 2) + kPrefetchBytes);
    floats16 c0, c1;
    if constexpr (Bits == 8) {
      bytes16 a, b;
      std::memcpy(&a, row + k, 16);
      std::memcpy(&b, row + k + 16, 16);
      c0 = __builtin_convertvector(widen_bytes<true>(a), floats16);
      c1 = __builtin_convertvector(widen_bytes<true>(b), floats16);
    } else {
      bytes16 packed;
      std::memcpy(&packed, row + k / 2, 16);
      const ints16 both = widen_bytes<false>(packed);  // split the nibbles in 32-bit lanes: x86 has no byte shift
      c0 = __builtin_convertvector(both & 15, floats16);
      c1 = __builtin_convertvector(both >> 4, floats16);
    }
    w0 = c0 * s[g0] + (m ? m[g0] : 0.f);
    w1 = c1 * s[g1] + (m ? m[g1] : 0.f);
    if constexpr (RoundBf16) {
      w0 = round_to_bf16(w0);
      w1 = round_to_bf16(w1);
    }
  }
};

// Rows × Out sums of one tile: rows of x (fp32, k contiguous) against outputs n0 .. n0 + Out.
template <int Bits, Group G, bool RoundBf16, int Out, int Rows>
void tile(const QuantWeight& w, int64_t n0, const float* x, int64_t k_total, float sums[kRows][kOut]) {
  floats16 acc[Rows][Out] = {};
  for (int64_t k = 0; k < k_total; k += 32) {
    floats16 x0[Rows], x1[Rows];  // loaded once for the tile's outputs
    for (int r = 0; r < Rows; ++r) {
      x0[r] = load_floats(x + r * k_total + k);
      x1[r] = load_floats(x + r * k_total + k + 16);
    }
    for (int j = 0; j < Out; ++j) {
      floats16 w0, w1;
      w.widen<Bits, G, RoundBf16>(n0 + j, k, w0, w1);
      for (int r = 0; r < Rows; ++r) acc[r][j] += w0 * x0[r] + w1 * x1[r];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Out; ++j) sums[r][j] = sum_lanes(acc[r][j]);
}

template <int Bits, Group G, bool RoundBf16, int Out>
void tile_rows(int rows, const QuantWeight& w, int64_t n0, const float* x, int64_t k, float sums[kRows][kOut]) {
  switch (rows) {
    case 1: return tile<Bits, G, RoundBf16, Out, 1>(w, n0, x, k, sums);
#if defined(__AVX512F__)
    case 2: return tile<Bits, G, RoundBf16, Out, 2>(w, n0, x, k, sums);
    case 3: return tile<Bits, G, RoundBf16, Out, 3>(w, n0, x, k, sums);
#endif
    default: return tile<Bits, G, RoundBf16, Out, kRows>(w, n0, x, k, sums);
  }
}

template <bool RoundBf16, typename T>
void run(const QuantWeight& w, int bits, Group group, const float* x, int64_t rows, int64_t k, int64_t n,
         T* y, int64_t y_stride, const float* bias) {
  auto one_tile = [&](int64_t n0, int out, int64_t r0, int r) {
    float sums[kRows][kOut];
    const float* xr = x + r0 * k;
#define LLMGW_TILE(B, G)                                                   \
  if (out == kOut) tile_rows<B, G, RoundBf16, kOut>(r, w, n0, xr, k, sums); \
  else tile_rows<B, G, RoundBf16, 1>(r, w, n0, xr, k, sums);
    if (bits == 4) { LLMGW_TILE(4, kGroup32) }
    else if (group == kGroup16) { LLMGW_TILE(8, kGroup16) }
    else if (group == kGroup32) { LLMGW_TILE(8, kGroup32) }
    else { LLMGW_TILE(8, kGroupRow) }
#undef LLMGW_TILE
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < out; ++j)
        y[(r0 + i) * y_stride + n0 + j] = static_cast<T>(sums[i][j] + (bias ? bias[n0 + j] : 0.f));
  };
  const int64_t tiles = (n + kOut - 1) / kOut;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kOut * k));  // a few thousand weights a task at least
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kOut;
      const int out = n - n0 >= kOut ? kOut : 1;
      // the tile's weights stay in L1 for its rows after the first
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
        if (out == kOut) {
          one_tile(n0, kOut, r0, r);
        } else {
          for (int64_t j = n0; j < n; ++j) one_tile(j, 1, r0, r);
        }
      }
    }
  });
}

#if defined(__AVX512BF16__)
// A bf16 model on a CPU with AVX-512 BF16: each weight rounded to bf16 in registers (one vcvtne2ps2bf16 per 32)
// meets the bf16 activations in vdpbf16ps, two products per lane: half the instructions of the fp32 path. With
// more rows than one register tile, the tile's weights are decoded once into an L1 buffer that every block of
// rows then reads, as linear_bf16 reads its packed weight.
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
void run_bf16(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
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
#endif

Group group_of(int64_t group, int64_t k, int64_t bits) {
  if (bits == 4) {
    TORCH_CHECK(group == 32, "4-bit codes come in groups of 32, not ", group);
    return kGroup32;
  }
  if (group == 16) return kGroup16;
  if (group == 32) return kGroup32;
  TORCH_CHECK(group == k, "8-bit codes come in groups of 16, 32 or the whole row (", k, "), not ", group);
  return kGroupRow;
}

QuantWeight weight_of(const torch::Tensor& codes, const torch::Tensor& scales,
                      const c10::optional<torch::Tensor>& mins, int64_t n, int64_t k, int64_t bits,
                      int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8, not ", bits);
  TORCH_CHECK(k % 32 == 0 && k > 0, "the inputs (", k, ") must be a multiple of 32");
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.dim() == 2 && codes.size(0) == n &&
                  codes.size(1) == (bits == 8 ? k : k / 2),
              "codes: [", n, ", ", bits == 8 ? k : k / 2, "] bytes, contiguous");
  const int64_t groups = k / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n * groups,
              "scales: [", n, ", ", groups, "] fp32, contiguous");
  if (mins)
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == n * groups,
                "mins: [", n, ", ", groups, "] fp32, contiguous");
  return QuantWeight{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1), scales.data_ptr<float>(),
                     mins ? mins->data_ptr<float>() : nullptr, groups};
}

}  // namespace

// out[:, col0 : col0 + N] = x · Wᵀ (+ bias). out: [M, ≥ col0 + N] fp32 or bf16, rows contiguous; x: [M, K] any
// float dtype (widened to fp32 once); several parts of one fused projection (q|k|v stored in different formats)
// write their columns of one output.
void linear_quant_(torch::Tensor out, int64_t col0, torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                   c10::optional<torch::Tensor> mins, int64_t bits, int64_t group, c10::optional<torch::Tensor> bias,
                   bool round_bf16) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1,
              "x: [M, K], out: [M, N'] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(col0 >= 0 && col0 + n <= out.size(1), "columns ", col0, "..", col0 + n, " outside out");
  const QuantWeight w = weight_of(codes, scales, mins, n, k, bits, group);
  const Group g = group_of(group, k, bits);
  torch::Tensor bias_f32;
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "bias: [", n, "]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias ? bias_f32.data_ptr<float>() : nullptr;
  if (rows == 0) return;
#if defined(__AVX512BF16__)
  if (round_bf16 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    if (out.scalar_type() == at::kFloat)
      run_bf16(w, bits, g, xp, x.stride(0), rows, k, n, out.data_ptr<float>() + col0, out.stride(0), bp);
    else
      run_bf16(w, bits, g, xp, x.stride(0), rows, k, n, out.data_ptr<at::BFloat16>() + col0, out.stride(0), bp);
    return;
  }
#endif
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
  const float* xp = xf.data_ptr<float>();
  if (out.scalar_type() == at::kFloat) {
    float* yp = out.data_ptr<float>() + col0;
    if (round_bf16) run<true>(w, bits, g, xp, rows, k, n, yp, out.stride(0), bp);
    else run<false>(w, bits, g, xp, rows, k, n, yp, out.stride(0), bp);
  } else {
    at::BFloat16* yp = out.data_ptr<at::BFloat16>() + col0;
    if (round_bf16) run<true>(w, bits, g, xp, rows, k, n, yp, out.stride(0), bp);
    else run<false>(w, bits, g, xp, rows, k, n, yp, out.stride(0), bp);
  }
}

// The whole weight dequantized, [N, K] in `dtype` (fp32 or bf16): for prefill-sized steps, whose matmul then
// runs on the dtype's GEMM (AMX or AVX-512 for bf16).
torch::Tensor dequantize_quant(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                               int64_t bits, int64_t group, int64_t k, at::ScalarType dtype) {
  const int64_t n = codes.size(0);
  const QuantWeight w = weight_of(codes, scales, mins, n, k, bits, group);
  const Group g = group_of(group, k, bits);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: fp32 or bf16");
  auto y = torch::empty({n, k}, codes.options().dtype(dtype));
  auto fill = [&](auto* yp) {
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < k; c += 32) {
          floats16 w0, w1;
          if (bits == 4) w.widen<4, kGroup32>(r, c, w0, w1);
          else if (g == kGroup16) w.widen<8, kGroup16>(r, c, w0, w1);
          else if (g == kGroup32) w.widen<8, kGroup32>(r, c, w0, w1);
          else w.widen<8, kGroupRow>(r, c, w0, w1);
          store(yp + r * k + c, w0);
          store(yp + r * k + c + 16, w1);
        }
    });
  };
  if (dtype == at::kFloat) fill(y.data_ptr<float>());
  else fill(y.data_ptr<at::BFloat16>());
  return y;
}
