// NF4 dequantisation for CPU tensors (fastllm::nf4_dequantize, fastllm/ops/nf4.py).
//
// A weight of n elements is stored as ceil(n / 2) bytes, two 4-bit codes each (the element of
// even index in the high nibble: bitsandbytes' layout), and one fp32 absmax per block of
// `blocksize` consecutive elements. Element i is code_table[q_i] * absmax[i / blocksize], the
// product in fp32, rounded to nearest even into the output's dtype (fp32, bf16, fp16).
//
// Blocks run in parallel in chunks of whole blocks; each output element is written once, so the
// result does not depend on the thread count. A byte's two values come from a 256-entry table
// of value pairs (2 KiB, in L1), built once per call from the 16 codes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>
#include <cstdint>

#include "fastllm.h"
#include "low_precision.h"

namespace fastllm {
namespace {

struct StoreF32 {
  using T = float;
  static float store(float v) { return v; }
};
struct StoreBF16 {
  using T = uint16_t;
  static uint16_t store(float v) { return lowp::BF16::round_nearest(v); }
};
struct StoreF16 {
  using T = uint16_t;
  static uint16_t store(float v) { return lowp::F16::round_nearest(v); }
};

using PairTable = std::array<float, 512>;  // [byte][0: high nibble's code, 1: low nibble's]

// Elements [begin, end) of the output, begin even (blocks are an even number of elements).
template <typename Store>
void dequantize_range(const uint8_t* packed, const float* absmax, const PairTable& pairs,
                      typename Store::T* out, int64_t begin, int64_t end, int64_t blocksize) {
  for (int64_t start = begin; start < end; start += blocksize) {
    const int64_t stop = std::min(start + blocksize, end);
    const float scale = absmax[start / blocksize];
    const uint8_t* bytes = packed + start / 2;
    typename Store::T* dst = out + start;
    const int64_t whole = (stop - start) / 2;
#pragma omp simd
    for (int64_t j = 0; j < whole; ++j) {
      const float* pair = pairs.data() + 2 * int64_t(bytes[j]);
      dst[2 * j] = Store::store(pair[0] * scale);
      dst[2 * j + 1] = Store::store(pair[1] * scale);
    }
    if ((stop - start) & 1) {  // an odd total: the last byte's low nibble is padding
      dst[2 * whole] = Store::store(pairs[2 * int64_t(bytes[whole])] * scale);
    }
  }
}

template <typename Store>
void dequantize_all(const at::Tensor& packed, const at::Tensor& absmax, const PairTable& pairs,
                    const at::Tensor& out, int64_t blocksize) {
  const int64_t n = out.numel();
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  // about 32K elements per task: enough work per task, and the split is by whole blocks
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / blocksize);
  const auto* p = packed.data_ptr<uint8_t>();
  const auto* a = absmax.data_ptr<float>();
  auto* o = static_cast<typename Store::T*>(out.data_ptr());
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    dequantize_range<Store>(p, a, pairs, o, b0 * blocksize, std::min(b1 * blocksize, n),
                            blocksize);
  });
}

}  // namespace

void nf4_dequantize_cpu(const at::Tensor& packed, const at::Tensor& absmax,
                        const at::Tensor& code, const at::Tensor& out, int64_t blocksize) {
  const int64_t n = out.numel();
  TORCH_CHECK(packed.device().is_cpu() && absmax.device().is_cpu() && code.device().is_cpu() &&
                  out.device().is_cpu(),
              "fastllm.nf4_dequantize (cpu): every tensor must be on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "fastllm.nf4_dequantize (cpu): packed must be a contiguous uint8 tensor");
  TORCH_CHECK(absmax.scalar_type() == at::kFloat && absmax.is_contiguous(),
              "fastllm.nf4_dequantize (cpu): absmax must be a contiguous float32 tensor");
  TORCH_CHECK(code.scalar_type() == at::kFloat && code.numel() == 16 && code.is_contiguous(),
              "fastllm.nf4_dequantize (cpu): code must be 16 contiguous float32 values");
  TORCH_CHECK(out.is_contiguous(), "fastllm.nf4_dequantize (cpu): out must be contiguous");
  TORCH_CHECK(blocksize >= 2 && blocksize % 2 == 0,
              "fastllm.nf4_dequantize (cpu): blocksize must be even and >= 2, got ", blocksize);
  TORCH_CHECK(packed.numel() == (n + 1) / 2, "fastllm.nf4_dequantize (cpu): packed has ",
              packed.numel(), " bytes, ", (n + 1) / 2, " expected for ", n, " elements");
  TORCH_CHECK(absmax.numel() == (n + blocksize - 1) / blocksize,
              "fastllm.nf4_dequantize (cpu): absmax has ", absmax.numel(), " values, ",
              (n + blocksize - 1) / blocksize, " expected");
  if (n == 0) return;
  PairTable pairs;
  const float* c = code.data_ptr<float>();
  for (int b = 0; b < 256; ++b) {
    pairs[2 * b] = c[b >> 4];
    pairs[2 * b + 1] = c[b & 15];
  }
  switch (out.scalar_type()) {
    case at::kFloat:
      return dequantize_all<StoreF32>(packed, absmax, pairs, out, blocksize);
    case at::kBFloat16:
      return dequantize_all<StoreBF16>(packed, absmax, pairs, out, blocksize);
    case at::kHalf:
      return dequantize_all<StoreF16>(packed, absmax, pairs, out, blocksize);
    default:
      TORCH_CHECK(false, "fastllm.nf4_dequantize (cpu): unsupported output dtype ",
                  out.scalar_type(), "; expected float32, bfloat16 or float16");
  }
}

}  // namespace fastllm
