"""AdamW with low-byte moments in Triton: one program per ROWS quantisation blocks of one tensor.

Maths (fastllm/ops/adamw8bit.py has the full contract), per element with step t:
    g  = grad * clip_coef / grad_scale (negated when maximize);   x = master | param
    m  = code_s[m_q] * absmax_m;   v = code_u[v_q] * absmax_v      (bf16 moments: upcast)
    x  = x * (1 - lr * wd);   m = lerp(m, g, 1 - beta1);   v = beta2 * v + (1 - beta2) * g^2
    x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    absmax = max |.| over the block;   m_q, v_q = nearest code to m / absmax_m, v / absmax_v
The tile is (ROWS, BLOCK_P2): one row per quantisation block (BLOCK_P2, the block size rounded
up to a power of two, masked), so the block's new absmax is a row reduction. The nearest code is
found as the C++ kernel finds it: a lookup by the fp32 exponent of a = |x| / absmax gives the
decade, inside which the codes are equally spaced (the constants in `qmaps`).
"""

import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels.adam_math import adam_moments, load_grad
from fastllm.kernels.rounding import round_nearest, round_stochastic

# The qmaps row layout of fastllm/ops/adamw8bit.py.
_FIRST, _LAST, _INV, _OFFSET, _OCT_BASE, _OCT_THR, _WIDTH = 256, 272, 288, 304, 320, 352, 384


@triton.jit
def _encode(x, inv_absmax, qrow_ptr, SIGNED: tl.constexpr):
    """Index (int32) of the code nearest to x * inv_absmax in the table at qrow_ptr."""
    a = tl.minimum(tl.abs(x) * inv_absmax, 1.0)
    a = tl.where(a == a, a, 1.0)
    exponent = (a.to(tl.uint32, bitcast=True) >> 23).to(tl.int32)
    slot = tl.maximum(exponent, 96) - 96
    base = tl.load(qrow_ptr + 320 + slot).to(tl.int32)
    thr = tl.load(qrow_ptr + 352 + slot)
    j = base + (a >= thr).to(tl.int32)
    inv = tl.load(qrow_ptr + 288 + j)
    offset = tl.load(qrow_ptr + 304 + j)
    first = tl.load(qrow_ptr + 256 + j).to(tl.int32)
    last = tl.load(qrow_ptr + 272 + j).to(tl.int32)
    k = tl.fma(a, inv, offset).to(tl.int32)
    idx = first + tl.minimum(tl.maximum(k, 0), last - first)
    if SIGNED:
        idx = tl.where(x < 0, 254 - tl.minimum(idx, 254), idx)
    return idx


@triton.jit
def _adamw8bit_kernel(
    param_ptr,  # *fp32|bf16|fp16, n elements, updated in place (rewritten as round(x))
    grad_ptr,  # *param dtype, n elements, read only
    master_ptr,  # *fp32, master weights (read and written only when MASTER)
    exp_avg_ptr,  # *uint8 codes (Q8) or *bf16, first moment, updated in place
    exp_avg_sq_ptr,  # *uint8 codes (Q8) or *bf16, second moment, updated in place
    absmax_m_ptr,  # *fp32, one per block of the first moment (Q8 only)
    absmax_v_ptr,  # *fp32, one per block of the second moment (Q8 only)
    qmaps_ptr,  # *fp32 (2, 384): signed and unsigned code tables and encoder constants
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    clip_coef_ptr,  # *fp32 scalar, the clipping factor (read only when HAS_CLIP_COEF)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    n_elements,  # elements of this tensor
    block_size,  # elements per quantisation block
    n_blocks,  # ceil(n_elements / block_size)
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1
    beta2,  # second-moment decay
    one_minus_beta2,  # 1 - beta2, from the host: in fp32 1 - fp32(0.999) is off by 1.3e-5
    neg_step_size,  # -lr / (1 - beta1^t)
    bc2_sqrt,  # sqrt(1 - beta2^t)
    eps,  # added to the denominator
    seed,  # this tensor's random stream (read only when SR)
    Q8: tl.constexpr,
    MASTER: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_P2)
    offsets = rows[:, None] * block_size + cols[None, :]
    row_mask = rows < n_blocks
    mask = (cols[None, :] < block_size) & (offsets < n_elements) & row_mask[:, None]
    if HAS_FOUND_INF:
        go = tl.load(found_inf_ptr) == 0
        mask = mask & go
        row_mask = row_mask & go

    g = load_grad(grad_ptr, offsets, mask, grad_scale_ptr, clip_coef_ptr, HAS_GRAD_SCALE,
                  HAS_CLIP_COEF, MAXIMIZE)
    if MASTER:
        x = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    else:
        x = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if Q8:
        m_q = tl.load(exp_avg_ptr + offsets, mask=mask, other=127).to(tl.int32)
        v_q = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0).to(tl.int32)
        absmax_m = tl.load(absmax_m_ptr + rows, mask=row_mask, other=0.0)
        absmax_v = tl.load(absmax_v_ptr + rows, mask=row_mask, other=0.0)
        m = tl.load(qmaps_ptr + m_q) * absmax_m[:, None]
        v = tl.load(qmaps_ptr + 384 + v_q) * absmax_v[:, None]
    else:
        m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    m, v = adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    x = tl.fma(x, decay, tl.div_rn(neg_step_size * m, denom))

    if SR:
        random = tl.randint(seed, offsets.to(tl.uint32))
        p_new = round_stochastic(x, random, param_ptr.dtype.element_ty)
    else:
        p_new = round_nearest(x, param_ptr.dtype.element_ty)
    if MASTER:
        tl.store(master_ptr + offsets, x, mask=mask)
    tl.store(param_ptr + offsets, p_new, mask=mask)

    if Q8:
        new_absmax_m = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1)
        new_absmax_v = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1)
        # Correctly rounded reciprocals, as the C++ kernel's 1.0f / absmax: `/` is approximate on
        # GPUs, and one ulp of the scale can move a value across a code boundary.
        safe_m = tl.where(new_absmax_m > 0, new_absmax_m, 1.0)
        safe_v = tl.where(new_absmax_v > 0, new_absmax_v, 1.0)
        one = tl.full(safe_m.shape, 1.0, tl.float32)
        inv_m = tl.where(new_absmax_m > 0, tl.div_rn(one, safe_m), 0.0)
        inv_v = tl.where(new_absmax_v > 0, tl.div_rn(one, safe_v), 0.0)
        m_idx = _encode(m, inv_m[:, None], qmaps_ptr, True)
        v_idx = _encode(v, inv_v[:, None], qmaps_ptr + 384, False)
        tl.store(exp_avg_ptr + offsets, m_idx.to(tl.uint8), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v_idx.to(tl.uint8), mask=mask)
        tl.store(absmax_m_ptr + rows, new_absmax_m, mask=row_mask)
        tl.store(absmax_v_ptr + rows, new_absmax_v, mask=row_mask)
    else:
        tl.store(exp_avg_ptr + offsets, round_nearest(m, tl.bfloat16), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, round_nearest(v, tl.bfloat16), mask=mask)


def _tensor_seed(seed, index):
    # Distinct, well-mixed 31-bit Philox keys per tensor of one call (splitmix64 finaliser).
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def adamw8bit_step_triton(
    params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes, steps,
    qmaps, *, lr, beta1, beta2, eps, weight_decay, block_size, maximize, stochastic_rounding,
    seed, grad_scale, clip_coef, found_inf,
):
    """One launch per non-empty tensor; the contract of fastllm.ops.adamw8bit_step."""
    if not params:
        return
    device = params[0].device
    grad_scale, clip_coef, found_inf = (
        t.to(device) if t is not None and t.device != device else t
        for t in (grad_scale, clip_coef, found_inf))
    q8 = exp_avgs[0].dtype.itemsize == 1
    block_p2 = triton.next_power_of_2(block_size)
    # Few large programs under the interpreter (numpy per program), ~4K elements on a GPU.
    rows = max(1, (16384 if triton_interpreting() else 4096) // block_p2)
    sr = stochastic_rounding and params[0].dtype.itemsize == 2
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        nb = -(-n // block_size)
        step = float(steps[i])
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        _adamw8bit_kernel[(triton.cdiv(nb, rows),)](
            p, grads[i], masters[i] if masters else p,
            exp_avgs[i], exp_avg_sqs[i],
            exp_avg_absmaxes[i] if q8 else qmaps, exp_avg_sq_absmaxes[i] if q8 else qmaps,
            qmaps,
            grad_scale if grad_scale is not None else qmaps,
            clip_coef if clip_coef is not None else qmaps,
            found_inf if found_inf is not None else qmaps,
            n, block_size, nb,
            1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, -lr / bc1, bc2**0.5, eps,
            _tensor_seed(seed, i),
            Q8=q8, MASTER=bool(masters), SR=sr, MAXIMIZE=maximize,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_CLIP_COEF=clip_coef is not None,
            HAS_FOUND_INF=found_inf is not None,
            ROWS=rows, BLOCK_P2=block_p2,
        )
