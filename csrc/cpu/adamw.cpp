// AdamW step for CPU tensors: one fused pass per element over param, grad and the moments.
//
// Maths (torch.optim.AdamW, decoupled weight decay), per tensor with step t:
//   g  = grad / grad_scale            (negated when maximize)
//   p  = p * (1 - lr * wd)
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   vm = max(vm, v)                   (amsgrad; the denominator then uses vm)
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// The operations are done in the same order as torch's single-tensor AdamW so the two agree to
// a few ulps, except that the division by sqrt(1 - beta2^t) is a multiplication by its inverse:
// with AVX-512 on 2 cores the step is bound by division/sqrt throughput whenever memory is fast,
// and this removes one of its three divisions/square roots per element (1 ulp apart).
// Arithmetic is in fp32 for fp32/bf16/fp16 tensors (fp64 for fp64); bf16/fp16 are widened and
// rounded (to nearest even, as c10's casts) with model_io.h's integer conversions, which gcc
// vectorises: c10's scalar casts kept the bf16 loop scalar, 4.8x torch fused's time at 33M bf16
// params (BENCHMARKS.md, 2026-12-04).
//
// All tensors of one call are cut into chunks and the chunks are split across the ATen (OpenMP)
// thread pool in one parallel region, so many small tensors cost one fork/join, not one each.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <cmath>
#include <type_traits>

#include "cpu/model_io.h"
#include "fastllm.h"
#include "static_dispatch.h"
#include "tensor_checks.h"

namespace fastllm {
namespace {

// Elements per work item: large enough to amortise the per-chunk setup, small enough that a few
// hundred chunks balance the threads of a 64M-element step.
constexpr int64_t kChunk = 1 << 16;

template <typename opmath_t>
struct AdamWScalars {
  opmath_t decay;          // 1 - lr * weight_decay
  opmath_t lerp_weight;    // 1 - beta1
  opmath_t beta2;
  opmath_t one_minus_beta2;
  opmath_t neg_step_size;  // -lr / (1 - beta1^t)
  opmath_t inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^t)
  opmath_t eps;
  opmath_t inv_grad_scale;
};

template <typename scalar_t, bool AMSGRAD, bool MAXIMIZE, bool SCALED>
void adamw_chunk(scalar_t* __restrict p_raw, const scalar_t* __restrict g_raw,
                 scalar_t* __restrict m_raw, scalar_t* __restrict v_raw,
                 scalar_t* __restrict vmax_raw, int64_t n,
                 const AdamWScalars<at::opmath_type<scalar_t>>& s) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Io = model_io::Io<scalar_t>;
  using raw_t = typename Io::raw_t;
  static_assert(sizeof(raw_t) == sizeof(scalar_t), "raw storage type");
  auto* __restrict p_ptr = reinterpret_cast<raw_t*>(p_raw);
  const auto* __restrict g_ptr = reinterpret_cast<const raw_t*>(g_raw);
  auto* __restrict m_ptr = reinterpret_cast<raw_t*>(m_raw);
  auto* __restrict v_ptr = reinterpret_cast<raw_t*>(v_raw);
  auto* __restrict vmax_ptr = reinterpret_cast<raw_t*>(vmax_raw);
  // torch's lerp switches formula at weight 0.5 for accuracy; the choice is uniform per call.
  const bool small_weight = s.lerp_weight < opmath_t(0.5);
  const opmath_t one_minus_weight = opmath_t(1) - s.lerp_weight;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    opmath_t g = Io::load(g_ptr[i]);
    if constexpr (SCALED) g = g * s.inv_grad_scale;
    if constexpr (MAXIMIZE) g = -g;
    opmath_t p = Io::load(p_ptr[i]) * s.decay;
    opmath_t m = Io::load(m_ptr[i]);
    const opmath_t diff = g - m;
    m = small_weight ? m + s.lerp_weight * diff : g - diff * one_minus_weight;
    opmath_t v = Io::load(v_ptr[i]) * s.beta2;
    v = v + s.one_minus_beta2 * g * g;
    opmath_t v_used = v;
    if constexpr (AMSGRAD) {
      const opmath_t vm = Io::load(vmax_ptr[i]);
      // torch.maximum's: a nan in either (a loaded state) stays nan, as torch's AdamW keeps it
      v_used = (vm > v || vm != vm) ? vm : v;
      vmax_ptr[i] = Io::store(v_used);
    }
    const opmath_t denom = std::sqrt(v_used) * s.inv_bc2_sqrt + s.eps;
    p = p + s.neg_step_size * m / denom;
    p_ptr[i] = Io::store(p);
    m_ptr[i] = Io::store(m);
    v_ptr[i] = Io::store(v);
  }
}

template <typename scalar_t, bool AMSGRAD, bool MAXIMIZE, bool SCALED>
void adamw_tensors(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::vector<at::Tensor>& max_exp_avg_sqs,
                   const std::vector<AdamWScalars<at::opmath_type<scalar_t>>>& scalars) {
  struct Chunk {
    int64_t tensor, begin, end;
  };
  std::vector<Chunk> chunks;
  for (const auto t : c10::irange(params.size())) {
    const int64_t n = params[t].numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({int64_t(t), b, std::min(n, b + kChunk)});
  }
  // Chunks are dealt round-robin, so the threads stream neighbouring chunks of the same tensors
  // at the same time (as torch's per-tensor parallel loops do), not two distant halves.
  const int64_t n_chunks = int64_t(chunks.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_chunks);
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t last_worker) {
    for (int64_t w = first_worker; w < last_worker; ++w)
    for (int64_t c = w; c < n_chunks; c += workers) {
      const Chunk& ch = chunks[c];
      const auto t = ch.tensor;
      auto ptr = [&](const at::Tensor& x) { return static_cast<scalar_t*>(x.data_ptr()) + ch.begin; };
      adamw_chunk<scalar_t, AMSGRAD, MAXIMIZE, SCALED>(
          ptr(params[t]), ptr(grads[t]), ptr(exp_avgs[t]), ptr(exp_avg_sqs[t]),
          AMSGRAD ? ptr(max_exp_avg_sqs[t]) : nullptr, ch.end - ch.begin, scalars[t]);
    }
  });
}

}  // namespace

void adamw_step_cpu(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& max_exp_avg_sqs,
                    const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize,
                    const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const auto check = [&](const std::vector<at::Tensor>& list, const char* name) {
    check_tensor_list("fastllm.adamw_step (cpu)", list, name, params, at::Device(at::kCPU));
  };
  check(params, "params");
  check(grads, "grads");
  check(exp_avgs, "exp_avgs");
  check(exp_avg_sqs, "exp_avg_sqs");
  if (amsgrad) check(max_exp_avg_sqs, "max_exp_avg_sqs");
  TORCH_CHECK(steps.size() == params.size(), "fastllm.adamw_step: steps has ", steps.size(),
              " tensors but params has ", params.size());
  const auto dtype = params[0].scalar_type();
  for (const auto i : c10::irange(params.size())) {
    TORCH_CHECK(params[i].scalar_type() == dtype,
                "fastllm.adamw_step: all params of one call must share a dtype; params[", i,
                "] is ", params[i].scalar_type(), ", params[0] is ", dtype);
  }
  if (found_inf.has_value() && scalar_value(*found_inf) != 0.0) return;
  double inv_scale = 1.0;
  if (grad_scale.has_value()) inv_scale = 1.0 / scalar_value(*grad_scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fastllm_adamw_step_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<AdamWScalars<opmath_t>> scalars(params.size());
    for (const auto i : c10::irange(params.size())) {
      const double step = scalar_value(steps[i]);
      const double bc1 = 1.0 - std::pow(beta1, step);
      const double bc2 = 1.0 - std::pow(beta2, step);
      scalars[i] = {opmath_t(1.0 - lr * weight_decay), opmath_t(1.0 - beta1), opmath_t(beta2),
                    opmath_t(1.0 - beta2), opmath_t(-lr / bc1), opmath_t(1.0 / std::sqrt(bc2)),
                    opmath_t(eps), opmath_t(inv_scale)};
    }
    dispatch_bool(amsgrad, [&](auto a) {
      dispatch_bool(maximize, [&](auto m) {
        dispatch_bool(grad_scale.has_value(), [&](auto sc) {
          adamw_tensors<scalar_t, decltype(a)::value, decltype(m)::value, decltype(sc)::value>(
              params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, scalars);
        });
      });
    });
  });
}

}  // namespace fastllm
