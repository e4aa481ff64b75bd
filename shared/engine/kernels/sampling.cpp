// Drawing tokens from the logits (CPU, float32): each row's softmax(logits / t) sampled at one
// uniform draw by the inverse of its cumulative distribution, in two passes over the row and
// no copy of it. torch took ~0.25 ms a row of a 49k vocabulary in its own operators (the
// shift, the scaling, exp, cumsum, searchsorted; torch.multinomial ~1 ms); a step at batch 32
// of requests at the API's default temperature of 1 spent 8-39 ms on it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using namespace ds;

constexpr int64_t SPAN = 64;  // weights summed a span at a time; the draw then walks one span
constexpr int64_t CANDIDATES = 256;  // where top_p looks for its nucleus first

// A token's weight e^((x - peak) / t); 0 for -inf, a token top_k or top_p took out.
inline float token_weight(float x, float peak, float t) {
  return x == -INFINITY ? 0.0f : std::exp((x - peak) / t);
}

struct Scratch {
  std::vector<float> spans, weights;
  std::vector<std::pair<float, int64_t>> candidates;
};

// The row's weights summed SPAN tokens at a time into `spans`; returns their total.
double span_sums(const float* x, int64_t n, float peak, float t, std::vector<float>& spans) {
  const int64_t count = (n + SPAN - 1) / SPAN;
  spans.resize(count);
  double total = 0.0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t end = std::min(n, (s + 1) * SPAN);
    float sum = 0.0f;
    int64_t i = s * SPAN;
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
  return total;
}

// The whole row at `u`: the span the draw falls in, then its tokens one by one.
int64_t draw_all(const float* x, int64_t n, float peak, float t, double u,
                 std::vector<float>& spans) {
  const int64_t count = (n + SPAN - 1) / SPAN;
  const double target = u * span_sums(x, n, peak, t, spans);
  double passed = 0.0;
  int64_t s = 0;
  for (; s + 1 < count && passed + spans[s] <= target; ++s) passed += spans[s];
  const int64_t begin = s * SPAN, end = std::min(n, begin + SPAN);
  int64_t last = -1, i = begin;
  for (; i < end; ++i) {
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

// The `want` likeliest tokens, likeliest first (ties: the lower id first).
void likeliest(const float* x, int64_t n, int64_t want,
               std::vector<std::pair<float, int64_t>>& out) {
  // a comes before b: likelier, or as likely with a lower id (a heap by it keeps the last
  // of the best so far on top)
  auto before = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  out.clear();
  if (want * 4 >= n) {  // most of the row: sorting it beats a heap that keeps changing
    for (int64_t i = 0; i < n; ++i) out.emplace_back(x[i], i);
    std::partial_sort(out.begin(), out.begin() + want, out.end(), before);
    out.resize(want);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (int64_t(out.size()) < want) {
      out.emplace_back(x[i], i);
      std::push_heap(out.begin(), out.end(), before);
    } else if (x[i] > out.front().first) {
      std::pop_heap(out.begin(), out.end(), before);
      out.back() = {x[i], i};
      std::push_heap(out.begin(), out.end(), before);
    }
  }
  std::sort_heap(out.begin(), out.end(), before);  // the likeliest first
}

// A row cut by top_k (k > 0) and top_p (p < 1), as the torch path cuts it: the k likeliest
// tokens, then the smallest likeliest prefix of them whose mass (of what top_k left) reaches
// p, the top token always. The prefix is looked for among the CANDIDATES likeliest tokens
// first, and among 8 times as many each time it reaches past those.
int64_t draw_cut(const float* x, int64_t n, float peak, float t, int64_t k, double p, double u,
                 Scratch& s) {
  int64_t want = k > 0 ? std::min(k, n) : std::min(CANDIDATES, n);
  double total = k > 0 ? 0.0 : span_sums(x, n, peak, t, s.spans);
  int64_t keep = 0;
  for (;;) {
    likeliest(x, n, want, s.candidates);
    s.weights.resize(want);
    for (int64_t j = 0; j < want; ++j) {
      s.weights[j] = token_weight(s.candidates[j].first, peak, t);
      if (k > 0) total += s.weights[j];
    }
    keep = want;
    if (p < 1.0) {
      double before = 0.0;
      keep = 0;
      while (keep < want && before < p * total) before += s.weights[keep++];
      keep = std::max<int64_t>(keep, 1);
      if (keep == want && want < n && k <= 0 && before < p * total) {
        want = std::min(n, want * 8);  // the nucleus reaches past the candidates: more
        continue;
      }
    }
    break;
  }
  double kept = 0.0;
  for (int64_t j = 0; j < keep; ++j) kept += s.weights[j];
  const double target = u * kept;
  double passed = 0.0;
  for (int64_t j = 0; j < keep; ++j) {
    passed += s.weights[j];
    if (passed > target && s.weights[j] > 0.0f) return s.candidates[j].second;
  }
  for (int64_t j = keep - 1; j > 0; --j)  // rounding: the last kept token that has weight
    if (s.weights[j] > 0.0f) return s.candidates[j].second;
  return s.candidates[0].second;
}

}  // namespace

// logits [B, V] float32 (rows may be strided); rows [n] int64: the rows to draw from;
// temperatures [n] float32 (> 0); top_ks [n] int64 (<= 0: none); top_ps [n] float64 (1: none);
// uniforms [n] float64 in [0, 1). Returns the n tokens drawn (int64): each row's
// e^((x - max) / t) over the tokens top_k and top_p leave, normalised, sampled at its uniform.
// A token at -inf has weight 0 and is never drawn.
at::Tensor sample_rows(at::Tensor logits, at::Tensor rows, at::Tensor temperatures,
                       at::Tensor top_ks, at::Tensor top_ps, at::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits: float32 [B, V] on the CPU, each row contiguous");
  const int64_t n = rows.numel(), V = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows: int64");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == n, "temperatures: float32 [n]");
  TORCH_CHECK(top_ks.scalar_type() == at::kLong && top_ks.is_contiguous() &&
                  top_ks.numel() == n, "top_ks: int64 [n]");
  for (const auto* d : {&top_ps, &uniforms})
    TORCH_CHECK(d->scalar_type() == at::kDouble && d->is_contiguous() && d->numel() == n,
                "top_ps, uniforms: float64 [n]");
  TORCH_CHECK(V > 0, "an empty vocabulary");
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* t = temperatures.data_ptr<float>();
  const int64_t* k = top_ks.data_ptr<int64_t>();
  const double *p = top_ps.data_ptr<double>(), *u = uniforms.data_ptr<double>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0), "row ", row[r], " outside the logits");
    TORCH_CHECK(t[r] > 0.0f, "temperature ", t[r], ": greedy rows take the argmax instead");
    TORCH_CHECK(p[r] >= 0.0 && p[r] <= 1.0, "top_p ", p[r], " outside [0, 1]");
    TORCH_CHECK(u[r] >= 0.0 && u[r] < 1.0, "uniform ", u[r], " outside [0, 1)");
  }
  auto out = at::empty({n}, rows.options());
  int64_t* tokens = out.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = base + row[r] * stride;
      const float peak = ds::row_max(x, V);
      const bool cut = (k[r] > 0 && k[r] < V) || p[r] < 1.0;
      tokens[r] = cut ? draw_cut(x, V, peak, t[r], k[r] < V ? k[r] : 0, p[r], u[r], scratch)
                      : draw_all(x, V, peak, t[r], u[r], scratch.spans);
    }
  });
  return out;
}

// logits [B, V] float32 (rows may be strided), written in place; rows [n] int64; bits [n, W]
// int32: row r's allowed tokens, bit j of word w token 32 w + j (llguidance's and xgrammar's
// layout). Sets each row's disallowed tokens, and those past 32 W, to -inf. A word of all
// ones (a string's content: most tokens allowed) is skipped in one test, and a word of none
// is 32 stores: a step's masks cost about a pass over the rows' logits, not a boolean
// tensor's several.
void mask_rows(at::Tensor logits, at::Tensor rows, at::Tensor bits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits: float32 [B, V] on the CPU, each row contiguous");
  const int64_t n = rows.numel(), V = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows: int64");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.dim() == 2 && bits.size(0) == n &&
                  bits.is_contiguous(), "bits: int32 [n, W]");
  const int64_t W = bits.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0), "row ", row[r], " outside the logits");
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = base + row[r] * stride;
      const uint32_t* word = words + r * W;
      const int64_t covered = std::min(V, 32 * W);
      for (int64_t w = 0; 32 * w < covered; ++w) {
        const uint32_t allowed = word[w];
        if (allowed == 0xFFFFFFFFu) continue;
        const int64_t last = std::min<int64_t>(32, covered - 32 * w);
        float* at_w = x + 32 * w;
        for (int64_t j = 0; j < last; ++j)
          if (!((allowed >> j) & 1u)) at_w[j] = -INFINITY;
      }
      for (int64_t v = covered; v < V; ++v) x[v] = -INFINITY;
    }
  });
}
