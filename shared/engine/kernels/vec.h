// The float vector the build targets, for the CPU kernels: W floats a register (AVX-512: 16,
// AVX2 + FMA: 8). DS_VEC is defined where there is one; other targets use plain loops and let
// the compiler vectorise them.
#ifndef DS_VEC_H
#define DS_VEC_H

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DS_VEC 1
namespace ds {
using V = __m512;
constexpr int W = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline float vmaxall(V a) { return _mm512_reduce_max_ps(a); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vround(V a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V vscale2(V a, V n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, n whole
}  // namespace ds
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DS_VEC 1
namespace ds {
using V = __m256;
constexpr int W = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline float vmaxall(V a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vround(V a) {
  return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V vscale2(V a, V n) {  // a * 2^n, n whole: n + 127 as a float's exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
}  // namespace ds
#else
#include <cmath>
namespace ds {
using V = float;
constexpr int W = 1;
inline V vzero() { return 0.0f; }
inline V vset(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V a) { *p = a; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline V vadd(V a, V b) { return a + b; }
inline float vsum(V a) { return a; }
inline V vsub(V a, V b) { return a - b; }
inline V vmax(V a, V b) { return a > b ? a : b; }
inline float vmaxall(V a) { return a; }
inline V vmul(V a, V b) { return a * b; }
inline V vdiv(V a, V b) { return a / b; }
inline V vexp(V x) { return std::exp(x); }
}  // namespace ds
#endif

#if defined(DS_VEC)
namespace ds {
// e^x to float precision: Cephes' polynomial on r = x - n ln 2, scaled by 2^n. x is clamped
// so 2^n stays a float; min and max return their second operand on a NaN, so it goes through.
inline V vexp(V x) {
  x = vmax(vset(-87.33f), vmin(vset(88.37f), x));
  const V n = vround(vmul(x, vset(1.44269504f)));
  V r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  V p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  return vscale2(vadd(vfma(p, vmul(r, r), r), vset(1.0f)), n);
}
}  // namespace ds
#endif
namespace ds {
// The tasks [begin, end) of n that thread t of T runs, split as at::parallel_for splits them
// (fewer than `grain` tasks: the first thread runs them all): for a kernel that runs its
// phases in one parallel region, a barrier between them, instead of a region a phase.
struct Share {
  int64_t begin, end;
};
inline Share share(int64_t n, int64_t grain, int t, int T) {
  const int64_t used = n < grain ? 1 : std::min<int64_t>(T, (n + grain - 1) / grain);
  const int64_t chunk = (n + used - 1) / used;
  const int64_t begin = std::min(n, t * chunk);
  return {begin, t < used ? std::min(n, begin + chunk) : begin};
}

// The largest of n floats (-inf for none).
inline float row_max(const float* x, int64_t n) {
  float peak = -INFINITY;
  int64_t i = 0;
#if defined(DS_VEC)
  V peaks = vset(-INFINITY);
  for (; i + W <= n; i += W) peaks = vmax(peaks, vload(x + i));
  peak = vmaxall(peaks);
#endif
  for (; i < n; ++i) peak = std::max(peak, x[i]);
  return peak;
}
}  // namespace ds
#endif  // DS_VEC_H
