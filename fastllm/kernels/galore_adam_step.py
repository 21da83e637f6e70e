"""GaLore AdamW step on GPU: the low-rank Adam update as one Triton kernel between two GEMMs.

    R = P^T G (left) or G P (right)                         GEMM (torch.mm, cuBLAS)
    m = lerp(m, R, 1 - beta1); v = beta2 v + (1 - beta2) R^2;
    U = m / (sqrt(v) / sqrt(1 - beta2^t) + eps)             this kernel, U written over R
    W = (1 - lr wd) W - lr / (1 - beta1^t) * scale * back(U)  one addmm_ (GEMM with beta)
"""

import math

import torch
import triton
import triton.language as tl

from fastllm.kernels import cdiv


@triton.jit
def _adam_lowrank_kernel(
    r_ptr,  # *fp32, projected gradient in, normalised update out
    m_ptr,  # *fp32, first moment, in place
    v_ptr,  # *fp32, second moment, in place
    n_elements,
    lerp_weight,  # 1 - beta1
    beta2,
    one_minus_beta2,  # 1 - beta2, from the host's double (in fp32, 1 - fp32(0.999) is off 1.3e-5)
    inv_bc2_sqrt,  # 1 / sqrt(1 - beta2^t)
    eps,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    g = tl.load(r_ptr + offsets, mask=mask, other=0.0)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    m = m + lerp_weight * (g - m)
    v = beta2 * v + one_minus_beta2 * g * g
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
    # IEEE-rounded sqrt and division, as the C++ kernel's (tl.sqrt and / are approximate on GPUs).
    tl.store(r_ptr + offsets, tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2_sqrt + eps), mask=mask)


def galore_adam_step_triton(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1,
                            beta2, eps, weight_decay, scale):
    """fp32 projector and moments; param fp32 or bf16/fp16 (updated through an fp32 copy)."""
    g = grad.float()
    low = proj.t().mm(g) if left else g.mm(proj)
    n = low.numel()
    block = 1024
    _adam_lowrank_kernel[(cdiv(n, block),)](
        low, exp_avg, exp_avg_sq, n, 1.0 - beta1, beta2, 1.0 - beta2,
        1.0 / math.sqrt(1.0 - beta2**step), eps, BLOCK_SIZE=block)
    decay = 1.0 - lr * weight_decay
    alpha = -lr * scale / (1.0 - beta1**step)
    w = param if param.dtype == torch.float32 else param.float()
    if left:
        w.addmm_(proj, low, beta=decay, alpha=alpha)
    else:
        w.addmm_(low, proj.t(), beta=decay, alpha=alpha)
    if w is not param:
        param.copy_(w)
