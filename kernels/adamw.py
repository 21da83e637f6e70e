"""AdamW step in Triton: one program per BLOCK_SIZE elements of one tensor.

Maths (torch.optim.AdamW, decoupled weight decay), with step t:
    g  = grad / grad_scale               (negated when maximize)
    p  = p * (1 - lr * wd)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    vm = max(vm, v)                      (amsgrad: the denominator uses vm)
    p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Loads are upcast to fp32 and the update is kernels/adam_math.py's, shared with the mixed-precision
kernel: the same order of operations, host-computed constants and IEEE-rounded sqrt and division
as the C++ and CUDA kernels, so the backends agree with torch's single-tensor AdamW to a few ulps.
grad_scale, found_inf and the step count are read on the device: a step costs no host
synchronisation and can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels.adam_math import (adam_moments, adam_param, bias_corrections,
                                       device_step, host_constants, load_grad)
from fastllm.kernels.rounding import store_rounded


@triton.jit
def _adamw_kernel(
    param_ptr,  # *T, n elements, updated in place
    grad_ptr,  # *T, n elements, read only
    exp_avg_ptr,  # *T, first moment, updated in place
    exp_avg_sq_ptr,  # *T, second moment, updated in place
    max_exp_avg_sq_ptr,  # *T, running max of the second moment (read only when AMSGRAD)
    step_ptr,  # *fp32 scalar, this tensor's step count, already incremented
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    n_elements,  # number of elements of this tensor
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1
    beta2,  # second-moment decay
    one_minus_beta2,  # 1 - beta2, from the host's double
    lr_hi, lr_lo,  # lr as an fp32 pair (see adam_math.split_f64)
    ln_beta1_hi, ln_beta1_lo,  # log(beta1) as an fp32 pair
    ln_beta2_hi, ln_beta2_lo,  # log(beta2) as an fp32 pair
    eps,  # added to the denominator
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    if HAS_FOUND_INF:
        # One scalar load selecting the mask: a uniform condition keeps the mask's constancy, so
        # the loads stay 128-bit vectors (a per-lane broadcast load of the flag made every access
        # scalar on sm_90). tl.where, not `&`: the interpreter cannot AND a scalar into a block.
        mask = tl.where(tl.load(found_inf_ptr) == 0, mask, False)
    neg_step_size, bc2_sqrt = bias_corrections(step_ptr, lr_hi, lr_lo, ln_beta1_hi, ln_beta1_lo,
                                               ln_beta2_hi, ln_beta2_lo)

    g = load_grad(grad_ptr, offsets, mask, grad_scale_ptr, grad_scale_ptr, HAS_GRAD_SCALE,
                  False, MAXIMIZE)
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * decay
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m, v = adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2)
    v_used = v
    if AMSGRAD:
        v_max = tl.load(max_exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v_used = tl.maximum(v_max, v)
        store_rounded(max_exp_avg_sq_ptr, offsets, v_used, mask)
    p = adam_param(p, m, v_used, neg_step_size, bc2_sqrt, eps)

    store_rounded(param_ptr, offsets, p, mask)
    store_rounded(exp_avg_ptr, offsets, m, mask)
    store_rounded(exp_avg_sq_ptr, offsets, v, mask)


def _block_size():
    # The interpreter runs each program instance in numpy: fewer, larger blocks are much faster
    # there. On a GPU 1024 elements (4 warps x 8 per thread) keeps loads vectorised.
    return 16384 if triton_interpreting() else 1024


def adamw_step_triton(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None,
):
    """Launch one AdamW kernel per non-empty tensor; the same contract as fastllm.ops.adamw_step."""
    if params and params[0].dtype == torch.float64:
        raise TypeError("fastllm.adamw_step (triton): the Triton kernel computes in fp32; fp64 "
                        "params run on the cuda, cpp or ref backend")
    if params:
        # The kernel reads the scalars through pointers: they must live where the params do.
        device = params[0].device
        if grad_scale is not None and grad_scale.device != device:
            grad_scale = grad_scale.to(device)
        if found_inf is not None and found_inf.device != device:
            found_inf = found_inf.to(device)
    block = _block_size()
    consts = host_constants(lr, beta1, beta2, weight_decay)
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        grid = (triton.cdiv(n, block),)
        _adamw_kernel[grid](
            p, grads[i], exp_avgs[i], exp_avg_sqs[i],
            max_exp_avg_sqs[i] if amsgrad else p,
            device_step(steps[i], p.device),
            grad_scale if grad_scale is not None else p,
            found_inf if found_inf is not None else p,
            n, eps=eps, **consts,
            AMSGRAD=amsgrad, MAXIMIZE=maximize,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            BLOCK_SIZE=block,
        )
