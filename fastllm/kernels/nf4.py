"""NF4 dequantisation in Triton: out[i] = code[q_i] * absmax[i // BLOCKSIZE], rounded into out.

One program per BLOCK output elements (a multiple of the quantisation block): it loads BLOCK / 2
packed bytes as one contiguous vector, splits each into its high (even element) and low (odd
element) nibble, looks both up in the 16-entry code table (64 bytes, cache-resident) and
interleaves them back into element order with tl.join, so the stores are contiguous too.
"""

import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels import cdiv
from fastllm.kernels.rounding import store_rounded


@triton.jit
def _nf4_dequantize_kernel(
    out_ptr,  # *D, n elements, written
    packed_ptr,  # *u8, ceil(n / 2) bytes
    absmax_ptr,  # *f32, ceil(n / BLOCKSIZE) values
    code_ptr,  # *f32, 16 values
    n,  # elements
    BLOCK: tl.constexpr,  # output elements per program, a multiple of BLOCKSIZE
    BLOCKSIZE: tl.constexpr,  # elements per absmax
):
    pid = tl.program_id(0).to(tl.int64)
    pairs = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    byte = tl.load(packed_ptr + pairs, mask=pairs < (n + 1) // 2, other=0)
    hi = tl.load(code_ptr + (byte >> 4).to(tl.int32))
    lo = tl.load(code_ptr + (byte & 15).to(tl.int32))
    values = tl.reshape(tl.join(hi, lo), (BLOCK // BLOCKSIZE, BLOCKSIZE))
    groups = pid * (BLOCK // BLOCKSIZE) + tl.arange(0, BLOCK // BLOCKSIZE)
    scale = tl.load(absmax_ptr + groups, mask=groups < (n + BLOCKSIZE - 1) // BLOCKSIZE, other=0.0)
    values = tl.reshape(values * scale[:, None], (BLOCK,))
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    store_rounded(out_ptr, offsets, values, offsets < n, "")


def nf4_dequantize_triton(packed, absmax, code, out, blocksize):
    """Fill `out` (contiguous, fp32/bf16/fp16) from NF4 `packed` / `absmax` at `blocksize`."""
    n = out.numel()
    if n == 0:
        return
    block = max(blocksize, 16384 if triton_interpreting() else 2048)
    _nf4_dequantize_kernel[(cdiv(n, block),)](out, packed, absmax, code, n, BLOCK=block,
                                               BLOCKSIZE=blocksize)
