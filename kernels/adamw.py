"""AdamW step in Triton: one program per BLOCK_SIZE elements of one tensor.

Maths (torch.optim.AdamW, decoupled weight decay), with step t:
    g  = grad / grad_scale               (negated when maximize)
    p  = p * (1 - lr * wd)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    vm = max(vm, v)                      (amsgrad: the denominator uses vm)
    p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Loads are upcast to fp32 and all arithmetic is fp32 with IEEE-rounded sqrt and division, so the
result matches the C++ kernel and torch's single-tensor AdamW to a few ulps. grad_scale and
found_inf are read on the device: a GradScaler step costs no host synchronisation.
"""

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels.rounding import store_rounded


@triton.jit
def _adamw_kernel(
    param_ptr,  # *T, n elements, updated in place
    grad_ptr,  # *T, n elements, read only
    exp_avg_ptr,  # *T, first moment, updated in place
    exp_avg_sq_ptr,  # *T, second moment, updated in place
    max_exp_avg_sq_ptr,  # *T, running max of the second moment (read only when AMSGRAD)
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    n_elements,  # number of elements of this tensor
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1
    beta2,  # second-moment decay
    neg_step_size,  # -lr / (1 - beta1^t)
    bc2_sqrt,  # sqrt(1 - beta2^t)
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
        # A broadcast load (every lane reads the one flag) keeps the mask a block-shaped tensor.
        mask = mask & (tl.load(found_inf_ptr + tl.zeros_like(offsets)) == 0)

    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = g * (1.0 / tl.load(grad_scale_ptr).to(tl.float32))
    if MAXIMIZE:
        g = -g
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * decay
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    diff = g - m
    if lerp_weight < 0.5:
        m = m + lerp_weight * diff
    else:
        m = g - diff * (1.0 - lerp_weight)
    v = v * beta2 + (1.0 - beta2) * g * g
    v_used = v
    if AMSGRAD:
        v_max = tl.load(max_exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v_used = tl.maximum(v_max, v)
        store_rounded(max_exp_avg_sq_ptr, offsets, v_used, mask)
    denom = tl.div_rn(tl.sqrt_rn(v_used), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)

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
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        step = float(steps[i])
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        grid = (triton.cdiv(n, block),)
        _adamw_kernel[grid](
            p, grads[i], exp_avgs[i], exp_avg_sqs[i],
            max_exp_avg_sqs[i] if amsgrad else p,
            grad_scale if grad_scale is not None else p,
            found_inf if found_inf is not None else p,
            n,
            1.0 - lr * weight_decay, 1.0 - beta1, beta2, -lr / bc1, bc2**0.5, eps,
            AMSGRAD=amsgrad, MAXIMIZE=maximize,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            BLOCK_SIZE=block,
        )
