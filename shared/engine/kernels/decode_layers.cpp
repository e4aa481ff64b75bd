// A decode step's layers in one call (CPU, float32 activations, one rank of a Llama-shaped
// model without Q/K/V bias or per-head norms): per layer RMSNorm, the fused QKV matmul, RoPE,
// the new K/V written into the paged pool, paged decode attention, the output projection and
// its residual, RMSNorm, gate/up, SiLU(gate) * up, down and its residual. The kernels are the
// ones the model calls one at a time (this file comes after theirs in the build); what goes is
// the ~15 Python and torch dispatches a layer between them: at batch 1 those cost more than
// the norms, RoPE and the KV write themselves.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace ds;

// A layer's tensors in `decode_layers`' list: its two norms, then for each of its four
// matrices (QKV, O, gate/up, down) the weights, scales and minimums (the last two empty for
// float panels and the minimums for int8); in `shapes`, each matrix's bits (32: float
// panels) and output columns.
constexpr int TENSORS_A_LAYER = 2 + 3 * 4, SHAPES_A_LAYER = 2 * 4;

struct Linear {
  const at::Tensor &weights, &scales, &mins;
  int64_t bits, N;
  const void* w = nullptr;  // the tensors' data, taken once checked (`check`)
  const float *d = nullptr, *m = nullptr;

  int64_t tasks(int64_t M) const {
    return bits == 32 ? panels::tasks(M, N) : quantized_tasks(M, N);
  }

  // y [M, N] = x [M, K] @ W^T, the tasks of `mine`; `sums`: the thread's scratch for the
  // minimums' block sums.
  void run(const float* x, int64_t M, int64_t K, float* y, Share mine,
           std::vector<float>& sums) const {
    if (mine.begin >= mine.end) return;
    const auto* q = static_cast<const uint8_t*>(w);
    if (bits == 32) {
      panels::run_tasks(x, static_cast<const float*>(w), y, M, N, K, mine.begin, mine.end);
    } else if (bits == 4) {
      block_sums(x, M, K, sums);
      quantized_run_tasks<4>(x, sums.data(), q, d, m, y, M, N, K, mine.begin, mine.end);
    } else {
      quantized_run_tasks<8>(x, nullptr, q, d, nullptr, y, M, N, K, mine.begin, mine.end);
    }
  }

  void prefetch(int64_t M, int64_t K, int64_t task) const {
    const auto* q = static_cast<const uint8_t*>(w);
    if (bits == 32) panels::prefetch_task(static_cast<const float*>(w), M, N, K, task);
    else if (bits == 4) quantized_prefetch_task<4>(q, M, N, K, task);
    else quantized_prefetch_task<8>(q, M, N, K, task);
  }

  void check(int64_t K) {
    TORCH_CHECK(bits == 32 || bits == 8 || bits == 4, "bits: 32 (float panels), 8 or 4");
    TORCH_CHECK(weights.is_contiguous() && weights.dim() == 3, "weights: contiguous panels");
    if (bits == 32) {
      TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.size(1) == K &&
                      weights.size(2) == panels::P &&
                      weights.size(0) == (N + panels::P - 1) / panels::P,
                  "float panels do not match K and N");
      w = weights.data_ptr();
      return;
    }
    const int64_t count = (N + G - 1) / G;
    TORCH_CHECK(K % QK == 0 && weights.scalar_type() == at::kByte &&
                    weights.size(0) == count && weights.size(1) == K / QK &&
                    weights.size(2) == QK * G * bits / 8,
                "quantized panels do not match K and N");
    TORCH_CHECK(scales.is_contiguous() && scales.sizes() == at::IntArrayRef({count, K / QK, G}) &&
                    scales.scalar_type() == at::kFloat,
                "scales: float32 [panels, K / 32, 16]");
    TORCH_CHECK(bits == 8 || (mins.is_contiguous() && mins.sizes() == scales.sizes() &&
                              mins.scalar_type() == at::kFloat),
                "mins: as scales");
    w = weights.data_ptr();
    d = scales.data_ptr<float>();
    m = bits == 4 ? mins.data_ptr<float>() : nullptr;
  }
};

void add_rows(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  int64_t i = 0;
#if defined(DS_VEC)
  for (; i + W <= n; i += W) vstore(x + i, vadd(vload(x + i), vload(y + i)));
#endif
  for (; i < n; ++i) x[i] += y[i];
}

}  // namespace

// x [B, hidden]: the decode tokens' hidden states, taken through every layer in place (and
// returned). `tensors` and `shapes`: the layers' weights, TENSORS_A_LAYER and SHAPES_A_LAYER
// a layer. pool [layers, 2, blocks, block_size, kv_heads, D] (the paged K/V, float32);
// positions, slots [B] (each token's position and pool slot); block_tables [B, max_blocks],
// context_lens [B] (the new token included); cos, sin [P, D]; scale: attention's 1 / sqrt(D),
// as the model gives it to the attention kernel alone.
at::Tensor decode_layers(at::Tensor x, std::vector<at::Tensor> tensors,
                         std::vector<int64_t> shapes, at::Tensor pool,
                         at::Tensor positions, at::Tensor slots,
                         at::Tensor block_tables, at::Tensor context_lens,
                         at::Tensor cos, at::Tensor sin, int64_t heads, double eps,
                         double scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(), "x: contiguous float32 [B, hidden] on the CPU");
  TORCH_CHECK(pool.is_contiguous() && pool.scalar_type() == at::kFloat && pool.dim() == 6 &&
                  pool.size(1) == 2,
              "pool: contiguous float32 [layers, 2, blocks, block, H_kv, D]");
  const int64_t layers = pool.size(0), B = x.size(0), H = x.size(1);
  const int64_t block_size = pool.size(3), kv_heads = pool.size(4), D = pool.size(5);
  const int64_t q_size = heads * D, kv_size = kv_heads * D, qkv_size = q_size + 2 * kv_size;
  TORCH_CHECK(int64_t(tensors.size()) == layers * TENSORS_A_LAYER &&
                  int64_t(shapes.size()) == layers * SHAPES_A_LAYER,
              "tensors, shapes: ", TENSORS_A_LAYER, " and ", SHAPES_A_LAYER, " a layer");
  TORCH_CHECK(heads % kv_heads == 0 && D % 2 == 0, "heads: a multiple of the KV heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat,
              "cos, sin: [P, D]");
  for (const auto* t : {&positions, &slots, &block_tables, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices: contiguous int64");
  TORCH_CHECK(positions.numel() == B && slots.numel() == B && context_lens.numel() == B &&
                  block_tables.dim() == 2 && block_tables.size(0) == B, "one row a token");
  const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), pool_slots = pool.size(2) * block_size;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0), "position ", pos[b], " past the RoPE tables");
    TORCH_CHECK(slot[b] >= 0 && slot[b] < pool_slots, "slot ", slot[b], " outside the pool");
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context past its table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < pool.size(2),
                  "block outside the pool");
  }
  std::vector<Linear> linears;
  linears.reserve(layers * 4);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* t = tensors.data() + l * TENSORS_A_LAYER;
    const int64_t* s = shapes.data() + l * SHAPES_A_LAYER;
    for (int m = 0; m < 4; ++m)
      linears.push_back(Linear{t[2 + 3 * m], t[3 + 3 * m], t[4 + 3 * m], s[2 * m], s[2 * m + 1]});
    Linear* mat = linears.data() + l * 4;
    TORCH_CHECK(mat[0].N == qkv_size && mat[1].N == H && mat[3].N == H && mat[2].N % 2 == 0 &&
                    mat[2].N == linears[2].N,
                "layer ", l, ": matrices of the wrong widths");
    mat[0].check(H);
    mat[1].check(q_size);
    mat[2].check(H);
    mat[3].check(mat[2].N / 2);
    for (int n = 0; n < 2; ++n)
      TORCH_CHECK(t[n].is_contiguous() && t[n].numel() == H && t[n].scalar_type() == at::kFloat,
                  "norms: float32 [hidden]");
  }
  if (B == 0) return x;
  const int64_t inter = layers ? linears[2].N / 2 : 0;
  std::vector<float> h(B * H), qkv(B * qkv_size), attn(B * q_size), out(B * H),
      gate_up(B * 2 * inter), act(B * inter);
  float* xs = x.data_ptr<float>();
  float* kv = pool.data_ptr<float>();
  const int64_t half_layer = pool_slots * kv_size;  // K or V of one layer
  const float e = float(eps);
  const int threads = at::get_num_threads();
  DecodeAttention<float> attention(tables, lens, B, heads, kv_heads, D, block_size, max_blocks,
                                   static_cast<float>(scale), threads);
  std::vector<const float*> norms(2 * layers);
  for (int64_t l = 0; l < layers; ++l)
    for (int n = 0; n < 2; ++n) norms[2 * l + n] = tensors[l * TENSORS_A_LAYER + n].data_ptr<float>();
  const float *cos_table = cos.data_ptr<float>(), *sin_table = sin.data_ptr<float>();
  // a thread's scratch for the int4 minimums' block sums, allocated before the region (an
  // allocation that failed inside it would end the process)
  std::vector<std::vector<float>> block_sums_of(threads);
  for (auto& sums : block_sums_of) sums.reserve(B * std::max({H, q_size, inter}) / QK);
  pybind11::gil_scoped_release no_gil;  // the service's event loop runs meanwhile
  // One parallel region for the whole step, its phases split as at::parallel_for would split
  // them and a barrier between: a region a matmul (and two an attention) cost ~3 us each to
  // start and join, ~180 a step at batch 1. A thread done with a matrix early fetches the
  // start of its share of the next one while it waits. Row-wise work (norms, RoPE, the KV
  // write, SiLU, residuals) goes by rows, 16 a thread (at batch 1 the first thread does it),
  // in the kernels' serial forms: nothing in the region calls into torch or allocates.
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const Share rows = share(B, ROWS_A_TASK, t, team);
    const int64_t r0 = rows.begin, n = rows.end - rows.begin;
    std::vector<float>& sums = block_sums_of[t];
    // y = in @ W^T by the team, then the start of `next`'s share (taking `next_K` inputs)
    auto matmul = [&](const Linear& m, const float* in, int64_t K, float* y, const Linear* next,
                      int64_t next_K) {
      m.run(in, B, K, y, share(m.tasks(B), 1, t, team), sums);
      if (next) next->prefetch(B, next_K, share(next->tasks(B), 1, t, team).begin);
#pragma omp barrier
    };
    for (int64_t l = 0; l < layers; ++l) {
      const Linear* mat = linears.data() + l * 4;
      float *keys = kv + 2 * l * half_layer, *values = keys + half_layer;
      rms_norm_range(xs, H, norms[2 * l], h.data(), r0, rows.end, H, e);
#pragma omp barrier
      matmul(mat[0], h.data(), H, qkv.data(), &mat[1], q_size);
      rope_range(qkv.data(), qkv_size, r0, rows.end, heads + kv_heads, D, cos_table,
                 sin_table, pos);
      for (int64_t b = r0; b < rows.end; ++b) {
        const float* row = qkv.data() + b * qkv_size + q_size;
        std::memcpy(keys + slot[b] * kv_size, row, kv_size * sizeof(float));
        std::memcpy(values + slot[b] * kv_size, row + kv_size, kv_size * sizeof(float));
      }
#pragma omp barrier
      const Share scored = share(attention.score_tasks(), 1, t, team);
      attention.score(qkv.data(), qkv_size, keys, values, scored.begin, scored.end, t);
#pragma omp barrier
      const Share merged = share(attention.merge_tasks(), attention.MERGE_GRAIN, t, team);
      attention.merge(attn.data(), merged.begin, merged.end, t);
#pragma omp barrier
      matmul(mat[1], attn.data(), q_size, out.data(), &mat[2], H);
      add_rows(xs + r0 * H, out.data() + r0 * H, n * H);
      rms_norm_range(xs, H, norms[2 * l + 1], h.data(), r0, rows.end, H, e);
#pragma omp barrier
      matmul(mat[2], h.data(), H, gate_up.data(), &mat[3], inter);
      silu_mul_range(gate_up.data(), 2 * inter, act.data(), r0, rows.end, inter);
#pragma omp barrier
      matmul(mat[3], act.data(), inter, out.data(), l + 1 < layers ? &mat[4] : nullptr, H);
      add_rows(xs + r0 * H, out.data() + r0 * H, n * H);  // the next norm takes the same rows
    }
  }
  return x;
}
