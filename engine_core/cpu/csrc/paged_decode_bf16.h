// paged_decode's bf16 path for CPUs with AVX-512 BF16.
#pragma once

#include <ATen/Parallel.h>

#include "paged_rows.h"
#include "vec512.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace llmgw_paged {

#if defined(__AVX512BF16__)
// r[j] = sum of the 16 lanes of v[j], for 16 vectors at once: a transpose-and-add tree (45 shuffles and
// adds) instead of 16 horizontal reductions (~8 dependent ops each).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0 0+2, v1 0+2, v0 1+3, v1 1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum for four vectors
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

template <int HINT>
inline void prefetch_span(const at::BFloat16* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < elements * 2; byte += 64) _mm_prefetch(c + byte, static_cast<_mm_hint>(HINT));
}

// How many 32-value columns of a head p·v sums at once: 2·G of them each keep an even and an odd sum, and
// those must stay in registers (24 of the 32) for the loop over keys to be fmas only. SmolLM2 (G = 3, 64
// values: 2 columns) takes them all at once; Gemma 3 270M (G = 4, 256 values: 8 columns), 2 at a time.
template <int G, int C>
constexpr int kPvColumns = [] {
  int columns = 1;
  while (columns * 2 <= C && columns * 2 * G <= 12) columns *= 2;
  return columns;
}();

// p·v over a span's len keys for value columns [c0, c0 + CC) of G query heads (probabilities in scores[g · padded
// + t]): pv[g][c][0] the sums of the even values, pv[g][c][1] the odd. Each sum is one fma chain over the keys
// in order, whatever CC is.
template <int G, int CC, int C>
inline void pv_columns(const at::BFloat16* v_cache, const int64_t* offsets, int64_t head_offset, int64_t len,
                       const float* scores, int64_t padded, int c0, float (*pv)[C][2][16]) {
  __m512 even[G][CC], odd[G][CC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CC; ++c) even[g][c] = odd[g][c] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t = 0; t < len; ++t) {
    const at::BFloat16* vrow = v_cache + offsets[t] + head_offset + c0 * 32;
    for (int c = 0; c < CC; ++c) {
      const __m512i x = _mm512_loadu_si512(vrow + c * 32);
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));  // elements 0, 2, 4, ...
      const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, high));  // elements 1, 3, 5, ...
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * padded + t]);
        even[g][c] = _mm512_fmadd_ps(p, e, even[g][c]);
        odd[g][c] = _mm512_fmadd_ps(p, o, odd[g][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < CC; ++c) {
      _mm512_store_ps(pv[g][c0 + c][0], even[g][c]);
      _mm512_store_ps(pv[g][c0 + c][1], odd[g][c]);
    }
}

// bf16 with AVX512-BF16, G query heads per KV head and head size HD, both fixed at compile time so that
// the per-head accumulators live in registers. q·k takes bf16 pairs straight from the cache (vdpbf16ps,
// exact products summed in fp32) for 16 keys at a time; p·v widens each bf16 vector into its even and
// odd elements (one shift or mask each) and accumulates them apart, interleaving once at the end.
//
// Memory, not arithmetic, sets the pace once the cache outgrows the CPU's caches: its blocks lie
// anywhere, so the hardware prefetcher cannot follow, and the kernel prefetches rows itself. A task
// takes all KV heads of a span of keys when there are enough spans: a token's KV heads are one contiguous row,
// so each block streams in once; few spans are split by KV head to keep every thread busy.
//
// A row of more than kKeySpan keys splits them into as many even spans, each span a task of its own, so that one long sequence (an agent's
// single stream: a 4,000-key cache split over 3 KV heads ran on two threads 2:1) keeps every thread reading.
// A row of one span normalizes its softmax before p·v; a row of several keeps each span's max, sum and
// unnormalized p·v, merged after (the flash-decoding split). Spans depend on the key count alone, so a row
// gets the same result in a step of any row count (a verify pass scores a position as a 1-row step does).
constexpr int64_t kKeySpan = 512;

template <int G, int HD>
void decode_bf16(const Args<at::BFloat16>& a) {
  constexpr int C = HD / 32;  // 512-bit vectors of bf16 per row
  constexpr int64_t kPartial = 2 + HD;  // a span's max, sum and p·v for one query head
  const at::BFloat16 *q = a.q, *k_cache = a.k_cache, *v_cache = a.v_cache;
  const int64_t num_kv_heads = a.num_kv_heads, num_heads = G * num_kv_heads;
  const SpanPlan plan = plan_spans(a, kKeySpan, 16);
  const int64_t heads_per_task = plan.heads_per_task(num_kv_heads);
  const int64_t tasks_per_span = num_kv_heads / heads_per_task;
  std::vector<float> partials(plan.partial_spans() * num_heads * kPartial);
  at::parallel_for(0, plan.spans() * tasks_per_span, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;  // where each key's row starts
    for (int64_t work = begin; work < end; ++work) {
      const int64_t span = work / tasks_per_span, first_head = (work % tasks_per_span) * heads_per_task;
      const int64_t b = plan.row_of(span), s = span - plan.first_span[b];
      const bool whole = plan.whole(b);  // the row's keys are this one span
      const int64_t len =
          key_offsets(a, b, first_head * HD, offsets, s * plan.span_keys[b], (s + 1) * plan.span_keys[b]);
      const int64_t padded = (len + 15) / 16 * 16;
      scores.resize(G * padded);
      const __m512 vscale = _mm512_set1_ps(a.scale);
      for (int64_t h = first_head; h < first_head + heads_per_task; ++h) {
        const int64_t head_offset = (h - first_head) * HD;
        const bool fetch = h == first_head;  // its prefetches cover every head of the task
        __m512bh qv[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c)
            qv[g][c] = as_bh(_mm512_loadu_si512(q + (b * num_heads + h * G + g) * HD + c * 32));
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          if (fetch) {  // the next tile's keys; this tile's values, for p·v after the softmax
            for (int64_t t = t0 + 16; t < std::min(t0 + 32, len); ++t)
              prefetch_span<_MM_HINT_T0>(k_cache + offsets[t], heads_per_task * HD);
            for (int64_t t = t0; t < std::min(t0 + 16, len); ++t)
              prefetch_span<_MM_HINT_T1>(v_cache + offsets[t], heads_per_task * HD);
          }
          const at::BFloat16* rows[16];  // the tail of the last tile repeats a row
          for (int j = 0; j < 16; ++j) rows[j] = k_cache + offsets[std::min(t0 + j, len - 1)] + head_offset;
          for (int g = 0; g < G; ++g) {
            __m512 dots[16];
            for (int j = 0; j < 16; ++j) {
              __m512 acc = _mm512_setzero_ps();
              for (int c = 0; c < C; ++c)
                acc = _mm512_dpbf16_ps(acc, qv[g][c], as_bh(_mm512_loadu_si512(rows[j] + c * 32)));
              dots[j] = acc;
            }
            _mm512_storeu_ps(&scores[g * padded + t0], _mm512_mul_ps(sum_lanes16(dots), vscale));
          }
        }
        float* partial[G];  // this span's max, sum and p·v per query head, where the row has several spans
        for (int g = 0; g < G; ++g) {
          softcap_scores(scores.data() + g * padded, len, a.softcap);
          if (whole) {
            softmax16(scores.data() + g * padded, len);
          } else {
            partial[g] = partials.data() + ((plan.first_partial[b] + s) * num_heads + h * G + g) * kPartial;
            partial[g][1] = exp_scores16(scores.data() + g * padded, len, partial[g][0]);
          }
        }
        // the sums leave their registers once per column block, by constant indices (indexing them in a loop kept
        // them in memory, and GCC then stored all of them after every key)
        alignas(64) float pv[G][C][2][16];
        for (int c0 = 0; c0 < C; c0 += kPvColumns<G, C>)
          pv_columns<G, kPvColumns<G, C>, C>(v_cache, offsets.data(), head_offset, len, scores.data(), padded, c0, pv);
        for (int g = 0; g < G; ++g) {
          at::BFloat16* orow = a.out + (b * num_heads + h * G + g) * HD;
          for (int c = 0; c < C; ++c) {
            const float* e = pv[g][c][0];
            const float* o = pv[g][c][1];
            for (int i = 0; i < 16; ++i) {
              if (whole) {
                orow[c * 32 + 2 * i] = static_cast<at::BFloat16>(e[i]);
                orow[c * 32 + 2 * i + 1] = static_cast<at::BFloat16>(o[i]);
              } else {
                partial[g][2 + c * 32 + 2 * i] = e[i];
                partial[g][2 + c * 32 + 2 * i + 1] = o[i];
              }
            }
          }
        }
      }
    }
  });
  if (plan.partial_spans() > 0) merge_spans<HD>(a, plan, partials);
}

// The bf16 kernel for this (group, head size), or nullptr when none is compiled for it.
using Bf16Kernel = void (*)(const Args<at::BFloat16>&);
template <int HD>
Bf16Kernel bf16_kernel_for_group(int64_t group) {
  switch (group) {
    case 1: return decode_bf16<1, HD>;
    case 2: return decode_bf16<2, HD>;
    case 3: return decode_bf16<3, HD>;
    case 4: return decode_bf16<4, HD>;
    case 8: return decode_bf16<8, HD>;
    default: return nullptr;
  }
}
#endif

}  // namespace llmgw_paged
