// What every path of paged_decode.cpp shares: the arguments, where a row's keys are in the cache, the soft-cap.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec512.h"

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <climits>
#include <cstring>
#include <vector>

namespace llmgw_paged {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// Everything a kernel reads, one struct for every code path.
template <typename scalar_t>
struct Args {
  const scalar_t* q;  // [rows, num_heads, head_dim]
  const scalar_t* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const scalar_t* v_cache;
  const int64_t* block_table;  // [rows, table_width]: each row's sequence's blocks
  const int64_t* key_counts;  // [rows]: the keys of its sequence up to and including the row's own
  scalar_t* out;  // [rows, num_heads, head_dim]
  int64_t rows, num_heads, num_kv_heads, head_dim, block_size, table_width;
  int64_t window;  // sliding window in keys, 0: none
  float scale;
  float softcap;  // 0: none
};

// How many keys row b attends to: its sequence's first key_count, or with a window only the last W of them.
template <typename scalar_t>
int64_t visible_keys(const Args<scalar_t>& a, int64_t b) {
  const int64_t count = a.key_counts[b];
  return a.window > 0 ? std::min(count, a.window) : count;
}

// Where each key row b attends to starts in the cache (in elements, plus head_offset), from one walk over
// the blocks its window spans: the kernels then read its i-th key at cache + offsets[i]. Returns how many.
// begin / end: only the visible keys [begin, end) (a span of them), offsets[0] being key `begin`'s.
template <typename scalar_t>
int64_t key_offsets(const Args<scalar_t>& a, int64_t b, int64_t head_offset, std::vector<int64_t>& offsets,
                    int64_t begin = 0, int64_t end = INT64_MAX) {
  const int64_t count = a.key_counts[b];
  const int64_t first = count - visible_keys(a, b);
  const int64_t lo = std::min(count, first + begin), hi = std::min(count, first + std::min(end, count));
  const int64_t* table = a.block_table + b * a.table_width;
  const int64_t token_stride = a.num_kv_heads * a.head_dim;
  offsets.resize(hi - lo);
  for (int64_t t = lo; t < hi;) {  // block by block: one table read per block, no division per key
    const int64_t blk = t / a.block_size, stop = std::min(hi, (blk + 1) * a.block_size);
    const int64_t base = (table[blk] - blk) * a.block_size;  // key t's slot is base + t
    for (; t < stop; ++t) offsets[t - lo] = (base + t) * token_stride + head_offset;
  }
  return hi - lo;
}

// A step's rows with their keys in spans (the flash-decoding split): row b's spans are first_span[b] ..
// first_span[b + 1], each span_keys[b] keys (the last one fewer), as even as whole tiles of `tile` keys allow; a
// row of several keeps each span's max, sum and unnormalized p·v from partial first_partial[b]. Spans depend on
// the key count alone, so a row gets the same result in a step of any row count (a verify pass scores a position
// as a 1-row step does).
struct SpanPlan {
  std::vector<int64_t> first_span, first_partial, span_keys;
  int64_t spans() const { return first_span.back(); }
  int64_t partial_spans() const { return first_partial.back(); }
  int64_t row_of(int64_t span) const {
    return std::upper_bound(first_span.begin(), first_span.end(), span) - first_span.begin() - 1;
  }
  bool whole(int64_t b) const { return first_span[b + 1] - first_span[b] == 1; }  // one span: no partials
  // KV heads a task takes: all of a span's where there are enough spans to keep the threads busy (a token's KV
  // heads are one contiguous row, streamed in once), else one; a head's result is the same either way
  int64_t heads_per_task(int64_t num_kv_heads) const {
    return spans() >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  }
};

template <typename scalar_t>
SpanPlan plan_spans(const Args<scalar_t>& a, int64_t max_keys, int64_t tile) {
  SpanPlan plan{std::vector<int64_t>(a.rows + 1, 0), std::vector<int64_t>(a.rows + 1, 0), std::vector<int64_t>(a.rows)};
  for (int64_t b = 0; b < a.rows; ++b) {
    const int64_t keys = visible_keys(a, b), even = std::max<int64_t>(1, (keys + max_keys - 1) / max_keys);
    plan.span_keys[b] = even == 1 ? keys : ((keys + even - 1) / even + tile - 1) / tile * tile;
    const int64_t spans = even == 1 ? 1 : (keys + plan.span_keys[b] - 1) / plan.span_keys[b];  // none left empty
    plan.first_span[b + 1] = plan.first_span[b] + spans;
    plan.first_partial[b + 1] = plan.first_partial[b] + (spans > 1 ? spans : 0);
  }
  return plan;
}

// Rows of several spans: out = Σ_s e^(max_s - M) · pv_s / Σ_s e^(max_s - M) · sum_s, M the largest max.
// `partials`: [partial span, query head, 2 + HD].
template <int HD, typename scalar_t>
void merge_spans(const Args<scalar_t>& a, const SpanPlan& plan, const std::vector<float>& partials) {
  constexpr int64_t kPartial = 2 + HD;
  const int64_t num_heads = a.num_heads;
  at::parallel_for(0, a.rows * num_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weight;
    float sum[HD];
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_heads, head = work % num_heads;
      if (plan.whole(b)) continue;  // written by its task
      const int64_t spans = plan.first_span[b + 1] - plan.first_span[b];
      const float* part = partials.data() + (plan.first_partial[b] * num_heads + head) * kPartial;
      const int64_t stride = num_heads * kPartial;  // from one span's partial to the next's
      float top = part[0];
      for (int64_t s = 1; s < spans; ++s) top = std::max(top, part[s * stride]);
      weight.resize(spans);
      float total = 0.f;
      for (int64_t s = 0; s < spans; ++s) {
        weight[s] = std::exp(part[s * stride] - top);
        total += weight[s] * part[s * stride + 1];
      }
      std::fill(sum, sum + HD, 0.f);
      for (int64_t s = 0; s < spans; ++s)
        for (int64_t d = 0; d < HD; ++d) sum[d] = std::fma(weight[s], part[s * stride + 2 + d], sum[d]);
      const float inv = 1.f / total;
      scalar_t* orow = a.out + (b * num_heads + head) * HD;
      for (int64_t d = 0; d < HD; ++d) orow[d] = static_cast<scalar_t>(sum[d] * inv);
    }
  });
}

#if defined(__AVX512F__)
// In place: s[0:len] = e^(s - max), 16 at a time. Returns their sum; `top` is the max.
inline float exp_scores16(float* s, int64_t len, float& top) {
  __m512 high = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16)
    high = _mm512_max_ps(high, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(len - t), s + t));
  top = _mm512_reduce_max_ps(high);
  const __m512 m = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail_mask(len - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(s + t, k, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// In place: s[0:len] = softmax(s[0:len]), 16 at a time.
inline void softmax16(float* s, int64_t len) {
  float top;
  const __m512 inv = _mm512_set1_ps(1.f / exp_scores16(s, len, top));
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail_mask(len - t);
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), inv));
  }
}

// In place: s[0:len] = cap * tanh(s[0:len] / cap), 16 at a time, with tanh(x) = 1 - 2 / (e^2x + 1). x is
// clamped to +-9 (tanh(9) is 1 in fp32) so that e^2x stays finite: -ffast-math assumes no infinities.
inline void softcap16(float* s, int64_t len, float cap) {
  const __m512 inv2 = _mm512_set1_ps(2.f / cap), lo = _mm512_set1_ps(-18.f), hi = _mm512_set1_ps(18.f);
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f), vcap = _mm512_set1_ps(cap);
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail_mask(len - t);
    const __m512 x2 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), inv2), lo), hi);
    const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp16(x2), one)));
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(vcap, th));
  }
}
#endif

// Scores soft-capped in place before the softmax, where the layer asks for it.
inline void softcap_scores(float* s, int64_t len, float cap) {
  if (cap <= 0.f) return;
#if defined(__AVX512F__)
  softcap16(s, len, cap);
#else
  const float inv = 1.f / cap;
  for (int64_t t = 0; t < len; ++t) s[t] = cap * std::tanh(s[t] * inv);
#endif
}

// In place: s[0:len] = e^(s - max), in loops the compiler vectorizes (expf through libmvec). Returns their sum;
// `top` is the max.
inline float exp_scores(float* s, int64_t len, float& top) {
  const float high = *std::max_element(s, s + len);  // a local: a store to s[t] could alias `top`, and the loop
  for (int64_t t = 0; t < len; ++t) s[t] = expf(s[t] - high);  // then stayed scalar (expf a score at a time)
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) sum += s[t];
  top = high;
  return sum;
}

// In place: s[0:len] = softmax(s[0:len])
inline void softmax_scores(float* s, int64_t len) {
  float top;
  const float inv = 1.f / exp_scores(s, len, top);
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

}  // namespace llmgw_paged
