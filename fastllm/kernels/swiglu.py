"""SwiGLU and GeGLU in Triton (fastllm/ops/swiglu.py has the maths): flat elementwise kernels
over contiguous gate and up, fp32 arithmetic, one rounding per output; the backward recomputes
sigmoid(a(gate)), and on request the product act(gate) * up in the same pass. act(g) is
g * sigmoid(a(g)): SiLU's a(g) = g, the tanh GELU's a(g) = 2k (g + c g^3) (GELU constexpr).
Interpreter-tested; the SwiGLU kernels without the product ran on an H200 (2026-12-04), the
product's store and GeGLU have not.
"""

import torch
import triton
import triton.language as tl

from fastllm.kernels import cdiv
from fastllm.kernels.rounding import round_nearest


@triton.jit
def _act_arg(g, GELU: tl.constexpr):
    """a(g) of act(g) = g * sigmoid(a(g)): g (SiLU), or 2k (g + c g^3), k = sqrt(2 / pi),
    c = 0.044715 (gelu(approximate="tanh"), since 0.5 (1 + tanh(z)) = sigmoid(2z)), with g
    clamped to [-20, 20] as in csrc/cpu/swiglu.cpp (past it act(g) is g or 0, its slope 1 or
    0; unclamped, a'(g) of a gate of 1e19 or more was inf and the slope nan)."""
    if GELU:
        c = tl.minimum(tl.maximum(g, -20.0), 20.0)
        return c * (1.5957691216057308 + 0.07135481627260025 * c * c)
    return g


@triton.jit
def _act_slope(g, GELU: tl.constexpr):
    """a'(g), on _act_arg's clamped g: 2k (1 + 3c g^2), or SiLU's 1 (a product by 1 is exact:
    SwiGLU's grads are what they were before GeGLU shared the kernel)."""
    if GELU:
        c = tl.minimum(tl.maximum(g, -20.0), 20.0)
        slope = 1.5957691216057308 + 0.21406444881780076 * c * c
    else:  # (one return of one type: a tensor of ones)
        slope = tl.full(g.shape, 1.0, tl.float32)
    return slope


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr,  # *T (n,) gate, up
    y_ptr,  # *T (n,) silu(gate) * up
    n,  # elements
    GELU: tl.constexpr,  # GeGLU (tanh GELU) instead of SwiGLU
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(_act_arg(g, GELU)) * u
    tl.store(y_ptr + offs, round_nearest(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr,  # *T (n,) grad of y, gate, up
    dg_ptr, du_ptr,  # *T (n,) grads of gate and up
    h_ptr,  # *T (n,) act(gate) * up, written when NEED_H (as the forward rounds it)
    n,
    NEED_H: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(_act_arg(g, GELU))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig) * _act_slope(g, GELU))
    du = dy * g * sig
    tl.store(dg_ptr + offs, round_nearest(dg, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, round_nearest(du, du_ptr.dtype.element_ty), mask=mask)
    if NEED_H:  # the forward's expression: g * sigmoid(a(g)) * u, rounded once
        tl.store(h_ptr + offs, round_nearest(g * sig * u, h_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def swiglu_fwd_triton(gate, up, gelu=False):
    """silu(gate) * up; gelu: gelu(gate, approximate="tanh") * up."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(cdiv(n, _BLOCK),)](gate, up, y, n, GELU=gelu, BLOCK=_BLOCK,
                                               num_warps=4)
    return y


def swiglu_bwd_triton(dy, gate, up, need_h=False, gelu=False):
    """(dgate, dup, act(gate) * up or None)."""
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    h = torch.empty_like(gate) if need_h else None
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(cdiv(n, _BLOCK),)](dy, gate, up, dg, du, dg if h is None else h, n,
                                                      NEED_H=need_h, GELU=gelu, BLOCK=_BLOCK,
                                                      num_warps=4)
    return dg, du, h
