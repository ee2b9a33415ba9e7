// Paged attention for CPU: one query per row against its keys and values read in place from the block-paged
// cache (no gather, no padding), scores and softmax in fp32. A row sees the first key_count keys of its
// sequence, or with a sliding window W only the last W of them (the only ones read, so a long sequence costs
// W keys), and its scores may be soft-capped, cap * tanh(s / cap), before the softmax (Gemma 2).
// Work is split over (row, KV head) pairs; each pair serves its group of query heads (GQA). The bf16 path
// (paged_decode_bf16.h) also splits a row's keys into spans, so that one long sequence uses every thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "paged_decode_avx2.h"
#include "paged_decode_bf16.h"
#include "paged_rows.h"
#include "vec512.h"

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace llmgw_paged;

#if defined(__AVX512F__)
// The same computation with AVX-512 registers: HD/16 vectors per row, group query rows.
template <typename scalar_t, int HD>
void decode_avx512(const Args<scalar_t>& a) {
  constexpr int C = HD / 16;
  const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, group = num_heads / num_kv_heads;
  at::parallel_for(0, a.rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * HD), acc(group * HD), scores;
    std::vector<int64_t> offsets;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = key_offsets(a, b, h * HD, offsets);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = a.q + (b * num_heads + h * group + g) * HD;
        for (int c = 0; c < C; ++c)
          store16(&qf[g * HD + c * 16], _mm512_mul_ps(load16(qrow + c * 16), _mm512_set1_ps(a.scale)));
      }
      scores.resize(group * len);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* krow = a.k_cache + offsets[t];
        __m512 k[C];
        for (int c = 0; c < C; ++c) k[c] = load16(krow + c * 16);
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(&qf[g * HD]), k[0]);
          for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(&qf[g * HD + c * 16]), k[c], dot);
          scores[g * len + t] = _mm512_reduce_add_ps(dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        softcap_scores(scores.data() + g * len, len, a.softcap);
        softmax16(scores.data() + g * len, len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* vrow = a.v_cache + offsets[t];
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = load16(vrow + c * 16);
        for (int64_t g = 0; g < group; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * len + t]);
          float* sum = &acc[g * HD];
          for (int c = 0; c < C; ++c) store16(sum + c * 16, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(sum + c * 16)));
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = a.out + (b * num_heads + h * group + g) * HD;
        for (int64_t d = 0; d < HD; ++d) orow[d] = static_cast<scalar_t>(acc[g * HD + d]);
      }
    }
  });
}

#endif

// The portable path (the AVX2 build's, the scalar build's, and any head size or dtype the others lack).
// HD: the head size when known at compile time (64, 128, 256: fixed trip counts vectorize), else 0.
template <typename scalar_t, int HD>
void decode(const Args<scalar_t>& a) {
  const int64_t head_dim = HD > 0 ? HD : a.head_dim;
  const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, group = num_heads / num_kv_heads;
  at::parallel_for(0, a.rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    std::vector<int64_t> offsets;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = key_offsets(a, b, h * head_dim, offsets);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = a.q + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qrow[d]) * a.scale;
      }
      scores.resize(group * len);
      float* kf = row.data();
      for (int64_t t = 0; t < len; ++t) {  // q·k, keys read in place
        const scalar_t* krow = a.k_cache + offsets[t];
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(krow[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
          scores[g * len + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax
        float* sc = scores.data() + g * len;
        softcap_scores(sc, len, a.softcap);
        softmax_scores(sc, len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float* vf = row.data();
      for (int64_t t = 0; t < len; ++t) {  // Σ p·v
        const scalar_t* vrow = a.v_cache + offsets[t];
        for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_float(vrow[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* sum = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) sum[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = a.out + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

// The fastest path compiled for this dtype and head size.
template <typename scalar_t>
void dispatch(const Args<scalar_t>& args) {
  const int64_t head_dim = args.head_dim;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const int64_t group = args.num_heads / args.num_kv_heads;
    const Bf16Kernel kernel = head_dim == 64    ? bf16_kernel_for_group<64>(group)
                              : head_dim == 128 ? bf16_kernel_for_group<128>(group)
                              : head_dim == 256 ? bf16_kernel_for_group<256>(group)
                                                : nullptr;
    if (kernel != nullptr) return kernel(args);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, float>) {
    if (head_dim == 64) return decode_avx512<scalar_t, 64>(args);
    if (head_dim == 128) return decode_avx512<scalar_t, 128>(args);
    if (head_dim == 256) return decode_avx512<scalar_t, 256>(args);
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (head_dim == 64) return decode_avx2<64>(args);
    if (head_dim == 128) return decode_avx2<128>(args);
    if (head_dim == 256) return decode_avx2<256>(args);
  }
#endif
  if (head_dim == 64) decode<scalar_t, 64>(args);
  else if (head_dim == 128) decode<scalar_t, 128>(args);
  else if (head_dim == 256) decode<scalar_t, 256>(args);
  else decode<scalar_t, 0>(args);
}

}  // namespace

// This step's keys or values, [T, Hkv, D] with each token's heads contiguous (a view into the qkv projection is),
// copied into their cache slots: what two index_copy_ calls a layer did, without their dispatch.
void write_slots(at::Tensor& cache, const at::Tensor& rows, const at::Tensor& slots) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3) &&
                  rows.scalar_type() == cache.scalar_type(),
              "new keys and values: [T, Hkv, D] in the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows.size(0),
              "slots: [T] int64");
  const at::Tensor src = rows.stride(2) == 1 && rows.stride(1) == rows.size(2) ? rows : rows.contiguous();
  const at::Tensor where = slots.contiguous();
  const int64_t total = cache.size(0) * cache.size(1), element = cache.element_size();
  const int64_t bytes = cache.size(2) * cache.size(3) * element, src_step = src.stride(0) * element;
  const int64_t* slot = where.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < src.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < total, "slot ", slot[t], " outside the cache");
    std::memcpy(dst + slot[t] * bytes, from + t * src_step, bytes);
  }
}

// q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_table: [T, W] int64; key_counts:
// [T] int64 (position + 1); window: 0 or the keys a row sees, its own included; softcap: 0 or the cap. With k, v
// ([T, Hkv, D]) and slots ([T]), this step's keys and values are written to their slots first (a prefill row reads
// its own). Returns [T, Hq, D].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                           at::Tensor key_counts, double scale, int64_t window, double softcap,
                           c10::optional<at::Tensor> k, c10::optional<at::Tensor> v,
                           c10::optional<at::Tensor> slots) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(k.has_value() == slots.has_value() && v.has_value() == slots.has_value(), "k, v and slots go together");
  if (slots) {
    write_slots(k_cache, *k, *slots);
    write_slots(v_cache, *v, *slots);
  }
  q = q.contiguous();
  block_table = block_table.to(at::kLong).contiguous();
  key_counts = key_counts.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const Args<scalar_t> args{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              block_table.data_ptr<int64_t>(), key_counts.data_ptr<int64_t>(),
                              out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_cache.size(2), q.size(2),
                              k_cache.size(1), block_table.size(1), window, static_cast<float>(scale),
                              static_cast<float>(softcap)};
    dispatch(args);
  });
  return out;
}
