"""Mixed-precision AdamW step in Triton: one persistent launch per step over every tensor.

Maths (torch.optim.AdamW, decoupled weight decay), with step t:
    g  = grad * clip_coef / grad_scale           (negated when maximize)
    x  = master | param + kahan_comp | param     (MASTER | KAHAN | pure bf16)
    x  = x * (1 - lr * wd)
    m  = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) * g * g
    x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    master = x;   param = round(x);   kahan_comp = round(x - param)
Loads are upcast to fp32 and the update is adam_math.py's, shared with the plain AdamW
kernel. Stochastic rounding takes its random bits from tl.randint (Philox keyed by the call's
seed, counter (tensor index, element)): the same distribution as the C++/CUDA kernels' hash, not
the same bits. grad_scale, clip_coef, found_inf and the step count are read on the device.

`_adamw_master_kernel` reads a table of the tensors' addresses (tensor_table.py) and
strides over their chunks: one launch per step; a nonzero found_inf makes its loop empty.
`_adamw_master_tensor_kernel` launches once per tensor, the fallback where no table can be used
(see adamw.py).
"""

import triton
import triton.language as tl

from fastllm.kernels import cdiv
from fastllm.kernels.adam_math import (CONSTANT_BITS, adam_moments, adam_param, device_step,
                                       host_constants, load_grad, one_multiplier, step_scalars,
                                       stream_load, stream_store)
from fastllm.kernels.adamw import _TL_DTYPES, _sizes
from fastllm.kernels.rounding import philox_key, round_nearest, round_stochastic
from fastllm.kernels.tensor_table import (address, chunk_at, chunks_to_run, load_fallback,
                                          one_device, programs, table)

# Table fields per tensor: param, grad, master, exp_avg, exp_avg_sq, kahan_comp, step, numel.
_FIELDS = 8


@triton.jit
def _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, comp_ptr, offsets,
            mask, random_offsets, grad_scale_ptr, clip_coef_ptr, neg_step_size, bc2_sqrt, decay,
            lerp_weight, beta2, one_minus_beta2, eps, seed, MASTER: tl.constexpr,
            KAHAN: tl.constexpr, SR: tl.constexpr, MAXIMIZE: tl.constexpr,
            HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP_COEF: tl.constexpr):
    """The update of the elements at `offsets` (where `mask`) of one tensor; random_offsets are
    the Philox counters of its stochastic rounding. Every array is read once and written once
    per step: evict_first (adam_math.stream_load)."""
    g = load_grad(grad_ptr, offsets, mask, grad_scale_ptr, clip_coef_ptr, HAS_GRAD_SCALE,
                  HAS_CLIP_COEF, MAXIMIZE)
    if MASTER:
        x = stream_load(master_ptr, offsets, mask, 0.0)
    else:
        x = stream_load(param_ptr, offsets, mask, 0.0).to(tl.float32)
        if KAHAN:
            x = x + stream_load(comp_ptr, offsets, mask, 0.0).to(tl.float32)
    x = x * decay
    m = stream_load(exp_avg_ptr, offsets, mask, 0.0)
    v = stream_load(exp_avg_sq_ptr, offsets, mask, 0.0)
    m, v = adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2)
    x = adam_param(x, m, v, neg_step_size, bc2_sqrt, eps)

    if SR:
        random = tl.randint(seed, random_offsets)
        p_new = round_stochastic(x, random, param_ptr.dtype.element_ty)
    else:
        p_new = round_nearest(x, param_ptr.dtype.element_ty)
    if MASTER:
        stream_store(master_ptr, offsets, x, mask)
    if KAHAN:
        comp = round_nearest(x - p_new.to(tl.float32), comp_ptr.dtype.element_ty)
        stream_store(comp_ptr, offsets, comp, mask)
    stream_store(param_ptr, offsets, p_new, mask)
    stream_store(exp_avg_ptr, offsets, m, mask)
    stream_store(exp_avg_sq_ptr, offsets, v, mask)


@triton.jit(do_not_specialize=CONSTANT_BITS)
def _adamw_master_kernel(
    tensors_ptr,  # *int64, FIELDS per tensor (see _FIELDS and tensor_table.py)
    chunks_ptr,  # *int64, (tensor index, first element) per chunk
    n_chunks,  # number of chunks
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    clip_coef_ptr,  # *fp32 scalar, the clipping factor (read only when HAS_CLIP_COEF)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1
    beta2,  # second-moment decay
    one_minus_beta2,  # 1 - beta2, from the host's double
    lr_bits,  # lr, the bits of the host's double (see adam_math.f64_bits)
    weight_decay_bits,  # weight_decay, likewise (for the decay of a tensor lr)
    lr_ptr,  # *float scalar, the learning rate (read only when LR_PTR; lr_bits, decay unused)
    ln_beta1_bits,  # log(beta1), likewise
    ln_beta2_bits,  # log(beta2), likewise
    eps,  # added to the denominator
    seed,  # the call's random stream (read only when SR)
    DTYPE: tl.constexpr,  # bf16 or fp16: the params', grads' and Kahan buffers' element type
    FIELDS: tl.constexpr,
    MASTER: tl.constexpr,
    KAHAN: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LR_PTR: tl.constexpr,  # the learning rate at lr_ptr
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned (host-checked)
    BLOCK_SIZE: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,  # blocks per chunk
):
    n_loop = chunks_to_run(n_chunks, found_inf_ptr, HAS_FOUND_INF)
    for c in range(tl.program_id(0), n_loop, tl.num_programs(0)):
        index, row, start = chunk_at(tensors_ptr, chunks_ptr, c, FIELDS)
        param_ptr = address(row, 0, DTYPE, ALIGNED)
        grad_ptr = address(row, 1, DTYPE, ALIGNED)
        master_ptr = address(row, 3, tl.float32, ALIGNED)  # unread unless MASTER
        if MASTER:
            master_ptr = address(row, 2, tl.float32, ALIGNED)
        exp_avg_ptr = address(row, 3, tl.float32, ALIGNED)
        exp_avg_sq_ptr = address(row, 4, tl.float32, ALIGNED)
        comp_ptr = param_ptr  # unread unless KAHAN
        if KAHAN:
            comp_ptr = address(row, 5, DTYPE, ALIGNED)
        step_ptr = address(row, 6, tl.float32, False)
        n = tl.load(row + 7)
        neg_step_size, bc2_sqrt, step_decay = step_scalars(
            step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits,
            ln_beta2_bits, LR_PTR)
        n_blocks = tl.minimum(tl.cdiv(n - start, BLOCK_SIZE), CHUNK_BLOCKS)
        for b in range(0, n_blocks):
            # Chunks start at multiples of the chunk size, so each block at one of BLOCK_SIZE.
            first = tl.multiple_of(start + b * BLOCK_SIZE, BLOCK_SIZE)
            offsets = first + tl.arange(0, BLOCK_SIZE)
            # Philox counter (tensor index, element): a stream per tensor from one seed.
            random_offsets = offsets + (index << 32)
            if first + BLOCK_SIZE <= n:
                _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, comp_ptr,
                        offsets, tl.full([BLOCK_SIZE], 1, tl.int1), random_offsets,
                        grad_scale_ptr, clip_coef_ptr, neg_step_size, bc2_sqrt, step_decay,
                        lerp_weight, beta2, one_minus_beta2, eps, seed, MASTER, KAHAN, SR,
                        MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP_COEF)
            else:
                _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, comp_ptr,
                        offsets, offsets < n, random_offsets, grad_scale_ptr, clip_coef_ptr,
                        neg_step_size, bc2_sqrt, step_decay, lerp_weight, beta2, one_minus_beta2,
                        eps, seed, MASTER, KAHAN, SR, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP_COEF)


@triton.jit(do_not_specialize=CONSTANT_BITS)
def _adamw_master_tensor_kernel(
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
    decay, lerp_weight, beta2, one_minus_beta2, lr_bits, weight_decay_bits, lr_ptr,
    ln_beta1_bits, ln_beta2_bits,
    eps,  # as _adamw_master_kernel's
    seed,  # this tensor's random stream (read only when SR)
    MASTER: tl.constexpr,
    KAHAN: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LR_PTR: tl.constexpr,  # the learning rate at lr_ptr
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
    neg_step_size, bc2_sqrt, step_decay = step_scalars(
        step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits, ln_beta2_bits,
        LR_PTR)
    _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, comp_ptr, offsets,
            mask, offsets.to(tl.uint32), grad_scale_ptr, clip_coef_ptr, neg_step_size, bc2_sqrt,
            step_decay, lerp_weight, beta2, one_minus_beta2, eps, seed, MASTER, KAHAN, SR, MAXIMIZE,
            HAS_GRAD_SCALE, HAS_CLIP_COEF)


def adamw_master_step_triton(
    params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *, lr, beta1, beta2, eps,
    weight_decay, maximize, stochastic_rounding, seed, grad_scale, clip_coef, found_inf,
    lr_tensor=None,
):
    """One launch for every tensor (a table); the contract of fastllm.ops.adamw_master_step
    (lr_tensor: one element on the params' device, read there instead of lr)."""
    if not params:
        return
    # The kernel reads the scalars through pointers: they must live where the params do.
    device = params[0].device
    grad_scale, clip_coef, found_inf = (
        t.to(device) if t is not None and t.device != device else t
        for t in (grad_scale, clip_coef, found_inf))
    grad_scale, clip_coef = one_multiplier(grad_scale, clip_coef)
    steps = [device_step(s, device) for s in steps]
    block, chunk_blocks = _sizes()
    arrays = [params, grads, masters or None, exp_avgs, exp_avg_sqs, kahan_comps or None]
    found = None
    single = one_device(device, *arrays)
    if single:
        found = table(arrays, steps, block * chunk_blocks, device)
    if not single and lr_tensor is not None:
        # Tensors on several devices (the per-tensor fallback): the value, read once here.
        lr, lr_tensor = float(lr_tensor.reshape(()).item()), None
    consts = host_constants(lr, beta1, beta2, weight_decay, lr_tensor)
    flags = dict(MASTER=bool(masters), KAHAN=bool(kahan_comps), SR=stochastic_rounding,
                 MAXIMIZE=maximize, HAS_GRAD_SCALE=grad_scale is not None,
                 HAS_CLIP_COEF=clip_coef is not None, HAS_FOUND_INF=found_inf is not None)
    if found is None:
        _per_tensor(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, consts,
                    flags, eps=eps, seed=seed, grad_scale=grad_scale, clip_coef=clip_coef,
                    found_inf=found_inf)
        return
    if found.n_chunks == 0:
        return
    spare = found.tensors  # any pointer: the kernel never reads one whose flag is off
    _adamw_master_kernel[(programs(device, found.n_chunks),)](
        found.tensors, found.chunks, found.n_chunks,
        grad_scale if grad_scale is not None else spare,
        clip_coef if clip_coef is not None else spare,
        found_inf if found_inf is not None else spare,
        eps=eps, seed=philox_key(seed, -1), **consts, DTYPE=_TL_DTYPES[params[0].dtype],
        FIELDS=_FIELDS, **flags, ALIGNED=found.aligned, BLOCK_SIZE=block,
        CHUNK_BLOCKS=chunk_blocks,
    )
    load_fallback(found, device, lambda: _per_tensor(
        params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, consts, flags,
        eps=eps, seed=seed, grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf,
        load_only=True), key=lambda: (
            "adamw_master", params[0].dtype, tuple(p.numel() for p in params), seed,
            tuple(sorted(flags.items())), consts["LR_PTR"]))


def _per_tensor(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, consts, flags,
                *, eps, seed, grad_scale, clip_coef, found_inf, load_only=False):
    """One launch per non-empty tensor (the fallback: see adamw.py); load_only: grids of 0
    programs (tensor_table.load_fallback)."""
    block = _sizes()[0]
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        _adamw_master_tensor_kernel[(0 if load_only else cdiv(n, block),)](
            p, grads[i],
            masters[i] if masters else exp_avgs[i],
            exp_avgs[i], exp_avg_sqs[i],
            kahan_comps[i] if kahan_comps else p,
            grad_scale if grad_scale is not None else exp_avgs[i],
            clip_coef if clip_coef is not None else exp_avgs[i],
            found_inf if found_inf is not None else exp_avgs[i],
            device_step(steps[i], p.device),
            n, eps=eps, seed=philox_key(seed, i), **consts, **flags, BLOCK_SIZE=block,
        )
