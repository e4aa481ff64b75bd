// Weight-only quantized matmul (CPU): y = x @ W^T with W stored in blocks of 32 weights along
// the input dimension, each block with its own scale (and, for 4 bits, its own minimum).
//
//   int8: w = d * q, q in [-127, 127]            (GGUF Q8_0)
//   int4: w = d * q + m, q in [0, 15]            (GGUF Q4_1; Q4_0 is m = -8 d)
//
// The weights are laid out in panels of G = 16 output columns (quant.QuantizedPanels): for
// each block, the levels of input k for the panel's 16 columns lie together (int4: inputs k
// and k + 1 in one byte a column, low and high nibble), so one widening and one conversion
// (AVX2: two of each) give the levels of 16 columns as floats, multiplied by x_k broadcast
// into 16 sums at once:
// no horizontal sum a column, and a block's scale and minimum are applied once to its sums,
// not to every weight:
//   y = sum over blocks of  d * sum_k(q_k x_k)  +  m * sum_k(x_k)
// (for Q4_0's m = -8 d the two terms are of a size and partly cancel: a few more float32
// rounding errors than summing (q - 8) d x, within what the accuracy tests measure).
// Activations stay float32 (integer activations, as llama.cpp quantizes them, cost this
// model 7 points of top-1 agreement with float32).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace ds;

constexpr int64_t QK = 32;         // weights a block (along the input)
constexpr int64_t G = 16;          // output columns a panel
constexpr int H = G / W;           // vectors a panel's row of 16
// rows of x a pass: partial and running sums for each take 2 H registers a row (AVX2's 5
// rows spill the running sums, touched once a block: on a Zen 3, one thread, SmolLM2's int4
// matrices at 3 / 4 / 5 rows took 13.5 / 15.7 / 18.4 ms a step, 19.0 / 22.2 / 23.0 in tiles
// of 2 and blocks unpacked once; benchmarks/kernel_ab.py)
constexpr int R_MAX = W == 16 ? 8 : (W == 8 ? 5 : 4);
constexpr int64_t AHEAD = 4;      // blocks a panel is prefetched ahead

// The levels of inputs k and k + 1 (a pair) for the panel's 16 columns, as floats.
template <int BITS>
inline void unpack_pair(const uint8_t* __restrict__ p, V* w0, V* w1) {
#if defined(__AVX512F__)
  if constexpr (BITS == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(15);
    w0[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    w1[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high));
  } else {
    w0[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p))));
    w1[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p + G))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (BITS == 4) {  // 8 columns' bytes widened from memory, split in 32-bit lanes
    const __m256i low = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
      w0[h] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
      w1[h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
  } else {
    for (int h = 0; h < 2; ++h) {
      w0[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
      w1[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + G + 8 * h))));
    }
  }
#else
  for (int c = 0; c < G; ++c) {
    if constexpr (BITS == 4) {
      w0[c] = float(p[c] & 15);
      w1[c] = float(p[c] >> 4);
    } else {
      w0[c] = float(reinterpret_cast<const int8_t*>(p)[c]);
      w1[c] = float(reinterpret_cast<const int8_t*>(p)[G + c]);
    }
  }
#endif
}

// A panel's block AHEAD blocks on, with its scales and minimums, into L2, ahead of the
// hardware's prefetcher (3-8% faster at 1-512 rows of x); past the panel's end too: a
// prefetch never faults. wb: block b's weights.
template <int BITS>
inline void prefetch_ahead(const uint8_t* wb, const float* d, const float* m, int64_t b) {
  constexpr int64_t BLOCK_BYTES = G * BITS / 4 * QK / 2;
  for (int64_t line = 0; line < BLOCK_BYTES; line += 64)
    __builtin_prefetch(wb + AHEAD * BLOCK_BYTES + line, 0, 2);
  __builtin_prefetch(d + (b + AHEAD) * G, 0, 2);
  if (m) __builtin_prefetch(m + (b + AHEAD) * G, 0, 2);
}

// R rows of x times one panel: out[r, 0:cols]. A partial sums a row and vector, so a row or
// two still keep four FMA chains in flight.
template <int BITS, int R>
void panel_rows(const float* __restrict__ x, const float* __restrict__ sums, int64_t K,
                const uint8_t* __restrict__ w, const float* __restrict__ d,
                const float* __restrict__ m, float* __restrict__ out, int64_t N, int64_t cols) {
  constexpr int A = R * H >= 4 ? 1 : 4 / (R * H);
  constexpr int64_t PAIR_BYTES = G * BITS / 4, BLOCK_BYTES = PAIR_BYTES * QK / 2;
  const int64_t blocks = K / QK;
  V total[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) total[r][h] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    V part[R][A][H];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a)
        for (int h = 0; h < H; ++h) part[r][a][h] = vzero();
    const uint8_t* wb = w + b * BLOCK_BYTES;
    prefetch_ahead<BITS>(wb, d, m, b);
    for (int64_t pair = 0; pair < QK / 2; pair += A) {
      for (int a = 0; a < A; ++a) {
        V w0[H], w1[H];
        unpack_pair<BITS>(wb + (pair + a) * PAIR_BYTES, w0, w1);
        const int64_t k = b * QK + 2 * (pair + a);
        for (int r = 0; r < R; ++r) {
          const V x0 = vset(x[r * K + k]), x1 = vset(x[r * K + k + 1]);
          for (int h = 0; h < H; ++h) {
            part[r][a][h] = vfma(w0[h], x0, part[r][a][h]);
            part[r][a][h] = vfma(w1[h], x1, part[r][a][h]);
          }
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const V scale = vload(d + b * G + h * W);
      for (int r = 0; r < R; ++r) {
        V sum = part[r][0][h];
        for (int a = 1; a < A; ++a) sum = vadd(sum, part[r][a][h]);
        total[r][h] = vfma(sum, scale, total[r][h]);
        if (m) total[r][h] = vfma(vload(m + b * G + h * W), vset(sums[r * blocks + b]),
                                  total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == G) {
      for (int h = 0; h < H; ++h) vstore(out + r * N + h * W, total[r][h]);
    } else {  // the last panel's columns past N are padding
      float row[G];
      for (int h = 0; h < H; ++h) vstore(row + h * W, total[r][h]);
      std::copy(row, row + cols, out + r * N);
    }
  }
}

template <int BITS, int R>
void rows_remaining(const float* x, const float* sums, int64_t K, const uint8_t* w,
                    const float* d, const float* m, float* out, int64_t N, int64_t cols,
                    int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return panel_rows<BITS, R>(x, sums, K, w, d, m, out, N, cols);
    rows_remaining<BITS, R - 1>(x, sums, K, w, d, m, out, N, cols, rows);
  }
}

// Each row's sum of x over each block [M, K / QK], for the minimums.
void block_sums(const float* __restrict__ x, int64_t M, int64_t K, std::vector<float>& sums) {
  sums.resize(M * K / QK);
  for (int64_t i = 0; i < M * K / QK; ++i) {
    V s = vzero();
    for (int64_t j = 0; j < QK; j += W) s = vadd(s, vload(x + i * QK + j));
    sums[i] = vsum(s);
  }
}

// AVX2 unpacks a pair's levels in about as many instructions as two rows' FMAs take to use
// them (AVX-512 widens a row of 16 in one), so while every 2 rows unpacked a block again the
// panels read the model's int4 matrices 1.7x slower than float32's at 32 rows (2-vCPU Zen 3;
// tiles of 5 rows since).
// There a task of several rows unpacks each of its panel's blocks once, into floats in L1,
// and runs its rows over them R_U at a time with the sums in memory: the same sums in the
// same order as panel_rows at R >= 2 (a 2-row tile's bits). int8 takes it too (its levels
// widen as int4's do; not timed apart).
constexpr bool UNPACK_ONCE = W == 8;
constexpr int R_U = 6;                     // rows a pass: 2 R_U partial sums + 2 levels + x
constexpr int64_t UNPACKED_ROWS = 8 * R_U; // rows a task where blocks are unpacked once
constexpr int64_t UNPACK_FROM = R_MAX + 1; // rows a task from which they are

// Tasks of an [M, K] x [K, N] product: one panel for a run of rows each (its blocks stay in
// cache while they meet): TILES_A_TASK tiles of R_MAX rows, or UNPACKED_ROWS.
constexpr int64_t TILES_A_TASK = 8;
constexpr int64_t QUANTIZED_TASK_ROWS = UNPACK_ONCE ? UNPACKED_ROWS : TILES_A_TASK * R_MAX;
static_assert(!UNPACK_ONCE || QUANTIZED_TASK_ROWS <= UNPACKED_ROWS,
              "panel_unpacked's sums hold a task's rows");
inline int64_t quantized_tasks(int64_t M, int64_t N) {
  return (N + G - 1) / G * ((M + QUANTIZED_TASK_ROWS - 1) / QUANTIZED_TASK_ROWS);
}

// A block's 32 x 16 levels as floats, k by k.
template <int BITS>
inline void unpack_block(const uint8_t* __restrict__ wb, float* __restrict__ levels) {
  constexpr int64_t PAIR_BYTES = G * BITS / 4;
  for (int64_t pair = 0; pair < QK / 2; ++pair) {
    V w0[H], w1[H];
    unpack_pair<BITS>(wb + pair * PAIR_BYTES, w0, w1);
    for (int h = 0; h < H; ++h) {
      vstore(levels + 2 * pair * G + h * W, w0[h]);
      vstore(levels + (2 * pair + 1) * G + h * W, w1[h]);
    }
  }
}

// R rows of x (from k0) over a block's unpacked levels, added to their sums acc[R][G] with
// the block's scales d and minimums m (sums: the rows' block sums, `blocks` apart).
template <int R>
inline void unpacked_rows(const float* __restrict__ x, int64_t K, int64_t k0,
                          const float* __restrict__ levels, const float* __restrict__ d,
                          const float* __restrict__ m, const float* __restrict__ sums,
                          int64_t blocks, float* __restrict__ acc) {
  V part[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) part[r][h] = vzero();
  for (int64_t k = 0; k < QK; ++k) {
    V w[H];
    for (int h = 0; h < H; ++h) w[h] = vload(levels + k * G + h * W);
    for (int r = 0; r < R; ++r) {
      const V xb = vset(x[r * K + k0 + k]);
      for (int h = 0; h < H; ++h) part[r][h] = vfma(w[h], xb, part[r][h]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const V scale = vload(d + h * W);
    for (int r = 0; r < R; ++r) {
      V total = vfma(part[r][h], scale, vload(acc + r * G + h * W));
      if (m) total = vfma(vload(m + h * W), vset(sums[r * blocks]), total);
      vstore(acc + r * G + h * W, total);
    }
  }
}

template <int R>
inline void unpacked_left(const float* x, int64_t K, int64_t k0, const float* levels,
                          const float* d, const float* m, const float* sums, int64_t blocks,
                          float* acc, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return unpacked_rows<R>(x, K, k0, levels, d, m, sums, blocks, acc);
    unpacked_left<R - 1>(x, K, k0, levels, d, m, sums, blocks, acc, rows);
  }
}

// `rows` (up to UNPACKED_ROWS) rows of x times one panel, its blocks unpacked once.
template <int BITS>
void panel_unpacked(const float* __restrict__ x, const float* __restrict__ sums, int64_t K,
                    const uint8_t* __restrict__ w, const float* __restrict__ d,
                    const float* __restrict__ m, float* __restrict__ out, int64_t N,
                    int64_t cols, int64_t rows) {
  constexpr int64_t BLOCK_BYTES = G * BITS / 4 * QK / 2;
  const int64_t blocks = K / QK;
  alignas(64) float levels[QK * G];
  alignas(64) float acc[UNPACKED_ROWS * G];
  std::fill(acc, acc + rows * G, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * BLOCK_BYTES;
    prefetch_ahead<BITS>(wb, d, m, b);
    unpack_block<BITS>(wb, levels);
    const float* db = d + b * G;
    const float* mb = m ? m + b * G : nullptr;
    for (int64_t r0 = 0; r0 < rows; r0 += R_U) {
      const float* s = m ? sums + r0 * blocks + b : nullptr;
      if (rows - r0 >= R_U)
        unpacked_rows<R_U>(x + r0 * K, K, b * QK, levels, db, mb, s, blocks, acc + r0 * G);
      else
        unpacked_left<R_U - 1>(x + r0 * K, K, b * QK, levels, db, mb, s, blocks,
                               acc + r0 * G, rows - r0);
    }
  }
  for (int64_t r = 0; r < rows; ++r)  // the last panel's columns past N are padding
    std::copy(acc + r * G, acc + r * G + cols, out + r * N);
}

// Tasks [begin, end) of out = x @ W^T; `sums` from block_sums where there are minimums.
template <int BITS>
void quantized_run_tasks(const float* __restrict__ x, const float* __restrict__ sums,
                         const uint8_t* __restrict__ weights, const float* __restrict__ scales,
                         const float* __restrict__ mins, float* __restrict__ out, int64_t M,
                         int64_t N, int64_t K, int64_t begin, int64_t end) {
  const int64_t blocks = K / QK, panels = (N + G - 1) / G;
  const int64_t panel_bytes = blocks * QK * G * BITS / 8;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t p = task % panels, first = task / panels * QUANTIZED_TASK_ROWS;
    const int64_t cols = std::min(G, N - p * G), last = std::min(M, first + QUANTIZED_TASK_ROWS);
    const uint8_t* w = weights + p * panel_bytes;
    const float* d = scales + p * blocks * G;
    const float* m = mins ? mins + p * blocks * G : nullptr;
    if constexpr (UNPACK_ONCE) {
      if (last - first >= UNPACK_FROM) {
        panel_unpacked<BITS>(x + first * K, mins ? sums + first * blocks : nullptr, K, w, d, m,
                             out + first * N + p * G, N, cols, last - first);
        continue;
      }
    }
    for (int64_t r0 = first; r0 < last; r0 += R_MAX) {
      const int64_t rows = std::min<int64_t>(R_MAX, last - r0);
      const float* s = mins ? sums + r0 * blocks : nullptr;
      float* o = out + r0 * N + p * G;
      if (rows == R_MAX) panel_rows<BITS, R_MAX>(x + r0 * K, s, K, w, d, m, o, N, cols);
      else rows_remaining<BITS, R_MAX - 1>(x + r0 * K, s, K, w, d, m, o, N, cols, rows);
    }
  }
}

// The first blocks of task `task`'s panel into L2, ahead of the task (float_matmul's
// prefetch_task).
template <int BITS>
inline void quantized_prefetch_task(const uint8_t* weights, int64_t M, int64_t N, int64_t K,
                                    int64_t task) {
  if (task >= quantized_tasks(M, N)) return;
  const int64_t panels = (N + G - 1) / G, block_bytes = QK * G * BITS / 8;
  const uint8_t* w = weights + task % panels * (K / QK) * block_bytes;
  for (int64_t i = 0; i < std::min(K / QK, AHEAD) * block_bytes; i += 64)
    __builtin_prefetch(w + i, 0, 2);
}

template <int BITS>
void quantized_matmul_kernel(const float* __restrict__ x, const uint8_t* __restrict__ weights,
                             const float* __restrict__ scales, const float* __restrict__ mins,
                             float* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  std::vector<float> sums;
  if (mins) block_sums(x, M, K, sums);
  at::parallel_for(0, quantized_tasks(M, N), 1, [&](int64_t begin, int64_t end) {
    quantized_run_tasks<BITS>(x, sums.data(), weights, scales, mins, out, M, N, K, begin, end);
  });
}

}  // namespace

// x [M, K] float32; weights uint8 [panels, K / 32, 32 * 16 * bits / 8]; scales float32
// [panels, K / 32, 16]; mins the same for 4 bits (empty for 8); N output columns (the last
// panel's others are padding). Returns [M, N] float32.
at::Tensor quantized_matmul(at::Tensor x, at::Tensor weights, at::Tensor scales,
                            at::Tensor mins, int64_t bits, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x: float32 on the CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = (N + G - 1) / G;
  TORCH_CHECK(K % QK == 0 && weights.dim() == 3 && weights.size(0) == panels &&
              weights.size(1) == K / QK && weights.size(2) == QK * G * bits / 8,
              "weights do not match x and N");
  TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == at::kByte, "weights: uint8");
  TORCH_CHECK(scales.is_contiguous() && scales.sizes() == at::IntArrayRef({panels, K / QK, G}),
              "scales: [panels, K / 32, 16]");
  auto out = at::empty({M, N}, x.options());
  const float* m = nullptr;
  if (bits == 4) {
    TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous(), "mins: as scales");
    m = mins.data_ptr<float>();
  }
  pybind11::gil_scoped_release no_gil;  // the service's event loop runs meanwhile
  if (bits == 4)
    quantized_matmul_kernel<4>(x.data_ptr<float>(), weights.data_ptr<uint8_t>(),
                               scales.data_ptr<float>(), m, out.data_ptr<float>(), M, N, K);
  else
    quantized_matmul_kernel<8>(x.data_ptr<float>(), weights.data_ptr<uint8_t>(),
                               scales.data_ptr<float>(), m, out.data_ptr<float>(), M, N, K);
  return out;
}
