"""Rounding helpers shared by the Triton kernels.

`fp32_to_bf16_rne` rounds fp32 to bf16 to nearest-even with integer arithmetic. A plain
`.to(tl.bfloat16)` does the same on a GPU, but Triton's CPU interpreter truncates instead, which
biases every low-precision update towards zero; the bit arithmetic gives the same, correctly
rounded, result on both.
"""

import triton
import triton.language as tl


@triton.jit
def fp32_to_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    # NaN must stay NaN (rounding could carry its payload into the exponent): keep it quiet.
    rounded = tl.where(x != x, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_rounded(ptr, offsets, x, mask):
    """Store fp32 `x` into `ptr`'s element type, rounding to nearest-even."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr + offsets, fp32_to_bf16_rne(x), mask=mask)
    else:
        tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)
