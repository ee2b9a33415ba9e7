// AVX2 helpers shared by the CPU kernels' AVX2 paths.
#pragma once

#include <immintrin.h>

#if defined(__AVX2__)
// the sum of v's 8 lanes
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif
