"""fastllm::swiglu: y = silu(gate) * up, the gated MLP activation of Llama, Qwen2 and Mistral.

gate, up: (...,) of one shape and dtype (fp32, bf16, fp16, fp64), any layout (made contiguous).
Computed in fp32 (fp64 for fp64) and rounded once. The backward reads gate, up and dy once and
recomputes sigmoid(gate) instead of keeping silu(gate) (HF's LlamaMLP keeps gate, silu(gate) and
up for its backward; this keeps gate and up):

    dgate = dy * up * sig * (1 + gate * (1 - sig)),   dup = dy * silu(gate)

Ops (schemas in fastllm/_library.py): swiglu(gate, up) -> y, swiglu_backward(dy, gate, up,
need_h=False) -> (dgate, dup, h): with need_h, h = silu(gate) * up as the forward rounds it (the
cpp and Triton kernels write it in the same pass; swiglu_linear's weight grad reads it), else empty.
Backends: cpp (csrc/cpu/swiglu.cpp), triton (fastllm/kernels/swiglu.py), ref.
"""

import math

import torch
import torch.nn.functional as F

from fastllm import _backend, _extension, _lowp
from fastllm._library import (direct_op, first_order_only, lib, on_forward_backend,
                              register_autograd, remember_backend)
from fastllm.ops.linear import _linear as _linear_op, _linear_backward, linear_is_plain

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_ref(gate, up):
    """Plain-PyTorch silu(gate) * up in fp32 (fp64 for fp64), rounded once."""
    op = _opmath(gate.dtype)
    return (F.silu(gate.to(op)) * up.to(op)).to(gate.dtype)


def check_swiglu_args(gate, up):
    where = "fastllm.swiglu"
    if gate.dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype {gate.dtype} is not supported (fp32, bf16, fp16, fp64)")
    if up.dtype != gate.dtype:
        raise TypeError(f"{where}: up has dtype {up.dtype}, gate has {gate.dtype}")
    if up.device != gate.device:
        raise ValueError(f"{where}: up is on {up.device}, gate on {gate.device}")
    if up.shape != gate.shape:
        raise ValueError(f"{where}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.layout != torch.strided or up.layout != torch.strided:
        raise TypeError(f"{where}: only dense tensors are supported")


def _forward_ref(gate, up):
    return swiglu_ref(gate, up)


def _backward_ref(dy, gate, up, need_h):
    op = _opmath(gate.dtype)
    g, u, d = gate.to(op), up.to(op), dy.to(op)
    sig = torch.sigmoid(g)
    h = swiglu_ref(gate, up) if need_h else None
    return (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(gate.dtype), h


def _forward_cpp(gate, up):
    return _extension.extension().swiglu_cpu(gate, up)


def _backward_cpp(dy, gate, up, need_h):
    dg, du, h = _extension.extension().swiglu_backward_cpu(dy, gate, up, need_h)
    return dg, du, (h if need_h else None)


def _forward_triton(gate, up):
    from fastllm.kernels.swiglu import swiglu_fwd_triton

    return swiglu_fwd_triton(gate, up)


def _backward_triton(dy, gate, up, need_h):
    from fastllm.kernels.swiglu import swiglu_bwd_triton

    return swiglu_bwd_triton(dy, gate, up, need_h)


_FORWARD = {"ref": _forward_ref, "cpp": _forward_cpp, "triton": _forward_triton}
_BACKWARD = {"ref": _backward_ref, "cpp": _backward_cpp, "triton": _backward_triton}


def _select(x):
    return _backend.select_kernel("swiglu", x.device.type, x.dtype, _PREFERENCE, _FORWARD,
                                  cpp_entry="swiglu_cpu",
                                  kernel_dtypes={"triton": _backend.KERNEL_DTYPES})


def _swiglu_impl(gate, up):
    check_swiglu_args(gate, up)
    with _backend.device_guard(gate.device):
        return _FORWARD[_select(gate)](gate.contiguous(), up.contiguous())


def _swiglu_backward_impl(grad_out, gate, up, need_h=False):
    with _backend.device_guard(gate.device):
        dg, du, h = _BACKWARD[_select(gate)](grad_out.contiguous(), gate.contiguous(),
                                             up.contiguous(), need_h)
    return dg, du, (gate.new_empty(0) if h is None else h)


lib.impl("swiglu", _swiglu_impl, "CPU")
lib.impl("swiglu", _swiglu_impl, "CUDA")
lib.impl("swiglu_backward", _swiglu_backward_impl, "CPU")
lib.impl("swiglu_backward", _swiglu_backward_impl, "CUDA")
_swiglu_backward = direct_op("swiglu_backward", _swiglu_backward_impl)


@torch.library.register_fake("fastllm::swiglu")
def _swiglu_fake(gate, up):
    check_swiglu_args(gate, up)
    return gate.new_empty(gate.shape)


@torch.library.register_fake("fastllm::swiglu_backward")
def _swiglu_backward_fake(grad_out, gate, up, need_h=False):
    return (gate.new_empty(gate.shape), gate.new_empty(gate.shape),
            gate.new_empty(gate.shape) if need_h else gate.new_empty(0))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


@first_order_only("fastllm.swiglu")
def _backward(ctx, grad_y):
    gate, up = ctx.saved_tensors
    dg, du, _ = _swiglu_backward(grad_y, gate, up, False)
    return dg, du


_swiglu = register_autograd("fastllm::swiglu", _backward, setup_context=_setup_context,
                            impl=_swiglu_impl)


def swiglu(gate, up):
    """silu(gate) * up; gate, up (...,) of one shape and dtype."""
    return _swiglu(gate, up)


class _SwiGLULinear(torch.autograd.Function):
    """silu(gate) * up, then the down projection, keeping gate and up only: the product h (as
    large as gate) is recomputed in the backward when the weight's gradient needs it, by the
    same pass that computes dgate and dup (one read of gate and up for both)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        h = _swiglu(gate, up)
        # fastllm.linear where a CPU policy applies (fastllm/_lowp.py, _gemm.py); else (a GPU)
        # F.linear and torch.mm in the backward: the same products without the op's Python
        # layers (the patched step was host-bound on an H200)
        # (not under autocast: F.linear would cast the product down, the backward's mm not)
        ctx.plain = linear_is_plain(h) and not _lowp.autocast_enabled(h.device.type)
        out = F.linear(h, weight, bias) if ctx.plain else _linear_op(h, weight, bias)
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        remember_backend(ctx)
        return out

    @staticmethod
    @on_forward_backend
    @first_order_only("fastllm.swiglu_linear")
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        need_g, need_u, need_w, need_b = ctx.needs_input_grad
        need_h, need_b = need_g or need_u, need_b and ctx.has_bias
        dgate = dup = h = dw = db = None
        if not ctx.plain:  # fastllm.linear's backward op: dh, dW and db in one call
            h = _swiglu(gate, up) if need_w else gate  # (dh = dy W reads only h's shape)
            dh, dw, db = _linear_backward(grad_out, h, weight, [need_h, need_w, need_b])
            del h
            if need_h:
                dgate, dup, _ = _swiglu_backward(dh, gate, up, False)
            return dgate, dup, (dw if need_w else None), (db if need_b else None)
        if need_h:
            # dh = dy W reads nothing of h but its shape (gate's); then dgate, dup and, when dW
            # needs it, the product h itself from one pass over dh, gate and up
            dh = _plain_linear_grads(grad_out, gate, weight, True, False, False)[0]
            dgate, dup, h = _swiglu_backward(dh, gate, up, need_w)
            del dh
        elif need_w:
            h = _swiglu(gate, up)
        if need_w or need_b:
            _, dw, db = _plain_linear_grads(grad_out, h if need_w else gate, weight, False,
                                            need_w, need_b)
        return dgate, dup, dw, db


def _plain_linear_grads(grad_out, h, weight, need_h, need_w, need_b):
    """The grads of F.linear(h, weight, bias) for grad_out through torch.mm: (dh, dweight,
    dbias), None where not needed."""
    rows = math.prod(h.shape[:-1])  # (reshape(-1, 0) cannot infer it: a 0-feature layer)
    dy = grad_out.reshape(rows, weight.shape[0])
    dh = torch.mm(dy, weight).view(h.shape) if need_h else None
    dw = torch.mm(dy.t(), h.reshape(rows, h.shape[-1])) if need_w else None
    return dh, dw, (dy.sum(0) if need_b else None)


def swiglu_linear(gate, up, weight, bias=None):
    """F.linear(silu(gate) * up, weight, bias) without keeping silu(gate) * up for the backward.

    gate, up: (..., ffn); weight: (out, ffn); bias: (out,) or None; one dtype. The product is
    recomputed only when weight requires grad (full fine-tuning), by the SwiGLU backward's own
    pass over gate and up; with a frozen weight (LoRA elsewhere) nothing is recomputed."""
    where = "fastllm.swiglu_linear"
    if weight.dtype != gate.dtype:
        raise TypeError(f"{where}: weight has dtype {weight.dtype}, gate has {gate.dtype}")
    if bias is not None and bias.dtype != gate.dtype:
        raise TypeError(f"{where}: bias has dtype {bias.dtype}, gate has {gate.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{where}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    return _SwiGLULinear.apply(gate, up, weight, bias)
