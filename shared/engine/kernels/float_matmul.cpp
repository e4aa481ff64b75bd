// Float matmul of the engine's layers on the CPU: y = x @ W^T for float32 weights packed in
// panels (shared/engine/panels.py packs them). BLAS's skinny GEMMs, the decode step's, read
// the weights at half the memory bandwidth or less on some CPUs (MKL on AMD EPYC: 11-19 GB/s
// of 33 at one row of x), and a decode step is bound by reading them once.
//
// A panel holds P = C vectors' worth of W's rows (output columns) interleaved along K: for
// each k, the P weights of its columns side by side, so a panel streams from memory in one
// pass. The micro-kernel keeps an R x P tile of y in registers: per k it loads C weight
// vectors, broadcasts R values of x and issues R x C FMAs (the classic GEMM register tile:
// no horizontal sums, each load feeding several FMAs). K is cut in chunks so a panel's chunk
// stays in L2 and R rows of x in L1 while the next rows pass; work is split over panels and
// blocks of rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace panels {  // named: the kernels' sources are built as one unit

using namespace ds;
// registers: R x C accumulators + C weight vectors + a broadcast (AVX-512 has 32, AVX2 16)
constexpr int C = W == 16 ? 3 : W == 8 ? 2 : 16;
constexpr int R = W == 16 ? 8 : W == 8 ? 6 : 4;
constexpr int P = C * W;              // output columns a panel
constexpr int64_t K_CHUNK = 512;      // a panel's chunk: 512 x 48 floats = 96 KiB (L2)
constexpr int64_t M_BLOCK = 8 * R;    // rows of x a task

constexpr int64_t AHEAD = 32;         // k steps a first pass prefetches ahead (AVX-512: 6 KiB)
// rows of x up to which two panels are read side by side (2 x R2 x C accumulators): on a
// Zen 3 at 3 rows, one thread, SmolLM2's matrices took 32-34 ms a step read one panel at a
// time, 27.6 two at a time (benchmarks/kernel_ab.py), a batch of 3 slower than one of 4;
// AVX2's 3-row tile wants 17 vector registers, one spilled, and still reads faster
constexpr int R2 = W == 16 ? 4 : W == 8 ? 3 : 1;

// a row of a tile's accumulators into out[0:cols] (or added to it)
inline void put(const V* acc, float* out, int64_t cols, bool accumulate) {
  alignas(64) float tile[P];
  for (int c = 0; c < C; ++c) vstore(tile + c * W, acc[c]);
  if (accumulate)
    for (int64_t j = 0; j < cols; ++j) out[j] += tile[j];
  else
    for (int64_t j = 0; j < cols; ++j) out[j] = tile[j];
}

// y[0:ROWS, 0:P] (+)= x[0:ROWS, k0:k1] @ panel[k0:k1]. The first rows over a chunk (`fetch`)
// prefetch the panel into L2 as they go, ahead of the hardware's prefetcher: at one row of x
// the kernel reads the weights 7-10% faster so (the model's matrices in turn, 2 threads).
template <int ROWS>
inline void micro(const float* __restrict__ x, int64_t ldx, const float* __restrict__ panel,
                  int64_t k0, int64_t k1, float* __restrict__ y, int64_t ldy, int64_t cols,
                  bool accumulate, bool fetch) {
  V acc[ROWS][C];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    V w[C];
    for (int c = 0; c < C; ++c) w[c] = vload(panel + k * P + c * W);
    if (fetch)  // past the panel's end too: a prefetch never faults
      for (int c = 0; c < C; ++c) __builtin_prefetch(panel + (k + AHEAD) * P + c * W, 0, 2);
    for (int r = 0; r < ROWS; ++r) {
      const V xb = vset(x[r * ldx + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(w[c], xb, acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r) put(acc[r], y + r * ldy, cols, accumulate);
}

template <int ROWS>
inline void micro_left(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                       float* y, int64_t ldy, int64_t cols, bool accumulate, bool fetch,
                       int64_t rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return micro<ROWS>(x, ldx, panel, k0, k1, y, ldy, cols, accumulate, fetch);
    micro_left<ROWS - 1>(x, ldx, panel, k0, k1, y, ldy, cols, accumulate, fetch, rows);
  }
}


// y0[0:ROWS, 0:cols0] (+)= x[0:ROWS, k0:k1] @ panel0[k0:k1] and y1 from panel1 the same:
// a decode step's few rows read two streams of weights a thread, which keeps more reads in
// flight than one (the model's matrices at one row, 2 threads, Zen 4: 4-5% faster). Each
// panel's sums run in the order `micro`'s do, so a row's result is the same in any batch.
template <int ROWS>
inline void micro2(const float* __restrict__ x, int64_t ldx, const float* __restrict__ panel0,
                   const float* __restrict__ panel1, int64_t k0, int64_t k1,
                   float* __restrict__ y0, float* __restrict__ y1, int64_t ldy, int64_t cols0,
                   int64_t cols1, bool accumulate) {
  V a[ROWS][C], b[ROWS][C];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = b[r][c] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    V w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      w0[c] = vload(panel0 + k * P + c * W);
      w1[c] = vload(panel1 + k * P + c * W);
      __builtin_prefetch(panel0 + (k + AHEAD) * P + c * W, 0, 2);
      __builtin_prefetch(panel1 + (k + AHEAD) * P + c * W, 0, 2);
    }
    for (int r = 0; r < ROWS; ++r) {
      const V xb = vset(x[r * ldx + k]);
      for (int c = 0; c < C; ++c) {
        a[r][c] = vfma(w0[c], xb, a[r][c]);
        b[r][c] = vfma(w1[c], xb, b[r][c]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    put(a[r], y0 + r * ldy, cols0, accumulate);
    put(b[r], y1 + r * ldy, cols1, accumulate);
  }
}

template <int ROWS>
inline void micro2_left(const float* x, int64_t ldx, const float* panel0, const float* panel1,
                        int64_t k0, int64_t k1, float* y0, float* y1, int64_t ldy,
                        int64_t cols0, int64_t cols1, bool accumulate, int64_t rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS)
      return micro2<ROWS>(x, ldx, panel0, panel1, k0, k1, y0, y1, ldy, cols0, cols1,
                          accumulate);
    micro2_left<ROWS - 1>(x, ldx, panel0, panel1, k0, k1, y0, y1, ldy, cols0, cols1,
                          accumulate, rows);
  }
}

// Tasks of an [M, K] x [K, N] product: a panel for a block of rows each.
inline int64_t tasks(int64_t M, int64_t N) {
  return (N + P - 1) / P * ((M + M_BLOCK - 1) / M_BLOCK);
}

// Tasks [begin, end) of y = x @ W^T.
void run_tasks(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
               int64_t M, int64_t N, int64_t K, int64_t begin, int64_t end) {
  const int64_t blocks = (M + M_BLOCK - 1) / M_BLOCK;
  if (M <= R2) {  // a task a panel: the range's two halves side by side, the odd one alone
    const int64_t half = (end - begin) / 2;
    for (int64_t p = begin; p < begin + half; ++p) {
      const int64_t q = p + half;
      for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK)
        micro2_left<R2>(x, K, w + p * K * P, w + q * K * P, k0, std::min(K, k0 + K_CHUNK),
                        y + p * P, y + q * P, N, std::min<int64_t>(P, N - p * P),
                        std::min<int64_t>(P, N - q * P), k0 > 0, M);
    }
    begin += 2 * half;
  }
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task / blocks, m0 = (task % blocks) * M_BLOCK;
    const int64_t m1 = std::min(M, m0 + M_BLOCK), n0 = p * P;
    const int64_t cols = std::min<int64_t>(P, N - n0);
    const float* panel = w + p * K * P;
    for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
      const int64_t k1 = std::min(K, k0 + K_CHUNK);
      int64_t m = m0;
      for (; m + R <= m1; m += R)
        micro<R>(x + m * K, K, panel, k0, k1, y + m * N + n0, N, cols, k0 > 0, m == m0);
      if (m < m1)
        micro_left<R - 1>(x + m * K, K, panel, k0, k1, y + m * N + n0, N, cols, k0 > 0,
                          m == m0, m1 - m);
    }
  }
}

// The first k steps of task `task`'s panel into L2, ahead of the task: a thread that is done
// with one matrix before the others starts on its share of the next.
inline void prefetch_task(const float* w, int64_t M, int64_t N, int64_t K, int64_t task) {
  if (task >= tasks(M, N)) return;
  const float* panel = w + task / ((M + M_BLOCK - 1) / M_BLOCK) * K * P;
  for (int64_t k = 0; k < std::min(K, AHEAD); ++k)
    for (int c = 0; c < C; ++c) __builtin_prefetch(panel + k * P + c * W, 0, 2);
}

void run(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
         int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, tasks(M, N), 1, [&](int64_t begin, int64_t end) {
    run_tasks(x, w, y, M, N, K, begin, end);
  });
}

}  // namespace panels

int64_t panel_width() { return panels::P; }

// x [M, K] float32; packed [ceil(N / P), K, P]: panel p's column j at k is W[p * P + j, k].
// Returns x @ W^T, [M, N].
at::Tensor float_matmul(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x: float32 on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == panels::P && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "panels: contiguous float32 [panels, K, P]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K && (N + panels::P - 1) / panels::P == packed.size(0),
              "panels do not match x or N");
  auto out = at::empty({M, N}, x.options());
  pybind11::gil_scoped_release no_gil;  // the service's event loop runs meanwhile
  panels::run(x.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  return out;
}
