// The float vector the build targets, for the CPU kernels: W floats a register (AVX-512: 16,
// AVX2 + FMA: 8). DS_VEC is defined where there is one; other targets use plain loops and let
// the compiler vectorise them.
#ifndef DS_VEC_H
#define DS_VEC_H

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
}  // namespace ds
#else
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
}  // namespace ds
#endif
#endif  // DS_VEC_H
