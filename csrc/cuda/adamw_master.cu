// Mixed-precision AdamW step and the global grad norm for CUDA tensors, one multi-tensor launch
// per chunk of tensors (multi_tensor_apply.cuh).
//
// adamw_master_step (the contract of csrc/cpu/adamw_master.cpp), per element, with step t:
//   g  = grad * clip_coef / grad_scale     (negated when maximize)
//   x  = master | p + kahan_comp | p       (master weights | pure bf16 with Kahan | pure bf16)
//   x  = x * (1 - lr * wd)
//   m  = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) * g * g
//   x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   master = x;  p = round(x);  kahan_comp = round(x - p)
// round() is round-to-nearest-even, or stochastic rounding with the same random bits and rule as
// the C++ kernel (lowbias32 of seed, tensor index and element index). grad_scale, clip_coef and
// found_inf on the GPU are read by the kernel (no host synchronisation); on the CPU, here.
//
// l2norm: each block writes the sum of squares of its chunk (summed in fp32, in fp64 for fp64
// tensors) to its own fp64 slot; the slots are added in fp64 afterwards, so the norm is the same
// from run to run.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <cub/block/block_reduce.cuh>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"
#include "fastllm.h"
#include "low_precision.h"
#include "static_dispatch.h"
#include "tensor_checks.h"

namespace fastllm {
namespace {

using mta::TensorListMetadata;

// bf16/fp16 rounding (lowp::BF16, lowp::F16) and the stochastic-rounding hash (hash32) come
// from csrc/low_precision.h, shared with the C++ kernels: the cpp and cuda backends round alike
// and draw the same random bits.

struct MasterTensorMeta {
  const float* step;    // the step count on the GPU, or nullptr when the two below are set
  float neg_step_size;  // -lr / (1 - beta1^t)
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  uint32_t seed;        // this tensor's random stream
};

template <typename Fmt, bool MASTER, bool KAHAN, bool SR>
struct AdamWMasterFunctor {
  // param, grad, exp_avg, exp_avg_sq[, master or kahan_comp]
  static constexpr int kDepth = (MASTER || KAHAN) ? 5 : 4;
  static constexpr int kThreads = mta::kBlockSize;
  using Metadata = TensorListMetadata<kDepth, MasterTensorMeta>;

  float decay;            // 1 - lr * weight_decay
  float lerp_weight;      // 1 - beta1
  float beta2;
  float one_minus_beta2;  // 1 - beta2
  float eps;
  double host_grad_mult;  // clip_coef / grad_scale from CPU scalars (1 when absent)
  double lr, beta1_d, beta2_d;  // for the bias corrections of step counts on the GPU
  double weight_decay_d;        // for the decay of a learning rate read on the GPU
  const void* lr_ptr;           // the learning rate, fp32 or fp64 on the GPU, or nullptr (lr)
  bool lr_is_double;
  const float* grad_scale;  // on the GPU, or nullptr
  const float* clip_coef;   // on the GPU, or nullptr
  const float* found_inf;   // on the GPU, or nullptr
  bool maximize;

  __device__ __forceinline__ void operator()(const Metadata& tl, int tensor, int64_t start,
                                             int n) const {
    if (found_inf != nullptr && *found_inf != 0.0f) return;
    // (1 / grad_scale) * clip_coef in fp64, rounded once, as the C++, Triton and ref backends
    // build it (two fp32 roundings were 1 ulp off for a scale that is not a power of two)
    double mult_d = host_grad_mult;
    if (grad_scale != nullptr) mult_d = mult_d / double(*grad_scale);
    if (clip_coef != nullptr) mult_d = mult_d * double(*clip_coef);
    const float mult = float(mult_d);
    MasterTensorMeta meta = tl.meta[tensor];
    double lr_d = lr;
    float decay_c = decay;
    if (lr_ptr != nullptr) {
      // A tensor lr (capturable): the host's formulas, in fp64, from its value (steps are then
      // on the GPU too, so both corrections are computed below).
      lr_d = lr_is_double ? *static_cast<const double*>(lr_ptr)
                          : double(*static_cast<const float*>(lr_ptr));
      decay_c = float(1.0 - lr_d * weight_decay_d);
    }
    if (meta.step != nullptr) {
      // Device step counts (capturable): the host corrections' formula, in fp64, here.
      const double step = *meta.step;
      meta.neg_step_size = float(-lr_d / (1.0 - ::pow(beta1_d, step)));
      meta.bc2_sqrt = float(::sqrt(1.0 - ::pow(beta2_d, step)));
    }
    // torch's lerp switches formula at weight 0.5 for accuracy (ATen/native/Lerp.h).
    const bool small_weight = lerp_weight < 0.5f;
    const float one_minus_weight = 1.0f - lerp_weight;

    uint16_t* p_ptr = static_cast<uint16_t*>(tl.addresses[0][tensor]) + start;
    const uint16_t* g_ptr = static_cast<const uint16_t*>(tl.addresses[1][tensor]) + start;
    float* m_ptr = static_cast<float*>(tl.addresses[2][tensor]) + start;
    float* v_ptr = static_cast<float*>(tl.addresses[3][tensor]) + start;
    float* master_ptr = nullptr;
    uint16_t* comp_ptr = nullptr;
    if constexpr (MASTER) master_ptr = static_cast<float*>(tl.addresses[4][tensor]) + start;
    if constexpr (KAHAN) comp_ptr = static_cast<uint16_t*>(tl.addresses[4][tensor]) + start;
    const uint32_t base = meta.seed + uint32_t(start);

    // One element: g, x (the weight in fp32), m and v in, x, m and v out.
    auto update = [&](float g, float& x, float& m, float& v) {
      g *= mult;
      if (maximize) g = -g;
      x = x * decay_c;
      const float diff = g - m;
      m = small_weight ? m + lerp_weight * diff : g - diff * one_minus_weight;
      v = v * beta2;
      v = v + one_minus_beta2 * g * g;
      const float denom = __fdiv_rn(__fsqrt_rn(v), meta.bc2_sqrt) + eps;
      x = x + __fdiv_rn(meta.neg_step_size * m, denom);
    };
    auto round = [&](float x, int i) -> uint16_t {
      if constexpr (SR) {
        return Fmt::round_stochastic(x, hash32(base + uint32_t(i)));
      } else {
        return Fmt::round_nearest(x);
      }
    };

    // 16-byte accesses: 8 elements per thread per iteration, one access to each bf16/fp16 array
    // and two to each fp32 one.
    int body = 0;
    if (mta::aligned16(tl, tensor)) {
      using HalfVec = mta::Vec16<uint16_t>;
      using FloatVec = mta::Vec16<float>;
      const int nvec = n / 8;
      for (int i = threadIdx.x; i < nvec; i += kThreads) {
        const HalfVec gv = reinterpret_cast<const HalfVec*>(g_ptr)[i];
        HalfVec pv, cv;
        FloatVec xv[2];
        if constexpr (MASTER) {
          xv[0] = reinterpret_cast<const FloatVec*>(master_ptr)[2 * i];
          xv[1] = reinterpret_cast<const FloatVec*>(master_ptr)[2 * i + 1];
        } else {
          pv = reinterpret_cast<const HalfVec*>(p_ptr)[i];
          if constexpr (KAHAN) cv = reinterpret_cast<const HalfVec*>(comp_ptr)[i];
        }
        FloatVec mv[2] = {reinterpret_cast<const FloatVec*>(m_ptr)[2 * i],
                          reinterpret_cast<const FloatVec*>(m_ptr)[2 * i + 1]};
        FloatVec vv[2] = {reinterpret_cast<const FloatVec*>(v_ptr)[2 * i],
                          reinterpret_cast<const FloatVec*>(v_ptr)[2 * i + 1]};
        HalfVec po, co;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float x;
          if constexpr (MASTER) {
            x = xv[k / 4].val[k % 4];
          } else if constexpr (KAHAN) {
            x = Fmt::load(pv.val[k]) + Fmt::load(cv.val[k]);
          } else {
            x = Fmt::load(pv.val[k]);
          }
          update(Fmt::load(gv.val[k]), x, mv[k / 4].val[k % 4], vv[k / 4].val[k % 4]);
          po.val[k] = round(x, 8 * i + k);
          if constexpr (MASTER) xv[k / 4].val[k % 4] = x;
          if constexpr (KAHAN) co.val[k] = Fmt::round_nearest(x - Fmt::load(po.val[k]));
        }
        reinterpret_cast<HalfVec*>(p_ptr)[i] = po;
        if constexpr (KAHAN) reinterpret_cast<HalfVec*>(comp_ptr)[i] = co;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (MASTER) reinterpret_cast<FloatVec*>(master_ptr)[2 * i + h] = xv[h];
          reinterpret_cast<FloatVec*>(m_ptr)[2 * i + h] = mv[h];
          reinterpret_cast<FloatVec*>(v_ptr)[2 * i + h] = vv[h];
        }
      }
      body = nvec * 8;
    }

    // Unaligned tensors, and the last n % 8 elements of aligned ones.
    for (int i = body + threadIdx.x; i < n; i += kThreads) {
      float x;
      if constexpr (MASTER) {
        x = master_ptr[i];
      } else if constexpr (KAHAN) {
        x = Fmt::load(p_ptr[i]) + Fmt::load(comp_ptr[i]);
      } else {
        x = Fmt::load(p_ptr[i]);
      }
      float m = m_ptr[i];
      float v = v_ptr[i];
      update(Fmt::load(g_ptr[i]), x, m, v);
      const uint16_t p_new = round(x, i);
      if constexpr (MASTER) master_ptr[i] = x;
      if constexpr (KAHAN) comp_ptr[i] = Fmt::round_nearest(x - Fmt::load(p_new));
      p_ptr[i] = p_new;
      m_ptr[i] = m;
      v_ptr[i] = v;
    }
  }
};

template <typename T>
struct SumSquaresFunctor {
  using Metadata = TensorListMetadata<1, int64_t>;  // meta: this tensor's first slot
  // fp64 tensors are summed in fp64: their squares can overflow or underflow fp32.
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  double* partial;

  __device__ __forceinline__ void operator()(const Metadata& tl, int tensor, int64_t start,
                                             int n) const {
    const T* x = static_cast<const T*>(tl.addresses[0][tensor]) + start;
    acc_t acc = 0;
    // 16-byte loads where the tensor's base allows (chunks start at multiples of kChunkSize)
    int body = 0;
    if (mta::aligned16(tl, tensor)) {
      using V = mta::Vec16<T>;
      constexpr int kV = V::kSize;
      const int nvec = n / kV;
      for (int i = threadIdx.x; i < nvec; i += mta::kBlockSize) {
        const V xv = reinterpret_cast<const V*>(x)[i];
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          const acc_t v = static_cast<acc_t>(xv.val[k]);
          acc += v * v;
        }
      }
      body = nvec * kV;
    }
    for (int i = body + threadIdx.x; i < n; i += mta::kBlockSize) {
      const acc_t v = static_cast<acc_t>(x[i]);
      acc += v * v;
    }
    using BlockReduce = cub::BlockReduce<acc_t, mta::kBlockSize>;
    __shared__ typename BlockReduce::TempStorage temp;
    const acc_t total = BlockReduce(temp).Sum(acc);
    if (threadIdx.x == 0) partial[tl.meta[tensor] + start / mta::kChunkSize] = total;
  }
};

// A one-element fp32 tensor for the kernel: nullptr when absent or on the CPU (read on the host),
// its address when on params' device.
const float* device_scalar(const c10::optional<at::Tensor>& t, const char* name,
                           const at::Device& device) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == 1, "fastllm.adamw_master_step (cuda): ", name,
              " must have one element, has ", t->numel());
  if (t->is_cpu()) return nullptr;
  TORCH_CHECK(t->device() == device && t->scalar_type() == at::kFloat,
              "fastllm.adamw_master_step (cuda): ", name, " must be an fp32 tensor on ", device,
              " or on the CPU; got ", t->scalar_type(), " on ", t->device());
  return t->data_ptr<float>();
}

}  // namespace

void adamw_master_step_cuda(const std::vector<at::Tensor>& params,
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
                            const c10::optional<at::Tensor>& found_inf,
                            const c10::optional<at::Tensor>& lr_tensor) {
  if (params.empty()) return;
  const auto dtype = params[0].scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "fastllm.adamw_master_step: params must be bfloat16 or float16, got ", dtype);
  const bool master = !masters.empty();
  const bool kahan = !kahan_comps.empty();
  TORCH_CHECK(!(master && kahan), "fastllm.adamw_master_step: pass either masters or "
              "kahan_comps, not both");
  TORCH_CHECK(params[0].is_cuda(), "fastllm.adamw_master_step (cuda): params[0] must be a CUDA "
              "tensor, got one on ", params[0].device());
  const auto check = [&](const std::vector<at::Tensor>& list, const char* name,
                         at::ScalarType expected) {
    check_tensor_list("fastllm.adamw_master_step (cuda)", list, name, params,
                      params[0].device(), expected);
  };
  check(params, "params", dtype);
  check(grads, "grads", dtype);
  if (master) check(masters, "masters", at::kFloat);
  check(exp_avgs, "exp_avgs", at::kFloat);
  check(exp_avg_sqs, "exp_avg_sqs", at::kFloat);
  if (kahan) check(kahan_comps, "kahan_comps", dtype);
  TORCH_CHECK(steps.size() == params.size(), "fastllm.adamw_master_step: steps has ",
              steps.size(), " tensors but params has ", params.size());
  const auto device = params[0].device();
  const float* grad_scale_ptr = device_scalar(grad_scale, "grad_scale", device);
  const float* clip_coef_ptr = device_scalar(clip_coef, "clip_coef", device);
  const float* found_inf_ptr = device_scalar(found_inf, "found_inf", device);
  const void* lr_ptr = nullptr;
  if (lr_tensor.has_value()) {
    TORCH_CHECK(lr_tensor->numel() == 1, "fastllm.adamw_master_step (cuda): lr_tensor must have "
                "one element, has ", lr_tensor->numel());
    if (lr_tensor->is_cpu()) {
      lr = lr_tensor->item<double>();  // no GPU synchronisation
    } else {
      TORCH_CHECK(lr_tensor->device() == device, "fastllm.adamw_master_step (cuda): lr_tensor "
                  "is on ", lr_tensor->device(), " but params[0] is on ", device);
      TORCH_CHECK(lr_tensor->scalar_type() == at::kFloat ||
                  lr_tensor->scalar_type() == at::kDouble, "fastllm.adamw_master_step (cuda): "
                  "lr_tensor on the GPU must be float32 or float64, got ",
                  lr_tensor->scalar_type());
      lr_ptr = lr_tensor->data_ptr();
    }
  }
  if (found_inf.has_value() && found_inf->is_cpu() && found_inf->item<double>() != 0.0) return;
  double host_mult = 1.0;
  if (grad_scale.has_value() && grad_scale->is_cpu()) host_mult /= grad_scale->item<double>();
  if (clip_coef.has_value() && clip_coef->is_cpu()) host_mult *= clip_coef->item<double>();

  const uint32_t seed32 =
      hash32(uint32_t(uint64_t(seed)) ^ hash32(uint32_t(uint64_t(seed) >> 32)));
  std::vector<MasterTensorMeta> meta(params.size());
  for (const auto i : c10::irange(params.size())) {
    TORCH_CHECK(steps[i].numel() == 1, "fastllm.adamw_master_step (cuda): steps[", i,
                "] must have one element");
    const uint32_t tensor_seed = hash32(seed32 + 0x9e3779b9U * uint32_t(i + 1));
    TORCH_CHECK(lr_ptr == nullptr || steps[i].device() == device, "fastllm.adamw_master_step "
                "(cuda): a learning rate on the GPU needs every step count on the GPU; steps[",
                i, "] is on ", steps[i].device());
    if (steps[i].device() == device) {
      // Read by the kernel: no host synchronisation, and the step can be graph-captured.
      TORCH_CHECK(steps[i].scalar_type() == at::kFloat, "fastllm.adamw_master_step (cuda): "
                  "steps[", i, "] on the GPU must be fp32, got ", steps[i].scalar_type());
      meta[i] = {steps[i].data_ptr<float>(), 0.0f, 1.0f, tensor_seed};
    } else {
      const double step = steps[i].item<double>();
      meta[i] = {nullptr, float(-lr / (1.0 - std::pow(beta1, step))),
                 float(std::sqrt(1.0 - std::pow(beta2, step))), tensor_seed};
    }
  }

  const at::cuda::CUDAGuard guard(device);
  auto run = [&](auto fmt, auto ma, auto ka, auto sr) {
    using Fmt = decltype(fmt);
    constexpr bool kMaster = decltype(ma)::value;
    constexpr bool kKahan = decltype(ka)::value && !kMaster;
    constexpr bool kSR = decltype(sr)::value;
    AdamWMasterFunctor<Fmt, kMaster, kKahan, kSR> op;
    op.decay = float(1.0 - lr * weight_decay);
    op.lerp_weight = float(1.0 - beta1);
    op.beta2 = float(beta2);
    op.one_minus_beta2 = float(1.0 - beta2);
    op.eps = float(eps);
    op.host_grad_mult = host_mult;
    op.lr = lr;
    op.weight_decay_d = weight_decay;
    op.lr_ptr = lr_ptr;
    op.lr_is_double = lr_ptr != nullptr && lr_tensor->scalar_type() == at::kDouble;
    op.beta1_d = beta1;
    op.beta2_d = beta2;
    op.grad_scale = grad_scale_ptr;
    op.clip_coef = clip_coef_ptr;
    op.found_inf = found_inf_ptr;
    op.maximize = maximize;
    if constexpr (kMaster) {
      mta::multi_tensor_apply<5>({&params, &grads, &exp_avgs, &exp_avg_sqs, &masters}, meta, op);
    } else if constexpr (kKahan) {
      mta::multi_tensor_apply<5>({&params, &grads, &exp_avgs, &exp_avg_sqs, &kahan_comps}, meta,
                                 op);
    } else {
      mta::multi_tensor_apply<4>({&params, &grads, &exp_avgs, &exp_avg_sqs}, meta, op);
    }
  };
  dispatch_bool(master, [&](auto ma) {
    dispatch_bool(kahan && !master, [&](auto ka) {
      dispatch_bool(stochastic_rounding, [&](auto sr) {
        if (dtype == at::kBFloat16) {
          run(lowp::BF16{}, ma, ka, sr);
        } else {
          run(lowp::F16{}, ma, ka, sr);
        }
      });
    });
  });
}

at::Tensor l2norm_cuda(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "fastllm.l2norm (cuda): needs at least one tensor");
  const auto device = tensors[0].device();
  // Slots: one per chunk, tensors in order; tensors of one dtype share a launch sequence.
  std::vector<int64_t> first_slot(tensors.size());
  int64_t slots = 0;
  for (const auto t : c10::irange(tensors.size())) {
    const auto& x = tensors[t];
    TORCH_CHECK(x.is_cuda() && x.device() == device && x.layout() == at::kStrided &&
                    x.is_contiguous(),
                "fastllm.l2norm (cuda): tensors[", t, "] must be a dense contiguous tensor on ",
                device);
    first_slot[t] = slots;
    slots += (x.numel() + mta::kChunkSize - 1) / mta::kChunkSize;
  }
  const at::cuda::CUDAGuard guard(device);
  auto partial = at::zeros({std::max<int64_t>(slots, 1)},
                           at::TensorOptions().dtype(at::kDouble).device(device));
  auto run = [&](auto tag, at::ScalarType dtype) {
    using T = decltype(tag);
    std::vector<at::Tensor> group;
    std::vector<int64_t> meta;
    for (const auto t : c10::irange(tensors.size())) {
      if (tensors[t].scalar_type() != dtype) continue;
      group.push_back(tensors[t]);
      meta.push_back(first_slot[t]);
    }
    if (group.empty()) return;
    SumSquaresFunctor<T> op{partial.data_ptr<double>()};
    mta::multi_tensor_apply<1>({&group}, meta, op);
  };
  for (const auto t : c10::irange(tensors.size())) {
    const auto dt = tensors[t].scalar_type();
    TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat || dt == at::kDouble,
                "fastllm.l2norm: tensors[", t, "] has dtype ", dt,
                "; expected a floating-point dtype");
  }
  run(at::BFloat16{}, at::kBFloat16);
  run(at::Half{}, at::kHalf);
  run(float{}, at::kFloat);
  run(double{}, at::kDouble);
  return partial.sum().sqrt().to(l2norm_out_dtype(tensors));
}

}  // namespace fastllm
