"""Global L2 norm of many tensors in Triton: one persistent launch, finished by its last program.

Maths:   norm = sqrt(sum over every element x of every tensor of x^2)

`_sum_squares_kernel` strides over the chunks of a table of the tensors (tensor_table.py):
each block of BLOCK_SIZE elements is squared and summed in fp32 (fp64 for fp64 tensors, whose
squares can overflow or underflow fp32) and the block sums are added into one fp64 partial per
program, written to that program's slot. Each program then takes a ticket from an atomic counter
(after its partial: release/acquire ordering); the program holding the last ticket adds the
partials in slot order, as one fixed-shape fp64 reduction, and writes the result. So the norm
does not depend on which program finishes last: the same bits from run to run on one GPU model
(the grid, a few programs per SM, fixes which chunks each program sums). That program resets the
counter for the next launch, so a launch needs no memset and replays in a CUDA graph (Apex's
multi_tensor_l2norm finishes in a second kernel; cub's single-pass reductions use the same
last-block pattern). Full blocks take unmasked 128-bit loads, a tensor's last block is masked.
The table has one address field per element type; a tensor fills the one of its type, the others
are 0, and constexpr flags compile only the types present.

`grad_norm_step_triton` is the same launch for fastllm.optim.AdamW's mixed-precision step: its last
program also turns the norm into every scalar the step needs, on the device, so that the whole
step is this launch and the update's (fastllm/optim/adamw.py):
    norm     = sqrt(sum) / grad_scale                          (the reported grad norm)
    found    = norm is inf/nan, or the found_inf passed in      (the update skips the step)
    clip     = min(1, max_norm / (norm + 1e-6))                 (torch.nn.utils.clip_grad_norm_)
    mult     = clip / grad_scale      divisor = grad_scale / clip
    steps   += 1 - found                                        (the step counts of the update)
    skipped += found;  and the loss scaler's policy (fastllm/amp.py), when one is given.
The update multiplies each grad by mult (adamw_step, which divides by its grad_scale, is handed
divisor). Both kernels run in the test suite under the Triton interpreter and compile for sm_90
in `make kernel-check`; neither has run on a GPU yet.
"""

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels.tensor_table import address, chunk_at, one_device, programs, table

# One address field per element type, in this order; then the step field (unused) and numel.
_TYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_FIELDS = 6


@triton.jit
def _chunk_sum_squares(row, FIELD: tl.constexpr, DTYPE: tl.constexpr, start, n,
                       ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       CHUNK_BLOCKS: tl.constexpr):
    """fp64 sum of squares of the chunk at `start` of the DTYPE tensor whose address is field
    FIELD of its table row (n elements)."""
    x_ptr = address(row, FIELD, DTYPE, ALIGNED)
    total = tl.full([], 0.0, tl.float64)
    n_blocks = tl.minimum(tl.cdiv(n - start, BLOCK_SIZE), CHUNK_BLOCKS)
    for b in range(0, n_blocks):
        # Chunks start at multiples of the chunk size, so each block at one of BLOCK_SIZE.
        first = tl.multiple_of(start + b * BLOCK_SIZE, BLOCK_SIZE)
        offsets = first + tl.arange(0, BLOCK_SIZE)
        if first + BLOCK_SIZE <= n:
            x = tl.load(x_ptr + offsets)
        else:
            x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
        if DTYPE != tl.float64:
            x = x.to(tl.float32)
        total += tl.sum(x * x, axis=0).to(tl.float64)
    return total


@triton.jit
def _advance_scaler(scale_ptr, trackers_ptr, found, growth_factor, backoff_factor,
                    growth_interval, hysteresis, min_scale):
    """fastllm.amp.LossScaler's update after a step (found: whether it overflowed), on its
    device state: scale (fp32) and trackers (int32: growth count, hysteresis left, overflows,
    collapsed). The policy is amp.py's `_advance`, written there with torch ops."""
    scale = tl.load(scale_ptr)
    growth = tl.load(trackers_ptr)
    left = tl.load(trackers_ptr + 1)
    collapsed = tl.load(trackers_ptr + 3)
    if found:
        growth = 0
        left = left - 1
        tl.store(trackers_ptr + 2, tl.load(trackers_ptr + 2) + 1)
        if left <= 0:
            if scale <= min_scale:
                collapsed = 1  # raised on the host by LossScaler.poll()
            else:
                scale = tl.maximum(scale * backoff_factor, min_scale)
    else:
        growth = growth + 1
        if growth == growth_interval:
            growth = 0
            left = hysteresis
            # As torch's _amp_update_scale_: never grow to inf (amp.py's _advance says why).
            grown = scale * growth_factor
            if grown < float("inf"):
                scale = grown
    tl.store(scale_ptr, scale)
    tl.store(trackers_ptr, growth)
    tl.store(trackers_ptr + 1, left)
    tl.store(trackers_ptr + 3, collapsed)


@triton.jit
def _finish_step(norm, out_ptr, skipped_ptr, skipped_steps_ptr, grad_scale_ptr, found_inf_ptr,
                 steps_ptr, n_steps, max_norm, scale_ptr, trackers_ptr, growth_factor,
                 backoff_factor, growth_interval, hysteresis, min_scale,
                 HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                 HAS_CLIP: tl.constexpr, HAS_STEPS: tl.constexpr, HAS_SCALER: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The step's scalars from the fp64 norm of the scaled grads (see the module docstring):
    out_ptr[0..3] = (norm / grad_scale, found, mult, divisor), all fp32."""
    # The eager step's roundings: the norm to fp32, then IEEE divisions in fp32.
    norm = norm.to(tl.float32)
    scale = tl.full([], 1.0, tl.float32)
    if HAS_GRAD_SCALE:
        scale = tl.load(grad_scale_ptr)
        norm = tl.div_rn(norm, scale)
    found = (norm != norm) | (tl.abs(norm) == float("inf"))
    if HAS_FOUND_INF:
        found = found | (tl.load(found_inf_ptr) != 0)
    clip = tl.full([], 1.0, tl.float32)
    if HAS_CLIP:
        # torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), which torch evaluates as
        # reciprocal(norm + 1e-6) * max_norm, then clamp(max=1).
        clip = tl.minimum(tl.div_rn(1.0, norm + 1e-6) * max_norm, 1.0)
        clip = tl.where(found, 1.0, clip)  # a skipped step reads neither: keep them finite
    tl.store(out_ptr, norm)
    tl.store(out_ptr + 1, found.to(tl.float32))
    # The C++ and CUDA kernels' grad multiplier: clip / grad_scale in double, rounded once.
    tl.store(out_ptr + 2, (tl.cast(clip, tl.float64) / tl.cast(scale, tl.float64)).to(tl.float32))
    tl.store(out_ptr + 3, tl.div_rn(scale, clip))
    tl.store(skipped_ptr, found)
    tl.store(skipped_steps_ptr, tl.load(skipped_steps_ptr) + found.to(tl.int64))
    if HAS_STEPS:
        advance = 1.0 - found.to(tl.float32)
        for i in range(0, n_steps, BLOCK):
            index = i + tl.arange(0, BLOCK)
            step = tl.load(steps_ptr + index, mask=index < n_steps)
            tl.store(steps_ptr + index, step + advance, mask=index < n_steps)
    if HAS_SCALER:
        # The scale may be grad_scale itself: every thread has read it before one writes it.
        tl.debug_barrier()
        _advance_scaler(scale_ptr, trackers_ptr, found, growth_factor, backoff_factor,
                        growth_interval, hysteresis, min_scale)


@triton.jit
def _sum_squares_kernel(
    tensors_ptr,  # *int64, FIELDS per tensor (see _FIELDS and tensor_table.py)
    chunks_ptr,  # *int64, (tensor index, first element) per chunk
    n_chunks,  # number of chunks
    partial_ptr,  # *fp64, one slot per program
    ticket_ptr,  # *int32, programs finished so far: 0 before and after every launch
    out_ptr,  # *fp32|fp64: the norm (without STEP); the step's four scalars (with STEP)
    # STEP only (_finish_step): the step's other outputs and inputs
    skipped_ptr,  # *bool scalar: whether the step is skipped
    skipped_steps_ptr,  # *int64 scalar: skipped steps so far, incremented on a skip
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    found_inf_ptr,  # *fp32 scalar, nonzero: skip the step anyway (read only when HAS_FOUND_INF)
    steps_ptr,  # *fp32, n_steps step counts advanced by 1 - found (only when HAS_STEPS)
    n_steps,  # number of step counts
    max_norm,  # clipping threshold (only when HAS_CLIP)
    scale_ptr,  # *fp32 scalar, the loss scaler's scale (only when HAS_SCALER)
    trackers_ptr,  # *int32 (4,), the loss scaler's counters (only when HAS_SCALER)
    growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,  # its policy
    HAS_BF16: tl.constexpr,  # which element types the table holds
    HAS_FP16: tl.constexpr,
    HAS_FP32: tl.constexpr,
    HAS_FP64: tl.constexpr,
    FIELDS: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned (host-checked)
    BLOCK_SIZE: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,  # blocks per chunk
    REDUCE_BLOCK: tl.constexpr,  # partials added per iteration by the last program
    STEP: tl.constexpr,  # finish with _finish_step instead of writing the norm
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_STEPS: tl.constexpr,
    HAS_SCALER: tl.constexpr,
):
    total = tl.full([], 0.0, tl.float64)
    for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        _, row, start = chunk_at(tensors_ptr, chunks_ptr, c, FIELDS)
        n = tl.load(row + FIELDS - 1)
        if HAS_BF16:
            if tl.load(row) != 0:
                total += _chunk_sum_squares(row, 0, tl.bfloat16, start, n, ALIGNED, BLOCK_SIZE,
                                            CHUNK_BLOCKS)
        if HAS_FP16:
            if tl.load(row + 1) != 0:
                total += _chunk_sum_squares(row, 1, tl.float16, start, n, ALIGNED, BLOCK_SIZE,
                                            CHUNK_BLOCKS)
        if HAS_FP32:
            if tl.load(row + 2) != 0:
                total += _chunk_sum_squares(row, 2, tl.float32, start, n, ALIGNED, BLOCK_SIZE,
                                            CHUNK_BLOCKS)
        if HAS_FP64:
            if tl.load(row + 3) != 0:
                total += _chunk_sum_squares(row, 3, tl.float64, start, n, ALIGNED, BLOCK_SIZE,
                                            CHUNK_BLOCKS)
    programs = tl.num_programs(0)
    tl.store(partial_ptr + tl.program_id(0), total)
    # Every thread's part of this program done before its ticket (the partial is stored by one
    # thread; the barrier orders the program, the release orders the device).
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        # The last program: every partial is written. Add them in slot order, past L1 (.cg).
        sums = tl.zeros([REDUCE_BLOCK], tl.float64)
        for i in range(0, programs, REDUCE_BLOCK):
            slots = i + tl.arange(0, REDUCE_BLOCK)
            sums += tl.load(partial_ptr + slots, mask=slots < programs, other=0.0,
                            cache_modifier=".cg")
        norm = tl.sqrt(tl.sum(sums, axis=0))  # fp64: sqrt.rn.f64 on the GPU, exact
        tl.store(ticket_ptr, 0)
        if STEP:
            _finish_step(norm, out_ptr, skipped_ptr, skipped_steps_ptr, grad_scale_ptr,
                         found_inf_ptr, steps_ptr, n_steps, max_norm, scale_ptr, trackers_ptr,
                         growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                         HAS_GRAD_SCALE, HAS_FOUND_INF, HAS_CLIP, HAS_STEPS, HAS_SCALER,
                         REDUCE_BLOCK)
        else:
            tl.store(out_ptr, norm.to(out_ptr.dtype.element_ty))


def _sizes():
    """(BLOCK_SIZE, CHUNK_BLOCKS). On a GPU blocks of 4096 elements (32 per thread: four 16-byte
    vectors of bf16, eight of fp32 in flight, for one array) and chunks of 16K, as the
    optimizer kernels'; few large blocks under the interpreter."""
    return (16384, 1) if triton_interpreting() else (4096, 4)


_TICKETS = {}  # (device, stream) -> the int32 counter of that stream's launches


def _ticket(device):
    """The launch's zeroed counter: one per device and stream (launches on one stream run one
    after another, and each leaves its counter at 0)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    found = _TICKETS.get(key)
    if found is None:
        found = _TICKETS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return found


def _launch(tensors, out, step=None):
    """One launch over `tensors` (one device, dense and contiguous); False when no table can be
    built (a CUDA graph capture before the table exists: the caller computes the norm another
    way)."""
    device = tensors[0].device
    types = [t.dtype for t in tensors]
    for i, d in enumerate(types):
        # The table has no field for any other float type (fp8, ...): such a tensor would add
        # nothing to the norm. The C++ kernels refuse it too.
        if d not in _TYPES:
            raise TypeError(f"fastllm.l2norm: tensors[{i}] has dtype {d}; the Triton kernel "
                            f"takes bfloat16, float16, float32 and float64")
    arrays = [[t if d == dtype else None for t, d in zip(tensors, types)] if dtype in types
              else None for dtype in _TYPES]
    block, chunk_blocks = _sizes()
    found = None
    if one_device(device, tensors):
        found = table(arrays, None, block * chunk_blocks, device,
                      sizes=[t.numel() for t in tensors])
    if found is None:
        return False
    n_programs = programs(device, max(found.n_chunks, 1))
    partial = torch.empty(n_programs, dtype=torch.float64, device=device)
    step = step or {}
    spare = found.tensors  # any pointer: the kernel never reads one whose flag is off
    scaler = step.get("scaler")
    _sum_squares_kernel[(n_programs,)](
        found.tensors, found.chunks, found.n_chunks, partial, _ticket(device), out,
        step.get("skipped", spare), step.get("skipped_steps", spare),
        step.get("grad_scale", spare), step.get("found_inf", spare), step.get("steps", spare),
        0 if step.get("steps") is None else step["steps"].numel(), step.get("max_norm", 0.0),
        spare if scaler is None else scaler.scale, spare if scaler is None else scaler.trackers,
        *((0.0, 0.0, 0, 0, 0.0) if scaler is None else
          (scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval,
           scaler.hysteresis, scaler.min_scale)),
        HAS_BF16=torch.bfloat16 in types, HAS_FP16=torch.float16 in types,
        HAS_FP32=torch.float32 in types, HAS_FP64=torch.float64 in types, FIELDS=_FIELDS,
        ALIGNED=found.aligned, BLOCK_SIZE=block, CHUNK_BLOCKS=chunk_blocks, REDUCE_BLOCK=1024,
        STEP=bool(step), HAS_GRAD_SCALE="grad_scale" in step, HAS_FOUND_INF="found_inf" in step,
        HAS_CLIP="max_norm" in step, HAS_STEPS=step.get("steps") is not None,
        HAS_SCALER=scaler is not None,
    )
    return True


def l2norm_triton(tensors):
    """sqrt(sum of squares) of every element of `tensors`: a 0-dim tensor on their device, fp64
    when every tensor is fp64, else fp32; one launch (the contract of fastllm.ops.l2norm). None,
    launching nothing, during a CUDA graph capture before the table exists."""
    fp64 = all(t.dtype == torch.float64 for t in tensors)
    out = torch.empty((), dtype=torch.float64 if fp64 else torch.float32,
                      device=tensors[0].device)
    return out if _launch(tensors, out) else None


def grad_norm_step_triton(grads, out, *, skipped, skipped_steps, grad_scale=None,
                          found_inf=None, max_norm=None, steps=None, scaler=None):
    """The grad norm and the step's scalars in one launch (the module docstring).

    grads: plain tensors on one device, dense and contiguous, not all fp64. out: fp32 (4,) on
    that device, written (norm / grad_scale, found, mult, divisor). skipped: bool scalar and
    skipped_steps: int64 scalar, written. grad_scale, found_inf: fp32 scalars or None. max_norm:
    a float or None. steps: a 1-D fp32 tensor of step counts advanced by 1 - found, or None.
    scaler: a fastllm.amp.ScalerState advanced by the step's outcome, or None. Returns False
    (nothing launched) when no table can be built."""
    step = dict(skipped=skipped, skipped_steps=skipped_steps, steps=steps, scaler=scaler)
    if grad_scale is not None:
        step["grad_scale"] = grad_scale
    if found_inf is not None:
        step["found_inf"] = found_inf
    if max_norm is not None:
        step["max_norm"] = float(max_norm)
    return _launch(grads, out, step)
