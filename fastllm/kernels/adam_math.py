"""The AdamW update shared by the Triton kernels (adamw.py, adamw_master.py,
adamw8bit.py).

One `@triton.jit` helper per stage, so every kernel computes the same thing in the same order as
csrc/cpu/adamw.cpp and csrc/cuda/adamw.cu (torch's single-tensor AdamW):
    g  = grad * (1 / grad_scale)           correctly rounded reciprocal, as the C++/CUDA kernels
    m  = lerp(m, g, 1 - beta1)             torch's two-formula lerp (ATen/native/Lerp.h)
    v  = v * beta2 + (1 - beta2) * g * g
    x  = x + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Constants are computed on the host in double and passed rounded to fp32 (`host_constants`), as
the C++ and CUDA kernels get them, never recomputed from fp32 operands in the kernel. The bias
corrections come from the step count on the device (`step_scalars`), computed in fp64 there,
so a step needs no host read of the step and can be captured in a CUDA graph; so is the learning
rate when it is a tensor (`step_scalars`). Triton passes
Python floats as fp32, so the fp64 inputs of that computation (lr, log(beta1), log(beta2)) travel
as the int64 bit patterns of the host's doubles (`f64_bits`), bitcast back in the kernel: exact,
and used straight from the kernel's parameters (an fp64 sum of an fp32 pair, live across a
persistent kernel's loop, is what ptxas once spilled). Every array a step streams is read and
written with evict_first (`stream_load`, `stream_store`).
"""

import math
import struct

import torch
import triton
import triton.language as tl


def f64_bits(value):
    """The IEEE-754 bits of the double `value` as a signed int64 (a kernel argument that
    `as_f64` turns back into the same double)."""
    return struct.unpack("q", struct.pack("d", value))[0]


def host_constants(lr, beta1, beta2, weight_decay, lr_tensor=None):
    """The kernel's scalar arguments, in double on the host: a dict of keyword arguments.

    With `lr_tensor` (one element on the kernel's device) the kernel reads the learning rate
    there (LR_PTR) and computes 1 - lr * weight_decay itself, in fp64 from the same doubles as
    the host would (so both give the same bits); `lr` is then unused."""
    ln_beta1 = math.log(beta1) if beta1 > 0 else -math.inf
    ln_beta2 = math.log(beta2) if beta2 > 0 else -math.inf
    return dict(decay=1.0 - lr * weight_decay, lerp_weight=1.0 - beta1, beta2=beta2,
                one_minus_beta2=1.0 - beta2, lr_bits=f64_bits(lr),
                weight_decay_bits=f64_bits(weight_decay), ln_beta1_bits=f64_bits(ln_beta1),
                ln_beta2_bits=f64_bits(ln_beta2),
                # (0: an unused argument where the flag is off; never dereferenced)
                lr_ptr=0 if lr_tensor is None else lr_tensor, LR_PTR=lr_tensor is not None)


# The bit-pattern arguments of every kernel that takes host_constants(): not specialised, so a
# learning-rate schedule never recompiles a kernel (Triton specialises ints divisible by 16).
CONSTANT_BITS = ("lr_bits", "weight_decay_bits", "ln_beta1_bits", "ln_beta2_bits")


def device_step(step, device):
    """The step count as the fp32 tensor on `device` that the kernel reads (a copy only when a
    caller hands steps elsewhere; fastllm.optim.AdamW keeps them on the params' device)."""
    if step.device != device or step.dtype != torch.float32:
        step = step.to(device=device, dtype=torch.float32)
    return step


@triton.jit
def as_f64(bits):
    """The double whose bits `bits` holds (an int32 argument when Triton typed a small value so:
    widened first)."""
    # tl.cast, not .to: the interpreter hands scalar arguments over as Python ints.
    return tl.cast(tl.cast(bits, tl.int64), tl.float64, bitcast=True)


@triton.jit
def step_scalars(step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits,
                 ln_beta2_bits, LR_PTR: tl.constexpr):
    """(-lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * wd) in fp32, from the fp32 step count at
    step_ptr and the learning rate: the host's double (lr_bits; `decay` computed on the host) or,
    with LR_PTR, the one element at lr_ptr, widened to fp64 (as torch's fused AdamW reads a
    tensor lr).

    beta^t = exp(t ln beta) in fp64 agrees with the host's pow to ~1e-15 relative, far below the
    fp32 rounding that follows."""
    if LR_PTR:
        lr = tl.load(lr_ptr).to(tl.float64)
        decay_out = (1.0 - lr * as_f64(weight_decay_bits)).to(tl.float32)
    else:
        lr = as_f64(lr_bits)
        decay_out = decay
    step = tl.load(step_ptr).to(tl.float64)
    bc1 = 1.0 - tl.exp(step * as_f64(ln_beta1_bits))
    bc2 = 1.0 - tl.exp(step * as_f64(ln_beta2_bits))
    neg_step_size = (-lr / bc1).to(tl.float32)
    bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
    return neg_step_size, bc2_sqrt, decay_out


def one_multiplier(grad_scale, clip_coef):
    """(grad_scale, clip_coef) as load_grad takes them: with both, one fp32 multiplier
    (1 / grad_scale) * clip_coef built in fp64 on the device and passed as clip_coef alone, as
    the C++/CUDA kernels build theirs (two fp32 products rounded the grad twice: 1 ulp off them
    on ~20% of elements; fp64 inside the kernel made the master kernel spill on Triton 3.6)."""
    if grad_scale is None or clip_coef is None:
        return grad_scale, clip_coef
    mult = (1.0 / grad_scale.double()) * clip_coef.double()
    return None, mult.float().reshape(clip_coef.shape)


@triton.jit
def inv_grad_scale(grad_scale_ptr):
    """1 / grad_scale, correctly rounded (the C++/CUDA kernels' 1.0 / scale rounded to fp32)."""
    scale = tl.load(grad_scale_ptr).to(tl.float32)
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def stream_load(ptr, offsets, mask, other):
    """A block of an array the step reads once (its params, grads, moments): evict_first, so the
    stream does not displace from the caches what the rest of the step reuses."""
    return tl.load(ptr + offsets, mask=mask, other=other, eviction_policy="evict_first")


@triton.jit
def stream_store(ptr, offsets, x, mask):
    """A block of an array the step writes once (see stream_load)."""
    tl.store(ptr + offsets, x, mask=mask, eviction_policy="evict_first")


@triton.jit
def load_grad(grad_ptr, offsets, mask, grad_scale_ptr, clip_coef_ptr,
              HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP_COEF: tl.constexpr, MAXIMIZE: tl.constexpr):
    """The gradient as the update sees it, in fp32: grad / grad_scale * clip_coef, negated when
    maximising (the scalars read on the device; a pointer whose flag is off is never read)."""
    g = stream_load(grad_ptr, offsets, mask, 0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = g * inv_grad_scale(grad_scale_ptr)
    if HAS_CLIP_COEF:
        g = g * tl.load(clip_coef_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2):
    """The moment updates in fp32: (lerp(m, g, 1 - beta1), v * beta2 + (1 - beta2) g^2).

    torch's lerp takes 1 - weight in fp32 from the fp32 weight; so does this."""
    diff = g - m
    if lerp_weight < 0.5:
        m = m + lerp_weight * diff
    else:
        m = g - diff * (1.0 - lerp_weight)
    v = v * beta2
    v = v + one_minus_beta2 * g * g
    return m, v


@triton.jit
def adam_param(x, m, v_used, neg_step_size, bc2_sqrt, eps):
    """x + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), sqrt and divisions IEEE-rounded."""
    denom = tl.div_rn(tl.sqrt_rn(v_used), bc2_sqrt) + eps
    return x + tl.div_rn(neg_step_size * m, denom)
