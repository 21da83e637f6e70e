"""Mixed-precision AdamW step in Triton: one program per BLOCK_SIZE elements of one tensor.

Maths (torch.optim.AdamW, decoupled weight decay), with step t:
    g  = grad * clip_coef / grad_scale           (negated when maximize)
    x  = master | param + kahan_comp | param     (MASTER | KAHAN | pure bf16)
    x  = x * (1 - lr * wd)
    m  = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) * g * g
    x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    master = x;   param = round(x);   kahan_comp = round(x - param)
Loads are upcast to fp32 and the update is kernels/adam_math.py's, shared with the plain AdamW
kernel. Stochastic rounding takes its random bits from tl.randint (Philox keyed by a per-tensor
seed and the element offset): the same distribution as the C++/CUDA kernels' hash, not the same
bits. grad_scale, clip_coef, found_inf and the step count are read on the device.
"""

import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels.adam_math import (adam_moments, adam_param, bias_corrections,
                                       device_step, host_constants, load_grad)
from fastllm.kernels.rounding import round_nearest, round_stochastic


@triton.jit
def _adamw_master_kernel(
    param_ptr,  # *bf16|fp16, n elements, rewritten as round(x)
    grad_ptr,  # *bf16|fp16, n elements, read only
    master_ptr,  # *fp32, master weights (read and written only when MASTER)
    exp_avg_ptr,  # *fp32, first moment, updated in place
    exp_avg_sq_ptr,  # *fp32, second moment, updated in place
    comp_ptr,  # *bf16|fp16, Kahan compensation (read and written only when KAHAN)
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    clip_coef_ptr,  # *fp32 scalar, the clipping factor (read only when HAS_CLIP_COEF)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    step_ptr,  # *fp32 scalar, this tensor's step count, already incremented
    n_elements,  # number of elements of this tensor
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1
    beta2,  # second-moment decay
    one_minus_beta2,  # 1 - beta2, from the host's double
    lr_hi, lr_lo,  # lr as an fp32 pair (see adam_math.split_f64)
    ln_beta1_hi, ln_beta1_lo,  # log(beta1) as an fp32 pair
    ln_beta2_hi, ln_beta2_lo,  # log(beta2) as an fp32 pair
    eps,  # added to the denominator
    seed,  # this tensor's random stream (read only when SR)
    MASTER: tl.constexpr,
    KAHAN: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
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

    g = load_grad(grad_ptr, offsets, mask, grad_scale_ptr, clip_coef_ptr, HAS_GRAD_SCALE,
                  HAS_CLIP_COEF, MAXIMIZE)
    if MASTER:
        x = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    else:
        x = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if KAHAN:
            x = x + tl.load(comp_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = x * decay
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    m, v = adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2)
    x = adam_param(x, m, v, neg_step_size, bc2_sqrt, eps)

    if SR:
        random = tl.randint(seed, offsets.to(tl.uint32))
        p_new = round_stochastic(x, random, param_ptr.dtype.element_ty)
    else:
        p_new = round_nearest(x, param_ptr.dtype.element_ty)
    if MASTER:
        tl.store(master_ptr + offsets, x, mask=mask)
    if KAHAN:
        comp = round_nearest(x - p_new.to(tl.float32), comp_ptr.dtype.element_ty)
        tl.store(comp_ptr + offsets, comp, mask=mask)
    tl.store(param_ptr + offsets, p_new, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)


def _block_size():
    # Few large blocks are much faster under the interpreter (numpy per program instance).
    return 16384 if triton_interpreting() else 1024


def _tensor_seed(seed, index):
    # Distinct, well-mixed 31-bit Philox keys per tensor of one call (splitmix64 finaliser).
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def adamw_master_step_triton(
    params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *, lr, beta1, beta2, eps,
    weight_decay, maximize, stochastic_rounding, seed, grad_scale, clip_coef, found_inf,
):
    """Launch one kernel per non-empty tensor; the contract of fastllm.ops.adamw_master_step."""
    if params:
        # The kernel reads the scalars through pointers: they must live where the params do.
        device = params[0].device
        grad_scale, clip_coef, found_inf = (
            t.to(device) if t is not None and t.device != device else t
            for t in (grad_scale, clip_coef, found_inf))
    block = _block_size()
    consts = host_constants(lr, beta1, beta2, weight_decay)
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        _adamw_master_kernel[(triton.cdiv(n, block),)](
            p, grads[i],
            masters[i] if masters else exp_avgs[i],
            exp_avgs[i], exp_avg_sqs[i],
            kahan_comps[i] if kahan_comps else p,
            grad_scale if grad_scale is not None else exp_avgs[i],
            clip_coef if clip_coef is not None else exp_avgs[i],
            found_inf if found_inf is not None else exp_avgs[i],
            device_step(steps[i], p.device),
            n, eps=eps, seed=_tensor_seed(seed, i), **consts,
            MASTER=bool(masters), KAHAN=bool(kahan_comps), SR=stochastic_rounding,
            MAXIMIZE=maximize,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_CLIP_COEF=clip_coef is not None,
            HAS_FOUND_INF=found_inf is not None,
            BLOCK_SIZE=block,
        )
