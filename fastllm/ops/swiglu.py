"""fastllm::swiglu: y = silu(gate) * up, the gated MLP activation of Llama, Qwen2 and Mistral.

gate, up: (...,) of one shape and dtype (fp32, bf16, fp16, fp64), any layout (made contiguous).
Computed in fp32 (fp64 for fp64) and rounded once. The backward reads gate, up and dy once and
recomputes sigmoid(gate) instead of keeping silu(gate) (HF's LlamaMLP keeps gate, silu(gate) and
up for its backward; this keeps gate and up):

    dgate = dy * up * sig * (1 + gate * (1 - sig)),   dup = dy * silu(gate)

Ops (schemas in fastllm/_library.py): swiglu(gate, up) -> y, swiglu_backward(dy, gate, up) ->
(dgate, dup). Backends: cpp (csrc/cpu/swiglu.cpp), triton (fastllm/kernels/swiglu.py), ref.
"""

import torch
import torch.nn.functional as F

from fastllm import _backend, _extension
from fastllm._library import (direct_op, first_order_only, lib, on_forward_backend,
                              register_autograd, remember_backend)
from fastllm.ops.linear import _linear as _linear_op, _linear_backward

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


def _backward_ref(dy, gate, up):
    op = _opmath(gate.dtype)
    g, u, d = gate.to(op), up.to(op), dy.to(op)
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(gate.dtype)


def _forward_cpp(gate, up):
    return _extension.extension().swiglu_cpu(gate, up)


def _backward_cpp(dy, gate, up):
    dg, du = _extension.extension().swiglu_backward_cpu(dy, gate, up)
    return dg, du


def _forward_triton(gate, up):
    from fastllm.kernels.swiglu import swiglu_fwd_triton

    return swiglu_fwd_triton(gate, up)


def _backward_triton(dy, gate, up):
    from fastllm.kernels.swiglu import swiglu_bwd_triton

    return swiglu_bwd_triton(dy, gate, up)


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


def _swiglu_backward_impl(grad_out, gate, up):
    with _backend.device_guard(gate.device):
        return _BACKWARD[_select(gate)](grad_out.contiguous(), gate.contiguous(),
                                        up.contiguous())


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
def _swiglu_backward_fake(grad_out, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


@first_order_only("fastllm.swiglu")
def _backward(ctx, grad_y):
    gate, up = ctx.saved_tensors
    dg, du = _swiglu_backward(grad_y, gate, up)
    return dg, du


_swiglu = register_autograd("fastllm::swiglu", _backward, setup_context=_setup_context,
                            impl=_swiglu_impl)


def swiglu(gate, up):
    """silu(gate) * up; gate, up (...,) of one shape and dtype."""
    return _swiglu(gate, up)


class _SwiGLULinear(torch.autograd.Function):
    """silu(gate) * up, then the down projection, keeping gate and up only: the product h (as
    large as gate) is recomputed in the backward when the weight's gradient needs it."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        h = _swiglu(gate, up)
        out = _linear_op(h, weight, bias)  # fastllm/_lowp.py's bf16 policy
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
        dgate = dup = dw = db = None
        # the product h only when dW needs it; dh = dy W reads nothing of h but its shape
        h = _swiglu(gate, up) if need_w else gate
        dh, dw, db = _linear_backward(grad_out, h, weight, [need_h, need_w, need_b])
        del h
        if need_h:
            dgate, dup = _swiglu_backward(dh, gate, up)
        return dgate, dup, (dw if need_w else None), (db if need_b else None)


def swiglu_linear(gate, up, weight, bias=None):
    """F.linear(silu(gate) * up, weight, bias) without keeping silu(gate) * up for the backward.

    gate, up: (..., ffn); weight: (out, ffn); bias: (out,) or None; one dtype. The product is
    recomputed (one elementwise pass) only when weight requires grad (full fine-tuning); with a
    frozen weight (LoRA elsewhere) nothing is recomputed."""
    if weight.dtype != gate.dtype:
        raise TypeError(f"fastllm.swiglu_linear: weight has dtype {weight.dtype}, gate has "
                        f"{gate.dtype}")
    return _SwiGLULinear.apply(gate, up, weight, bias)
