"""fastllm::linear: y = x W^T + bias, with bf16/fp16 matmuls computed in fp32 on CPUs that have
no native low-precision GEMM (fastllm/_lowp.py says which, and why: on an AVX2-only CPU torch's
bf16 dY @ W ran at 1.4 GFLOP/s against fp32's ~100), and fp32 matmuls through oneDNN on CPUs
where ATen's fp32 GEMM is slow (fastllm/_gemm.py: 2-8x on an AMD Zen 5).

x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None; one
dtype (fp32, bf16, fp16, fp64) and device. Low-precision tensors stay low precision in memory:
the op saves x and W as they are and widens them only inside each product, rounding each output
once (dx = dy W, dweight = dy^T x, dbias = sum of dy in fp32). Elsewhere (CUDA, CPUs where
neither policy applies) it is exactly F.linear and its autograd.

Ops (schemas in fastllm/_library.py): linear(x, weight, bias) -> y and
linear_backward(dy, x, weight, output_mask) -> (dx, dweight, dbias). One implementation for every
device (ATen's GEMMs; the policy is the kernel); `linear_ref` is the fp32-accumulated oracle.
fastllm.patch routes a model's nn.Linear layers here when the widening applies.
"""

import math

import torch
import torch.nn.functional as F

from fastllm import _backend, _gemm, _lowp
from fastllm._library import direct_op, first_order_only, lib, register_autograd

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_WHERE = "fastllm.linear"


def linear_ref(x, weight, bias=None):
    """F.linear in fp32 (fp64 for fp64), rounded once into x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.linear(x.to(acc), weight.to(acc), None if bias is None else bias.to(acc))
    return y.to(x.dtype)


def check_linear_args(x, weight, bias):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"{_WHERE}: dtype {x.dtype} is not supported (fp32, bf16, fp16, fp64)")
    tensors = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    for name, t in tensors.items():
        if t.dtype != x.dtype:
            raise TypeError(f"{_WHERE}: {name} has dtype {t.dtype}, x has {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{_WHERE}: {name} is on {t.device}, x on {x.device}")
        if t.layout != torch.strided:
            raise TypeError(f"{_WHERE}: {name} is {t.layout}; only dense tensors are supported")
    if x.layout != torch.strided:
        raise TypeError(f"{_WHERE}: x is {x.layout}; only dense tensors are supported")
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{_WHERE}: expected x (..., in_features) and weight (out_features, "
                         f"in_features), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_WHERE}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")


def _widener(x):
    """t -> t in the dtype the products over x run in (fp32 for widened bf16/fp16)."""
    return (lambda t: t.float()) if _lowp.widen(x) else (lambda t: t)


def linear_is_plain(x):
    """Whether fastllm.linear over x is exactly F.linear: neither CPU policy applies (always
    the case off the CPU)."""
    return not x.is_cpu or not (_lowp.widen(x) or _gemm.routes(x.device, x.dtype))


def _linear_impl(x, weight, bias=None):
    check_linear_args(x, weight, bias)
    _backend.forced_backend()  # (one implementation for every backend: a bad name still refused)
    wide = _widener(x)
    return _gemm.linear(wide(x), wide(weight), None if bias is None else wide(bias)).to(x.dtype)


def _linear_backward_impl(grad_out, x, weight, output_mask):
    need_x, need_w, need_b = output_mask
    wide = _widener(x)
    out_features, in_features = weight.shape
    rows = math.prod(x.shape[:-1])  # (reshape(-1, 0) cannot infer it: a 0-feature layer)
    dy = wide(grad_out.reshape(rows, out_features))
    empty = x.new_empty(0)
    dx = _gemm.mm(dy, wide(weight)).to(x.dtype).view(x.shape) if need_x else empty
    dw = _gemm.mm(dy.t(), wide(x.reshape(rows, in_features))).to(x.dtype) if need_w \
        else empty.clone()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    db = dy.sum(0, dtype=acc).to(x.dtype) if need_b else empty.clone()
    return dx, dw, db


lib.impl("linear", _linear_impl, "CPU")
lib.impl("linear", _linear_impl, "CUDA")
lib.impl("linear_backward", _linear_backward_impl, "CPU")
lib.impl("linear_backward", _linear_backward_impl, "CUDA")
_linear_backward = direct_op("linear_backward", _linear_backward_impl)


@torch.library.register_fake("fastllm::linear")
def _linear_fake(x, weight, bias=None):
    check_linear_args(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("fastllm::linear_backward")
def _linear_backward_fake(grad_out, x, weight, output_mask):
    need_x, need_w, need_b = output_mask
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w else x.new_empty(0),
            weight.new_empty(weight.shape[:1]) if need_b else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight = inputs[:2]
    if not weight.requires_grad:
        # x is read by the backward for dW only: with a frozen weight (LoRA's base layers) a
        # one-element stand-in of its shape and dtype is kept instead, as autograd keeps
        # nothing of F.linear's input then
        x = x.new_empty(()).expand(x.shape)
    ctx.save_for_backward(x, weight)
    ctx.has_bias = len(inputs) > 2 and inputs[2] is not None


@first_order_only("fastllm.linear")
def _autograd_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad  # (x, weight) or (x, weight, bias): a defaulted bias is dropped
    need_x, need_w = needs[:2]
    need_b = ctx.has_bias and needs[2]
    grads = [None] * len(needs)
    if need_x or need_w or need_b:
        dx, dw, db = _linear_backward(grad_y, x, weight, [need_x, need_w, need_b])
        for i, (need, g) in enumerate(zip((need_x, need_w, need_b), (dx, dw, db))):
            if need:
                grads[i] = g
    return tuple(grads)


_linear = register_autograd("fastllm::linear", _autograd_backward, setup_context=_setup_context,
                            impl=_linear_impl)


def linear(x, weight, bias=None):
    """x weight^T + bias (F.linear's contract), matmuls in fp32 for bf16/fp16 on CPUs without a
    native low-precision GEMM. Under autocast on x's device type (CPU, CUDA) the inputs are cast
    to its dtype first, as F.linear's are (fp64 ones are not)."""
    device_type = x.device.type
    if _lowp.autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return linear(*_lowp.autocast_args(device_type, x, weight, bias))
    return _linear(x, weight, bias)

