// AdamW step for CUDA tensors: one multi-tensor launch per chunk of tensors
// (multi_tensor_apply.cuh).
//
// Maths (torch.optim.AdamW, decoupled weight decay), per tensor with step t:
//   g  = grad / grad_scale            (negated when maximize)
//   p  = p * (1 - lr * wd)
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   vm = max(vm, v)                   (amsgrad; the denominator then uses vm)
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// The operations are done in the same order as csrc/cpu/adamw.cpp (torch's single-tensor AdamW),
// with correctly rounded sqrt and division whatever the compiler flags (nvcc still fuses a * b + c
// into FMAs, as in torch's own CUDA kernels), so the backends agree to a few ulps. Arithmetic is in
// fp32 for fp32/bf16/fp16 tensors (fp64 for fp64).
//
// grad_scale and found_inf are read by the kernel when they are on the GPU, so a GradScaler step
// costs no host synchronisation; found_inf != 0 makes every block return before writing. Step
// counts on the CPU become per-tensor bias corrections computed here on the host; step counts on
// the GPU are read by the kernel, which computes the same corrections in fp64.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <cmath>
#include <cstdint>

#include "cuda/multi_tensor_apply.cuh"
#include "fastllm.h"
#include "tensor_checks.h"

namespace fastllm {
namespace {

using mta::TensorListMetadata;

// dtype of a one-element tensor that the kernel reads (a step count, grad_scale, found_inf).
enum class ScalarKind : uint8_t { kFloat, kDouble, kHalf, kBFloat16, kLong, kInt, kBool };

ScalarKind scalar_kind(at::ScalarType dtype, const char* what) {
  switch (dtype) {
    case at::kFloat: return ScalarKind::kFloat;
    case at::kDouble: return ScalarKind::kDouble;
    case at::kHalf: return ScalarKind::kHalf;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kLong: return ScalarKind::kLong;
    case at::kInt: return ScalarKind::kInt;
    case at::kBool: return ScalarKind::kBool;
    default:
      TORCH_CHECK(false, "fastllm.adamw_step (cuda): ", what, " has unsupported dtype ", dtype);
  }
}

__device__ __forceinline__ double load_as_double(const void* ptr, ScalarKind kind) {
  switch (kind) {
    case ScalarKind::kFloat: return *static_cast<const float*>(ptr);
    case ScalarKind::kDouble: return *static_cast<const double*>(ptr);
    case ScalarKind::kHalf: return static_cast<float>(*static_cast<const at::Half*>(ptr));
    case ScalarKind::kBFloat16: return static_cast<float>(*static_cast<const at::BFloat16*>(ptr));
    case ScalarKind::kLong: return static_cast<double>(*static_cast<const int64_t*>(ptr));
    case ScalarKind::kInt: return *static_cast<const int32_t*>(ptr);
    case ScalarKind::kBool: return *static_cast<const bool*>(ptr) ? 1.0 : 0.0;
  }
  return 0.0;
}

// Correctly rounded whatever --use_fast_math / -prec-div / -prec-sqrt say.
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float x) { return __fsqrt_rn(x); }
__device__ __forceinline__ double sqrt_rn(double x) { return __dsqrt_rn(x); }

// Per-tensor scalars carried in the kernel arguments.
template <typename opmath_t>
struct AdamWTensorMeta {
  const void* step;        // the step count on the GPU, or nullptr when the two below are set
  opmath_t neg_step_size;  // -lr / (1 - beta1^t)
  opmath_t bc2_sqrt;       // sqrt(1 - beta2^t)
};

template <typename scalar_t, bool AMSGRAD>
struct AdamWFunctor {
  using opmath_t = at::opmath_type<scalar_t>;
  using Meta = AdamWTensorMeta<opmath_t>;
  static constexpr int kDepth = AMSGRAD ? 5 : 4;  // param, grad, exp_avg, exp_avg_sq[, max]
  // 16-byte loads and stores: 4 fp32, 8 bf16/fp16 or 2 fp64 elements per thread per access.
  using Vec = mta::Vec16<scalar_t>;
  static constexpr int kVec = Vec::kSize;
  // A compile-time block size turns the strided offsets below into immediates.
  static constexpr int kThreads = mta::kBlockSize;
  using Metadata = TensorListMetadata<kDepth, Meta>;

  opmath_t decay;            // 1 - lr * weight_decay
  opmath_t lerp_weight;      // 1 - beta1
  opmath_t beta2;
  opmath_t one_minus_beta2;  // 1 - beta2
  opmath_t eps;
  opmath_t host_inv_scale;   // 1 / grad_scale for a CPU grad_scale, else 1
  double lr, beta1_d, beta2_d;  // for the bias corrections of step counts on the GPU
  double weight_decay_d;        // for the decay of a learning rate read on the GPU
  const void* lr_ptr;           // the learning rate, one element on the GPU, or nullptr (lr)
  const void* grad_scale;       // one element on the GPU, or nullptr
  const void* found_inf;        // one element on the GPU, or nullptr
  ScalarKind grad_scale_kind, found_inf_kind, step_kind, lr_kind;
  bool maximize;

  // Scalars shared by every element of one block's chunk.
  struct ChunkScalars {
    opmath_t inv_scale, neg_step_size, bc2_sqrt, one_minus_weight, decay;
    bool small_weight;
  };

  template <int N>
  __device__ __forceinline__ void update(opmath_t (&p)[N], const opmath_t (&grad)[N],
                                         opmath_t (&m)[N], opmath_t (&v)[N], opmath_t (&vmax)[N],
                                         const ChunkScalars& s) const {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      opmath_t g = grad[k] * s.inv_scale;
      if (maximize) g = -g;
      p[k] = p[k] * s.decay;
      const opmath_t diff = g - m[k];
      m[k] = s.small_weight ? m[k] + lerp_weight * diff : g - diff * s.one_minus_weight;
      v[k] = v[k] * beta2;
      v[k] = v[k] + one_minus_beta2 * g * g;
      opmath_t v_used = v[k];
      if constexpr (AMSGRAD) {
        // torch.maximum's: a nan in either stays nan (vm > nan is false, nan > v too)
        v_used = (vmax[k] > v[k] || vmax[k] != vmax[k]) ? vmax[k] : v[k];
        vmax[k] = v_used;
      }
      const opmath_t denom = div_rn(sqrt_rn(v_used), s.bc2_sqrt) + eps;
      p[k] = p[k] + div_rn(s.neg_step_size * m[k], denom);
    }
  }

  __device__ __forceinline__ void operator()(const Metadata& tl, int tensor, int64_t start,
                                             int n) const {
    if (found_inf != nullptr && load_as_double(found_inf, found_inf_kind) != 0.0) return;

    ChunkScalars s;
    s.inv_scale = grad_scale != nullptr
                      ? static_cast<opmath_t>(1.0 / load_as_double(grad_scale, grad_scale_kind))
                      : host_inv_scale;
    const Meta& meta = tl.meta[tensor];
    s.neg_step_size = meta.neg_step_size;
    s.bc2_sqrt = meta.bc2_sqrt;
    double lr_d = lr;
    s.decay = decay;
    if (lr_ptr != nullptr) {
      // A tensor lr (capturable): the host's formulas, in fp64, from its value (steps are then
      // on the GPU too, so both corrections are computed below).
      lr_d = load_as_double(lr_ptr, lr_kind);
      s.decay = static_cast<opmath_t>(1.0 - lr_d * weight_decay_d);
    }
    if (meta.step != nullptr) {
      const double step = load_as_double(meta.step, step_kind);
      s.neg_step_size = static_cast<opmath_t>(-lr_d / (1.0 - ::pow(beta1_d, step)));
      s.bc2_sqrt = static_cast<opmath_t>(::sqrt(1.0 - ::pow(beta2_d, step)));
    }
    // torch's lerp switches formula at weight 0.5 for accuracy (ATen/native/Lerp.h).
    s.small_weight = lerp_weight < opmath_t(0.5);
    s.one_minus_weight = opmath_t(1) - lerp_weight;

    scalar_t* p_ptr = static_cast<scalar_t*>(tl.addresses[0][tensor]) + start;
    const scalar_t* g_ptr = static_cast<const scalar_t*>(tl.addresses[1][tensor]) + start;
    scalar_t* m_ptr = static_cast<scalar_t*>(tl.addresses[2][tensor]) + start;
    scalar_t* v_ptr = static_cast<scalar_t*>(tl.addresses[3][tensor]) + start;
    scalar_t* vmax_ptr = nullptr;
    if constexpr (AMSGRAD) vmax_ptr = static_cast<scalar_t*>(tl.addresses[4][tensor]) + start;

    const bool aligned = mta::aligned16(tl, tensor);

    opmath_t p[kVec], g[kVec], m[kVec], v[kVec], vmax[kVec];
    int body = 0;
    if (aligned) {
      const int nvec = n / kVec;
      for (int i = threadIdx.x; i < nvec; i += kThreads) {
        const Vec pv = reinterpret_cast<const Vec*>(p_ptr)[i];
        const Vec gv = reinterpret_cast<const Vec*>(g_ptr)[i];
        const Vec mv = reinterpret_cast<const Vec*>(m_ptr)[i];
        const Vec vv = reinterpret_cast<const Vec*>(v_ptr)[i];
        Vec vmaxv;
        if constexpr (AMSGRAD) vmaxv = reinterpret_cast<const Vec*>(vmax_ptr)[i];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          p[k] = static_cast<opmath_t>(pv.val[k]);
          g[k] = static_cast<opmath_t>(gv.val[k]);
          m[k] = static_cast<opmath_t>(mv.val[k]);
          v[k] = static_cast<opmath_t>(vv.val[k]);
          if constexpr (AMSGRAD) vmax[k] = static_cast<opmath_t>(vmaxv.val[k]);
        }
        update(p, g, m, v, vmax, s);
        Vec po, mo, vo, vmaxo;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          po.val[k] = static_cast<scalar_t>(p[k]);
          mo.val[k] = static_cast<scalar_t>(m[k]);
          vo.val[k] = static_cast<scalar_t>(v[k]);
          if constexpr (AMSGRAD) vmaxo.val[k] = static_cast<scalar_t>(vmax[k]);
        }
        reinterpret_cast<Vec*>(p_ptr)[i] = po;
        reinterpret_cast<Vec*>(m_ptr)[i] = mo;
        reinterpret_cast<Vec*>(v_ptr)[i] = vo;
        if constexpr (AMSGRAD) reinterpret_cast<Vec*>(vmax_ptr)[i] = vmaxo;
      }
      body = nvec * kVec;
    }

    // Unaligned tensors, and the last n % kVec elements of aligned ones: kVec independent
    // coalesced accesses per thread, all loads issued before any store.
    for (int base = body; base < n; base += kThreads * kVec) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const int i = base + threadIdx.x + k * kThreads;
        if (i < n) {
          p[k] = static_cast<opmath_t>(p_ptr[i]);
          g[k] = static_cast<opmath_t>(g_ptr[i]);
          m[k] = static_cast<opmath_t>(m_ptr[i]);
          v[k] = static_cast<opmath_t>(v_ptr[i]);
          if constexpr (AMSGRAD) vmax[k] = static_cast<opmath_t>(vmax_ptr[i]);
        }
      }
      update(p, g, m, v, vmax, s);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const int i = base + threadIdx.x + k * kThreads;
        if (i < n) {
          p_ptr[i] = static_cast<scalar_t>(p[k]);
          m_ptr[i] = static_cast<scalar_t>(m[k]);
          v_ptr[i] = static_cast<scalar_t>(v[k]);
          if constexpr (AMSGRAD) vmax_ptr[i] = static_cast<scalar_t>(vmax[k]);
        }
      }
    }
  }
};

// A one-element tensor for the kernel: nullptr when absent or on the CPU (the caller reads those
// on the host), its address when on params' device.
const void* device_scalar(const c10::optional<at::Tensor>& t, const char* name,
                          const at::Device& device) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == 1, "fastllm.adamw_step (cuda): ", name, " must have one element, has ",
              t->numel());
  if (t->is_cpu()) return nullptr;
  TORCH_CHECK(t->device() == device, "fastllm.adamw_step (cuda): ", name, " is on ", t->device(),
              " but params[0] is on ", device);
  return t->data_ptr();
}

}  // namespace

void adamw_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs,
                     const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool amsgrad, bool maximize,
                     const c10::optional<at::Tensor>& grad_scale,
                     const c10::optional<at::Tensor>& found_inf,
                     const c10::optional<at::Tensor>& lr_tensor) {
  if (params.empty()) return;
  TORCH_CHECK(params[0].is_cuda(), "fastllm.adamw_step (cuda): params[0] must be a CUDA tensor, "
              "got one on ", params[0].device());
  const auto check = [&](const std::vector<at::Tensor>& list, const char* name) {
    check_tensor_list("fastllm.adamw_step (cuda)", list, name, params, params[0].device());
  };
  check(params, "params");
  check(grads, "grads");
  check(exp_avgs, "exp_avgs");
  check(exp_avg_sqs, "exp_avg_sqs");
  if (amsgrad) check(max_exp_avg_sqs, "max_exp_avg_sqs");
  TORCH_CHECK(steps.size() == params.size(), "fastllm.adamw_step: steps has ", steps.size(),
              " tensors but params has ", params.size());
  const auto device = params[0].device();
  const auto dtype = params[0].scalar_type();
  for (const auto i : c10::irange(params.size())) {
    TORCH_CHECK(params[i].scalar_type() == dtype,
                "fastllm.adamw_step: all params of one call must share a dtype; params[", i,
                "] is ", params[i].scalar_type(), ", params[0] is ", dtype);
  }

  // Step counts on the GPU are read by the kernel, which needs one dtype for all of them.
  bool any_device_step = false;
  at::ScalarType device_step_dtype = at::kFloat;
  for (const auto i : c10::irange(steps.size())) {
    const auto& s = steps[i];
    TORCH_CHECK(s.numel() == 1, "fastllm.adamw_step (cuda): steps[", i,
                "] must have one element, has ", s.numel());
    if (s.is_cpu()) continue;
    TORCH_CHECK(s.device() == device, "fastllm.adamw_step (cuda): steps[", i, "] is on ",
                s.device(), " but params[0] is on ", device, "; steps may be on the CPU or on ",
                "params' device");
    if (!any_device_step) {
      any_device_step = true;
      device_step_dtype = s.scalar_type();
    }
    TORCH_CHECK(s.scalar_type() == device_step_dtype, "fastllm.adamw_step (cuda): steps on the ",
                "GPU must share a dtype; steps[", i, "] is ", s.scalar_type(), ", an earlier one ",
                device_step_dtype);
  }

  const auto step_kind = any_device_step ? scalar_kind(device_step_dtype, "steps")
                                         : ScalarKind::kFloat;
  const void* grad_scale_ptr = device_scalar(grad_scale, "grad_scale", device);
  const void* found_inf_ptr = device_scalar(found_inf, "found_inf", device);
  const auto grad_scale_kind =
      grad_scale_ptr ? scalar_kind(grad_scale->scalar_type(), "grad_scale") : ScalarKind::kFloat;
  const auto found_inf_kind =
      found_inf_ptr ? scalar_kind(found_inf->scalar_type(), "found_inf") : ScalarKind::kFloat;
  const void* lr_ptr = device_scalar(lr_tensor, "lr_tensor", device);
  const auto lr_kind = lr_ptr ? scalar_kind(lr_tensor->scalar_type(), "lr_tensor")
                              : ScalarKind::kFloat;
  if (lr_tensor.has_value() && lr_tensor->is_cpu()) lr = lr_tensor->item<double>();
  // CPU grad_scale / found_inf / lr cost no GPU synchronisation to read here.
  if (found_inf.has_value() && found_inf->is_cpu() && found_inf->item<double>() != 0.0) return;
  double host_inv_scale = 1.0;
  if (grad_scale.has_value() && grad_scale->is_cpu()) {
    host_inv_scale = 1.0 / grad_scale->item<double>();
  }

  const at::cuda::CUDAGuard guard(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fastllm_adamw_step_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<AdamWTensorMeta<opmath_t>> meta(params.size());
    for (const auto i : c10::irange(params.size())) {
      TORCH_CHECK(lr_ptr == nullptr || !steps[i].is_cpu(), "fastllm.adamw_step (cuda): a "
                  "learning rate on the GPU needs every step count on the GPU; steps[", i,
                  "] is on the CPU");
      if (steps[i].is_cpu()) {
        const double step = steps[i].item<double>();
        const double bc1 = 1.0 - std::pow(beta1, step);
        const double bc2 = 1.0 - std::pow(beta2, step);
        meta[i] = {nullptr, opmath_t(-lr / bc1), opmath_t(std::sqrt(bc2))};
      } else {
        meta[i] = {steps[i].data_ptr(), opmath_t(0), opmath_t(0)};
      }
    }
    auto run = [&](auto amsgrad_c) {
      constexpr bool kAmsgrad = decltype(amsgrad_c)::value;
      AdamWFunctor<scalar_t, kAmsgrad> op;
      op.decay = opmath_t(1.0 - lr * weight_decay);
      op.lerp_weight = opmath_t(1.0 - beta1);
      op.beta2 = opmath_t(beta2);
      op.one_minus_beta2 = opmath_t(1.0 - beta2);
      op.eps = opmath_t(eps);
      op.host_inv_scale = opmath_t(host_inv_scale);
      op.lr = lr;
      op.weight_decay_d = weight_decay;
      op.lr_ptr = lr_ptr;
      op.lr_kind = lr_kind;
      op.beta1_d = beta1;
      op.beta2_d = beta2;
      op.grad_scale = grad_scale_ptr;
      op.found_inf = found_inf_ptr;
      op.grad_scale_kind = grad_scale_kind;
      op.found_inf_kind = found_inf_kind;
      op.step_kind = step_kind;
      op.maximize = maximize;
      if constexpr (kAmsgrad) {
        mta::multi_tensor_apply<5>({&params, &grads, &exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs},
                                   meta, op);
      } else {
        mta::multi_tensor_apply<4>({&params, &grads, &exp_avgs, &exp_avg_sqs}, meta, op);
      }
    };
    amsgrad ? run(std::true_type{}) : run(std::false_type{});
  });
}

}  // namespace fastllm
