"""Global L2 norm of many tensors in Triton: one program per BLOCK_SIZE elements of one tensor.

Each program writes the sum of squares of its block to its own fp64 slot of one buffer; the
slots are added in fp64 afterwards. Blocks are summed in fp32, or in fp64 for fp64 tensors (whose
squares can overflow or underflow fp32). No atomics, so the norm is the same from run to run.
"""

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting


@triton.jit
def _sum_squares_kernel(
    x_ptr,  # *T, n_elements, read only
    partial_ptr,  # *fp64, one slot per program
    n_elements,  # number of elements of this tensor
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr + offsets, mask=offsets < n_elements, other=0.0)
    if x_ptr.dtype.element_ty != tl.float64:
        x = x.to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0).to(tl.float64))


def _block_size():
    return 16384 if triton_interpreting() else 4096


def l2norm_triton(tensors):
    """sqrt(sum of squares) of every element of `tensors`: a 0-dim tensor on their device, fp64
    when every tensor is fp64, else fp32."""
    block = _block_size()
    blocks = [triton.cdiv(t.numel(), block) for t in tensors]
    partial = torch.zeros(max(sum(blocks), 1), dtype=torch.float64, device=tensors[0].device)
    start = 0
    for t, nb in zip(tensors, blocks):
        if nb == 0:
            continue
        _sum_squares_kernel[(nb,)](t, partial[start:], t.numel(), BLOCK_SIZE=block)
        start += nb
    fp64 = all(t.dtype == torch.float64 for t in tensors)
    return partial.sum().sqrt().to(torch.float64 if fp64 else torch.float32)
