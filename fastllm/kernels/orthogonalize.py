"""Gram-Schmidt orthonormalisation of the columns of tall-skinny matrices in Triton.

For each (n, r) matrix X (row-major, fp32), column by column (modified Gram-Schmidt, the order
of torch's powerSGD_hook):
    x_i  = x_i / (||x_i|| + eps)
    x_j -= (x_i . x_j) x_i            for every j > i
One program per matrix; per column, one pass over row blocks accumulates ||x_i||^2 and every
x_i . x_j at once, a second pass normalises x_i and removes it from the later columns. The whole
row (r <= BLOCK_R columns) is one tile, so column i is picked out of the tile with a mask.
"""

import triton
import triton.language as tl


@triton.jit
def _orthogonalize_kernel(
    x_ptr,  # *fp32, (n_rows, n_cols) row-major, updated in place
    n_rows,  # rows of the matrix (n)
    n_cols,  # columns of the matrix (r), at most BLOCK_R
    eps,  # added to every column norm before dividing
    BLOCK_N: tl.constexpr,  # rows per tile
    BLOCK_R: tl.constexpr,  # n_cols rounded up to a power of two
):
    cols = tl.arange(0, BLOCK_R)
    col_mask = cols < n_cols
    for i in range(0, n_cols):
        dots = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, n_rows, BLOCK_N):
            rows = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
            mask = (rows[:, None] < n_rows) & col_mask[None, :]
            tile = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
            xi = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)
            dots += tl.sum(xi[:, None] * tile, axis=0)
        # IEEE-rounded sqrt and reciprocal as the C++ kernel's (tl.sqrt and / are approximate
        # on GPUs and exact in the interpreter, so the tests would not see the difference).
        norm = tl.sqrt_rn(tl.sum(tl.where(cols == i, dots, 0.0), axis=0))
        denom = norm + eps
        # (not tl.maximum(denom, 1e-38): below fp32's normal range Triton 3.6 types the constant
        # fp64, and tl.div_rn takes fp32 only)
        safe = tl.where(denom > 0.0, denom, 1.0)
        inv = tl.where(denom > 0.0, tl.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe), 0.0)
        coef = tl.where(cols > i, dots * inv * inv, 0.0)
        for start in range(0, n_rows, BLOCK_N):
            rows = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
            mask = (rows[:, None] < n_rows) & col_mask[None, :]
            ptrs = x_ptr + rows[:, None] * n_cols + cols[None, :]
            tile = tl.load(ptrs, mask=mask, other=0.0)
            xi = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)
            out = tile - xi[:, None] * coef[None, :]
            out = tl.where(cols[None, :] == i, xi[:, None] * inv, out)
            tl.store(ptrs, out, mask=mask)


def orthogonalize_triton(matrices, epsilon=0.0):
    """In place, for each contiguous fp32 (n, r) matrix: one program each."""
    for x in matrices:
        n, r = x.shape
        if x.numel() == 0:
            continue
        block_r = max(triton.next_power_of_2(r), 2)
        block_n = max(16, min(256, 4096 // block_r))
        _orthogonalize_kernel[(1,)](x, n, r, float(epsilon), BLOCK_N=block_n, BLOCK_R=block_r)
