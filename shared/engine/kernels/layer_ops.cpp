// A layer's small operations in one call each (CPU, float32): RMSNorm, SiLU(gate) * up, RoPE.
// Torch runs each as 4-8 operators of its own (a decode step at batch 1 spent ~40 us a layer
// on them, mostly dispatch, against a few us of arithmetic).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

using namespace ds;

// rows per task: small batches stay on the calling thread (a task costs more than its work)
constexpr int64_t ROWS_A_TASK = 16;

void check_rows(const at::Tensor& x, int64_t width, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, ": float32 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == width && x.stride(1) == 1, name,
              ": rows of ", width, " contiguous floats");
}

// x [T, H] (rows `stride` apart) -> out [T, H]: x / sqrt(mean(x^2) + eps) * weight, rows
// [begin, end) on the calling thread.
void rms_norm_range(const float* in, int64_t stride, const float* w, float* o, int64_t begin,
                    int64_t end, int64_t H, float eps) {
  for (int64_t t = begin; t < end; ++t) {
    const float* row = in + t * stride;
    V acc = vzero();
    int64_t j = 0;
    for (; j + W <= H; j += W) acc = vfma(vload(row + j), vload(row + j), acc);
    float squares = vsum(acc);
    for (; j < H; ++j) squares += row[j] * row[j];
    const float inv = 1.0f / std::sqrt(squares / float(H) + eps);
    float* dst = o + t * H;
    j = 0;
    for (; j + W <= H; j += W)
      vstore(dst + j, vmul(vmul(vload(row + j), vset(inv)), vload(w + j)));
    for (; j < H; ++j) dst[j] = row[j] * inv * w[j];
  }
}

void rms_norm_rows(const float* in, int64_t stride, const float* w, float* o, int64_t T,
                   int64_t H, float eps) {
  at::parallel_for(0, T, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    rms_norm_range(in, stride, w, o, begin, end, H, eps);
  });
}

// gate_up [T, 2I] (gate, then up; rows `stride` apart) -> out [T, I]: silu(gate) * up, rows
// [begin, end) on the calling thread.
void silu_mul_range(const float* in, int64_t stride, float* o, int64_t begin, int64_t end,
                    int64_t I) {
  for (int64_t t = begin; t < end; ++t) {
    const float *gate = in + t * stride, *up = gate + I;
    float* dst = o + t * I;
    int64_t j = 0;
#if defined(DS_VEC)
    for (; j + W <= I; j += W) {
      const V g = vload(gate + j);
      const V e = vexp(vsub(vzero(), g));
      vstore(dst + j, vdiv(vmul(g, vload(up + j)), vadd(vset(1.0f), e)));
    }
#endif
    for (; j < I; ++j) dst[j] = gate[j] * up[j] / (1.0f + std::exp(-gate[j]));
  }
}

void silu_mul_rows(const float* in, int64_t stride, float* o, int64_t T, int64_t I) {
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    silu_mul_range(in, stride, o, begin, end, I);
  });
}

// RoPE in place on rows [begin, end) (`stride` apart) of `heads` heads of D floats, at
// positions `p` of cos/sin tables [P, D] whose halves repeat, on the calling thread.
void rope_range(float* base, int64_t stride, int64_t begin, int64_t end, int64_t heads,
                int64_t D, const float* c, const float* s, const int64_t* p) {
  const int64_t half = D / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float *ct = c + p[t] * D, *st = s + p[t] * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = base + t * stride + h * D;
      float* b = a + half;
      int64_t i = 0;
#if defined(DS_VEC)
      for (; i + W <= half; i += W) {
        const V va = vload(a + i), vb = vload(b + i);
        vstore(a + i, vsub(vmul(va, vload(ct + i)), vmul(vb, vload(st + i))));
        vstore(b + i, vadd(vmul(vb, vload(ct + half + i)), vmul(va, vload(st + half + i))));
      }
#endif
      for (; i < half; ++i) {
        const float va = a[i], vb = b[i];
        a[i] = va * ct[i] - vb * st[i];
        b[i] = vb * ct[half + i] + va * st[half + i];
      }
    }
  }
}

void rope_rows(float* base, int64_t stride, int64_t T, int64_t heads, int64_t D,
               const float* c, const float* s, const int64_t* p) {
  at::parallel_for(0, T, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    rope_range(base, stride, begin, end, heads, D, c, s, p);
  });
}

}  // namespace

// x [T, H] -> x / sqrt(mean(x^2) + eps) * weight, row by row.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  const int64_t H = weight.size(0);
  check_rows(x, H, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat, "weight: float32");
  auto out = at::empty({x.size(0), H}, x.options());
  pybind11::gil_scoped_release no_gil;
  rms_norm_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                out.data_ptr<float>(), x.size(0), H, float(eps));
  return out;
}

// gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I].
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: [T, 2I]");
  const int64_t I = gate_up.size(1) / 2;
  check_rows(gate_up, 2 * I, "gate_up");
  auto out = at::empty({gate_up.size(0), I}, gate_up.options());
  pybind11::gil_scoped_release no_gil;
  silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(),
                gate_up.size(0), I);
  return out;
}

// RoPE in place on x [T, heads, D] (each head's D floats contiguous; rows may be strided, as
// a view of the fused QKV output is), at `positions` [T] of cos/sin tables [P, D] whose
// halves repeat: x_i <- x_i cos_i - x_{i+D/2} sin_i, x_{i+D/2} <- x_{i+D/2} cos_i + x_i sin_i.
void rope(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor positions) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3,
              "x: float32 [T, heads, D] on the CPU");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == D && D % 2 == 0, "x: heads of D floats");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat, "cos, sin: [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T, "positions: [T]");
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "position ", p[t], " past the RoPE tables");
  pybind11::gil_scoped_release no_gil;
  rope_rows(x.data_ptr<float>(), x.stride(0), T, heads, D, cos.data_ptr<float>(),
            sin.data_ptr<float>(), p);
}
