// Memory-bandwidth probe for `fastllm bench`: the access pattern of an optimizer step (several
// arrays read and written back, some only read) with no arithmetic to speak of, parallelised the
// same way as the fused kernels. Its bytes per second, timed in the same interleaved rounds as
// the providers (bench/harness.py memory_probe), are the ceiling that a memory-bound fused
// kernel with that pattern can reach on this machine.
//
// Why benchmark-only code ships in fastllm._C: `fastllm bench` is part of the installed package
// and runs wherever fastllm is installed, where there may be no compiler to build a probe at
// run time (and a JIT build would cost a minute of the benchmark). The ceiling must come from
// code compiled like the kernels it bounds (same -O3/-march, OpenMP, at::parallel_for chunks),
// and PyTorch's eager ops cannot stream four arrays in one pass. It is not a torch.library op
// and not public API (only fastllm._C.stream_probe_cpu), and it adds one small function.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include "fastllm.h"

namespace fastllm {

void stream_probe_cpu(const std::vector<at::Tensor>& read_write,
                      const std::vector<at::Tensor>& read_only) {
  TORCH_CHECK(!read_write.empty(), "fastllm.stream_probe: needs at least one read_write tensor");
  const int64_t n = read_write[0].numel();
  std::vector<float*> rw;
  std::vector<const float*> ro;
  for (const auto& t : read_write) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == n,
                "fastllm.stream_probe: tensors must be contiguous fp32 CPU tensors of one size");
    rw.push_back(t.data_ptr<float>());
  }
  for (const auto& t : read_only) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == n,
                "fastllm.stream_probe: tensors must be contiguous fp32 CPU tensors of one size");
    ro.push_back(t.data_ptr<float>());
  }
  constexpr int64_t kChunk = 1 << 16;
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
      if (rw.size() == 3 && ro.size() == 1) {
        // An optimizer step's pattern, all four streams in one loop as the fused kernels do.
        float* __restrict a0 = rw[0];
        float* __restrict a1 = rw[1];
        float* __restrict a2 = rw[2];
        const float* __restrict b = ro[0];
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) {
          const float g = b[i];
          a0[i] = a0[i] * 0.5f + g;
          a1[i] = a1[i] * 0.5f + g;
          a2[i] = a2[i] * 0.5f + g;
        }
        continue;
      }
      for (float* a : rw) {
        const float* b = ro.empty() ? a : ro[0];
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) a[i] = a[i] * 0.5f + b[i];
      }
      for (size_t k = 1; k < ro.size(); ++k) {
        const float* b = ro[k];
        float* a = rw[0];
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) a[i] += b[i];
      }
    }
  });
}

}  // namespace fastllm
