"""Gram-Schmidt orthonormalisation of the columns of tall-skinny matrices in Triton.

For each (n, r) matrix X (row-major, fp32), column by column (modified Gram-Schmidt, the order
of torch's powerSGD_hook and of orthogonalize_ref):
    q_i  = x_i / (||x_i|| + eps), or 0 when ||x_i|| <= tol * ||x_i before any removal||
    x_j -= (q_i . x_j) q_i            for every j > i
tol = 16 r eps(fp32) (fastllm/ops/orthogonalize.py derives it) marks a column that depends on
the earlier ones: what is left of it is rounding residue, zeroed (times 0: a nan stays) instead
of normalised. A kept column whose norm fell below 1/sqrt(2) of its first one is projected a
second time against q_0 .. q_{i-1} (c = Q^T x_i, x_i -= Q c: two more passes) before it is
normalised, so that it comes out orthogonal to them (twice is enough; the ops module's docstring).
A normaliser above 2^64 (a column of norm below 1/FLT_MAX, fp32-subnormal values: inf in fp32) is
applied as 2^64 (exact) times inv / 2^64, so it cannot overflow (that docstring, SPLIT).
One program per matrix. A first pass over row blocks takes every column's squared norm; then per
column one pass normalises x_i and accumulates every q_i . x_j at once, a second removes q_i from
the later columns and accumulates ||x_{i+1}||^2. The whole row (r <= BLOCK_R columns) is one
tile, so column i is picked out of the tile with a mask.
"""

import torch
import triton
import triton.language as tl

from fastllm.kernels import next_power_of_2

_DEPENDENCE_C = 16  # as DEPENDENCE_C in fastllm/ops/orthogonalize.py
_REORTHOGONALIZE = 0.5  # as REORTHOGONALIZE there
_SPLIT = 2.0 ** 64  # as SPLIT there
_EPS = torch.finfo(torch.float32).eps


@triton.jit
def _row_tile(x_ptr, start, n_rows, n_cols, cols, col_mask, BLOCK_N: tl.constexpr):
    """The rows start .. start + BLOCK_N of the matrix as one tile: (pointers, mask, values)."""
    rows = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    ptrs = x_ptr + rows[:, None] * n_cols + cols[None, :]
    return ptrs, mask, tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _orthogonalize_kernel(
    x_ptr,  # *fp32, (n_rows, n_cols) row-major, updated in place
    n_rows,  # rows of the matrix (n)
    n_cols,  # columns of the matrix (r), at most BLOCK_R
    eps,  # added to every column norm before dividing
    tol,  # a column whose norm falls to tol * its first norm or below is set to zero
    again_below,  # a kept column whose squared norm falls below this * its first is projected twice
    split,  # a normaliser above this is applied as split times inv / split (2^64; no overflow)
    BLOCK_N: tl.constexpr,  # rows per tile
    BLOCK_R: tl.constexpr,  # n_cols rounded up to a power of two
):
    cols = tl.arange(0, BLOCK_R)
    col_mask = cols < n_cols
    # Squared norms summed in fp64, as the C++ kernel's: fp32 squares of a column of 1e-25 are
    # 0 (and the column was zeroed as dependent), of 1e21 inf. fp64 square roots are IEEE.
    sq = tl.zeros([BLOCK_R], dtype=tl.float64)
    for start in range(0, n_rows, BLOCK_N):
        ptrs, mask, tile = _row_tile(x_ptr, start, n_rows, n_cols, cols, col_mask, BLOCK_N)
        wide = tile.to(tl.float64)
        sq += tl.sum(wide * wide, axis=0)
    limit = tol * tl.sqrt(sq)
    first = sq
    norm2 = tl.sum(tl.where(cols == 0, sq, 0.0), axis=0)
    for i in range(0, n_cols):
        keep = tl.sqrt(norm2) > tl.sum(tl.where(cols == i, limit, 0.0), axis=0)
        first_i = tl.sum(tl.where(cols == i, first, 0.0), axis=0)
        if keep & (i > 0) & (norm2 < again_below * first_i):
            c = tl.zeros([BLOCK_R], dtype=tl.float32)
            for start in range(0, n_rows, BLOCK_N):
                ptrs, mask, tile = _row_tile(x_ptr, start, n_rows, n_cols, cols, col_mask, BLOCK_N)
                x_i = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)
                c += tl.sum(tile * x_i[:, None], axis=0)
            c = tl.where(cols < i, c, 0.0)
            sq_i = tl.zeros([BLOCK_N], dtype=tl.float64)
            for start in range(0, n_rows, BLOCK_N):
                ptrs, mask, tile = _row_tile(x_ptr, start, n_rows, n_cols, cols, col_mask, BLOCK_N)
                x_i = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)
                x_i -= tl.sum(tile * c[None, :], axis=1)
                tl.store(ptrs, tl.broadcast_to(x_i[:, None], tile.shape),
                         mask=mask & (cols[None, :] == i))
                sq_i += x_i.to(tl.float64) * x_i.to(tl.float64)
            norm2 = tl.sum(sq_i, axis=0)
        # A dependent column gets inv = 0; 1 / (norm + eps) in fp64 (IEEE), then rounded. Above
        # split (2^64; norm below 1/FLT_MAX: inf in fp32) the column is scaled up by split first
        # (exact) and then by inv / split; any other column by 1 first (bitwise as x * inv)
        safe = tl.where(keep, tl.sqrt(norm2) + eps, 1.0)
        inv64 = tl.where(keep, 1.0 / safe, 0.0)
        big = inv64 > split
        pre = tl.where(big, split, 1.0).to(tl.float32)
        inv = tl.where(big, inv64 / split, inv64).to(tl.float32)
        dots = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, n_rows, BLOCK_N):
            ptrs, mask, tile = _row_tile(x_ptr, start, n_rows, n_cols, cols, col_mask, BLOCK_N)
            q = (tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1) * pre) * inv
            dots += tl.sum(q[:, None] * tile, axis=0)
            tl.store(ptrs, tl.broadcast_to(q[:, None], tile.shape),
                     mask=mask & (cols[None, :] == i))
        coef = tl.where(cols > i, dots, 0.0)
        if i + 1 < n_cols:
            sq = tl.zeros([BLOCK_R], dtype=tl.float64)
            for start in range(0, n_rows, BLOCK_N):
                ptrs, mask, tile = _row_tile(x_ptr, start, n_rows, n_cols, cols, col_mask, BLOCK_N)
                q = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)
                out = tile - q[:, None] * coef[None, :]
                tl.store(ptrs, out, mask=mask & (cols[None, :] > i))
                wide = out.to(tl.float64)
                sq += tl.sum(wide * wide, axis=0)
            norm2 = tl.sum(tl.where(cols == i + 1, sq, 0.0), axis=0)


def orthogonalize_triton(matrices, epsilon=0.0):
    """In place, for each contiguous fp32 (n, r) matrix: one program each."""
    for x in matrices:
        n, r = x.shape
        if x.numel() == 0:
            continue
        block_r = max(next_power_of_2(r), 2)
        # 16 elements a thread per tile (4 warps): with 32 the kernel spilled under Triton 3.6
        block_n = max(16, min(128, 2048 // block_r))
        _orthogonalize_kernel[(1,)](x, n, r, float(epsilon), _DEPENDENCE_C * r * _EPS,
                                    _REORTHOGONALIZE, _SPLIT, BLOCK_N=block_n, BLOCK_R=block_r)
