// fp32 GEMMs on the CPU by fastllm's routes, for CPUs where ATen's fp32 path runs far below the
// hardware (fastllm/_gemm.py owns the policy and says when): oneDNN here, fastllm's own AVX2
// kernel in csrc/cpu/sgemm_avx2.cpp.
//
// ATen multiplies fp32 matrices on x86 with MKL's sgemm. On AMD CPUs MKL does not take its
// AVX-512 code: measured on an AMD EPYC Zen 5 (AVX-512, 2 threads, torch 2.13), sgemm ran at
// 55-67 GFLOP/s on a SmolLM2-sized (4096 x 576) x (576 x 1536) product and 16 GFLOP/s on a
// LoRA-sized 4096 x 16 x 576 one, where PyTorch's own copy of oneDNN (the library its bf16
// matmuls go through; it picks its kernels from the CPU's features, not its vendor) ran the same
// fp32 products at 132-154 and 188 GFLOP/s (BENCHMARKS.md). Both accumulate in fp32; only the
// order of the sums differs.
//
// The oneDNN entry is ATen's own at::native::mkldnn_matmul (beta/alpha, transposed operands
// without a copy, the sum fused into the output): exported by libtorch_cpu but not in the
// installed headers, so it is looked up at run time, and a torch without it (a build without
// oneDNN) only loses the route (onednn_gemm_available() false), never the extension. It refuses
// CPUs without AVX-512 (or AVX-NE-CONVERT), fp32 included: there the AVX2 kernel is the route.
#include <dlfcn.h>

#include <atomic>

#include "../fastllm.h"

namespace fastllm {

namespace {

using MatmulFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float, float);

MatmulFn onednn_matmul() {
  // at::native::mkldnn_matmul(const Tensor&, const Tensor&, const Tensor&, float, float)
  static const MatmulFn fn = reinterpret_cast<MatmulFn>(
      torch_cpu_symbol("_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff"));
  return fn;
}

// the route of the C++ kernels' fp32 GEMMs: 0 ATen, 1 oneDNN, 2 fastllm's AVX2 kernel
std::atomic<int> g_route{0};

bool routed(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  return g_route.load(std::memory_order_relaxed) != 0 && a.scalar_type() == at::kFloat &&
         b.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && a.dim() == 2 &&
         b.dim() == 2 && out.dim() == 2 && a.device().is_cpu() && out.is_contiguous() &&
         !a.is_neg() && !b.is_neg();  // (ATen resolves a negative bit; the routes refuse it)
}

}  // namespace

void* torch_cpu_symbol(const char* name) {
#if defined(__linux__)
  void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  return lib == nullptr ? nullptr : dlsym(lib, name);
#else
  (void)name;
  return nullptr;
#endif
}

bool onednn_gemm_available() { return onednn_matmul() != nullptr; }

void set_fp32_gemm_route(int64_t route) {
  TORCH_CHECK(route >= 0 && route <= 2, "fastllm: fp32 GEMM route must be 0 (ATen), 1 (oneDNN) "
              "or 2 (AVX2), got ", route);
  TORCH_CHECK(route != 1 || onednn_gemm_available(),
              "fastllm: this PyTorch has no oneDNN matmul (at::native::mkldnn_matmul)");
  TORCH_CHECK(route != 2 || sgemm_avx2_available(),
              "fastllm: this CPU (or build) has no AVX2 + FMA for fastllm's fp32 GEMM");
  g_route.store(static_cast<int>(route), std::memory_order_relaxed);
}

int64_t fp32_gemm_route() { return g_route.load(std::memory_order_relaxed); }

void check_fp32_gemm_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2,
              "fastllm.gemm: a, b and out must be 2-D, got ", a.sizes(), ", ", b.sizes(), ", ",
              out.sizes());
  TORCH_CHECK(a.size(1) == b.size(0) && out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "fastllm.gemm: shapes do not chain: a ", a.sizes(), " @ b ", b.sizes(), " into out ",
              out.sizes());
  for (const at::Tensor* t : {&a, &b, &out}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "fastllm.gemm: fp32 tensors only, got ",
                t->scalar_type());
    TORCH_CHECK(t->device().is_cpu() && t->layout() == at::kStrided,
                "fastllm.gemm: dense CPU tensors only");
  }
  TORCH_CHECK(out.is_contiguous(), "fastllm.gemm: out must be contiguous");
  TORCH_CHECK(!a.is_neg() && !b.is_neg(),
              "fastllm.gemm: a and b must not carry a negative bit (resolve_neg() first)");
}

void gemm_onednn_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                     double beta, double alpha) {
  TORCH_CHECK(onednn_gemm_available(),
              "fastllm.gemm: this PyTorch has no oneDNN matmul (at::native::mkldnn_matmul)");
  check_fp32_gemm_args(a, b, out);
  if (out.numel() == 0) return;
  // oneDNN is not asked for what it does not do: an empty inner dimension, alpha 0 (it would
  // leave out untouched even for beta 0)
  if (a.size(1) == 0 || alpha == 0.0) {
    if (beta == 0.0) {
      out.zero_();
    } else if (beta != 1.0) {
      out.mul_(beta);
    }
    return;
  }
  onednn_matmul()(a, b, out, static_cast<float>(beta), static_cast<float>(alpha));
}

namespace {
// The AVX2 kernel's packing pays from here on (csrc/cpu/sgemm_avx2.cpp): below 64 in any
// dimension or 2^25 multiply-adds (a LoRA r=16 product, an attention block of 128 x 64 x 512, a
// 300^3 cube) ATen's GEMM ran as fast or faster on the Zen 2 it was measured on.
bool avx2_pays(const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  return m >= 64 && n >= 64 && k >= 64 && m * n * k >= (int64_t{1} << 25);
}
}  // namespace

void gemm_routed_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                     double beta, double alpha) {
  const int64_t route = g_route.load(std::memory_order_relaxed);
  if (route == 1) {
    gemm_onednn_cpu(a, b, out, beta, alpha);
  } else if (route == 2 && avx2_pays(a, b)) {
    sgemm_avx2_cpu(a, b, out, beta, alpha);
  } else {
    check_fp32_gemm_args(a, b, out);
    auto o = out;
    if (beta == 0.0 && alpha == 1.0) {
      at::mm_out(o, a, b);  // (addmm_ with beta 0 ran a LoRA r=16 product 1.3x slower)
    } else {
      o.addmm_(a, b, beta, alpha);  // (beta 0: torch does not read out either)
    }
  }
}

void routed_mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (routed(a, b, out)) {
    gemm_routed_cpu(a, b, out, 0.0, 1.0);
  } else {
    auto o = out;
    at::mm_out(o, a, b);
  }
}

void bias_mm_out(const at::Tensor& out, const at::Tensor& bias, const at::Tensor& a,
                 const at::Tensor& b) {
  if (routed(a, b, out) && bias.scalar_type() == at::kFloat) {
    out.copy_(bias.expand(out.sizes()));
    gemm_routed_cpu(a, b, out, 1.0, 1.0);
  } else {
    auto o = out;
    at::addmm_out(o, bias, a, b);
  }
}

void addmm_inplace(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                   double alpha) {
  if (routed(a, b, out)) {
    gemm_routed_cpu(a, b, out, 1.0, alpha);
  } else {
    out.addmm_(a, b, 1.0, alpha);
  }
}

}  // namespace fastllm
