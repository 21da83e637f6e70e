// Mixed-precision AdamW step for CPU tensors: bf16/fp16 params, fp32 master weights and states,
// one fused pass per element.
//
// Maths (torch.optim.AdamW, decoupled weight decay), per tensor with step t:
//   g  = grad * clip_coef / grad_scale     (negated when maximize)
//   x  = master                            (master mode)
//      | p + kahan_comp                    (pure bf16 with Kahan summation)
//      | p                                 (pure bf16)
//   x  = x * (1 - lr * wd)
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   master = x;  p = round(x);  kahan_comp = round(x - p)
// round() is round-to-nearest-even, or stochastic rounding (bf16: 16 random bits added to the bits
// that bf16 drops, then truncation; fp16: see csrc/low_precision.h), which rounds up with
// probability equal to the dropped fraction, so E[round(x)] = x. The random bits come from a
// counter-based hash of (seed, tensor index, element index): a step is reproducible from its seed.
//
// bf16/fp16 <-> fp32 conversions are integer and fp32 operations (csrc/low_precision.h) so the
// inner loop vectorises (AVX-512 / AVX2 with -march=native). The loop layout is adamw.cpp's: all
// tensors of a call cut into chunks, one parallel region.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "low_precision.h"
#include "fastllm.h"
#include "static_dispatch.h"
#include "tensor_checks.h"

namespace fastllm {
namespace {

using lowp::BF16;
using lowp::F16;

constexpr int64_t kChunk = 1 << 16;


struct Scalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  float eps;
  float grad_mult;      // clip_coef / grad_scale
  uint32_t seed;        // this tensor's random stream (stochastic rounding)
};

template <typename Fmt, bool MASTER, bool KAHAN, bool SR, bool MAXIMIZE>
void adamw_master_chunk(uint16_t* __restrict p_ptr, const uint16_t* __restrict g_ptr,
                        float* __restrict master_ptr, float* __restrict m_ptr,
                        float* __restrict v_ptr, uint16_t* __restrict comp_ptr, int64_t begin,
                        int64_t n, const Scalars& s) {
  // torch's lerp switches formula at weight 0.5 for accuracy; the choice is uniform per call.
  const bool small_weight = s.lerp_weight < 0.5f;
  const float one_minus_weight = 1.0f - s.lerp_weight;
  const uint32_t base = s.seed + uint32_t(begin);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float g = Fmt::load(g_ptr[i]) * s.grad_mult;
    if constexpr (MAXIMIZE) g = -g;
    float x;
    if constexpr (MASTER) {
      x = master_ptr[i];
    } else if constexpr (KAHAN) {
      x = Fmt::load(p_ptr[i]) + Fmt::load(comp_ptr[i]);
    } else {
      x = Fmt::load(p_ptr[i]);
    }
    x = x * s.decay;
    float m = m_ptr[i];
    const float diff = g - m;
    m = small_weight ? m + s.lerp_weight * diff : g - diff * one_minus_weight;
    float v = v_ptr[i] * s.beta2;
    v = v + s.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
    x = x + s.neg_step_size * m / denom;
    uint16_t p_new;
    if constexpr (SR) {
      p_new = Fmt::round_stochastic(x, hash32(base + uint32_t(i)));
    } else {
      p_new = Fmt::round_nearest(x);
    }
    if constexpr (MASTER) master_ptr[i] = x;
    if constexpr (KAHAN) comp_ptr[i] = Fmt::round_nearest(x - Fmt::load(p_new));
    p_ptr[i] = p_new;
    m_ptr[i] = m;
    v_ptr[i] = v;
  }
}

template <typename Fmt, bool MASTER, bool KAHAN, bool SR, bool MAXIMIZE>
void adamw_master_tensors(const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& masters,
                          const std::vector<at::Tensor>& exp_avgs,
                          const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& kahan_comps,
                          const std::vector<Scalars>& scalars) {
  struct Chunk {
    int64_t tensor, begin, end;
  };
  std::vector<Chunk> chunks;
  for (const auto t : c10::irange(params.size())) {
    const int64_t n = params[t].numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({int64_t(t), b, std::min(n, b + kChunk)});
  }
  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& ch = chunks[c];
      const auto t = ch.tensor;
      auto half = [&](const at::Tensor& x) { return static_cast<uint16_t*>(x.data_ptr()) + ch.begin; };
      auto single = [&](const at::Tensor& x) { return static_cast<float*>(x.data_ptr()) + ch.begin; };
      adamw_master_chunk<Fmt, MASTER, KAHAN, SR, MAXIMIZE>(
          half(params[t]), half(grads[t]), MASTER ? single(masters[t]) : nullptr,
          single(exp_avgs[t]), single(exp_avg_sqs[t]), KAHAN ? half(kahan_comps[t]) : nullptr,
          ch.begin, ch.end - ch.begin, scalars[t]);
    }
  });
}

}  // namespace

void adamw_master_step_cpu(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& masters,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& kahan_comps,
                           const std::vector<at::Tensor>& steps, double lr, double beta1,
                           double beta2, double eps, double weight_decay, bool maximize,
                           bool stochastic_rounding, int64_t seed,
                           const c10::optional<at::Tensor>& grad_scale,
                           const c10::optional<at::Tensor>& clip_coef,
                           const c10::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const auto dtype = params[0].scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "fastllm.adamw_master_step: params must be bfloat16 or float16, got ", dtype);
  const bool master = !masters.empty();
  const bool kahan = !kahan_comps.empty();
  TORCH_CHECK(!(master && kahan),
              "fastllm.adamw_master_step: kahan_comps is for pure low-precision training; "
              "pass either masters or kahan_comps, not both");
  const auto check = [&](const std::vector<at::Tensor>& list, const char* name,
                         at::ScalarType expected) {
    check_tensor_list("fastllm.adamw_master_step (cpu)", list, name, params, at::Device(at::kCPU), expected);
  };
  check(params, "params", dtype);
  check(grads, "grads", dtype);
  if (master) check(masters, "masters", at::kFloat);
  check(exp_avgs, "exp_avgs", at::kFloat);
  check(exp_avg_sqs, "exp_avg_sqs", at::kFloat);
  if (kahan) check(kahan_comps, "kahan_comps", dtype);
  TORCH_CHECK(steps.size() == params.size(), "fastllm.adamw_master_step: steps has ",
              steps.size(), " tensors but params has ", params.size());
  if (found_inf.has_value() && scalar_value(*found_inf) != 0.0) return;
  double grad_mult = 1.0;
  if (grad_scale.has_value()) grad_mult /= scalar_value(*grad_scale);
  if (clip_coef.has_value()) grad_mult *= scalar_value(*clip_coef);

  std::vector<Scalars> scalars(params.size());
  const uint32_t seed32 = hash32(uint32_t(uint64_t(seed)) ^ hash32(uint32_t(uint64_t(seed) >> 32)));
  for (const auto i : c10::irange(params.size())) {
    const double step = scalar_value(steps[i]);
    const double bc1 = 1.0 - std::pow(beta1, step);
    const double bc2 = 1.0 - std::pow(beta2, step);
    scalars[i] = {float(1.0 - lr * weight_decay), float(1.0 - beta1), float(beta2),
                  float(1.0 - beta2),             float(-lr / bc1),   float(std::sqrt(bc2)),
                  float(eps),                     float(grad_mult),
                  hash32(seed32 + 0x9e3779b9U * uint32_t(i + 1))};
  }
  auto run = [&](auto fmt) {
    using Fmt = decltype(fmt);
    dispatch_bool(master, [&](auto ma) {
      dispatch_bool(kahan && !master, [&](auto ka) {
        dispatch_bool(stochastic_rounding, [&](auto sr) {
          dispatch_bool(maximize, [&](auto mx) {
            adamw_master_tensors<Fmt, decltype(ma)::value, decltype(ka)::value,
                                 decltype(sr)::value,
                                 decltype(mx)::value>(params, grads, masters, exp_avgs,
                                                      exp_avg_sqs, kahan_comps, scalars);
          });
        });
      });
    });
  };
  if (dtype == at::kBFloat16) {
    run(BF16{});
  } else {
    run(F16{});
  }
}

}  // namespace fastllm
