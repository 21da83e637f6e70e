// Loads and stores of the model kernels (rms_norm.cpp, rotary_embedding.cpp, swiglu.cpp): every
// value is widened to opmath (fp32; fp64 for fp64) on load and rounded to nearest even on store,
// with low_precision.h's integer conversions so that gcc vectorises the loops (c10's scalar
// conversions do not).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "low_precision.h"

namespace fastllm {
namespace model_io {

template <typename scalar_t>
struct Io {
  using opmath_t = scalar_t;
  using raw_t = scalar_t;
  static opmath_t load(raw_t v) { return v; }
  static raw_t store(opmath_t v) { return v; }
};

template <>
struct Io<at::BFloat16> {
  using opmath_t = float;
  using raw_t = uint16_t;
  static float load(uint16_t b) { return lowp::BF16::load(b); }
  static uint16_t store(float f) { return lowp::BF16::round_nearest(f); }
};

template <>
struct Io<at::Half> {
  using opmath_t = float;
  using raw_t = uint16_t;
  static float load(uint16_t b) { return lowp::F16::load(b); }
  static uint16_t store(float f) { return lowp::F16::round_nearest(f); }
};

}  // namespace model_io
}  // namespace fastllm
