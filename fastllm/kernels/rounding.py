"""Rounding helpers shared by the Triton kernels: fp32 to bf16/fp16, to nearest or stochastically.

`fp32_to_bf16_rne` rounds fp32 to bf16 to nearest-even with integer arithmetic. A plain
`.to(tl.bfloat16)` does the same on a GPU, but Triton's CPU interpreter truncates instead, which
biases every low-precision update towards zero; the bit arithmetic gives the same, correctly
rounded, result on both.
"""

import triton
import triton.language as tl


def philox_key(seed, index):
    """A distinct, well-mixed 31-bit Philox key (splitmix64 finaliser) per tensor `index` of a
    call seeded `seed`: the key of a per-tensor launch; index -1 gives the key of a table
    launch, whose counters carry the tensor index instead."""
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFF


@triton.jit
def fp32_to_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    # NaN must stay NaN (rounding could carry its payload into the exponent): keep it quiet.
    rounded = tl.where(x != x, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_nearest(x, dtype: tl.constexpr):
    """fp32 -> dtype, rounded to nearest-even on the GPU and in the interpreter alike."""
    if dtype == tl.bfloat16:
        return fp32_to_bf16_rne(x)
    return x.to(dtype)


@triton.jit
def store_rounded(ptr, offsets, x, mask, EVICTION: tl.constexpr):
    """Store fp32 `x` into `ptr`'s element type, rounding to nearest-even (EVICTION: tl.store's
    eviction_policy, "" for none; no default: Triton 3.6 hands a jit function's default string
    through as a plain str, which fails to compile)."""
    tl.store(ptr + offsets, round_nearest(x, ptr.dtype.element_ty), mask=mask,
             eviction_policy=EVICTION)


@triton.jit
def round_stochastic(x, random, dtype: tl.constexpr):
    """fp32 -> dtype, rounding up with probability equal to the fraction dropped (random: uint32).
    bf16: add 16 random bits below bf16's last bit and truncate. fp16: choose between the two
    neighbours lo <= |x| < hi with probability (|x| - lo) / (hi - lo), compared exactly in fp32
    against 24 random bits; nan and values that round to inf keep round-to-nearest's result."""
    # tl.randint of 64-bit offsets gives uint64 words in Triton 3.2 and 3.3 (their low 32 bits
    # are as random); uint64 arithmetic below would not bitcast back to fp32.
    random = random.to(tl.uint32)
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        bits = (u + (random & 0xFFFF)) & 0xFFFF0000
        # A finite x above bf16's largest value can be carried up to inf where rounding to
        # nearest gives that largest value: an inf result takes round-to-nearest's instead.
        nearest = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        bits = tl.where((bits & 0x7FFFFFFF) == 0x7F800000, nearest, bits)
        out = tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(dtype)
    else:
        rn = x.to(tl.float16)
        bits = rn.to(tl.uint16, bitcast=True).to(tl.uint32)
        ax = tl.abs(x)
        arn = tl.abs(rn.to(tl.float32))
        below = arn < ax
        other = tl.where(below, bits + 1, bits - 1).to(tl.uint16).to(tl.float16, bitcast=True)
        lo = tl.where(below, rn, other)
        hi = tl.where(below, other, rn)
        alo = tl.abs(lo.to(tl.float32))
        ulp = tl.abs(hi.to(tl.float32)) - alo
        up = (random >> 8).to(tl.float32) * ulp < (ax - alo) * 16777216.0
        keep = (arn == ax) | (arn == float("inf")) | (x != x)
        out = tl.where(keep, rn, tl.where(up, hi, lo))
    return out
