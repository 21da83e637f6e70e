// Scaled, casting copy between many tensor pairs for CPU tensors: dst[i] = src[i] * factor,
// factor = scale / *divisor, computed in fp32 and rounded to nearest even into dst's dtype.
//
// This is the one pass behind fastllm.distributed's gradient buckets (pack tensors into a flat
// bucket, unpack it again) and the low-precision DDP comm hooks (cast to bf16 with 1/world-size
// and the loss-scale unscale folded in, cast back). Pairs are cut into chunks of kChunk elements
// that run in parallel; each element is written once, so the result does not depend on threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <cstdint>

#include "low_precision.h"
#include "fastllm.h"

namespace fastllm {
namespace {

constexpr int64_t kChunk = 1 << 15;

struct LoadF32 {
  static float load(float v) { return v; }
};
struct StoreF32 {
  static float store(float v) { return v; }
};
struct StoreBF16 {
  static uint16_t store(float v) { return lowp::BF16::round_nearest(v); }
};
struct StoreF16 {
  static uint16_t store(float v) { return lowp::F16::round_nearest(v); }
};

template <typename S, typename Load, typename D, typename Store>
void copy_run(const S* src, D* dst, int64_t n, float factor) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = Store::store(Load::load(src[i]) * factor);
}

template <typename S, typename Load>
void copy_to(const S* src, const at::Tensor& dst, int64_t begin, int64_t n, float factor) {
  switch (dst.scalar_type()) {
    case at::kFloat:
      return copy_run<S, Load, float, StoreF32>(src, static_cast<float*>(dst.data_ptr()) + begin,
                                                n, factor);
    case at::kBFloat16:
      return copy_run<S, Load, uint16_t, StoreBF16>(
          src, static_cast<uint16_t*>(dst.data_ptr()) + begin, n, factor);
    case at::kHalf:
      return copy_run<S, Load, uint16_t, StoreF16>(
          src, static_cast<uint16_t*>(dst.data_ptr()) + begin, n, factor);
    default:
      TORCH_CHECK(false, "fastllm.scaled_copy (cpu): unsupported dst dtype ", dst.scalar_type());
  }
}

void copy_chunk(const at::Tensor& dst, const at::Tensor& src, int64_t begin, int64_t n,
                float factor) {
  switch (src.scalar_type()) {
    case at::kFloat:
      return copy_to<float, LoadF32>(static_cast<const float*>(src.data_ptr()) + begin, dst,
                                     begin, n, factor);
    case at::kBFloat16:
      return copy_to<uint16_t, lowp::BF16>(static_cast<const uint16_t*>(src.data_ptr()) + begin,
                                           dst, begin, n, factor);
    case at::kHalf:
      return copy_to<uint16_t, lowp::F16>(static_cast<const uint16_t*>(src.data_ptr()) + begin,
                                          dst, begin, n, factor);
    default:
      TORCH_CHECK(false, "fastllm.scaled_copy (cpu): unsupported src dtype ", src.scalar_type());
  }
}

bool supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace

void scaled_copy_cpu(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                     double scale, const c10::optional<at::Tensor>& divisor) {
  TORCH_CHECK(dst.size() == src.size(), "fastllm.scaled_copy: dst has ", dst.size(),
              " tensors but src has ", src.size());
  for (const auto i : c10::irange(dst.size())) {
    for (const auto* t : {&dst[i], &src[i]}) {
      TORCH_CHECK(t->device().is_cpu() && t->layout() == at::kStrided && t->is_contiguous(),
                  "fastllm.scaled_copy (cpu): dst[", i, "] and src[", i,
                  "] must be dense contiguous CPU tensors");
      TORCH_CHECK(supported(t->scalar_type()), "fastllm.scaled_copy (cpu): tensor pair ", i,
                  " has dtype ", t->scalar_type(), "; expected float32, bfloat16 or float16");
    }
    TORCH_CHECK(dst[i].numel() == src[i].numel(), "fastllm.scaled_copy: dst[", i, "] has ",
                dst[i].numel(), " elements but src[", i, "] has ", src[i].numel());
  }
  double factor = scale;
  if (divisor.has_value()) {
    TORCH_CHECK(divisor->numel() == 1, "fastllm.scaled_copy: divisor must have one element");
    factor /= divisor->to(at::kCPU, at::kDouble).item<double>();
  }
  const float f = static_cast<float>(factor);
  struct Chunk {
    int64_t pair, begin, end;
  };
  std::vector<Chunk> chunks;
  for (const auto i : c10::irange(dst.size())) {
    const int64_t n = dst[i].numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({int64_t(i), b, std::min(n, b + kChunk)});
  }
  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& ch = chunks[c];
      copy_chunk(dst[ch.pair], src[ch.pair], ch.begin, ch.end - ch.begin, f);
    }
  });
}

}  // namespace fastllm
