"""Scaled, casting copy in Triton: dst = src * factor, computed in fp32, stored in dst's dtype.

One launch per (dst, src) pair, one program per BLOCK_SIZE elements. `factor` is scale / divisor,
formed on the host as one fp32 number, so every backend multiplies by the same value.
"""

import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels import cdiv
from fastllm.kernels.rounding import store_rounded


@triton.jit
def _scaled_copy_kernel(
    dst_ptr,  # *D, n_elements, written
    src_ptr,  # *S, n_elements, read
    factor,  # fp32 multiplier
    n_elements,  # elements of this pair
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    store_rounded(dst_ptr, offsets, x * factor, mask, "")  # nearest-even, in the interpreter too


def scaled_copy_triton(dst, src, factor):
    """dst[i] = src[i] * factor for each pair (contiguous, equal numel, one device)."""
    block = 16384 if triton_interpreting() else 4096
    for d, s in zip(dst, src):
        n = d.numel()
        if n:
            _scaled_copy_kernel[(cdiv(n, block),)](d, s, factor, n, BLOCK_SIZE=block)
