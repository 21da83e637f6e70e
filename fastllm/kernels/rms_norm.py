"""RMSNorm in Triton (fastllm/ops/rms_norm.py has the maths and the op): one launch forward, two
backward (one without the weight's gradient).

x, dy: (..., h), contiguous, any rank; rows = x.numel() // h. The forward and backward work on
2-D tiles of ROWS rows x BLOCK_H columns (BLOCK_H >= h, a power of two; ROWS a power of two
making the tile 8192 elements in the forward, 2048 in the backward, 1 for longer rows), so a
program moves a few KB per tensor rather than one short row.

`_rms_norm_fwd_kernel`: one program per tile. Each row's mean square in fp32,
rstd = 1 / sqrt(sum(x^2) / h + eps) stored (fp32), y = x * rstd * (offset + w) rounded once
into x's dtype.

`_rms_norm_bwd_kernel`: a persistent grid (two programs per SM) striding over the tiles. Each
row's dx from one load of x and dy; each program adds its rows' dy * xhat into an fp32 dweight
partial in registers and stores it to its slot of a (programs, h) fp32 buffer, which
`_rms_norm_dw_kernel` (programs of 32 columns) adds in a fixed order (the same bits from run to
run for one grid size, i.e. one GPU model) and rounds once into the weight's dtype.
No PyTorch op follows (no sum, no cast: on an H200 those were two of the five kernels of a
forward and backward, and the sum 10 us of 66); only zero rows with a weight gradient take a
torch.zeros instead of the launches.

Accesses are 128 bits wide when h is a multiple of 8 (bf16, fp16) or 4 (fp32): Triton
specialises the int h on divisibility by 16 only, so the constexpr H_DIVISOR (the power of two
up to 16 dividing h) tells it the rest; `.ci/kernel_check.py` checks the sm_90 PTX (wide
accesses, no spills). The three kernels run in the test suite under the Triton interpreter
(TRITON_INTERPRET=1); none has run on a GPU yet.
"""

import functools

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels import cdiv, next_power_of_2
from fastllm.kernels.rounding import round_nearest

# Elements per tile: the forward's 16 per thread (two 16-byte loads of bf16) at 16 warps (40
# registers: three programs fit an SM); the backward's 8 per thread at 8 warps (57-75
# registers; at 16 per thread ptxas, with Triton's options, capped it at 80 and spilled:
# `make kernel-check` on a cold Triton cache, sm_90, 2026-12-04).
_TILE = 8192
_BWD_TILE = 2048
# The dweight finish: programs of 32 columns (128 bytes of each partial row) adding 128 partials
# per iteration (4096 elements: eight 16-byte loads per thread in flight), so the (programs, h)
# partials are read by h / 32 programs at once: at h = 576 and 264 partials, 18 programs of
# three iterations. (One program finishing everything after an atomic ticket, as l2norm.py
# does for its scalar partials, would read all of them alone: 0.6 MB at h = 576, 4.3 MB at
# h = 4096, latency-bound on one SM.)
_DW_COLUMNS = 32
_DW_SLOTS = 128
# Backward programs per SM: two (each program's loads overlap the other's arithmetic), few
# enough that the partials stay small next to x and dy.
_PER_SM = 2
_SMS = {}


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # *T (rows, h), contiguous
    w_ptr,  # *T (h,)
    y_ptr,  # *T (rows, h)
    rstd_ptr,  # *fp32 (rows,)
    rows, h,  # sizes
    eps,  # fp32
    offset,  # fp32, 0 or 1 (Gemma)
    ROWS: tl.constexpr,  # rows per tile, a power of two
    BLOCK_H: tl.constexpr,  # >= h, a power of two
    H_DIVISOR: tl.constexpr,  # a power of two (<= 16) that divides h
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_mask = r < rows
    col_mask = tl.max_constancy(cols < h, H_DIVISOR)
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = tl.multiple_of(r * h, H_DIVISOR)[:, None] + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # (a masked row of the last tile divides by 1, not by eps: eps may be 0)
    rstd = 1.0 / tl.sqrt(tl.where(row_mask, tl.sum(x * x, axis=1) / h + eps, 1.0))
    tl.store(rstd_ptr + r, rstd, mask=row_mask)
    y = x * rstd[:, None] * (offset + w)[None, :]
    tl.store(y_ptr + offsets, round_nearest(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # *T (rows, h), contiguous
    x_ptr,  # *T (rows, h)
    w_ptr,  # *T (h,)
    rstd_ptr,  # *fp32 (rows,)
    dx_ptr,  # *T (rows, h), written when NEED_DX
    partial_ptr,  # *fp32 (programs, h): each program's dweight partial (NEED_DW)
    rows, h,  # sizes
    offset,  # fp32
    ROWS: tl.constexpr,  # rows per tile, a power of two
    BLOCK_H: tl.constexpr,  # >= h, a power of two
    H_DIVISOR: tl.constexpr,  # a power of two (<= 16) that divides h
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
):
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = tl.max_constancy(cols < h, H_DIVISOR)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # int64 tiles: int32 would wrap within ROWS of 2^31 rows
    for tile in range(tl.program_id(0).to(tl.int64), tl.cdiv(rows, ROWS), programs):
        r = tile * ROWS + tl.arange(0, ROWS)
        row_mask = r < rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = tl.multiple_of(r * h, H_DIVISOR)[:, None] + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        if NEED_DW:
            dw += tl.sum(dy * xhat, axis=0)
        if NEED_DX:
            g = dy * w[None, :]
            mean = tl.sum(g * xhat, axis=1) / h
            dx = rstd[:, None] * (g - xhat * mean[:, None])
            tl.store(dx_ptr + offsets, round_nearest(dx, dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        pid = tl.program_id(0).to(tl.int64)
        tl.store(partial_ptr + tl.multiple_of(pid * h, H_DIVISOR) + cols, dw, mask=col_mask)


@triton.jit
def _rms_norm_dw_kernel(
    partial_ptr,  # *fp32 (programs, h): the backward's dweight partials
    dw_ptr,  # *T (h,), the weight's dtype
    programs, h,  # sizes
    SLOTS: tl.constexpr,  # partials added per iteration, a power of two
    BLOCK_C: tl.constexpr,  # columns per program, a power of two
    H_DIVISOR: tl.constexpr,  # a power of two (<= 16) that divides h
):
    """dweight[c] = the sum over slots of partial[slot, c] (a fixed order: slot s into lane
    s % SLOTS, then the lanes' tree), rounded once."""
    cc = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cc_mask = tl.max_constancy(cc < h, H_DIVISOR)
    sums = tl.zeros((SLOTS, BLOCK_C), dtype=tl.float32)
    for s in range(0, programs, SLOTS):
        slots = s + tl.arange(0, SLOTS)
        first = tl.multiple_of(slots.to(tl.int64) * h, H_DIVISOR)
        sums += tl.load(partial_ptr + first[:, None] + cc[None, :],
                        mask=(slots < programs)[:, None] & cc_mask[None, :], other=0.0)
    tl.store(dw_ptr + cc, round_nearest(tl.sum(sums, axis=0), dw_ptr.dtype.element_ty),
             mask=cc_mask)


def _block_h(h):
    block = next_power_of_2(max(h, 1))
    if block > 65536:
        raise ValueError(f"fastllm.rms_norm: the Triton kernel takes rows of up to 65536, got {h}")
    return block


def _tile(h, elements, per_thread=16):
    """(ROWS, BLOCK_H, num_warps): a tile of about `elements`, `per_thread` per thread."""
    block = _block_h(h)
    rows = max(1, elements // block)
    return rows, block, min(16, max(1, rows * block // (32 * per_thread)))


@functools.lru_cache(maxsize=None)
def _config(h, elements, per_thread):
    """(ROWS, BLOCK_H, num_warps, H_DIVISOR) of a launch over rows of h: computed once per
    shape (a patched model launches with a handful of h, hundreds of times a step)."""
    return (*_tile(h, elements, per_thread), _divisor(h))


def _divisor(h):
    """The largest power of two up to 16 dividing h. Triton specialises an int argument on
    divisibility by 16 only; this hint gives rows of 8 bf16 or 4 fp32 (h = 8 mod 16) their
    128-bit accesses too."""
    return h & -h if h % 16 else 16


def _programs(device, tiles):
    """The backward's persistent grid: _PER_SM programs per SM, at most one per tile; two under
    the interpreter (as tensor_table.programs), so the grid-stride loop is exercised."""
    if triton_interpreting():
        return max(1, min(tiles, 2))
    sms = _SMS.get(device)
    if sms is None:
        sms = _SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                              if device.type == "cuda" else 132)  # the static check: an H200's
    return max(1, min(tiles, _PER_SM * sms))


def rms_norm_fwd_triton(x, weight, eps, offset):
    """x: (..., h), weight: (h,) of x's dtype -> (y like x, rstd fp32 of x.shape[:-1])."""
    x = x.contiguous()
    h = x.shape[-1]
    rows = x.shape[:-1].numel()
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows and not h:
        rstd.fill_(float("nan"))  # 1 / sqrt(0 / 0 + eps), as the C++ kernel and the reference
    elif rows:
        rows_per, block, warps, divisor = _config(h, _TILE, 16)
        _rms_norm_fwd_kernel[(cdiv(rows, rows_per),)](
            x, weight, y, rstd, rows, h, eps, offset, ROWS=rows_per, BLOCK_H=block,
            H_DIVISOR=divisor, num_warps=warps)
    return y, rstd


def rms_norm_bwd_triton(dy, x, weight, rstd, offset, need_dx, need_w):
    """dy, x: (..., h); weight: (h,); rstd: rows fp32 values, any shape, contiguous -> (dx like x
    or None, dweight of the weight's dtype or None). Two launches (one without dweight); none
    for empty x (with dweight, zeros when there are no rows)."""
    x, dy, rstd = x.contiguous(), dy.contiguous(), rstd.contiguous()
    h = x.shape[-1]
    rows = x.shape[:-1].numel()
    dx = torch.empty_like(x) if need_dx else None
    dw = None
    if need_w:
        # Zero rows: dweight is an empty sum; nothing else launches.
        dw = (torch.empty if rows else torch.zeros)(h, dtype=weight.dtype, device=x.device)
    if not (rows and h and (need_dx or need_w)):
        return dx, dw
    rows_per, block, warps, divisor = _config(h, _BWD_TILE, 8)
    n = _programs(x.device, cdiv(rows, rows_per))
    partial = torch.empty(n, h, dtype=torch.float32, device=x.device) if need_w else rstd
    _rms_norm_bwd_kernel[(n,)](
        dy, x, weight, rstd, dx if need_dx else x, partial, rows, h, offset, ROWS=rows_per,
        BLOCK_H=block, H_DIVISOR=divisor, NEED_DX=need_dx, NEED_DW=need_w,
        num_warps=warps)
    if need_w:
        _rms_norm_dw_kernel[(cdiv(h, _DW_COLUMNS),)](
            partial, dw, n, h, SLOTS=_DW_SLOTS, BLOCK_C=_DW_COLUMNS, H_DIVISOR=divisor,
            num_warps=4)
    return dx, dw
