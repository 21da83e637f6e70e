// GaLore AdamW step for one CPU matrix: project the gradient, Adam in the low-rank space,
// back-project and apply with decoupled weight decay.
//
// Maths (GaLore, Zhao et al. 2024, arXiv:2403.03507, Algorithm 2, with torch.optim.AdamW's
// update rule), for a param W (rows, cols), its grad G and an orthonormal projector P:
//   left  (P is (rows, r)):  R = P^T G   (r, cols)       back(U) = P U
//   right (P is (cols, r)):  R = G P     (rows, r)       back(U) = U P^T
//   m = lerp(m, R, 1 - beta1);  v = beta2 v + (1 - beta2) R^2          (m, v: R's shape)
//   U = m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   W = (1 - lr wd) W - lr / (1 - beta1^t) * scale * back(U)
// The two projections are GEMMs (ATen's BLAS); the Adam update of the low-rank moments is one
// fused pass that writes U over R; the back-projection, the weight decay and the update are one
// addmm_ (W = beta W + alpha P U) for fp32/fp64 params, so W is read and written once.
// Low-precision (bf16/fp16) params: the moments, projector and arithmetic are fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "fastllm.h"

namespace fastllm {
namespace {

template <typename T>
void adam_lowrank(T* __restrict r, T* __restrict m, T* __restrict v, int64_t n, T lerp_weight,
                  T beta2, T one_minus_beta2, T inv_bc2_sqrt, T eps) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const T g = r[i];
      const T mi = m[i] + lerp_weight * (g - m[i]);
      const T vi = beta2 * v[i] + one_minus_beta2 * g * g;
      m[i] = mi;
      v[i] = vi;
      r[i] = mi / (std::sqrt(vi) * inv_bc2_sqrt + eps);
    }
  });
}

}  // namespace

void galore_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& proj,
                          const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, double step,
                          bool left, double lr, double beta1, double beta2, double eps,
                          double weight_decay, double scale) {
  const char* op = "fastllm.galore_adam_step (cpu)";
  const auto opmath = param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  for (const at::Tensor* t : {&param, &grad, &proj, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->layout() == at::kStrided && t->is_contiguous() &&
                    t->dim() == 2,
                op, ": every tensor must be a dense contiguous 2-D CPU tensor");
  }
  TORCH_CHECK(grad.scalar_type() == param.scalar_type() && grad.sizes() == param.sizes(), op,
              ": grad must have param's dtype and shape");
  for (const at::Tensor* t : {&proj, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->scalar_type() == opmath, op, ": proj and the moments must be ", opmath);
  }
  const int64_t rank = proj.size(1);
  const int64_t rows = param.size(0), cols = param.size(1);
  TORCH_CHECK(proj.size(0) == (left ? rows : cols), op, ": proj has shape ", proj.sizes(),
              " for a ", left ? "left" : "right", " projection of a param of shape ",
              param.sizes());
  const std::vector<int64_t> low_shape = left ? std::vector<int64_t>{rank, cols}
                                              : std::vector<int64_t>{rows, rank};
  TORCH_CHECK(exp_avg.sizes() == at::IntArrayRef(low_shape) &&
                  exp_avg_sq.sizes() == at::IntArrayRef(low_shape),
              op, ": exp_avg and exp_avg_sq must have the low-rank shape ",
              at::IntArrayRef(low_shape));

  const at::Tensor g = grad.scalar_type() == opmath ? grad : grad.to(opmath);
  at::Tensor low = left ? at::mm(proj.t(), g) : at::mm(g, proj);
  const double bc1 = 1.0 - std::pow(beta1, step);
  const double inv_bc2_sqrt = 1.0 / std::sqrt(1.0 - std::pow(beta2, step));
  if (opmath == at::kDouble) {
    adam_lowrank<double>(low.data_ptr<double>(), exp_avg.data_ptr<double>(),
                         exp_avg_sq.data_ptr<double>(), low.numel(), 1.0 - beta1, beta2,
                         1.0 - beta2, inv_bc2_sqrt, eps);
  } else {
    adam_lowrank<float>(low.data_ptr<float>(), exp_avg.data_ptr<float>(),
                        exp_avg_sq.data_ptr<float>(), low.numel(), float(1.0 - beta1),
                        // 1 - beta2 from the double: in fp32, 1 - fp32(0.999) is off by 1.3e-5
                        float(beta2), float(1.0 - beta2), float(inv_bc2_sqrt), float(eps));
  }
  const double decay = 1.0 - lr * weight_decay;
  const double alpha = -lr * scale / bc1;
  if (param.scalar_type() == opmath) {
    if (left) {
      param.addmm_(proj, low, decay, alpha);
    } else {
      param.addmm_(low, proj.t(), decay, alpha);
    }
  } else {
    at::Tensor w = param.to(opmath);
    if (left) {
      w.addmm_(proj, low, decay, alpha);
    } else {
      w.addmm_(low, proj.t(), decay, alpha);
    }
    param.copy_(w);
  }
}

}  // namespace fastllm
