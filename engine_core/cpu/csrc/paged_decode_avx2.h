// paged_decode's fp32 path for the AVX2 build.
#pragma once

#include <ATen/Parallel.h>

#include "paged_rows.h"
#include "vec256.h"

namespace llmgw_paged {

#if defined(__AVX2__) && !defined(__AVX512F__)
// lane i: the sum of d[i]'s lanes (8 dot products finished at once)
inline __m256 sum_lanes8x8(const __m256 d[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// fp32 on AVX2: the portable path's steps, with 8 keys' scores finished together and each query head's sum of
// p·v kept in registers, 64 dimensions at a time.
template <int HD>
void decode_avx2(const Args<float>& a) {
  constexpr int C = HD / 8;
  const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, group = num_heads / num_kv_heads;
  at::parallel_for(0, a.rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * HD), scores;
    std::vector<int64_t> offsets;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = key_offsets(a, b, h * HD, offsets);
      const float* q = a.q + (b * num_heads + h * group) * HD;
      for (int64_t i = 0; i < group * HD; ++i) qf[i] = q[i] * a.scale;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {  // q·k
        const float* qg = qf.data() + g * HD;
        float* sc = scores.data() + g * len;
        auto dot = [&](int64_t t) {
          const float* k = a.k_cache + offsets[t];
          __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(k), _mm256_loadu_ps(qg));
          for (int c = 1; c < C; ++c) sum = _mm256_fmadd_ps(_mm256_loadu_ps(k + 8 * c), _mm256_loadu_ps(qg + 8 * c), sum);
          return sum;
        };
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
          __m256 d[8];
          for (int i = 0; i < 8; ++i) d[i] = dot(t + i);
          _mm256_storeu_ps(sc + t, sum_lanes8x8(d));
        }
        for (; t < len; ++t) sc[t] = sum8(dot(t));
        softcap_scores(sc, len, a.softcap);
        softmax_scores(sc, len);
      }
      for (int64_t g = 0; g < group; ++g) {  // Σ p·v
        const float* sc = scores.data() + g * len;
        float* orow = a.out + (b * num_heads + h * group + g) * HD;
        for (int c0 = 0; c0 < C; c0 += 8) {
          __m256 acc[8];
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
          for (int64_t t = 0; t < len; ++t) {
            const __m256 p = _mm256_set1_ps(sc[t]);
            const float* v = a.v_cache + offsets[t] + 8 * c0;
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
          }
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(orow + 8 * (c0 + c), acc[c]);
        }
      }
    }
  });
}
#endif

}  // namespace llmgw_paged
