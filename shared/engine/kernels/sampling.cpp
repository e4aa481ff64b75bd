// Drawing tokens from the logits (CPU, float32): each row's softmax(logits / t) sampled at one
// uniform draw by the inverse of its cumulative distribution, in two passes over the row and
// no copy of it. torch took ~0.25 ms a row of a 49k vocabulary in its own operators (the
// shift, the scaling, exp, cumsum, searchsorted; torch.multinomial ~1 ms); a step at batch 32
// of requests at the API's default temperature of 1 spent 8-39 ms on it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace ds;

constexpr int64_t SPAN = 64;  // weights summed a span at a time; the draw then walks one span

// A token's weight e^((x - peak) / t); 0 for -inf, a token top_k or top_p took out.
inline float token_weight(float x, float peak, float t) {
  return x == -INFINITY ? 0.0f : std::exp((x - peak) / t);
}

int64_t draw_row(const float* x, int64_t n, float t, double u, std::vector<float>& spans) {
  float peak = -INFINITY;
  int64_t i = 0;
#if defined(DS_VEC)
  V peaks = vset(-INFINITY);
  for (; i + W <= n; i += W) peaks = vmax(peaks, vload(x + i));
  peak = vmaxall(peaks);
#endif
  for (; i < n; ++i) peak = std::max(peak, x[i]);
  const int64_t count = (n + SPAN - 1) / SPAN;
  spans.resize(count);
  double total = 0.0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t end = std::min(n, (s + 1) * SPAN);
    float sum = 0.0f;
    i = s * SPAN;
#if defined(DS_VEC)
    V acc = vzero();  // -inf comes out of vexp as ~1e-38: nothing next to the peak's 1
    for (; i + W <= end; i += W)
      acc = vadd(acc, vexp(vdiv(vsub(vload(x + i), vset(peak)), vset(t))));
    sum = vsum(acc);
#endif
    for (; i < end; ++i) sum += token_weight(x[i], peak, t);
    spans[s] = sum;
    total += sum;
  }
  const double target = u * total;
  double passed = 0.0;
  int64_t s = 0;
  for (; s + 1 < count && passed + spans[s] <= target; ++s) passed += spans[s];
  const int64_t begin = s * SPAN, end = std::min(n, begin + SPAN);
  int64_t last = -1;
  for (i = begin; i < end; ++i) {
    const float w = token_weight(x[i], peak, t);
    if (w <= 0.0f) continue;
    last = i;
    passed += w;
    if (passed > target) return i;
  }
  if (last >= 0) return last;  // rounding between the two passes left the draw past its span
  for (i = begin - 1; i >= 0; --i)  // a span of tokens taken out only: the nearest one kept
    if (x[i] != -INFINITY) return i;
  for (i = end; i < n; ++i)
    if (x[i] != -INFINITY) return i;
  return 0;
}

}  // namespace

// logits [B, V] float32 (rows may be strided); rows [n] int64: the rows to draw from;
// temperatures [n] float32 (> 0); uniforms [n] float64 in [0, 1). Returns the n tokens drawn
// (int64): each row's e^((x - max) / t), normalised, sampled at its uniform. A token at -inf
// has weight 0 and is never drawn.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor temperatures,
                          torch::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits: float32 [B, V] on the CPU, each row contiguous");
  const int64_t n = rows.numel(), V = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows: int64");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == n, "temperatures: float32 [n]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() &&
                  uniforms.numel() == n, "uniforms: float64 [n]");
  TORCH_CHECK(V > 0, "an empty vocabulary");
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* t = temperatures.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0), "row ", row[r], " outside the logits");
    TORCH_CHECK(t[r] > 0.0f, "temperature ", t[r], ": greedy rows take the argmax instead");
    TORCH_CHECK(u[r] >= 0.0 && u[r] < 1.0, "uniform ", u[r], " outside [0, 1)");
  }
  auto out = torch::empty({n}, rows.options());
  int64_t* tokens = out.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> spans;
    for (int64_t r = begin; r < end; ++r)
      tokens[r] = draw_row(base + row[r] * stride, V, t[r], u[r], spans);
  });
  return out;
}
