"""AdamW with low-byte moments in Triton: one persistent launch per step over every tensor.

Maths (fastllm/ops/adamw8bit.py has the full contract), per element with step t:
    g  = grad * clip_coef / grad_scale (negated when maximize);   x = master | param
    m  = code_s[m_q] * absmax_m;   v = code_u[v_q] * absmax_v      (bf16 moments: upcast)
    x  = x * (1 - lr * wd);   m = lerp(m, g, 1 - beta1);   v = beta2 * v + (1 - beta2) * g^2
    x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    absmax = max |.| over the block (nan if it holds a nan);   m_q, v_q = nearest code to
    m / absmax_m, v / absmax_v
A tile is (ROWS, BLOCK_P2): one row per quantisation block (BLOCK_P2, the block size rounded up
to a power of two, masked), so a block's new absmax is a row reduction. The nearest code is found
as the C++ kernel finds it, without a search: the fp32 exponent of a = |x| / absmax picks a
binary octave, whose key (one integer) gives the decade when a's mantissa bits are added to it;
inside a decade the codes are equally spaced, so k = trunc(a * inv_spacing + offset).

Each program loads the two code maps once (`_code_map`: the 256 code values and the encoder's
per-octave and per-decade constants, from `qmaps`) and keeps them in registers; decoding and
encoding index them with tl.gather (ten lookups per element, where the old kernel made 14
global-memory gathers), which the sm_90 code serves from shared memory (ld.shared in its PTX),
not from global memory. The step count, the bias corrections, grad_scale, clip_coef and
found_inf are read on the device: a step reads nothing back to the host. Both kernels are
capped at MAX_REGISTERS (128) registers.

`_adamw8bit_kernel` reads a table of the tensors' addresses (tensor_table.py) and strides
over their chunks (a whole number of quantisation blocks each): one launch per step; a nonzero
found_inf makes its loop empty. Tiles of whole blocks take unmasked accesses, a tensor's last
tile is masked. `_adamw8bit_tensor_kernel` is the same update for one tensor per launch, the
fallback where no table can be used (see adamw.py). Both run in the test suite under the
Triton interpreter and compile for sm_90 in `make kernel-check`; neither has run on a GPU yet.
"""

import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels import cdiv, next_power_of_2
from fastllm.kernels.adam_math import (CONSTANT_BITS, adam_moments, device_step, host_constants,
                                       load_grad, one_multiplier, step_scalars, stream_load,
                                       stream_store)
from fastllm.kernels.adamw import _TL_DTYPES
from fastllm.kernels.rounding import philox_key, round_nearest, round_stochastic
from fastllm.kernels.tensor_table import (address, chunk_at, chunks_to_run, one_device,
                                          programs, table)

# The qmaps row layout of fastllm/ops/adamw8bit.py (constexpr: read inside the kernels).
_FIRST, _LAST, _INV, _OFFSET = (tl.constexpr(v) for v in (256, 272, 288, 304))
_OCT_BASE, _OCT_THR, _WIDTH = (tl.constexpr(v) for v in (320, 352, 384))
# Table fields per tensor: param, grad, master, exp_avg, exp_avg_sq, absmax_m, absmax_v, step,
# numel.
_FIELDS = 9
# The register cap of both kernels (ptxas .maxnreg; issue 18 item 4). Without it ptxas gives the
# table kernel 138-149 with Triton's own flags; at 128 it does not spill (`make kernel-check`
# checks both). The interpreter ignores it.
MAX_REGISTERS = 128


@triton.jit
def _code_map(qrow_ptr):
    """One row of qmaps as register tables: (values (256,) fp32, key (32,) int32, inv (16,) fp32,
    offset (16,) fp32, first_span (16,) int32).

    key[s], for the binary octave [2^(s-31), 2^(s-30)): its lower end's segment << 23, plus
    2^23 - the mantissa bits of the decade boundary inside it (0 when it holds none), so that for
    a in that octave (key + mantissa bits of a) >> 23 is a's segment: the sum carries into bit 23
    exactly when a >= the boundary (the C++ kernel's Code::oct_key). first_span[j] is the
    segment's first code index plus (last - first) << 8."""
    values = tl.load(qrow_ptr + tl.arange(0, 256))
    octave = tl.arange(0, 32)
    base = tl.load(qrow_ptr + _OCT_BASE + octave).to(tl.int32)
    threshold = tl.load(qrow_ptr + _OCT_THR + octave)
    upper = ((octave + 97) << 23).to(tl.float32, bitcast=True)  # 2^(s - 30)
    mantissa = threshold.to(tl.int32, bitcast=True) & 0x7FFFFF
    key = (base << 23) + tl.where(threshold < upper, (1 << 23) - mantissa, 0)
    segment = tl.arange(0, 16)
    inv = tl.load(qrow_ptr + _INV + segment)
    offset = tl.load(qrow_ptr + _OFFSET + segment)
    first = tl.load(qrow_ptr + _FIRST + segment).to(tl.int32)
    last = tl.load(qrow_ptr + _LAST + segment).to(tl.int32)
    return values, key, inv, offset, first + ((last - first) << 8)


@triton.jit
def _decode(codes, code_map):
    """code value of each uint8 code (a 2-D tile), from the register table."""
    flat = tl.reshape(codes.to(tl.int32), [codes.numel])
    return tl.reshape(tl.gather(code_map[0], flat, 0), codes.shape)


@triton.jit
def _encode(x, inv_absmax, code_map, SIGNED: tl.constexpr):
    """Index (int32) of the code nearest to x * inv_absmax (a 2-D tile); NaN gives 255."""
    a = tl.minimum(tl.abs(x) * inv_absmax, 1.0)
    a = tl.where(a == a, a, 1.0)
    bits = tl.reshape(a.to(tl.int32, bitcast=True), [a.numel])
    octave = tl.maximum(bits >> 23, 96) - 96
    segment = (tl.gather(code_map[1], octave, 0) + (bits & 0x7FFFFF)) >> 23
    inv = tl.reshape(tl.gather(code_map[2], segment, 0), a.shape)
    offset = tl.reshape(tl.gather(code_map[3], segment, 0), a.shape)
    first_span = tl.reshape(tl.gather(code_map[4], segment, 0), a.shape)
    k = tl.fma(a, inv, offset).to(tl.int32)
    idx = (first_span & 255) + tl.minimum(tl.maximum(k, 0), first_span >> 8)
    if SIGNED:
        idx = tl.where(x < 0, 254 - tl.minimum(idx, 254), idx)
    return idx


@triton.jit
def _absmax(x, mask):
    """Per row of a 2-D tile: the largest |x| where mask, nan when the row holds a nan (as
    torch.amax; tl.max, like fmax, drops it and would leave finite garbage in the state). The
    bits of |x| as int32 order as the values do, and every nan's lie above inf's."""
    bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    return tl.max(bits, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, absmax_m_ptr,
            absmax_v_ptr, rows, offsets, mask, row_mask, random_offsets, map_m, map_v,
            grad_scale_ptr, clip_coef_ptr, neg_step_size, bc2_sqrt, decay, lerp_weight, beta2,
            one_minus_beta2, eps, seed, Q8: tl.constexpr, MASTER: tl.constexpr, SR: tl.constexpr,
            MAXIMIZE: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP_COEF: tl.constexpr):
    """The update of one (ROWS, BLOCK_P2) tile: elements at `offsets` (where `mask`) of the
    quantisation blocks `rows` (where `row_mask`) of one tensor. Every array is read once and
    written once per step: evict_first (adam_math.stream_load)."""
    g = load_grad(grad_ptr, offsets, mask, grad_scale_ptr, clip_coef_ptr, HAS_GRAD_SCALE,
                  HAS_CLIP_COEF, MAXIMIZE)
    if MASTER:
        x = stream_load(master_ptr, offsets, mask, 0.0)
    else:
        x = stream_load(param_ptr, offsets, mask, 0.0).to(tl.float32)
    if Q8:
        absmax_m = tl.load(absmax_m_ptr + rows, mask=row_mask, other=0.0)
        absmax_v = tl.load(absmax_v_ptr + rows, mask=row_mask, other=0.0)
        m = _decode(stream_load(exp_avg_ptr, offsets, mask, 127), map_m)
        v = _decode(stream_load(exp_avg_sq_ptr, offsets, mask, 0), map_v)
        m = m * absmax_m[:, None]
        v = v * absmax_v[:, None]
    else:
        m = stream_load(exp_avg_ptr, offsets, mask, 0.0).to(tl.float32)
        v = stream_load(exp_avg_sq_ptr, offsets, mask, 0.0).to(tl.float32)

    m, v = adam_moments(g, m, v, lerp_weight, beta2, one_minus_beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    x = tl.fma(x, decay, tl.div_rn(neg_step_size * m, denom))

    if SR:
        random = tl.randint(seed, random_offsets)
        p_new = round_stochastic(x, random, param_ptr.dtype.element_ty)
    else:
        p_new = round_nearest(x, param_ptr.dtype.element_ty)
    if MASTER:
        stream_store(master_ptr, offsets, x, mask)
    stream_store(param_ptr, offsets, p_new, mask)

    if Q8:
        new_absmax_m = _absmax(m, mask)
        new_absmax_v = _absmax(v, mask)
        # Correctly rounded reciprocals, as the C++ kernel's 1.0f / absmax: `/` is approximate on
        # GPUs, and one ulp of the scale can move a value across a code boundary. A block whose
        # absmax is below 2^-64 is scaled up by 2^64 first (exact), as there: 1 / absmax
        # overflows fp32 below 2^-128 (subnormal moments), which made every code the top one.
        up_m = tl.where(new_absmax_m < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
        up_v = tl.where(new_absmax_v < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
        safe_m = tl.where(new_absmax_m > 0, new_absmax_m * up_m, 1.0)
        safe_v = tl.where(new_absmax_v > 0, new_absmax_v * up_v, 1.0)
        one = tl.full(safe_m.shape, 1.0, tl.float32)
        inv_m = tl.where(new_absmax_m > 0, tl.div_rn(one, safe_m), 0.0)
        inv_v = tl.where(new_absmax_v > 0, tl.div_rn(one, safe_v), 0.0)
        m_idx = _encode(m * up_m[:, None], inv_m[:, None], map_m, True)
        v_idx = _encode(v * up_v[:, None], inv_v[:, None], map_v, False)
        stream_store(exp_avg_ptr, offsets, m_idx.to(tl.uint8), mask)
        stream_store(exp_avg_sq_ptr, offsets, v_idx.to(tl.uint8), mask)
        tl.store(absmax_m_ptr + rows, new_absmax_m, mask=row_mask)
        tl.store(absmax_v_ptr + rows, new_absmax_v, mask=row_mask)
    else:
        stream_store(exp_avg_ptr, offsets, round_nearest(m, tl.bfloat16), mask)
        stream_store(exp_avg_sq_ptr, offsets, round_nearest(v, tl.bfloat16), mask)


@triton.jit(do_not_specialize=CONSTANT_BITS)
def _adamw8bit_kernel(
    tensors_ptr,  # *int64, FIELDS per tensor (see _FIELDS and tensor_table.py)
    chunks_ptr,  # *int64, (tensor index, first element) per chunk
    n_chunks,  # number of chunks
    qmaps_ptr,  # *fp32 (2, 384): signed and unsigned code maps (read only when Q8)
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
    DTYPE: tl.constexpr,  # the params' and grads' element type
    FIELDS: tl.constexpr,
    Q8: tl.constexpr,  # 8-bit codes (else bf16 moments)
    MASTER: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LR_PTR: tl.constexpr,  # the learning rate at lr_ptr
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned (host-checked)
    QBLOCK: tl.constexpr,  # elements per quantisation block
    BLOCK_P2: tl.constexpr,  # QBLOCK rounded up to a power of two
    ROWS: tl.constexpr,  # quantisation blocks per tile
    CHUNK_TILES: tl.constexpr,  # tiles per chunk
):
    state_dtype: tl.constexpr = tl.uint8 if Q8 else tl.bfloat16
    map_m = 0  # bf16 moments: no code maps
    map_v = 0
    if Q8:
        map_m = _code_map(qmaps_ptr)
        map_v = _code_map(qmaps_ptr + _WIDTH)
    cols = tl.arange(0, BLOCK_P2)
    n_loop = chunks_to_run(n_chunks, found_inf_ptr, HAS_FOUND_INF)
    for c in range(tl.program_id(0), n_loop, tl.num_programs(0)):
        index, row, start = chunk_at(tensors_ptr, chunks_ptr, c, FIELDS)
        param_ptr = address(row, 0, DTYPE, ALIGNED)
        grad_ptr = address(row, 1, DTYPE, ALIGNED)
        master_ptr = address(row, 0, tl.float32, ALIGNED)  # unread unless MASTER
        if MASTER:
            master_ptr = address(row, 2, tl.float32, ALIGNED)
        exp_avg_ptr = address(row, 3, state_dtype, ALIGNED)
        exp_avg_sq_ptr = address(row, 4, state_dtype, ALIGNED)
        absmax_m_ptr = address(row, 5, tl.float32, ALIGNED)  # unread unless Q8
        absmax_v_ptr = address(row, 6, tl.float32, ALIGNED)
        step_ptr = address(row, 7, tl.float32, False)
        n = tl.load(row + 8)
        neg_step_size, bc2_sqrt, step_decay = step_scalars(
            step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits,
            ln_beta2_bits, LR_PTR)
        # Chunks start at multiples of CHUNK_TILES * ROWS blocks, so each tile at one of ROWS.
        first_block = start // QBLOCK
        n_tiles = tl.minimum(tl.cdiv(tl.cdiv(n - start, QBLOCK), ROWS), CHUNK_TILES)
        for t in range(0, n_tiles):
            rows = tl.multiple_of(first_block + t * ROWS, ROWS) + tl.arange(0, ROWS)
            offsets = rows[:, None] * QBLOCK + cols[None, :]
            # Philox counter (tensor index, element): a stream per tensor from one seed.
            random_offsets = offsets + (index << 32)
            if (first_block + t * ROWS + ROWS) * QBLOCK <= n:
                if QBLOCK == BLOCK_P2:
                    mask = tl.full([ROWS, BLOCK_P2], 1, tl.int1)
                else:
                    mask = tl.broadcast_to(cols[None, :] < QBLOCK, [ROWS, BLOCK_P2])
                _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr,
                        absmax_m_ptr, absmax_v_ptr, rows, offsets, mask,
                        tl.full([ROWS], 1, tl.int1), random_offsets, map_m, map_v,
                        grad_scale_ptr, clip_coef_ptr, neg_step_size, bc2_sqrt, step_decay,
                        lerp_weight, beta2, one_minus_beta2, eps, seed, Q8, MASTER, SR,
                        MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP_COEF)
            else:
                mask = (cols[None, :] < QBLOCK) & (offsets < n)
                _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr,
                        absmax_m_ptr, absmax_v_ptr, rows, offsets, mask, rows * QBLOCK < n,
                        random_offsets, map_m, map_v, grad_scale_ptr, clip_coef_ptr,
                        neg_step_size, bc2_sqrt, step_decay, lerp_weight, beta2, one_minus_beta2,
                        eps, seed, Q8, MASTER, SR, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP_COEF)


@triton.jit(do_not_specialize=CONSTANT_BITS)
def _adamw8bit_tensor_kernel(
    param_ptr,  # *fp32|bf16|fp16, n elements, updated in place (rewritten as round(x))
    grad_ptr,  # *param dtype, n elements, read only
    master_ptr,  # *fp32, master weights (read and written only when MASTER)
    exp_avg_ptr,  # *uint8 codes (Q8) or *bf16, first moment, updated in place
    exp_avg_sq_ptr,  # *uint8 codes (Q8) or *bf16, second moment, updated in place
    absmax_m_ptr,  # *fp32, one per block of the first moment (Q8 only)
    absmax_v_ptr,  # *fp32, one per block of the second moment (Q8 only)
    qmaps_ptr,  # *fp32 (2, 384): signed and unsigned code maps (read only when Q8)
    grad_scale_ptr,  # *fp32 scalar, the loss scale (read only when HAS_GRAD_SCALE)
    clip_coef_ptr,  # *fp32 scalar, the clipping factor (read only when HAS_CLIP_COEF)
    found_inf_ptr,  # *fp32 scalar, nonzero skips the step (read only when HAS_FOUND_INF)
    step_ptr,  # *fp32 scalar, this tensor's step count, already incremented
    n_elements,  # elements of this tensor
    decay, lerp_weight, beta2, one_minus_beta2, lr_bits, weight_decay_bits, lr_ptr,
    ln_beta1_bits, ln_beta2_bits,
    eps,  # as _adamw8bit_kernel's
    seed,  # this tensor's random stream (read only when SR)
    Q8: tl.constexpr,
    MASTER: tl.constexpr,
    SR: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LR_PTR: tl.constexpr,  # the learning rate at lr_ptr
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_P2)
    offsets = rows[:, None] * QBLOCK + cols[None, :]
    row_mask = rows * QBLOCK < n_elements
    mask = (cols[None, :] < QBLOCK) & (offsets < n_elements)
    if HAS_FOUND_INF:
        # tl.where, not `&`: a uniform condition (see adamw.py).
        go = tl.load(found_inf_ptr) == 0
        mask = tl.where(go, mask, False)
        row_mask = tl.where(go, row_mask, False)
    neg_step_size, bc2_sqrt, step_decay = step_scalars(
        step_ptr, lr_ptr, decay, lr_bits, weight_decay_bits, ln_beta1_bits, ln_beta2_bits,
        LR_PTR)
    map_m = 0  # bf16 moments: no code maps
    map_v = 0
    if Q8:
        map_m = _code_map(qmaps_ptr)
        map_v = _code_map(qmaps_ptr + _WIDTH)
    _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, absmax_m_ptr,
            absmax_v_ptr, rows, offsets, mask, row_mask, offsets.to(tl.uint32), map_m, map_v,
            grad_scale_ptr, clip_coef_ptr,
            neg_step_size, bc2_sqrt, step_decay, lerp_weight, beta2, one_minus_beta2, eps, seed, Q8,
            MASTER, SR, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP_COEF)


def _tile(block_size, q8):
    """(QBLOCK, BLOCK_P2, ROWS, CHUNK_TILES, num_warps) for quantisation blocks of block_size
    (bf16 moments have none: their tiles are one row). Under the interpreter few, large tiles
    (numpy per program). On a GPU tiles of 1024 elements or one block, 8 elements per thread (two
    bf16 16-byte vectors, 8 code bytes: fewer registers than 16 per thread would need, with the
    code maps beside them), chunks of 16 tiles."""
    tile = 16384 if triton_interpreting() else 1024
    if not q8:
        block_size = tile = tile * 2
    block_p2 = next_power_of_2(block_size)
    rows = max(1, tile // block_p2)
    if triton_interpreting():
        return block_size, block_p2, rows, 1, 4
    return block_size, block_p2, rows, 16, max(4, rows * block_p2 // 256)


def adamw8bit_step_triton(
    params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes, steps,
    qmaps, *, lr, beta1, beta2, eps, weight_decay, block_size, maximize, stochastic_rounding,
    seed, grad_scale, clip_coef, found_inf, lr_tensor=None,
):
    """One launch for every tensor (a table); the contract of fastllm.ops.adamw8bit_step
    (lr_tensor: one element on the params' device, read there instead of lr)."""
    if not params:
        return
    q8 = exp_avgs[0].dtype.itemsize == 1
    if q8 and not hasattr(tl, "gather"):  # the code maps are register tables (_code_map)
        raise RuntimeError(f"8-bit AdamW's Triton kernel needs Triton >= 3.3 (tl.gather); this "
                           f"is Triton {triton.__version__}: upgrade Triton (torch >= 2.7)")
    # The kernel reads the scalars through pointers: they must live where the params do.
    device = params[0].device
    grad_scale, clip_coef, found_inf = (
        t.to(device) if t is not None and t.device != device else t
        for t in (grad_scale, clip_coef, found_inf))
    grad_scale, clip_coef = one_multiplier(grad_scale, clip_coef)
    steps = [device_step(s, device) for s in steps]
    qblock, block_p2, rows, chunk_tiles, num_warps = _tile(block_size, q8)
    arrays = [params, grads, masters or None, exp_avgs, exp_avg_sqs,
              exp_avg_absmaxes if q8 else None, exp_avg_sq_absmaxes if q8 else None]
    found = None
    single = one_device(device, *arrays)
    if single:
        found = table(arrays, steps, chunk_tiles * rows * qblock, device)
    if not single and lr_tensor is not None:
        # Tensors on several devices (the per-tensor fallback): the value, read once here.
        lr, lr_tensor = float(lr_tensor.reshape(()).item()), None
    consts = host_constants(lr, beta1, beta2, weight_decay, lr_tensor)
    flags = dict(Q8=q8, MASTER=bool(masters),
                 SR=stochastic_rounding and params[0].dtype.itemsize == 2, MAXIMIZE=maximize,
                 HAS_GRAD_SCALE=grad_scale is not None, HAS_CLIP_COEF=clip_coef is not None,
                 HAS_FOUND_INF=found_inf is not None, QBLOCK=qblock, BLOCK_P2=block_p2,
                 ROWS=rows)
    if found is None:
        _per_tensor(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                    exp_avg_sq_absmaxes, steps, qmaps, consts, flags, eps=eps, seed=seed,
                    grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf,
                    num_warps=num_warps)
        return
    if found.n_chunks == 0:
        return
    spare = found.tensors  # any pointer: the kernel never reads one whose flag is off
    _adamw8bit_kernel[(programs(device, found.n_chunks),)](
        found.tensors, found.chunks, found.n_chunks, qmaps if q8 else spare,
        grad_scale if grad_scale is not None else spare,
        clip_coef if clip_coef is not None else spare,
        found_inf if found_inf is not None else spare,
        eps=eps, seed=philox_key(seed, -1), **consts, DTYPE=_TL_DTYPES[params[0].dtype],
        FIELDS=_FIELDS, **flags, ALIGNED=found.aligned, CHUNK_TILES=chunk_tiles,
        num_warps=num_warps, maxnreg=MAX_REGISTERS,
    )


def _per_tensor(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                exp_avg_sq_absmaxes, steps, qmaps, consts, flags, *, eps, seed, grad_scale,
                clip_coef, found_inf, num_warps):
    """One launch per non-empty tensor (the fallback: see adamw.py)."""
    tile = flags["ROWS"] * flags["QBLOCK"]
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        spare = exp_avgs[i]
        _adamw8bit_tensor_kernel[(cdiv(n, tile),)](
            p, grads[i], masters[i] if masters else spare, exp_avgs[i], exp_avg_sqs[i],
            exp_avg_absmaxes[i] if flags["Q8"] else spare,
            exp_avg_sq_absmaxes[i] if flags["Q8"] else spare,
            qmaps if flags["Q8"] else spare,
            grad_scale if grad_scale is not None else spare,
            clip_coef if clip_coef is not None else spare,
            found_inf if found_inf is not None else spare,
            steps[i], n, eps=eps, seed=philox_key(seed, i), **consts, **flags,
            num_warps=num_warps, maxnreg=MAX_REGISTERS,
        )
