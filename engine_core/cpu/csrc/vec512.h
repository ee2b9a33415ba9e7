// AVX-512 helpers shared by the CPU kernels: bf16 <-> fp32 vectors of 16, e^x, tail masks.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__)
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

// e^x for 16 floats: 2^n · P(r) with n = round(x·log2 e), r = x − n·ln 2 (Cephes' expf polynomial);
// relative error ~1e-7, and no call into libm per element. Clamped to [-87.3, 88.3] as exp_approx is: past
// that, n overflows the scale and the result is NaN (a silu or GELU gate below -88 would be).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

#if defined(__AVX512BF16__)
inline void store16(at::BFloat16* p, __m512 x) {  // round to nearest even, as torch's casts do
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
#endif
#endif
