// Global L2 norm of many tensors for CPU tensors: sqrt(sum_i sum_j x_ij^2) in one pass.
//
// All tensors are cut into chunks of kChunk elements; each chunk's sum of squares is accumulated
// in fp32 (fp64 for fp64 tensors) across SIMD lanes, written to its own slot, and the slots are
// added in a fixed order in fp64, so the result does not depend on the thread count. Any inf or
// nan element makes the norm non-finite (squares are never negative, so nothing cancels); so do
// finite values whose squares overflow fp32 (|x| > 1.8e19), which callers treat as overflow too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <cmath>
#include <cstdint>

#include "low_precision.h"
#include "fastllm.h"

namespace fastllm {
namespace {

constexpr int64_t kChunk = 1 << 16;

// kLanes independent accumulators: several SIMD registers' worth, so the adds do not wait on
// each other's latency.
constexpr int kLanes = 64;

template <typename T, typename Load>
double sum_squares(const T* __restrict x, int64_t n, Load load) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float v = load(x[i + j]);
      acc[j] += v * v;
    }
  }
  for (int j = 0; i + j < n; ++j) {
    const float v = load(x[i + j]);
    acc[j] += v * v;
  }
  double total = 0.0;
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

double sum_squares_chunk(const at::Tensor& t, int64_t begin, int64_t n) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return sum_squares(static_cast<const uint16_t*>(t.data_ptr()) + begin, n,
                         [](uint16_t h) { return lowp::BF16::load(h); });
    case at::kHalf:
      return sum_squares(static_cast<const uint16_t*>(t.data_ptr()) + begin, n,
                         [](uint16_t h) { return lowp::F16::load(h); });
    case at::kFloat:
      return sum_squares(static_cast<const float*>(t.data_ptr()) + begin, n,
                         [](float v) { return v; });
    case at::kDouble: {
      const double* x = static_cast<const double*>(t.data_ptr()) + begin;
      double acc = 0.0;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
      return acc;
    }
    default:
      TORCH_CHECK(false, "fastllm.l2norm: unsupported dtype ", t.scalar_type());
  }
}

}  // namespace

at::Tensor l2norm_cpu(const std::vector<at::Tensor>& tensors) {
  struct Chunk {
    int64_t tensor, begin, end;
  };
  std::vector<Chunk> chunks;
  for (const auto t : c10::irange(tensors.size())) {
    const auto& x = tensors[t];
    TORCH_CHECK(x.device().is_cpu() && x.layout() == at::kStrided && x.is_contiguous(),
                "fastllm.l2norm (cpu): tensors[", t, "] must be a dense contiguous CPU tensor");
    const auto dt = x.scalar_type();
    TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat || dt == at::kDouble,
                "fastllm.l2norm: tensors[", t, "] has dtype ", dt,
                "; expected a floating-point dtype");
    const int64_t n = x.numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({int64_t(t), b, std::min(n, b + kChunk)});
  }
  std::vector<double> partial(chunks.size(), 0.0);
  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& ch = chunks[c];
      partial[c] = sum_squares_chunk(tensors[ch.tensor], ch.begin, ch.end - ch.begin);
    }
  });
  double total = 0.0;
  for (const double p : partial) total += p;
  return at::scalar_tensor(std::sqrt(total), at::TensorOptions().dtype(l2norm_out_dtype(tensors)));
}

}  // namespace fastllm
