// Row-wise math shared by the CPU kernels: a branch-free, auto-vectorisable expf and helpers.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// Compiled twice (AVX2+FMA and baseline x86-64), chosen at load time by the CPU (gcc ifunc).
#define FEDFAST_MULTIVERSION __attribute__((target_clones("avx2,fma", "default")))
// Kernels whose loops run across 16 rows (one AVX-512 vector of floats): an x86-64-v4 clone as well.
#define FEDFAST_MULTIVERSION_WIDE __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FEDFAST_MULTIVERSION
#define FEDFAST_MULTIVERSION_WIDE
#endif

namespace fedfast {

// exp(x) for x <= 0 (all callers subtract the row max first), as (1 + em1) * 2^n: Cephes-style range reduction
// x = n ln2 + r, |r| <= ln2/2, em1 = expm1(r) from a degree-6 polynomial; ~1 ulp.
struct ExpParts {
  float em1, n, scale;  // expm1(r), n, 2^n
};
__attribute__((always_inline)) static inline ExpParts fexp_parts(float x) {
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
  // 2^n from the integer in t's low mantissa bits (bit casts, not memcpy: keeps the loop vectorisable)
  const int32_t bits = (__builtin_bit_cast(int32_t, t) - 0x4B400000 + 127) << 23;
  return {p * r * r + r, n, __builtin_bit_cast(float, bits)};
}

// exp(x); 0 for x < -87.3 (incl. -inf).
__attribute__((always_inline)) static inline float fexp(float x) {
  const ExpParts e = fexp_parts(x);
  return x < -87.3f ? 0.0f : (e.em1 + 1.0f) * e.scale;
}
static inline double fexp(double x) { return std::exp(x); }

// expm1(x) for x <= 0: where |x| < ln2/2 (n = 0) the polynomial's em1 itself, to ~1 ulp of the result, where
// exp(x) - 1 would lose digits to cancellation; exp(x) - 1 elsewhere (no cancellation past ln2/2); -1 for x < -87.3
// (incl. -inf), NaN for NaN. The KL's row constant log(st / sq) = log1p((dt - dq) / (C + dq)) is formed from these
// sums (distill_reference._log_ratio): near-uniform rows at a large temperature keep their digits.
__attribute__((always_inline)) static inline float fexpm1(float x) {
  const ExpParts e = fexp_parts(x);
  return x < -87.3f ? -1.0f : (e.n == 0.0f ? e.em1 : (e.em1 + 1.0f) * e.scale - 1.0f);
}
static inline double fexpm1(double x) { return std::expm1(x); }

// exp(x) and expm1(x) from one polynomial evaluation (the KL's passes need both).
__attribute__((always_inline)) static inline float fexp_m1(float x, float* em1_out) {
  const ExpParts e = fexp_parts(x);
  const float ex = x < -87.3f ? 0.0f : (e.em1 + 1.0f) * e.scale;
  *em1_out = x < -87.3f ? -1.0f : (e.n == 0.0f ? e.em1 : ex - 1.0f);
  return ex;
}
static inline double fexp_m1(double x, double* em1_out) {
  *em1_out = std::expm1(x);
  return std::exp(x);
}

// log(x) for finite x > 0 (normal), branch-free and auto-vectorisable (Cephes logf: x = 2^e m, m in
// [sqrt(1/2), sqrt(2)), degree-8 polynomial in m - 1; ~1 ulp); NaN for NaN (a row sum over a NaN or +inf logit).
// Callers select away x = 0 themselves.
__attribute__((always_inline)) static inline float flog(float x) {
  const int32_t bits = __builtin_bit_cast(int32_t, x);
  float e = static_cast<float>(((bits >> 23) & 0xff) - 127);
  const float m = __builtin_bit_cast(float, (bits & 0x007fffff) | 0x3f800000);  // [1, 2)
  const bool big = m >= 1.41421356237f;
  const float f = big ? m * 0.5f - 1.0f : m - 1.0f;
  e = big ? e + 1.0f : e;
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  const float res = (f + y) + 0.693359375f * e;
  return x == x ? res : x;
}
static inline double flog(double x) { return std::log(x); }

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

// Row sum in fp64 throughout (each term widened): for sums that cancel, such as the KL's expm1 sums and its terms
// (dsum's fp32 partials cost 1e-4 of the KL at tau = 1000).
template <typename A>
__attribute__((always_inline)) inline double dsum64(const A* __restrict x, int64_t n) {
  double acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(x[j]);
  return acc;
}

// E = exp(X - m) with m = max(X) (written to *m; 0 and E = 0 for an all -inf row); returns sum(E) in fp64.
template <typename A>
__attribute__((always_inline)) inline double row_exp(int64_t C, const A* __restrict X, A* __restrict E, A* m_out) {
  A m = neg_inf<A>();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < C; ++j) m = X[j] > m ? X[j] : m;
  m = m == neg_inf<A>() ? A(0) : m;
  for (int64_t j = 0; j < C; ++j) E[j] = fexp(X[j] - m);
  *m_out = m;
  return dsum(E, C);
}

// The narrow kernels' row sums: L-wide vector adds in the element type over chunks of kLaneSumChunk classes, each
// chunk's partial folded into fp64 (as dsum does along a row).
constexpr int64_t kLaneSumChunk = 32;

// Rows laid out [C][L]: acc[l] += sum_j X[j * L + l], every term widened to fp64 (see dsum64).
template <int64_t L, typename A>
__attribute__((always_inline)) inline void lane_sums64(int64_t C, const A* __restrict X, double* __restrict acc) {
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) acc[l] += static_cast<double>(X[j * L + l]);
}

// Rows laid out [C][L] (column l of row j at j * L + l): acc[l] += sum_j X[j * L + l].
template <int64_t L, typename A>
__attribute__((always_inline)) inline void lane_sums(int64_t C, const A* __restrict X, double* __restrict acc) {
  alignas(64) A part[L];
  for (int64_t j0 = 0; j0 < C; j0 += kLaneSumChunk) {
    for (int64_t l = 0; l < L; ++l) part[l] = 0;
    for (int64_t j = j0, j1 = C < j0 + kLaneSumChunk ? C : j0 + kLaneSumChunk; j < j1; ++j)
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) part[l] += X[j * L + l];
    for (int64_t l = 0; l < L; ++l) acc[l] += part[l];
  }
}

// Adds w * softmax(X) into P (X = t/tau, X[y] = -inf when masked); returns w * sum p log p (FedGKD-VOTE's teacher
// mixture, fedfast/ops/teacher_mixture.py). Elementwise maps (vectorised) + dsum row sums; E, U are scratch.
template <typename A>
__attribute__((always_inline)) inline A mix_core(int64_t C, A* __restrict X, A* __restrict E, A* __restrict P,
                                                 A* __restrict U, A w) {
  A m;
  const double s = row_exp(C, X, E, &m);
  if (s == 0) return A(0);  // every class excluded; a NaN s (a NaN or +inf logit) makes this row's P and negent NaN
  const A inv = A(1 / s), ls = A(std::log(s));  // log p = (x - m) - log s (no m + log s cancellation)
  for (int64_t j = 0; j < C; ++j) {
    const A p = E[j] * inv;
    U[j] = p != 0 ? p * ((X[j] - m) - ls) : A(0);
    P[j] += w * p;
  }
  return w * A(dsum(U, C));
}

// Sum of (x_j - g_j)^2 over len values: sixteen float lanes per block of 512 values (each lane adds 32 squares:
// relative error ~1e-6), the blocks summed in double, so a P of millions keeps float rounding out of a norm while the
// loop runs near memory speed. Pointers by value (restrict): it vectorises (with setup.py's -fno-wrapv).
template <typename X>
double sq_dist(const X* __restrict xr, const float* __restrict g, int64_t len) {
  constexpr int64_t kBlock = 512;
  double total = 0.0;
  for (int64_t b = 0; b < len; b += kBlock) {
    const int64_t e = b + kBlock < len ? b + kBlock : len;
    float acc[16] = {0};
    int64_t j = b;
    for (; j + 16 <= e; j += 16)
      for (int i = 0; i < 16; ++i) {
        const float d = static_cast<float>(xr[j + i]) - g[j + i];
        acc[i] += d * d;
      }
    float part = 0.f;
    for (; j < e; ++j) {
      const float d = static_cast<float>(xr[j]) - g[j];
      part += d * d;
    }
    double block = part;
    for (int i = 0; i < 16; ++i) block += acc[i];
    total += block;
  }
  return total;
}

}  // namespace fedfast
