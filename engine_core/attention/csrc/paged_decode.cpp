// Paged decode attention for CPU: one query per sequence against its keys and values read in place
// from the block-paged cache (no gather, no padding), scores and softmax in fp32.
// Work is split over (sequence, KV head) pairs; each pair serves its group of query heads (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

// e^x for 16 floats: 2^n · P(r) with n = round(x·log2 e), r = x − n·ln 2 (Cephes' expf polynomial);
// relative error ~1e-7, and no call into libm per element.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
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

// In place: s[0:len] = softmax(s[0:len]), 16 at a time.
inline void softmax16(float* s, int64_t len) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(len - t), s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail_mask(len - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(s + t, k, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 k = tail_mask(len - t);
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), inv));
  }
}

// The same computation with AVX-512 registers: HD/16 vectors per row, group query rows.
template <typename scalar_t, int HD>
void decode_avx512(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_table,
                   const int64_t* seq_lens, scalar_t* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                   int64_t block_size, int64_t table_width, float scale) {
  constexpr int C = HD / 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * HD;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * HD), acc(group * HD), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_table + b * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + (b * num_heads + h * group + g) * HD;
        for (int c = 0; c < C; ++c) store16(&qf[g * HD + c * 16], _mm512_mul_ps(load16(qrow + c * 16), _mm512_set1_ps(scale)));
      }
      scores.resize(group * len);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* base = k_cache + table[t0 / block_size] * block_size * token_stride + h * HD;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* krow = base + i * token_stride;
          __m512 k[C];
          for (int c = 0; c < C; ++c) k[c] = load16(krow + c * 16);
          for (int64_t g = 0; g < group; ++g) {
            __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(&qf[g * HD]), k[0]);
            for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(&qf[g * HD + c * 16]), k[c], dot);
            scores[g * len + t0 + i] = _mm512_reduce_add_ps(dot);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax16(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* base = v_cache + table[t0 / block_size] * block_size * token_stride + h * HD;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* vrow = base + i * token_stride;
          __m512 v[C];
          for (int c = 0; c < C; ++c) v[c] = load16(vrow + c * 16);
          for (int64_t g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * len + t0 + i]);
            float* a = &acc[g * HD];
            for (int c = 0; c < C; ++c) store16(a + c * 16, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(a + c * 16)));
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = out + (b * num_heads + h * group + g) * HD;
        for (int64_t d = 0; d < HD; ++d) orow[d] = static_cast<scalar_t>(acc[g * HD + d]);
      }
    }
  });
}
#endif

// HD: the head size when known at compile time (64, 128: fixed trip counts vectorize), else 0.
template <typename scalar_t, int HD>
void decode(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_table,
            const int64_t* seq_lens, scalar_t* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
            int64_t dynamic_head_dim, int64_t block_size, int64_t table_width, float scale) {
  const int64_t head_dim = HD > 0 ? HD : dynamic_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the cache
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_table + b * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qrow[d]) * scale;
      }
      scores.resize(group * len);
      float* kf = row.data();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {  // q·k, block by block, keys read in place
        const scalar_t* base = k_cache + table[t0 / block_size] * block_size * token_stride + h * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* krow = base + i * token_stride;
          for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(krow[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
            scores[g * len + t0 + i] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax
        float* sc = scores.data() + g * len;
        const float top = *std::max_element(sc, sc + len);
        for (int64_t t = 0; t < len; ++t) sc[t] = expf(sc[t] - top);  // separate loops vectorize (libmvec)
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += sc[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float* vf = row.data();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {  // Σ p·v
        const scalar_t* base = v_cache + table[t0 / block_size] * block_size * token_stride + h * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* vrow = base + i * token_stride;
          for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_float(vrow[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t0 + i];
            float* a = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vf[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = out + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_table: [B, W] int64;
// seq_lens: [B] int64. Returns [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  q = q.contiguous();
  block_table = block_table.to(torch::kLong).contiguous();
  seq_lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             block_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
             q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_table.size(1), static_cast<float>(scale));
    };
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, float>) {
      auto fast = [&](auto kernel) {
        kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
               block_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
               q.size(1), k_cache.size(2), k_cache.size(1), block_table.size(1), static_cast<float>(scale));
      };
      if (q.size(2) == 64) return fast(decode_avx512<scalar_t, 64>);
      if (q.size(2) == 128) return fast(decode_avx512<scalar_t, 128>);
    }
#endif
    if (q.size(2) == 64) run(decode<scalar_t, 64>);
    else if (q.size(2) == 128) run(decode<scalar_t, 128>);
    else run(decode<scalar_t, 0>);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a block-paged KV cache (CPU)");
}
