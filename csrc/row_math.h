// Row-wise math shared by the CPU kernels: a branch-free, auto-vectorisable expf and helpers.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// Compiled twice (AVX2+FMA and baseline x86-64), chosen at load time by the CPU (gcc ifunc).
#define FEDFAST_MULTIVERSION __attribute__((target_clones("avx2,fma", "default")))
#else
#define FEDFAST_MULTIVERSION
#endif

namespace fedfast {

// exp(x) for x <= 0 (all callers subtract the row max first). Cephes-style range reduction
// x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial; ~1 ulp. exp(x) = 0 for x < -87.3 (incl. -inf).
__attribute__((always_inline)) static inline float fexp(float x) {
  const float lo = -87.3f;
  float xc = x < lo ? lo : x;  // NaN propagates through the polynomial
  xc = xc > 88.0f ? 88.0f : xc;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  // 2^n from the integer in t's low mantissa bits (bit casts, not memcpy: keeps the loop vectorisable)
  const int32_t bits = (__builtin_bit_cast(int32_t, t) - 0x4B400000 + 127) << 23;
  const float res = e * __builtin_bit_cast(float, bits);
  return x < lo ? 0.0f : res;
}
static inline double fexp(double x) { return std::exp(x); }

template <typename A>
inline A neg_inf() { return -std::numeric_limits<A>::infinity(); }

// Row sum: vectorised (omp simd) partial sums in the element type within blocks of 512 elements, blocks
// accumulated in fp64; each SIMD lane adds at most 64 terms, so fp32 rows of C = 32000 sum to ~1e-7.
template <typename A>
__attribute__((always_inline)) inline double dsum(const A* __restrict x, int64_t n) {
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 512) {
    const int64_t j1 = n < j0 + 512 ? n : j0 + 512;
    A acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = j0; j < j1; ++j) acc += x[j];
    total += acc;
  }
  return total;
}

}  // namespace fedfast
