"""PowerSGD decompression with the error-feedback update in Triton, one pass over each matrix.

For M (n, m), the all-reduced P (n, r) and Q (m, r), and this rank's Q_local (m, r), fp32:
    error = M - P Q_local^T (when given);   M = scale * P Q^T
One program per (BLOCK_M, BLOCK_N) tile of M: each product is r outer products of a column
block of P and of a Q, accumulated in registers (r is small: PowerSGD ranks are 1..32), then M
is read once and M and the error written once.
"""

import triton
import triton.language as tl

from fastllm.kernels import cdiv


@triton.jit
def _decompress_kernel(
    m_ptr,  # *fp32, (n_rows, n_cols), read, then overwritten with A
    err_ptr,  # *fp32, (n_rows, n_cols), written with M - A when HAS_ERROR
    p_ptr,  # *fp32, (n_rows, rank)
    q_ptr,  # *fp32, (n_cols, rank), all-reduced
    local_q_ptr,  # *fp32, (n_cols, rank), this rank's, read when HAS_ERROR
    n_rows,
    n_cols,
    rank,
    scale,  # multiplies P Q^T (1 / world size)
    HAS_ERROR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, rank):
        p = tl.load(p_ptr + rows * rank + k, mask=row_mask, other=0.0)
        q = tl.load(q_ptr + cols * rank + k, mask=col_mask, other=0.0)
        acc += p[:, None] * q[None, :]
    acc = acc * scale
    offsets = rows[:, None] * n_cols + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_ERROR:
        local = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, rank):
            p = tl.load(p_ptr + rows * rank + k, mask=row_mask, other=0.0)
            q = tl.load(local_q_ptr + cols * rank + k, mask=col_mask, other=0.0)
            local += p[:, None] * q[None, :]
        mat = tl.load(m_ptr + offsets, mask=mask, other=0.0)
        tl.store(err_ptr + offsets, mat - local, mask=mask)
    tl.store(m_ptr + offsets, acc, mask=mask)


def powersgd_decompress_triton(matrices, ps, qs, local_qs, errors, scale):
    """In place over lists of contiguous fp32 tensors; errors and local_qs may be empty."""
    block_m, block_n = 32, 64
    for i, (mat, p, q) in enumerate(zip(matrices, ps, qs)):
        n, m = mat.shape
        if mat.numel() == 0:
            continue
        err = errors[i] if errors else mat
        local_q = local_qs[i] if errors else q
        grid = (cdiv(n, block_m), cdiv(m, block_n))
        _decompress_kernel[grid](mat, err, p, q, local_q, n, m, p.shape[1], float(scale),
                                 HAS_ERROR=bool(errors), BLOCK_M=block_m, BLOCK_N=block_n)
