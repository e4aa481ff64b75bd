// Decode attention straight from the paged KV pool (CPU).
//
// One query token per request attends to its whole context, whose K/V lie in the blocks of
// its block table. Reading the blocks in place saves the gather copy the torch path needs,
// and the query heads that share a KV head are handled together, so each key and value is
// read once. Work is split over (request, KV head) pairs; scores and accumulation are float.
// Float K/V use the build's vector registers (vec.h: AVX-512 or AVX2+FMA); every other
// case is the portable loops below, vectorised by the compiler.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const double* p, int64_t i) { return float(p[i]); }
inline float load(const at::BFloat16* p, int64_t i) { return float(p[i]); }
inline float load(const at::Half* p, int64_t i) { return float(p[i]); }

// The portable loops: `omp simd` lets the compiler vectorise the reduction for whatever
// -march it builds for (without it a float sum stays scalar, one add after another).
template <typename T>
inline float dot(const float* __restrict__ q, const T* __restrict__ k, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * load(k, d);
  return s;
}

template <typename T>
inline void axpy(float a, const T* __restrict__ v, float* __restrict__ acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * load(v, d);
}

#if defined(DS_VEC)
using namespace ds;

template <>
inline float dot<float>(const float* __restrict__ q, const float* __restrict__ k, int64_t n) {
  V s0 = vzero(), s1 = vzero();  // two chains hide the FMA's latency
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    s0 = vfma(vload(q + d), vload(k + d), s0);
    s1 = vfma(vload(q + d + W), vload(k + d + W), s1);
  }
  for (; d + W <= n; d += W) s0 = vfma(vload(q + d), vload(k + d), s0);
  float r = vsum(vadd(s0, s1));
  for (; d < n; ++d) r += q[d] * k[d];
  return r;
}

template <>
inline void axpy<float>(float a, const float* __restrict__ v, float* __restrict__ acc, int64_t n) {
  const V av = vset(a);
  int64_t d = 0;
  for (; d + W <= n; d += W) vstore(acc + d, vfma(av, vload(v + d), vload(acc + d)));
  for (; d < n; ++d) acc[d] += a * v[d];
}
#endif

template <typename T>
void decode_attention_kernel(const T* q, const T* k_cache, const T* v_cache,
                             const int64_t* block_tables, const int64_t* context_lens, T* out,
                             int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t max_blocks,
                             float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // one token slot in the pool
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * head_dim), acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kh = task % num_kv_heads;
      const int64_t ctx = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(group * ctx);
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q + (b * num_heads + kh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = load(qh, d) * scale;
      }
      for (int64_t t = 0; t < ctx; ++t) {
        const T* kp = k_cache + (table[t / block_size] * block_size + t % block_size) *
                                    slot_stride + kh * head_dim;
        for (int64_t g = 0; g < group; ++g)
          scores[g * ctx + t] = dot(qf.data() + g * head_dim, kp, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * ctx;
        const float peak = *std::max_element(row, row + ctx);
        float sum = 0.0f;
        for (int64_t t = 0; t < ctx; ++t) {
          row[t] = std::exp(row[t] - peak);
          sum += row[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < ctx; ++t) {
        const T* vp = v_cache + (table[t / block_size] * block_size + t % block_size) *
                                    slot_stride + kh * head_dim;
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * ctx + t], vp, acc.data() + g * head_dim, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (b * num_heads + kh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = T(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks]
// (int64); context_lens [B] (int64). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "pool must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "shape mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_attention_kernel<scalar_t>(
        q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), batch, heads, kv_heads, dim, block_size,
        block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}
