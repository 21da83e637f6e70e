"""fastllm::rms_norm: RMSNorm, forward and backward each one pass over memory.

    y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight)

x: (..., h), fp32, bf16, fp16 or fp64; weight: (h,) of x's dtype; offset 0.0 (Llama, Qwen2,
Mistral: Hugging Face's LlamaRMSNorm) or 1.0 (Gemma's `1 + weight`). The statistics and the
product are computed in fp32 (fp64 for fp64) and rounded once into x's dtype: no fp32 copy of x
exists in memory (HF's LlamaRMSNorm makes one and rounds twice). The backward gives dx and
dweight in one pass over x and dy, from x and the per-row rstd (fp32, fp64 for fp64 x):

    xhat = x * rstd,  g = dy * (offset + w)
    dx = rstd * (g - xhat * mean(g * xhat, -1)),   dweight = sum over rows of dy * xhat

Two ops (schemas in fastllm/_library.py): rms_norm(x, weight, eps, offset) -> (y, rstd) and
rms_norm_backward(dy, x, weight, rstd, offset, output_mask) -> (dx, dweight).
Backends: cpp (csrc/cpu/rms_norm.cpp), triton (fastllm/kernels/rms_norm.py; GPU, CPU under
TRITON_INTERPRET=1), ref (plain PyTorch). `rms_norm_ref` is the autograd oracle.
"""

import math

import torch

from fastllm import _backend, _extension
from fastllm._library import direct_op, first_order_only, lib, register_autograd

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_ref(x, weight, eps=1e-6, offset=0.0):
    """Plain-PyTorch RMSNorm in fp32 (fp64 for fp64), rounded once into x's dtype."""
    xf = x.to(_opmath(x.dtype))
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * rstd * (offset + weight.to(xf.dtype))).to(x.dtype)


def check_rms_norm_args(x, weight, eps, offset):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing."""
    where = "fastllm.rms_norm"
    if x.dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype {x.dtype} is not supported (fp32, bf16, fp16, fp64)")
    if weight.dtype != x.dtype:
        raise TypeError(f"{where}: weight has dtype {weight.dtype}, x has {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{where}: weight is on {weight.device}, x on {x.device}")
    if x.layout != torch.strided or weight.layout != torch.strided:
        raise TypeError(f"{where}: only dense tensors are supported")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{where}: expected x (..., h) and weight (h,), got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"{where}: eps must be finite and >= 0, got {eps}")
    if offset not in (0.0, 1.0):
        raise ValueError(f"{where}: offset must be 0.0 (weight) or 1.0 (Gemma's 1 + weight), "
                         f"got {offset}")


def _forward_ref(x, weight, eps, offset):
    xf = x.to(_opmath(x.dtype))
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = (xf * rstd[..., None] * (offset + weight.to(xf.dtype))).to(x.dtype)
    return y, rstd  # fp64 for fp64 x, else fp32


def _backward_ref(dy, x, weight, rstd, offset, need_dx, need_w):
    op = _opmath(x.dtype)
    h = x.shape[-1]
    rows = math.prod(x.shape[:-1])  # (reshape(-1, h) cannot infer it when h is 0)
    x2, dyf = x.reshape(rows, h).to(op), dy.reshape(rows, h).to(op)
    r = rstd.reshape(rows, 1).to(op)
    xhat = x2 * r
    dx = dw = None
    if need_dx:
        g = dyf * (offset + weight.to(op))
        dx = (r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype).view(x.shape)
    if need_w:
        dw = (dyf * xhat).sum(0).to(weight.dtype)
    return dx, dw


def _forward_cpp(x, weight, eps, offset):
    y, rstd = _extension.extension().rms_norm_cpu(x, weight, eps, offset)
    return y, rstd


def _backward_cpp(dy, x, weight, rstd, offset, need_dx, need_w):
    dx, dw = _extension.extension().rms_norm_backward_cpu(dy, x, weight, rstd, offset, need_dx,
                                                          need_w)
    return (dx if need_dx else None), (dw if need_w else None)


def _forward_triton(*args):
    from fastllm.kernels.rms_norm import rms_norm_fwd_triton

    return rms_norm_fwd_triton(*args)


def _backward_triton(*args):
    from fastllm.kernels.rms_norm import rms_norm_bwd_triton

    return rms_norm_bwd_triton(*args)


_FORWARD = {"ref": _forward_ref, "cpp": _forward_cpp, "triton": _forward_triton}
_BACKWARD = {"ref": _backward_ref, "cpp": _backward_cpp, "triton": _backward_triton}


def _select(x):
    return _backend.select_kernel("rms_norm", x.device.type, x.dtype, _PREFERENCE, _FORWARD,
                                  cpp_entry="rms_norm_cpu",
                                  kernel_dtypes={"triton": _backend.KERNEL_DTYPES})


# Every backend takes contiguous x (..., h) as it is (no reshape to rows and back: each view
# costs the host microseconds, and the patched step is host-bound on a GPU) and returns y of
# x's shape, rstd of x.shape[:-1]; the backward takes rstd of that shape (or any with one
# element per row) and returns dx of x's shape.


def _rms_norm_impl(x, weight, eps, offset=0.0):
    check_rms_norm_args(x, weight, eps, offset)
    with _backend.device_guard(x.device):
        return _FORWARD[_select(x)](x.contiguous(), weight.contiguous(), eps, offset)


def _rms_norm_backward_impl(grad_out, x, weight, rstd, offset, output_mask):
    need_dx, need_w = output_mask
    with _backend.device_guard(x.device):
        dx, dw = _BACKWARD[_select(x)](grad_out.contiguous(), x.contiguous(), weight.contiguous(),
                                       rstd.contiguous(), offset, need_dx, need_w)
    if not need_dx:
        dx = x.new_empty(0)
    if not need_w:
        dw = x.new_empty(0)
    return dx, dw


lib.impl("rms_norm", _rms_norm_impl, "CPU")
lib.impl("rms_norm", _rms_norm_impl, "CUDA")
lib.impl("rms_norm_backward", _rms_norm_backward_impl, "CPU")
lib.impl("rms_norm_backward", _rms_norm_backward_impl, "CUDA")
_rms_norm_backward = direct_op("rms_norm_backward", _rms_norm_backward_impl)


@torch.library.register_fake("fastllm::rms_norm")
def _rms_norm_fake(x, weight, eps, offset=0.0):
    check_rms_norm_args(x, weight, eps, offset)
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_opmath(x.dtype))


@torch.library.register_fake("fastllm::rms_norm_backward")
def _rms_norm_backward_fake(grad_out, x, weight, rstd, offset, output_mask):
    need_dx, need_w = output_mask
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset
    ctx.mark_non_differentiable(output[1])


@first_order_only("fastllm.rms_norm")
def _backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_w = ctx.needs_input_grad[:2]
    if not (need_dx or need_w):
        return None, None, None, None
    dx, dw = _rms_norm_backward(grad_y, x, weight, rstd, ctx.offset, [need_dx, need_w])
    return (dx if need_dx else None), (dw if need_w else None), None, None


_rms_norm_op = register_autograd("fastllm::rms_norm", _backward, setup_context=_setup_context,
                                 impl=_rms_norm_impl, materialize_grads=False)


def rms_norm(x, weight, eps=1e-6, offset=0.0):
    """y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight); x (..., h), weight (h,).

    A weight of another dtype than x (an fp32 norm weight on bf16 activations) is cast to x's
    dtype first, so y always has x's dtype."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    y, _ = _rms_norm_op(x, weight, float(eps), float(offset))
    return y


class RMSNorm(torch.nn.Module):
    """Drop-in for Hugging Face's LlamaRMSNorm (offset=0) and GemmaRMSNorm (offset=1):
    `weight` (hidden_size,) and `variance_epsilon` as HF names them, so state_dicts load as is."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, device=None, dtype=None):
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = float(offset)

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset:g}"
