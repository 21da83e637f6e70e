"""RMSNorm in Triton (fastllm/ops/rms_norm.py has the maths and the op).

One program per row for the forward: the row (h <= BLOCK_H) is loaded once, its mean square
reduced in fp32, y stored rounded once. The backward runs one program per block of ROWS rows:
each row's dx from one load of x and dy, and the block's dweight partial sum in fp32 registers,
stored to a (blocks, h) buffer that PyTorch sums (a fixed order: deterministic).
Interpreter-tested only (TRITON_INTERPRET=1); not yet verified on a GPU.
"""

import torch
import triton
import triton.language as tl

from fastllm.kernels.rounding import round_nearest


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # *T (rows, h), contiguous
    w_ptr,  # *T (h,)
    y_ptr,  # *T (rows, h)
    rstd_ptr,  # *fp32 (rows,)
    h,  # row length
    eps,  # fp32
    offset,  # fp32, 0 or 1 (Gemma)
    BLOCK_H: tl.constexpr,  # >= h, a power of two
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < h
    x = tl.load(x_ptr + row * h + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / h + eps)
    tl.store(rstd_ptr + row, rstd)
    y = x * rstd * (offset + w)
    tl.store(y_ptr + row * h + cols, round_nearest(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # *T (rows, h)
    x_ptr,  # *T (rows, h)
    w_ptr,  # *T (h,)
    rstd_ptr,  # *fp32 (rows,)
    dx_ptr,  # *T (rows, h), written when NEED_DX
    dw_ptr,  # *fp32 (blocks, h) partial sums, written when NEED_DW
    rows, h,  # sizes
    offset,  # fp32
    ROWS: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < h
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < rows:
            x = tl.load(x_ptr + row * h + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * h + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            if NEED_DW:
                dw += dy * xhat
            if NEED_DX:
                g = dy * w
                mean = tl.sum(g * xhat, axis=0) / h
                dx = rstd * (g - xhat * mean)
                tl.store(dx_ptr + row * h + cols, round_nearest(dx, dx_ptr.dtype.element_ty),
                         mask=mask)
    if NEED_DW:
        tl.store(dw_ptr + pid * h + cols, dw, mask=mask)


def _block_h(h):
    block = triton.next_power_of_2(max(h, 1))
    if block > 65536:
        raise ValueError(f"fastllm.rms_norm: the Triton kernel takes rows of up to 65536, got {h}")
    return block


def rms_norm_fwd_triton(x2, weight, eps, offset):
    rows, h = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    if rows and h:
        block = _block_h(h)
        _rms_norm_fwd_kernel[(rows,)](x2, weight, y, rstd, h, eps, offset, BLOCK_H=block,
                                      num_warps=min(16, max(1, block // 256)))
    return y, rstd


def rms_norm_bwd_triton(dy2, x2, weight, rstd, offset, need_dx, need_w):
    rows, h = x2.shape
    dx = torch.empty_like(x2) if need_dx else None
    rows_per = 8 if rows <= 4096 else 32
    blocks = max(1, triton.cdiv(rows, rows_per))
    partial = torch.empty(blocks, h, dtype=torch.float32, device=x2.device) if need_w else None
    if rows and h:
        block = _block_h(h)
        _rms_norm_bwd_kernel[(blocks,)](
            dy2, x2, weight, rstd, dx if need_dx else x2, partial if need_w else rstd,
            rows, h, offset, ROWS=rows_per, BLOCK_H=block, NEED_DX=need_dx, NEED_DW=need_w,
            num_warps=min(16, max(1, block // 256)))
    dw = None
    if need_w:
        dw = (partial.sum(0) if rows else torch.zeros(h, device=x2.device)).to(weight.dtype)
    return dx, dw
