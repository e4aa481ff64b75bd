// Decode attention straight from the paged KV pool (CPU).
//
// One query token per request attends to its whole context, whose K/V lie in the blocks of
// its block table. Reading the blocks in place saves the gather copy the torch path needs.
// A task reads a token's slot whole (every KV head side by side, contiguous), so each key and
// value is read once and in order: tasks of one KV head each read a third of every slot and
// ran at 6 GB/s (AMD EPYC, batch 32). Work is split over (request, chunk of its context)
// pairs, enough chunks that every thread works even at batch 1; the chunks' outputs are
// merged as flash-decoding does (rescaled to the largest score). Scores and accumulation are
// float. Float K/V use the build's vector registers (vec.h: AVX-512 or AVX2+FMA; exp
// vectorised too); every other case is the portable loops below, vectorised by the compiler.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
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

// row = exp(row - max(row)), in place; returns (max, sum of the exponentials)
inline std::pair<float, float> exponentiate(float* __restrict__ row, int64_t n) {
  const float peak = ds::row_max(row, n);
#if defined(DS_VEC)
  int64_t t = 0;
  V sums = vzero();
  const V shift = vset(peak);
  for (t = 0; t + W <= n; t += W) {
    const V e = vexp(vsub(vload(row + t), shift));
    vstore(row + t, e);
    sums = vadd(sums, e);
  }
  float sum = vsum(sums);
  for (; t < n; ++t) sum += row[t] = std::exp(row[t] - peak);
#else
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) sum += row[t] = std::exp(row[t] - peak);
#endif
  return {peak, sum};
}

constexpr int64_t MIN_CHUNK = 64;  // tokens: a chunk's merge costs about one token
constexpr int64_t MAX_CHUNK = 2048;  // a task's scores stay in L2 at long contexts

// Calls `visit(t, slot)` for tokens [t0, t1) of a block table in order, `slot` pointing at
// token t's K (or V) slot in `cache` (`slot_stride` elements: every KV head's). A block's
// tokens lie side by side, so the block's position is looked up once (no division a token),
// and the next block's slots are prefetched into L2 a token at a time while this block's are
// read: a request's blocks lie anywhere in a pool that has served a while, where the
// hardware's prefetcher, which follows a stream, loses them (without this a random pool read
// half as fast as one in order; prefetched into L1 instead, a third slower than into L2).
template <typename T, typename Visit>
inline void for_each_slot(const T* cache, const int64_t* table, int64_t t0, int64_t t1,
                          int64_t block_size, int64_t slot_stride, Visit&& visit) {
  constexpr int64_t LINE = 64;
  const int64_t slot_bytes = slot_stride * int64_t(sizeof(T));
  for (int64_t t = t0; t < t1;) {
    const int64_t block = t / block_size, end = std::min(t1, (block + 1) * block_size);
    const T* slot = cache + (table[block] * block_size + t % block_size) * slot_stride;
    const char* next = end < t1 ? reinterpret_cast<const char*>(
                                      cache + table[block + 1] * block_size * slot_stride)
                                : nullptr;
    for (int64_t ahead = (t % block_size) * slot_bytes; t < end; ++t, slot += slot_stride) {
      if (next != nullptr) {
        for (int64_t b = 0; b < slot_bytes; b += LINE) __builtin_prefetch(next + ahead + b, 0, 2);
        ahead += slot_bytes;
      }
      visit(t, slot);
    }
  }
}

// scores[h * n + t - t0] = q_h . k_t for tokens [t0, t1), n = t1 - t0
template <typename T>
void score_chunk(const float* qf, const T* k_cache, const int64_t* table, int64_t t0,
                 int64_t t1, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 int64_t block_size, float* scores) {
  const int64_t group = heads / kv_heads, n = t1 - t0;
  for_each_slot(k_cache, table, t0, t1, block_size, kv_heads * head_dim,
                [&](int64_t t, const T* slot) {
    float* score = scores + t - t0;
    for (int64_t g = 0, h = 0; g < kv_heads; ++g, slot += head_dim)
      for (int64_t j = 0; j < group; ++j, ++h)
        score[h * n] = dot(qf + h * head_dim, slot, head_dim);
  });
}

#if defined(DS_VEC)
// score_chunk for float K whose head is NV vectors: each K head is loaded once, into
// registers, for its whole query group (above: once a query head); 1.2-1.4x at batch 8-32
template <int NV>
void score_chunk_vec(const float* qf, const float* k_cache, const int64_t* table, int64_t t0,
                     int64_t t1, int64_t heads, int64_t kv_heads, int64_t block_size,
                     float* scores) {
  constexpr int64_t D = NV * W;
  const int64_t group = heads / kv_heads, n = t1 - t0;
  for_each_slot(k_cache, table, t0, t1, block_size, kv_heads * D,
                [&](int64_t t, const float* slot) {
    float* score = scores + t - t0;
    const float* q = qf;
    for (int64_t g = 0; g < kv_heads; ++g, slot += D) {
      V k[NV];
      for (int v = 0; v < NV; ++v) k[v] = vload(slot + v * W);
      for (int64_t j = 0; j < group; ++j, q += D, score += n) {
        V s0 = vmul(vload(q), k[0]), s1 = vzero();  // two chains hide the FMA's latency
        for (int v = 1; v < NV; ++v) {
          if (v % 2) s1 = vfma(vload(q + v * W), k[v], s1);
          else s0 = vfma(vload(q + v * W), k[v], s0);
        }
        *score = vsum(vadd(s0, s1));
      }
    }
  });
}

#endif

// One task: request b's tokens [t0, t1) against all its query heads. Reads each token's slot
// (every KV head side by side) once, contiguously; leaves each head's unnormalised output, its
// score maximum and its sum of exponentials in `part` ([heads, head_dim + 2]) to be merged
// with the request's other chunks. NV > 0: float K/V whose head is NV vectors (head_dim a
// constant, the loops over it unrolled).
template <typename T, int NV>
void attend_chunk(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t t0, int64_t t1, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t block_size, std::vector<float>& scores, float* part) {
  const int64_t dim = NV > 0 ? NV * ds::W : head_dim;
  const int64_t group = heads / kv_heads, n = t1 - t0, width = dim + 2;
  scores.resize(heads * n);
#if defined(DS_VEC)
  if constexpr (NV > 0)
    score_chunk_vec<NV>(qf, k_cache, table, t0, t1, heads, kv_heads, block_size, scores.data());
  else
#endif
    score_chunk(qf, k_cache, table, t0, t1, heads, kv_heads, dim, block_size, scores.data());
  for (int64_t h = 0; h < heads; ++h) {
    float* out = part + h * width;
    const auto [peak, sum] = exponentiate(scores.data() + h * n, n);
    std::fill(out, out + dim, 0.0f);
    out[dim] = peak;
    out[dim + 1] = sum;
  }
  for_each_slot(v_cache, table, t0, t1, block_size, kv_heads * dim,
                [&](int64_t t, const T* slot) {
    const float* weight = scores.data() + t - t0;
    for (int64_t g = 0, h = 0; g < kv_heads; ++g, slot += dim)
      for (int64_t j = 0; j < group; ++j, ++h)
        axpy(weight[h * n], slot, part + h * width, dim);
  });
}

// attend_chunk with head_dim a constant where K/V are float and a head is 2-16 vectors
template <typename T>
void attend(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table,
            int64_t t0, int64_t t1, int64_t heads, int64_t kv_heads, int64_t head_dim,
            int64_t block_size, std::vector<float>& scores, float* part) {
  auto run = [&](auto nv) {
    attend_chunk<T, decltype(nv)::value>(qf, k_cache, v_cache, table, t0, t1, heads, kv_heads,
                                         head_dim, block_size, scores, part);
  };
#if defined(DS_VEC)
  if constexpr (std::is_same_v<T, float>) {
    switch (head_dim) {
      case 2 * W: return run(std::integral_constant<int, 2>{});
      case 4 * W: return run(std::integral_constant<int, 4>{});
      case 8 * W: return run(std::integral_constant<int, 8>{});
      case 16 * W: return run(std::integral_constant<int, 16>{});
      default: break;
    }
  }
#endif
  run(std::integral_constant<int, 0>{});
}

// Decode attention over a batch in two phases of tasks: `score` a (request, chunk of its
// context) a task, every head of a chunk into `parts`; `merge` a (request, head) a task. The
// chunks are cut for `threads` threads and the longest context (the same for every layer of
// a step, so one plan serves them all). Each thread has its scratch, allocated up front.
template <typename T>
struct DecodeAttention {
  const int64_t *block_tables, *context_lens;
  int64_t batch, heads, kv_heads, head_dim, block_size, max_blocks;
  float scale;
  int64_t chunk, chunks, width;
  std::vector<float> parts;
  struct Scratch {
    std::vector<float> scores, qf, acc;
  };
  std::vector<Scratch> scratch;  // a thread's

  DecodeAttention(const int64_t* block_tables, const int64_t* context_lens, int64_t batch,
                  int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t max_blocks, float scale, int threads)
      : block_tables(block_tables), context_lens(context_lens), batch(batch), heads(heads),
        kv_heads(kv_heads), head_dim(head_dim), block_size(block_size),
        max_blocks(max_blocks), scale(scale), width(head_dim + 2) {
    // enough chunks of a request's context for every thread even at batch 1
    const int64_t longest =
        std::max<int64_t>(1, *std::max_element(context_lens, context_lens + batch));
    const int64_t wanted = (4 * threads + batch - 1) / batch;
    chunk = std::clamp<int64_t>((longest + wanted - 1) / wanted, MIN_CHUNK, MAX_CHUNK);
    chunks = (longest + chunk - 1) / chunk;
    parts.resize(batch * chunks * heads * width);
    scratch.resize(threads);
    for (Scratch& mine : scratch) {
      mine.scores.reserve(heads * chunk);
      mine.qf.resize(heads * head_dim);
      mine.acc.resize(head_dim);
    }
  }

  int64_t score_tasks() const { return batch * chunks; }
  int64_t merge_tasks() const { return batch * heads; }
  static constexpr int64_t MERGE_GRAIN = 16;

  void score(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, int64_t begin,
             int64_t end, int thread) {
    auto& [scores, qf, acc] = scratch[thread];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, c = task % chunks;
      const int64_t t0 = c * chunk, t1 = std::min(context_lens[b], t0 + chunk);
      float* part = parts.data() + task * heads * width;
      if (t0 >= t1) {  // past this request's context: nothing to merge
        for (int64_t h = 0; h < heads; ++h) part[h * width + head_dim + 1] = 0.0f;
        continue;
      }
      for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = load(q + b * q_stride, i) * scale;
      attend(qf.data(), k_cache, v_cache, block_tables + b * max_blocks, t0, t1, heads,
             kv_heads, head_dim, block_size, scores, part);
    }
  }

  // each request's chunks: rescaled to the largest maximum, divided by the sum
  void merge(T* out, int64_t begin, int64_t end, int thread) {
    std::vector<float>& acc = scratch[thread].acc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads;
      const float* first = parts.data() + (b * chunks * heads + h) * width;
      float peak = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* p = first + c * heads * width;
        if (p[head_dim + 1] > 0.0f) peak = std::max(peak, p[head_dim]);
      }
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* p = first + c * heads * width;
        if (p[head_dim + 1] == 0.0f) continue;
        const float w = std::exp(p[head_dim] - peak);
        sum += w * p[head_dim + 1];
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * p[d];
      }
      T* o = out + (b * heads + h) * head_dim;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no context: zeros, not 0 / 0
      for (int64_t d = 0; d < head_dim; ++d) o[d] = T(acc[d] * inv);
    }
  }
};

template <typename T>
void decode_attention_kernel(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                             const int64_t* block_tables, const int64_t* context_lens, T* out,
                             int64_t batch, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t max_blocks,
                             float scale) {
  DecodeAttention<T> attention(block_tables, context_lens, batch, heads, kv_heads, head_dim,
                               block_size, max_blocks, scale, at::get_num_threads());
  at::parallel_for(0, attention.score_tasks(), 1, [&](int64_t begin, int64_t end) {
    attention.score(q, q_stride, k_cache, v_cache, begin, end, at::get_thread_num());
  });
  at::parallel_for(0, attention.merge_tasks(), attention.MERGE_GRAIN,
                   [&](int64_t begin, int64_t end) {
                     attention.merge(out, begin, end, at::get_thread_num());
                   });
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks]
// (int64); context_lens [B] (int64). Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                  at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "pool must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  if (batch == 0) return out;
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "shape mismatch");
  pybind11::gil_scoped_release no_gil;  // the service's event loop runs meanwhile
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_attention_kernel<scalar_t>(
        q.data_ptr<scalar_t>(), heads * dim, k_cache.data_ptr<scalar_t>(),
        v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), batch, heads, kv_heads, dim, block_size,
        block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}
