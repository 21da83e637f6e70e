// Apply one elementwise functor to many CUDA tensors with few kernel launches.
//
// The scheme follows NVIDIA/apex (csrc/multi_tensor_apply.cuh): every tensor is cut into chunks
// of kChunkSize elements, one thread block handles one chunk, and the tensor addresses, sizes and
// per-tensor scalars of a launch travel in the kernel arguments (TensorListMetadata), so a step
// over thousands of parameters costs a handful of launches and no host-to-device copies.
//
// Kernel arguments are kept under 4 KB: the limit before CUDA 12.1 and still on pre-Volta GPUs
// (CUDA 12.1+ allows 32 KB on Volta and later), so every toolkit and GPU torch supports works.
// A launch therefore carries at most kMaxBlocks chunks and TensorListMetadata::kMaxTensors
// tensors; a tensor whose chunks do not fit in one launch continues in the next.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

namespace fastllm {
namespace mta {

// One block per chunk: 512 threads x 128 elements each keeps enough loads in flight per SM, and
// 64K-element chunks make the per-block setup (a few parameter loads) negligible.
constexpr int kBlockSize = 512;
constexpr int kChunkSize = 65536;
// Most chunks per launch (the table size). block_to_tensor is a uint8_t, so a launch holds at
// most 255 tensors.
constexpr int kMaxBlocks = 320;
// Room for the functor's own arguments (the uniform scalars) in the 4 KB argument space.
constexpr int kMaxKernelArgBytes = 4096;
constexpr int kFunctorArgBytes = 256;

// The arguments of one launch. DEPTH tensor lists (e.g. param, grad, exp_avg, exp_avg_sq);
// Meta is a trivially copyable struct of per-tensor scalars.
template <int DEPTH, typename Meta>
struct TensorListMetadata {
  static constexpr int kBytesPerTensor = DEPTH * sizeof(void*) + sizeof(int64_t) + sizeof(Meta);
  static constexpr int kBytesPerBlock = sizeof(int32_t) + sizeof(uint8_t);
  static constexpr int kMaxTensorsBySize =
      (kMaxKernelArgBytes - kFunctorArgBytes - kMaxBlocks * kBytesPerBlock - 16) / kBytesPerTensor;
  static constexpr int kMaxTensors = kMaxTensorsBySize < 255 ? kMaxTensorsBySize : 255;

  void* addresses[DEPTH][kMaxTensors];  // data pointer of tensor t in list d
  int64_t numel[kMaxTensors];           // elements of tensor t
  Meta meta[kMaxTensors];               // per-tensor scalars, passed through to the functor
  int32_t block_to_chunk[kMaxBlocks];   // which chunk of its tensor block b handles
  uint8_t block_to_tensor[kMaxBlocks];  // which tensor (slot in this launch) block b handles
};

// 16 bytes of T for one vector access: 4 fp32, 8 bf16/fp16 or 2 fp64 elements.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T val[kSize];
};

// Whether every list's tensor `tensor` starts on a 16-byte boundary. Chunks start at multiples
// of kChunkSize elements, so the base addresses decide whether a chunk takes 16-byte accesses.
template <int DEPTH, typename Meta>
__device__ __forceinline__ bool aligned16(const TensorListMetadata<DEPTH, Meta>& tl, int tensor) {
  bool aligned = true;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    aligned = aligned && reinterpret_cast<uintptr_t>(tl.addresses[d][tensor]) % 16 == 0;
  }
  return aligned;
}

// __grid_constant__ (CUDA 11.7+, sm_70+) lets the functor index the arguments in place instead of
// copying 4 KB to each thread's local memory; older architectures get plain by-value arguments.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#define FASTLLM_GRID_CONSTANT
#else
#define FASTLLM_GRID_CONSTANT __grid_constant__
#endif

// Block b runs op(tl, tensor, start, n): elements [start, start + n) of tensor slot `tensor`,
// with n <= kChunkSize.
template <int DEPTH, typename Meta, typename Op>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(const FASTLLM_GRID_CONSTANT TensorListMetadata<DEPTH, Meta> tl,
                        const Op op) {
  const int tensor = tl.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(tl.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t remaining = tl.numel[tensor] - start;
  const int n = remaining < kChunkSize ? static_cast<int>(remaining) : kChunkSize;
  op(tl, tensor, start, n);
}

// Chunks per launch: whole waves of resident blocks, at most kMaxBlocks. A launch that ends
// with a partial wave leaves most SMs idle until it finishes; apex's fixed 320 is exactly one
// wave on a V100 (80 SMs x 4 blocks), but 1.2 waves for the AdamW kernel on an H100/H200
// (132 SMs x 2 blocks of 512 threads at its register use).
template <typename Kernel>
int blocks_per_launch(Kernel kernel) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockSize, 0));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int wave = std::max(per_sm, 1) * sms;
  return wave >= kMaxBlocks ? kMaxBlocks : kMaxBlocks / wave * wave;
}

// Runs op over every element of the tensors lists[0][i], ..., lists[DEPTH-1][i] for each i on the
// current stream of the current device. The tensors at one index must have the same numel and be
// contiguous (the caller checks); meta[i] is passed to the functor with tensor i. Empty tensors
// are skipped.
template <int DEPTH, typename Meta, typename Op>
void multi_tensor_apply(const std::array<const std::vector<at::Tensor>*, DEPTH>& lists,
                        const std::vector<Meta>& meta, const Op& op) {
  using Metadata = TensorListMetadata<DEPTH, Meta>;
  static_assert(sizeof(Metadata) + sizeof(Op) <= kMaxKernelArgBytes,
                "multi_tensor_apply: kernel arguments exceed 4 KB");
  static_assert(sizeof(Op) <= kFunctorArgBytes, "multi_tensor_apply: functor too large");
  static_assert(Metadata::kMaxTensors >= 1, "multi_tensor_apply: no room for a tensor");

  const auto& first = *lists[0];
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto kernel = multi_tensor_kernel<DEPTH, Meta, Op>;
  const int max_blocks = blocks_per_launch(kernel);
  Metadata tl;
  int ntensors = 0;
  int nblocks = 0;
  auto launch = [&] {
    kernel<<<nblocks, kBlockSize, 0, stream>>>(tl, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };

  for (const auto t : c10::irange(first.size())) {
    const int64_t numel = first[t].numel();
    if (numel == 0) continue;
    const int64_t nchunks = (numel + kChunkSize - 1) / kChunkSize;
    TORCH_CHECK(nchunks <= std::numeric_limits<int32_t>::max(), "fastllm: tensor ", t, " has ",
                numel, " elements, more than multi_tensor_apply can index");
    for (const auto d : c10::irange(DEPTH)) tl.addresses[d][ntensors] = (*lists[d])[t].data_ptr();
    tl.numel[ntensors] = numel;
    tl.meta[ntensors] = meta[t];
    ++ntensors;
    for (int64_t chunk = 0; chunk < nchunks; ++chunk) {
      tl.block_to_tensor[nblocks] = static_cast<uint8_t>(ntensors - 1);
      tl.block_to_chunk[nblocks] = static_cast<int32_t>(chunk);
      ++nblocks;
      const bool last_chunk = chunk == nchunks - 1;
      const bool tensors_full = ntensors == Metadata::kMaxTensors && last_chunk;
      if (nblocks == max_blocks || tensors_full) {
        launch();
        nblocks = 0;
        if (last_chunk) {
          ntensors = 0;
        } else {
          // The current tensor continues in the next launch, as its slot 0.
          for (const auto d : c10::irange(DEPTH)) {
            tl.addresses[d][0] = tl.addresses[d][ntensors - 1];
          }
          tl.numel[0] = tl.numel[ntensors - 1];
          tl.meta[0] = tl.meta[ntensors - 1];
          ntensors = 1;
        }
      }
    }
  }
  if (nblocks > 0) launch();
}

}  // namespace mta
}  // namespace fastllm
