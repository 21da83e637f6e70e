// Transcendental functions for the CPU kernels' vectorised loops. glibc's expf is a library call
// that gcc leaves scalar (it only uses libmvec under -ffast-math), so a loop over std::exp runs
// one element at a time; these are plain fp32 arithmetic that gcc turns into AVX2 / AVX-512 code
// under `#pragma omp simd`. They need -fno-trapping-math (setup.py): without it gcc may not
// if-convert the clamps below inside a loop that also stores ("control flow in loop").
#pragma once

#include <cmath>
#include <cstdint>

#include "low_precision.h"

// On a function: vectorise its loops 512 bits wide where the CPU has AVX-512. gcc's
// -march=native for those CPUs prefers 256-bit vectors (prefer-vector-width=256, against the
// frequency drop of older Xeons), which halves the work per instruction of a loop that is
// arithmetic, not memory: the fused loss's row pass ran 1.25x faster 512 bits wide on the AMX Xeon,
// the bf16 SwiGLU / GeGLU forward + backward about 1.1x; the attention's softmax rows (a few
// hundred keys) no faster, so they do not take it (BENCHMARKS.md, 2026-12-07, third session).
// Without AVX-512 the attribute changes nothing; other compilers and targets get none.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FASTLLM_WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))
#else
#define FASTLLM_WIDE_VECTORS
#endif

namespace fastllm {
namespace vec_math {

// e^x: Cephes' expf (Stephen Moshier, netlib.org/cephes): x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial for e^r, 2^n from the exponent bits. Relative error about 2 ulp over the
// normal range; arguments below -87.3 give ~1e-38 instead of 0, above 88.7 give ~3.4e38.
__attribute__((always_inline)) inline float exp_fast(float x) {
  // ternaries, not std::fmin/fmax: those are library calls (NaN rules) that stop vectorisation
  x = x < -87.3365f ? -87.3365f : (x > 88.7228f ? 88.7228f : x);
  // round to nearest by adding and removing 1.5 * 2^23 (std::floor would have to keep "inexact")
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return p * lowp::bits_to_float(static_cast<uint32_t>(e) << 23);
}

// e^x in the kernels' opmath type: exp_fast for fp32, the library's exp for fp64 (its tests hold
// it to fp64 accuracy, and no model runs in fp64 for speed).
template <typename T>
__attribute__((always_inline)) inline T exp(T x) {
  return std::exp(x);
}
template <>
__attribute__((always_inline)) inline float exp<float>(float x) {
  return exp_fast(x);
}

// 1 / (1 + e^-x), for x of any size (e^-x saturates, the quotient goes to 0 or 1).
template <typename T>
__attribute__((always_inline)) inline T sigmoid(T x) {
  return T(1) / (T(1) + exp<T>(-x));
}

// cap * tanh(x / cap), written with exp_fast so it vectorises: tanh(t) = 1 - 2 / (e^{2t} + 1)
// (saturates to +-1 for large |t|; absolute error ~1e-7 cap near 0).
__attribute__((always_inline)) inline float softcap_fast(float x, float cap, float inv_cap) {
  const float t = x * inv_cap;
  return cap * (1.0f - 2.0f / (exp_fast(2.0f * t) + 1.0f));
}

}  // namespace vec_math
}  // namespace fastllm
