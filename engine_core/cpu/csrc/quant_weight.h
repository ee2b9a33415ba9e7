// The quantized weight layout the engine's linear_quant kernels read (engine_core/models/layers/quant.py):
//     w[n, k] = scale[n, g] · code[n, k] + min[n, g]        (g: k's group; no mins: min = 0)
// - 8 bits: codes int8 [N, K], groups of 16 (Q6_K), 32 (Q8_0, Q5_0) or the whole row (int8 per output channel);
// - 4 bits: codes uint8 [N, K/2], groups of 32; byte j of a group holds code[j] | code[j + 16] << 4, GGUF's
//   Q4_0 / Q4_1 byte order (Q4_K is repacked to it at load).
// `QuantWeight::widen` turns 32 of them into fp32 in registers; the vectors are GCC vector types, so one source
// gives the AVX-512, AVX2 and scalar builds.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace llmgw_quant {

typedef float floats16 __attribute__((vector_size(64)));
typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef int32_t ints16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kOut = 4, kRows = 4;  // 16 accumulators: half the zmm registers
#elif defined(__AVX2__)
constexpr int kOut = 2, kRows = 4;  // quant_tile_avx2.h: 8 accumulators and 4 weight vectors of the 16 ymm registers
#else
constexpr int kOut = 2, kRows = 2;
#endif

enum Group { kGroup16, kGroup32, kGroupRow };

// how far ahead a decode step asks for a weight's bytes. On an AVX2-only Zen 3 EPYC, 3072 read the layers of a
// Q4_1 step from DRAM in 5.5 ms against 6.4 at 512 (6144: the same) and the int8 LM head at 26 GB/s against 17
#ifndef LLMGW_PREFETCH_BYTES
#if defined(__AVX2__) && !defined(__AVX512F__)
#define LLMGW_PREFETCH_BYTES 3072
#else
#define LLMGW_PREFETCH_BYTES 512
#endif
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
  template <int Bits, Group G>
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
#if defined(__AVX512F__)
    // one rounding (an fma) in every caller: -ffast-math lets GCC contract `c · s + m` in one inlined copy and not
    // in another, and the prefill kernel's bf16 weights must be dequantize_quant's to the bit
    w0 = (floats16)_mm512_fmadd_ps((__m512)c0, _mm512_set1_ps(s[g0]), _mm512_set1_ps(m ? m[g0] : 0.f));
    w1 = (floats16)_mm512_fmadd_ps((__m512)c1, _mm512_set1_ps(s[g1]), _mm512_set1_ps(m ? m[g1] : 0.f));
#else
    w0 = c0 * s[g0] + (m ? m[g0] : 0.f);
    w1 = c1 * s[g1] + (m ? m[g1] : 0.f);
#endif
  }
};

#if defined(__AVX512BF16__)
// bf16 bits of 0 .. 15, twice: vpermw indexes with a word's low 5 bits, and a low nibble's word still holds its
// byte's high nibble above them
alignas(64) inline constexpr uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140,
    0x4150, 0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110,
    0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

struct CodeDecoder {  // the codes of a 32-block as exact bf16, in the order of k
  const __m512i table = _mm512_loadu_si512(kNibbleBf16);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // words 16..31

  template <int Bits>
  inline __m512i bf16(const uint8_t* p) const {
    if constexpr (Bits == 4) {  // byte j holds code j (low nibble) and code j + 16 (high)
      const __m256i twice = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(twice), shift), table);
    } else {  // int8: through fp32, where they are exact, packed two vectors to one
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
  }
};

// lane i holds i · step
inline __m512i lanes_times(int step) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(step));
}

// each row's sum of each scale group's inputs, for the mins' term: sums[r · row_step + g · group_step]
inline void group_sums(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k, int64_t groups, float* sums,
                       int64_t row_step, int64_t group_step) {
  const int64_t size = k / groups;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = g * size; i < (g + 1) * size; i += 16)
        sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(x + r * x_stride + i))));
      sums[r * row_step + g * group_step] = _mm512_reduce_add_ps(sum);
    }
}

// the bf16 path (linear_quant_bf16.cpp): x bf16 [rows, k] with row stride x_stride, y [rows, n] with y_stride
void run_bf16(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, float* y, int64_t y_stride, const float* bias);
void run_bf16(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, at::BFloat16* y, int64_t y_stride, const float* bias);
// prefill-sized steps without AMX (linear_quant_rows.cpp): bf16-rounded weights through linear_bf16's tiles
void run_rows(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, float* y, int64_t y_stride, const float* bias);
void run_rows(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
              int64_t k, int64_t n, at::BFloat16* y, int64_t y_stride, const float* bias);
// the AMX path for 5-16 rows (linear_quant_amx.cpp); false where this CPU or OS has no AMX
bool run_amx(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
             int64_t k, int64_t n, float* y, int64_t y_stride, const float* bias);
bool run_amx(const QuantWeight& w, int bits, Group group, const uint16_t* x, int64_t x_stride, int64_t rows,
             int64_t k, int64_t n, at::BFloat16* y, int64_t y_stride, const float* bias);
#endif

}  // namespace llmgw_quant
