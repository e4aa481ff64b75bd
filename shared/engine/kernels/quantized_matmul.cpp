// Weight-only quantized matmul (CPU): y = x @ W^T with W stored in blocks of 32 weights along
// the input dimension, each block with its own scale (and, for 4 bits, its own minimum).
//
//   int8: w = d * q, q in [-127, 127]            (GGUF Q8_0)
//   int4: w = d * q + m, q in [0, 15]            (GGUF Q4_1; Q4_0 is m = -8 d)
//
// int4 weights are packed as GGUF packs them: byte j of a block holds weight j in its low
// nibble and weight j + 16 in its high one. Decode is bound by reading the weights, so each
// block is unpacked to floats in registers and multiplied into up to R_MAX rows of x at once;
// the activations stay float. Work is split over output columns.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace {

constexpr int64_t QK = 32;  // weights per block

using namespace ds;
// rows of x a pass: AVX-512 keeps 8 accumulators and 2 weight registers of its 32, AVX2 4 and
// 4 of its 16 (and the x loads)
constexpr int R_MAX = W == 16 ? 8 : 4;
constexpr int NV = QK / W;  // registers a block

// One block's 32 weights as floats, in registers (compilers do not vectorise the nibble
// split well: 3x slower than the loads it feeds, so the vector builds widen bytes themselves).
template <int BITS>
inline void unpack(const uint8_t* __restrict__ block, float d, float m, V* w) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  if constexpr (BITS == 4) {
    const __m128i low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    w[0] = vfma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vset(d), vset(m));
    w[1] = vfma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vset(d), vset(m));
  } else {
    const __m128i next = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16));
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), vset(d));
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(next)), vset(d));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (BITS == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    const __m128i low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = vfma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vset(d), vset(m));
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * i)))), vset(d));
  }
#else
  for (int j = 0; j < QK; ++j) {
    const float q = BITS == 4 ? float(j < 16 ? block[j] & 15 : block[j - 16] >> 4)
                              : float(reinterpret_cast<const int8_t*>(block)[j]);
    w[j] = q * d + m;
  }
#endif
}

// R rows of x times one column of W. A single row keeps one accumulator per register of the
// block (independent FMA chains); several rows are independent chains already.
template <int BITS, int R>
inline void column(const float* __restrict__ x, int64_t K, const uint8_t* __restrict__ row,
                   const float* __restrict__ d, const float* __restrict__ m, float* __restrict__ out,
                   int64_t N) {
  constexpr int A = R == 1 ? NV : 1;
  V acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = vzero();
  const int64_t blocks = K / QK;
  for (int64_t b = 0; b < blocks; ++b) {
    V w[NV];
    unpack<BITS>(row + b * QK * BITS / 8, d[b], m ? m[b] : 0.0f, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * QK;
      for (int i = 0; i < NV; ++i) acc[r][i % A] = vfma(w[i], vload(xr + i * W), acc[r][i % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    V total = acc[r][0];
    for (int a = 1; a < A; ++a) total = vadd(total, acc[r][a]);
    out[r * N] = vsum(total);
  }
}

template <int BITS, int R>
void rows_remaining(const float* x, int64_t K, const uint8_t* row, const float* d,
                    const float* m, float* out, int64_t N, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return column<BITS, R>(x, K, row, d, m, out, N);
    rows_remaining<BITS, R - 1>(x, K, row, d, m, out, N, rows);
  }
}

template <int BITS>
void quantized_matmul_kernel(const float* __restrict__ x, const uint8_t* __restrict__ qweight,
                             const float* __restrict__ scales, const float* __restrict__ mins,
                             float* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = K / QK, row_bytes = blocks * QK * BITS / 8;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = qweight + n * row_bytes;
      const float* d = scales + n * blocks;
      const float* m = mins ? mins + n * blocks : nullptr;
      int64_t m0 = 0;
      for (; m0 + R_MAX <= M; m0 += R_MAX)
        column<BITS, R_MAX>(x + m0 * K, K, row, d, m, out + m0 * N + n, N);
      if (m0 < M)
        rows_remaining<BITS, R_MAX - 1>(x + m0 * K, K, row, d, m, out + m0 * N + n, N, M - m0);
    }
  });
}

}  // namespace

// x [M, K] float32; qweight uint8 [N, K * bits / 8]; scales [N, K / 32] float32; mins the same
// shape for 4 bits (empty for 8). Returns [M, N] float32.
torch::Tensor quantized_matmul(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                               torch::Tensor mins, int64_t bits) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x: float32 on the CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % QK == 0 && qweight.size(1) * 8 == K * bits, "qweight does not match x");
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == N && scales.size(1) == K / QK,
              "scales: [N, K / 32]");
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kByte, "qweight: uint8");
  auto out = torch::empty({M, N}, x.options());
  const float* m = nullptr;
  if (bits == 4) {
    TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous(), "mins: [N, K / 32]");
    m = mins.data_ptr<float>();
  }
  pybind11::gil_scoped_release no_gil;  // the service's event loop runs meanwhile
  if (bits == 4)
    quantized_matmul_kernel<4>(x.data_ptr<float>(), qweight.data_ptr<uint8_t>(),
                               scales.data_ptr<float>(), m, out.data_ptr<float>(), M, N, K);
  else
    quantized_matmul_kernel<8>(x.data_ptr<float>(), qweight.data_ptr<uint8_t>(),
                               scales.data_ptr<float>(), m, out.data_ptr<float>(), M, N, K);
  return out;
}
