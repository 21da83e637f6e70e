"""AdamW step in Triton: one persistent launch per step over every tensor (tensor_table.py).

Maths (torch.optim.AdamW, decoupled weight decay), with step t:
    g  = grad / grad_scale               (negated when maximize)
    p  = p * (1 - lr * wd)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    vm = max(vm, v)                      (amsgrad: the denominator uses vm)
    p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Loads are upcast to fp32 and the update is adam_math.py's, shared with the mixed-precision
kernel: the same order of operations, host-computed constants and IEEE-rounded sqrt and division
as the C++ and CUDA kernels, so the backends agree with torch's single-tensor AdamW to a few ulps.
grad_scale, found_inf and the step count are read on the device: a step costs no host
synchronisation and can be captured in a CUDA graph (once its table is built).

`_adamw_kernel` reads a table of the tensors' addresses and strides over their chunks: one launch
per step, whatever the tensor count; a nonzero found_inf makes its loop empty. Full blocks take
unmasked 128-bit accesses; a tensor's last partial block is masked. `_adamw_tensor_kernel` is the
same update for one tensor per launch, the fallback where no table can be used (tensors on
several devices, which only a direct call of the launcher can pass; a CUDA graph capture before
the table exists, since uploading it would be captured too).
"""

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels import cdiv
from fastllm.kernels.adam_math import (CONSTANT_BITS, adam_moments, adam_param, device_step,
                                       host_constants, load_grad, step_scalars, stream_load)
from fastllm.kernels.rounding import store_rounded
from fastllm.kernels.tensor_table import (address, chunk_at, chunks_to_run, load_fallback,
                                          one_device, programs, table)

# Table fields per tensor: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, numel.
_FIELDS = 7
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _update(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, offsets, mask,
            grad_scale_ptr, neg_step_size, bc2_sqrt, decay, lerp_weight, beta2, one_minus_beta2,
            eps, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr):
    """The AdamW update of the elements at `offsets` (where `mask`) of one tensor. Each array
    is read once and written once per step: evict_first (adam_math.stream_load)."""
    g = load_grad(grad_ptr, offsets, mask, grad_scale_ptr, grad_scale_ptr, HAS_GRAD_SCALE,
                  False, MAXIMIZE)
    p = stream_load(param_ptr, offsets, mask, 0.0).to(tl.float32) * decay
    m = stream_load(exp_avg_ptr, offsets, mask, 0.0).to(tl.float32)
    v = stream_load(exp_avg_sq_ptr, offsets, mask, 0.0).to(tl.float32)
    m, v = adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2)
    v_used = v
    if AMSGRAD:
        v_max = stream_load(max_exp_avg_sq_ptr, offsets, mask, 0.0).to(tl.float32)
        # torch.maximum's: a nan in either stays nan (tl.maximum returns the other operand)
        v_used = tl.where((v_max > v) | (v_max != v_max), v_max, v)
        store_rounded(max_exp_avg_sq_ptr, offsets, v_used, mask, "evict_first")
    p = adam_param(p, m, v_used, neg_step_size, bc2_sqrt, eps)
    store_rounded(param_ptr, offsets, p, mask, "evict_first")
    store_rounded(exp_avg_ptr, offsets, m, mask, "evict_first")
    store_rounded(exp_avg_sq_ptr, offsets, v, mask, "evict_first")


@triton.jit(do_not_specialize=CONSTANT_BITS)
def _adamw_kernel(
    tensors_ptr,  # *int64, FIELDS per tensor (see _FIELDS and tensor_table.py)
    chunks_ptr,  # *int64, (tensor index, first element) per chunk
    n_chunks,  # number of chunks
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
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
    DTYPE: tl.constexpr,  # the element type of every param, grad and state
    FIELDS: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LR_PTR: tl.constexpr,  # the learning rate at lr_ptr
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned (host-checked)
    BLOCK_SIZE: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,  # blocks per chunk
):
    n_loop = chunks_to_run(n_chunks, found_inf_ptr, HAS_FOUND_INF)
    for c in range(tl.program_id(0), n_loop, tl.num_programs(0)):
        _, row, start = chunk_at(tensors_ptr, chunks_ptr, c, FIELDS)
        param_ptr = address(row, 0, DTYPE, ALIGNED)
        grad_ptr = address(row, 1, DTYPE, ALIGNED)
        exp_avg_ptr = address(row, 2, DTYPE, ALIGNED)
        exp_avg_sq_ptr = address(row, 3, DTYPE, ALIGNED)
        max_exp_avg_sq_ptr = exp_avg_sq_ptr
        if AMSGRAD:
            max_exp_avg_sq_ptr = address(row, 4, DTYPE, ALIGNED)
        step_ptr = address(row, 5, tl.float32, False)
        n = tl.load(row + 6)
        neg_step_size, bc2_sqrt, step_decay = step_scalars(
            step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits,
            ln_beta2_bits, LR_PTR)
        n_blocks = tl.minimum(tl.cdiv(n - start, BLOCK_SIZE), CHUNK_BLOCKS)
        for b in range(0, n_blocks):
            # Chunks start at multiples of the chunk size, so each block at one of BLOCK_SIZE.
            first = tl.multiple_of(start + b * BLOCK_SIZE, BLOCK_SIZE)
            offsets = first + tl.arange(0, BLOCK_SIZE)
            if first + BLOCK_SIZE <= n:
                _update(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
                        offsets, tl.full([BLOCK_SIZE], 1, tl.int1), grad_scale_ptr,
                        neg_step_size, bc2_sqrt, step_decay, lerp_weight, beta2, one_minus_beta2,
                        eps, AMSGRAD, MAXIMIZE, HAS_GRAD_SCALE)
            else:
                _update(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
                        offsets, offsets < n, grad_scale_ptr, neg_step_size, bc2_sqrt, step_decay,
                        lerp_weight, beta2, one_minus_beta2, eps, AMSGRAD, MAXIMIZE,
                        HAS_GRAD_SCALE)


@triton.jit(do_not_specialize=CONSTANT_BITS)
def _adamw_tensor_kernel(
    param_ptr,  # *T, n elements, updated in place
    grad_ptr,  # *T, n elements, read only
    exp_avg_ptr,  # *T, first moment, updated in place
    exp_avg_sq_ptr,  # *T, second moment, updated in place
    max_exp_avg_sq_ptr,  # *T, running max of the second moment (read only when AMSGRAD)
    step_ptr,  # *fp32 scalar, this tensor's step count, already incremented
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    n_elements,  # number of elements of this tensor
    decay, lerp_weight, beta2, one_minus_beta2, lr_bits, weight_decay_bits, lr_ptr,
    ln_beta1_bits, ln_beta2_bits,
    eps,  # as _adamw_kernel's
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LR_PTR: tl.constexpr,  # the learning rate at lr_ptr
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
    neg_step_size, bc2_sqrt, step_decay = step_scalars(
        step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits, ln_beta2_bits,
        LR_PTR)
    _update(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, offsets, mask,
            grad_scale_ptr, neg_step_size, bc2_sqrt, step_decay, lerp_weight, beta2,
            one_minus_beta2, eps, AMSGRAD, MAXIMIZE, HAS_GRAD_SCALE)


def _sizes():
    """(BLOCK_SIZE, CHUNK_BLOCKS). The interpreter runs each block in numpy: few, large blocks
    are much faster there. On a GPU 1024 elements (4 warps x 8 per thread: two 16-byte vectors
    per fp32 array in flight) and chunks of 16K elements, small enough to balance the grid."""
    return (16384, 1) if triton_interpreting() else (1024, 16)


def adamw_step_triton(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None,
    lr_tensor=None,
):
    """One launch for every tensor (a table); the same contract as fastllm.ops.adamw_step
    (lr_tensor: one element on the params' device, read there instead of lr)."""
    if not params:
        return
    dtype = params[0].dtype
    if dtype == torch.float64:
        raise TypeError("fastllm.adamw_step (triton): the Triton kernel computes in fp32; fp64 "
                        "params run on the cuda, cpp or ref backend")
    # The table kernel types every address with params[0]'s dtype: a tensor of another dtype
    # would be read and written as that one (out of bounds when it is narrower). The C++ kernels
    # refuse the same.
    for i, p in enumerate(params):
        if p.dtype != dtype:
            raise TypeError(f"fastllm.adamw_step: all params of one call must share a dtype; "
                            f"params[{i}] is {p.dtype}, params[0] is {dtype}")
    device = params[0].device
    # The kernel reads the scalars through pointers: they must live where the params do.
    if grad_scale is not None and grad_scale.device != device:
        grad_scale = grad_scale.to(device)
    if found_inf is not None and found_inf.device != device:
        found_inf = found_inf.to(device)
    steps = [device_step(s, device) for s in steps]
    block, chunk_blocks = _sizes()
    arrays = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None]
    found = None
    single = one_device(device, *arrays)
    if single:
        found = table(arrays, steps, block * chunk_blocks, device)
    if not single and lr_tensor is not None:
        # Tensors on several devices (the per-tensor fallback): the value, read once here.
        lr, lr_tensor = float(lr_tensor.reshape(()).item()), None
    consts = host_constants(lr, beta1, beta2, weight_decay, lr_tensor)
    if found is None:
        _per_tensor(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, consts,
                    eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
                    found_inf=found_inf)
        return
    if found.n_chunks == 0:
        return
    _adamw_kernel[(programs(device, found.n_chunks),)](
        found.tensors, found.chunks, found.n_chunks,
        grad_scale if grad_scale is not None else found.tensors,
        found_inf if found_inf is not None else found.tensors,
        eps=eps, **consts, DTYPE=_TL_DTYPES[params[0].dtype], FIELDS=_FIELDS, AMSGRAD=amsgrad,
        MAXIMIZE=maximize, HAS_GRAD_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None, ALIGNED=found.aligned, BLOCK_SIZE=block,
        CHUNK_BLOCKS=chunk_blocks,
    )
    load_fallback(found, device, lambda: _per_tensor(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, consts, eps=eps,
        amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf,
        load_only=True), key=lambda: (
            "adamw", params[0].dtype, tuple(p.numel() for p in params), amsgrad, maximize,
            grad_scale is None, found_inf is None, consts["LR_PTR"]))


def _per_tensor(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, consts, *, eps,
                amsgrad, maximize, grad_scale, found_inf, load_only=False):
    """One launch per non-empty tensor (the fallback: see the module docstring); load_only:
    grids of 0 programs (tensor_table.load_fallback)."""
    block = _sizes()[0]
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        _adamw_tensor_kernel[(0 if load_only else cdiv(n, block),)](
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
