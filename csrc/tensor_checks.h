// Argument checks shared by the multi-tensor kernels (CPU and CUDA), so every op reports a bad
// tensor list the same way: which list, which index, and what is wrong with it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <c10/util/irange.h>

#include <vector>

namespace fastllm {

// list[i] must be a dense, contiguous tensor on `device` with params[i]'s numel and with dtype
// `dtype` (params[i]'s dtype when not given); list and params must have the same length.
inline void check_tensor_list(const char* op, const std::vector<at::Tensor>& list,
                              const char* name, const std::vector<at::Tensor>& params,
                              const at::Device& device,
                              c10::optional<at::ScalarType> dtype = c10::nullopt) {
  TORCH_CHECK(list.size() == params.size(), op, ": ", name, " has ", list.size(),
              " tensors but params has ", params.size());
  for (const auto i : c10::irange(params.size())) {
    const auto& t = list[i];
    TORCH_CHECK(t.layout() == at::kStrided && t.device() == device, op, ": ", name, "[", i,
                "] must be a dense tensor on ", device, ", got a ", t.layout(), " tensor on ",
                t.device());
    const auto expected = dtype.value_or(params[i].scalar_type());
    TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, "[", i, "] has dtype ",
                t.scalar_type(), ", expected ", expected);
    TORCH_CHECK(t.numel() == params[i].numel(), op, ": ", name, "[", i, "] has ", t.numel(),
                " elements but params[", i, "] has ", params[i].numel());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous");
  }
}

// The value of a one-element tensor as a double. CPU fp32/fp64 tensors (step counts, grad_scale,
// found_inf) are read straight from memory: Tensor::item() goes through the dispatcher, about a
// microsecond each, which was most of a small tensor's cost in the CPU optimizer steps.
inline double scalar_value(const at::Tensor& t) {
  if (t.device().is_cpu() && t.numel() == 1 && t.layout() == at::kStrided) {
    if (t.scalar_type() == at::kFloat) return static_cast<double>(*t.const_data_ptr<float>());
    if (t.scalar_type() == at::kDouble) return *t.const_data_ptr<double>();
  }
  return t.item<double>();
}

}  // namespace fastllm
