// bf16 and fp16 <-> fp32 conversions and the per-element hash of stochastic rounding, shared by
// the C++ CPU kernels (csrc/cpu/) and the CUDA kernels (csrc/cuda/), so both round and draw
// random bits the same way: one definition, compiled for the host and for the device.
//
// Written with integer and fp32 operations only, so that CPU loops over them vectorise (c10's
// conversions use scalar F16C intrinsics for fp16). Values are raw uint16_t bit patterns;
// rounding is to nearest even unless stated otherwise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FASTLLM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTLLM_HOST_DEVICE inline
#endif

namespace fastllm {

// Chris Wellons' "lowbias32" integer hash (github.com/skeeto/hash-prospector): a bijection on
// uint32 with good avalanche, cheap enough to run per element in a vectorised loop. The random
// bits of stochastic rounding are hash32(tensor seed + element index) on every compiled backend.
FASTLLM_HOST_DEVICE uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

namespace lowp {

FASTLLM_HOST_DEVICE float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

FASTLLM_HOST_DEVICE uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

struct BF16 {
  static FASTLLM_HOST_DEVICE float load(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
  static FASTLLM_HOST_DEVICE uint16_t round_nearest(float f) {
    const uint32_t u = float_to_bits(f);
    const uint32_t rounded = (u + 0x7fffU + ((u >> 16) & 1U)) >> 16;
    return f != f ? uint16_t(0x7fc0) : uint16_t(rounded);
  }
  // Stochastic rounding: 16 random bits added below bf16's last bit, then truncation. A finite
  // f above bf16's largest value can be carried up to inf where round_nearest gives that largest
  // value: a result of inf (and nan) keeps round_nearest's result instead.
  static FASTLLM_HOST_DEVICE uint16_t round_stochastic(float f, uint32_t random) {
    const uint32_t u = float_to_bits(f);
    const uint32_t rounded = (u + (random & 0xffffU)) >> 16;
    const uint32_t nearest = (u + 0x7fffU + ((u >> 16) & 1U)) >> 16;
    const uint32_t to_inf = uint32_t((rounded & 0x7fffU) == 0x7f80U);
    return f != f ? uint16_t(0x7fc0) : uint16_t(rounded + to_inf * (nearest - rounded));
  }
};

// IEEE fp16 <-> fp32 with integer and fp32 arithmetic only (the FP16 library's algorithms,
// github.com/Maratyszcza/FP16, also c10's fallback): unlike c10's scalar F16C intrinsics these
// vectorise. Round-to-nearest-even, subnormals, infinities and nan are handled exactly.
struct F16 {
  static FASTLLM_HOST_DEVICE float load(uint16_t h) {
    const uint32_t w = uint32_t(h) << 16;
    const uint32_t sign = w & 0x80000000U;
    const uint32_t two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0U << 23)) * bits_to_float(15U << 23);
    const float denormalized = bits_to_float((two_w >> 17) | (126U << 23)) - 0.5f;
    const uint32_t result =
        sign | (two_w < (1U << 27) ? float_to_bits(denormalized) : float_to_bits(normalized));
    return bits_to_float(result);
  }
  static FASTLLM_HOST_DEVICE uint16_t round_nearest(float f) {
    float base = (fabsf(f) * bits_to_float(239U << 23)) * bits_to_float(17U << 23);
    const uint32_t w = float_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000U;
    uint32_t bias = shl1_w & 0xFF000000U;
    bias = bias < 0x71000000U ? 0x71000000U : bias;
    base = bits_to_float((bias >> 1) + 0x07800000U) + base;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00U) + (bits & 0x00000FFFU);
    return uint16_t((sign >> 16) | (shl1_w > 0xFF000000U ? 0x7E00U : nonsign));
  }
  // Stochastic rounding: the two fp16 neighbours lo <= |f| < hi (in magnitude) are round_nearest
  // and its next value up or down; hi is chosen when (random >> 8) * 2^-24 < (|f| - lo) / (hi - lo).
  // Both sides are exact in fp32 (Sterbenz; ulp a power of two), so the mean is exact to 2^-24
  // ulp. Exact values, nan, and values that round to inf keep round_nearest's result.
  // Written with 0/1 integers instead of selects: GCC does not if-convert the select version.
  static FASTLLM_HOST_DEVICE uint16_t round_stochastic(float f, uint32_t random) {
    const uint32_t rn = round_nearest(f);
    const float af = fabsf(f);
    const float arn = fabsf(load(uint16_t(rn)));
    const uint32_t below = uint32_t(arn < af);
    const uint32_t lo = rn - 1U + below;  // magnitude steps: sign-magnitude bits
    const uint32_t hi = rn + below;
    const float alo = fabsf(load(uint16_t(lo)));
    const float ulp = fabsf(load(uint16_t(hi))) - alo;
    const uint32_t up = uint32_t(float(random >> 8) * ulp < (af - alo) * 16777216.0f);
    const uint32_t keep = uint32_t(arn == af) | uint32_t(arn == INFINITY) | uint32_t(f != f);
    return uint16_t(rn + (1U - keep) * (lo + up - rn));
  }
};

}  // namespace lowp
}  // namespace fastllm
