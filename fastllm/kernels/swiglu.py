"""SwiGLU in Triton (fastllm/ops/swiglu.py has the maths): flat elementwise kernels over
contiguous gate and up, fp32 arithmetic, one rounding per output; the backward recomputes
sigmoid(gate), and on request the product silu(gate) * up in the same pass. Interpreter-tested;
the kernels without the product ran on an H200 (2026-12-04), the product's store has not.
"""

import torch
import triton
import triton.language as tl

from fastllm.kernels import cdiv
from fastllm.kernels.rounding import round_nearest


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr,  # *T (n,) gate, up
    y_ptr,  # *T (n,) silu(gate) * up
    n,  # elements
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, round_nearest(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr,  # *T (n,) grad of y, gate, up
    dg_ptr, du_ptr,  # *T (n,) grads of gate and up
    h_ptr,  # *T (n,) silu(gate) * up, written when NEED_H (as the forward rounds it)
    n,
    NEED_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * g * sig
    tl.store(dg_ptr + offs, round_nearest(dg, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, round_nearest(du, du_ptr.dtype.element_ty), mask=mask)
    if NEED_H:  # the forward's expression: g * sigmoid(g) * u, rounded once
        tl.store(h_ptr + offs, round_nearest(g * sig * u, h_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def swiglu_fwd_triton(gate, up):
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(cdiv(n, _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK, num_warps=4)
    return y


def swiglu_bwd_triton(dy, gate, up, need_h=False):
    """(dgate, dup, silu(gate) * up or None)."""
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    h = torch.empty_like(gate) if need_h else None
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(cdiv(n, _BLOCK),)](dy, gate, up, dg, du, dg if h is None else h, n,
                                                      NEED_H=need_h, BLOCK=_BLOCK, num_warps=4)
    return dg, du, h
