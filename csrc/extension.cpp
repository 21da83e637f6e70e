// fastllm._C: the compiled kernels, exposed to fastllm/ops/*.py which owns dispatch.
//
// The public ops are torch.library custom ops declared in fastllm/_library.py; their CPU and CUDA
// implementations are Python functions that pick a backend (FASTLLM_BACKEND, or the device's
// default) and, for the compiled backends, call the functions bound here. Keeping the routing in
// one place is what lets tests force the Triton or reference backend on any device.
#include <torch/extension.h>

#include "fastllm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastllm compiled kernels (C++ CPU, and CUDA when built with it)";
#ifdef FASTLLM_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.attr("cpu_capability") =
#if defined(__AVX512F__)
      "avx512";
#elif defined(__AVX2__)
      "avx2";
#elif defined(__ARM_NEON)
      "neon";
#else
      "baseline";
#endif

  auto no_gil = py::call_guard<py::gil_scoped_release>();
#ifndef FASTLLM_CUDA_ONLY  // (setup.py's FASTLLM_CUDA_ONLY: CI's compile check of csrc/cuda)
  m.def("adamw_step_cpu", &fastllm::adamw_step_cpu, no_gil);
  m.def("stream_probe_cpu", &fastllm::stream_probe_cpu, no_gil);
  m.def("lora_dropout_cpu", &fastllm::lora_dropout_cpu, no_gil);
  m.def("lora_dropout_add_cpu", &fastllm::lora_dropout_add_cpu, no_gil);
  m.def("adamw_master_step_cpu", &fastllm::adamw_master_step_cpu, no_gil);
  m.def("l2norm_cpu", &fastllm::l2norm_cpu, no_gil);
  m.def("scaled_copy_cpu", &fastllm::scaled_copy_cpu, no_gil);
  m.def("nf4_dequantize_cpu", &fastllm::nf4_dequantize_cpu, no_gil);
  // PowerSGD and GaLore
  m.def("orthogonalize_cpu", &fastllm::orthogonalize_cpu, no_gil);
  m.def("powersgd_decompress_cpu", &fastllm::powersgd_decompress_cpu, no_gil);
  m.def("galore_adam_step_cpu", &fastllm::galore_adam_step_cpu, no_gil);
  m.def("adamw8bit_step_cpu", &fastllm::adamw8bit_step_cpu, no_gil);
  m.def("fused_linear_cross_entropy_cpu", &fastllm::fused_linear_cross_entropy_cpu, no_gil);
  // fp32 GEMMs by fastllm's routes (fastllm/_gemm.py)
  m.def("gemm_onednn_cpu", &fastllm::gemm_onednn_cpu, no_gil);
  m.def("onednn_gemm_available", &fastllm::onednn_gemm_available);
  m.def("sgemm_avx2_cpu", &fastllm::sgemm_avx2_cpu, no_gil);
  m.def("sgemm_avx2_available", &fastllm::sgemm_avx2_available);
  m.def("set_fp32_gemm_route", &fastllm::set_fp32_gemm_route);
  m.def("fp32_gemm_route", &fastllm::fp32_gemm_route);
  m.def("gemm_routed_cpu", &fastllm::gemm_routed_cpu, no_gil);
  m.def("gemm_bf16f32_cpu", &fastllm::gemm_bf16f32_cpu, no_gil);
  m.def("gemm_bf16f32_available", &fastllm::gemm_bf16f32_available);
  m.def("set_gemm_bf16f32", &fastllm::set_gemm_bf16f32);
  m.def("gemm_bf16f32_engine", &fastllm::gemm_bf16f32_engine);
  m.def("gemm_bf16f32_engines", &fastllm::gemm_bf16f32_engines);
  m.def("set_gemm_bf16f32_engine", &fastllm::set_gemm_bf16f32_engine);
  m.def("gemm_bf16f32_preferred", &fastllm::gemm_bf16f32_preferred);
  m.def("bf16_gemm_on_amx", &fastllm::bf16_gemm_on_amx);
  // model ops: RMSNorm, rotary embedding, SwiGLU
  m.def("rms_norm_cpu", &fastllm::rms_norm_cpu, no_gil);
  m.def("rms_norm_backward_cpu", &fastllm::rms_norm_backward_cpu, no_gil);
  m.def("rotary_embedding_cpu", &fastllm::rotary_embedding_cpu, no_gil);
  m.def("swiglu_cpu", &fastllm::swiglu_cpu, no_gil);
  m.def("swiglu_backward_cpu", &fastllm::swiglu_backward_cpu, no_gil);
  m.def("geglu_cpu", &fastllm::geglu_cpu, no_gil);
  m.def("geglu_backward_cpu", &fastllm::geglu_backward_cpu, no_gil);
  m.def("attention_cpu", &fastllm::attention_cpu, no_gil);
  m.def("attention_backward_cpu", &fastllm::attention_backward_cpu, no_gil);
#endif
#ifdef FASTLLM_WITH_CUDA
  m.def("adamw_step_cuda", &fastllm::adamw_step_cuda, no_gil);
  m.def("adamw_master_step_cuda", &fastllm::adamw_master_step_cuda, no_gil);
  m.def("l2norm_cuda", &fastllm::l2norm_cuda, no_gil);
#endif
}
