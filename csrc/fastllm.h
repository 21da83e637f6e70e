// Declarations of every kernel entry point in fastllm._C.
//
// Each op has one Python-facing schema (fastllm/_library.py). The functions below take exactly
// that schema's arguments; fastllm/ops/<op>.py routes a call to one of them (or to the Triton or
// reference implementation) and extension.cpp exposes them to Python.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

namespace fastllm {

// AdamW with decoupled weight decay over many tensors (torch.optim.AdamW semantics).
// params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs when amsgrad) are updated in place; grads are
// only read (divided by *grad_scale on the fly when given); nothing changes when *found_inf != 0.
// steps are the per-parameter step counts, already incremented for this step.
void adamw_step_cpu(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& max_exp_avg_sqs,
                    const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize,
                    const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf);

#ifdef FASTLLM_WITH_CUDA
// Same contract on CUDA tensors: one multi-tensor launch per chunk of tensors. grad_scale and
// found_inf are read on the device (no host sync); steps may live on the CPU or on the device.
void adamw_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs,
                     const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool amsgrad, bool maximize,
                     const c10::optional<at::Tensor>& grad_scale,
                     const c10::optional<at::Tensor>& found_inf);
#endif

}  // namespace fastllm
