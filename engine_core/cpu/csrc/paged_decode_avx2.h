// paged_decode's fp32 path for the AVX2 build.
#pragma once

#include <ATen/Parallel.h>

#include "paged_rows.h"
#include "vec256.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace llmgw_paged {

#if defined(__AVX2__) && !defined(__AVX512F__)
// lane i: the sum of d[i]'s lanes (8 dot products finished at once)
inline __m256 sum_lanes8x8(const __m256 d[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int HINT>
inline void prefetch_floats(const float* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < count * 4; byte += 64) _mm_prefetch(c + byte, static_cast<_mm_hint>(HINT));
}

constexpr int64_t kPrefetchKeys = 16;  // how far ahead q·k asks for keys (16, 48 and 128: the same on the EPYC)

// A span holds at most this many bytes of one KV head's fp32 keys (and as many of values), so that its query
// heads' re-reads of a row come from L1/L2, and a long row makes enough tasks for both threads.
constexpr int64_t kSpanBytes = 64 * 1024;

// fp32 on AVX2, split like the bf16 path (paged_decode_bf16.h): a row's keys in even spans of at most
// kSpanBytes / (4 · HD) keys, each span (all its KV heads, or one where spans are few) a task, so that one long
// sequence keeps both threads reading: before, a row was split only by its 3 KV heads, 2:1 over two threads, and a
// step's attention at 4,000 keys took 33 ms against 23 now (benchmarks/attention_spans.py --dtype float32, AVX2
// EPYC). A row of several spans keeps each span's max, sum and unnormalized p·v per query head, merged after (the
// flash-decoding split). Spans depend on the key count alone, so a row gets the same result in a step of any row
// count (a verify pass scores a position as a 1-row step does). In a span, 8 keys' rows at a time serve every
// query head of the task, q·k and then p·v, so each row streams in once.
template <int HD>
void decode_avx2(const Args<float>& a) {
  constexpr int C = HD / 8;
  constexpr int64_t kSpanKeys = kSpanBytes / (4 * HD), kPartial = 2 + HD;
  const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, group = num_heads / num_kv_heads;
  const SpanPlan plan = plan_spans(a, kSpanKeys, 8);
  const int64_t heads_per_task = plan.heads_per_task(num_kv_heads);
  const int64_t tasks_per_span = num_kv_heads / heads_per_task;
  std::vector<float> partials(plan.partial_spans() * num_heads * kPartial);
  at::parallel_for(0, plan.spans() * tasks_per_span, 1, [&](int64_t begin, int64_t end) {
    const int64_t task_heads = heads_per_task * group;  // query heads a task serves
    std::vector<float> qf(task_heads * HD), pv(task_heads * HD), scores;
    std::vector<int64_t> offsets;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t span = work / tasks_per_span, first_head = (work % tasks_per_span) * heads_per_task;
      const int64_t b = plan.row_of(span), s = span - plan.first_span[b];
      const bool whole = plan.whole(b);  // the row's keys are this one span
      const int64_t len =
          key_offsets(a, b, first_head * HD, offsets, s * plan.span_keys[b], (s + 1) * plan.span_keys[b]);
      const float* q = a.q + (b * num_heads + first_head * group) * HD;  // the task's query heads, in order
      for (int64_t i = 0; i < task_heads * HD; ++i) qf[i] = q[i] * a.scale;
      scores.resize(task_heads * len);
      // q·k: 8 keys' rows at a time (in L1) for every query head of the task, so each row streams in once
      auto dot = [&](int64_t t, int64_t qh) {
        const float* k = a.k_cache + offsets[t] + qh / group * HD;
        const float* qv = qf.data() + qh * HD;
        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(k), _mm256_loadu_ps(qv));
        for (int c = 1; c < C; ++c) sum = _mm256_fmadd_ps(_mm256_loadu_ps(k + 8 * c), _mm256_loadu_ps(qv + 8 * c), sum);
        return sum;
      };
      int64_t t0 = 0;
      for (; t0 + 8 <= len; t0 += 8) {
        for (int64_t i = t0; i < t0 + 8; ++i) {  // the blocks lie anywhere: ask for the next keys, these values
          if (i + kPrefetchKeys < len)
            prefetch_floats<_MM_HINT_T0>(a.k_cache + offsets[i + kPrefetchKeys], heads_per_task * HD);
          prefetch_floats<_MM_HINT_T1>(a.v_cache + offsets[i], heads_per_task * HD);
        }
        for (int64_t qh = 0; qh < task_heads; ++qh) {
          __m256 d[8];
          for (int i = 0; i < 8; ++i) d[i] = dot(t0 + i, qh);
          _mm256_storeu_ps(scores.data() + qh * len + t0, sum_lanes8x8(d));
        }
      }
      for (; t0 < len; ++t0)
        for (int64_t qh = 0; qh < task_heads; ++qh) scores[qh * len + t0] = sum8(dot(t0, qh));
      for (int64_t qh = 0; qh < task_heads; ++qh) {  // softmax, or a span's max and sum of e^(s - max)
        float* sc = scores.data() + qh * len;
        softcap_scores(sc, len, a.softcap);
        if (whole) softmax_scores(sc, len);
        else {
          float* partial =
              partials.data() + ((plan.first_partial[b] + s) * num_heads + first_head * group + qh) * kPartial;
          partial[1] = exp_scores(sc, len, partial[0]);
        }
      }
      // Σ p·v: 8 keys' value rows at a time for every query head, each head's sums in pv between blocks (each sum
      // is one fma chain over the keys in order, whatever the task's heads)
      std::fill(pv.begin(), pv.end(), 0.f);
      for (int64_t t = 0; t < len; t += 8) {
        const int n = static_cast<int>(std::min<int64_t>(8, len - t));
        for (int64_t qh = 0; qh < task_heads; ++qh) {
          const float* sc = scores.data() + qh * len + t;
          float* sum = pv.data() + qh * HD;
          const int64_t head_offset = qh / group * HD;
          for (int c0 = 0; c0 < C; c0 += 8) {
            __m256 acc[8];
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(sum + 8 * (c0 + c));
            for (int i = 0; i < n; ++i) {
              const __m256 p = _mm256_set1_ps(sc[i]);
              const float* v = a.v_cache + offsets[t + i] + head_offset + 8 * c0;
              for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
            }
            for (int c = 0; c < 8; ++c) _mm256_storeu_ps(sum + 8 * (c0 + c), acc[c]);
          }
        }
      }
      for (int64_t qh = 0; qh < task_heads; ++qh) {
        const int64_t head = first_head * group + qh;
        float* out = whole ? a.out + (b * num_heads + head) * HD
                           : partials.data() + ((plan.first_partial[b] + s) * num_heads + head) * kPartial + 2;
        std::memcpy(out, pv.data() + qh * HD, HD * sizeof(float));
      }
    }
  });
  if (plan.partial_spans() > 0) merge_spans<HD>(a, plan, partials);
}
#endif

}  // namespace llmgw_paged
