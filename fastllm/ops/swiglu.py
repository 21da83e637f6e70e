"""fastllm::swiglu: y = silu(gate) * up, the gated MLP activation of Llama, Qwen2 and Mistral;
fastllm::geglu: y = gelu(gate, approximate="tanh") * up, Gemma's.

gate, up: (...,) of one shape and dtype (fp32, bf16, fp16, fp64), any layout (made contiguous).
Computed in fp32 (fp64 for fp64) and rounded once. Both activations are act(g) = g * sigmoid(a(g)):
SiLU's a(g) = g, the tanh GELU's a(g) = 2k (g + c g^3) (k = sqrt(2 / pi), c = 0.044715; since
0.5 (1 + tanh(z)) = sigmoid(2z)). The backward reads gate, up and dy once and recomputes
sig = sigmoid(a(gate)) instead of keeping act(gate) (HF's LlamaMLP keeps gate, silu(gate) and up
for its backward; this keeps gate and up):

    dgate = dy * up * sig * (1 + gate * (1 - sig) * a'(gate)),   dup = dy * act(gate)

Ops (schemas in fastllm/_library.py): swiglu(gate, up) -> y, swiglu_backward(dy, gate, up,
need_h=False) -> (dgate, dup, h): with need_h, h = silu(gate) * up as the forward rounds it (the
cpp and Triton kernels write it in the same pass; swiglu_linear's weight grad reads it), else empty.
geglu and geglu_backward likewise; geglu_linear as swiglu_linear.
Backends: cpp (csrc/cpu/swiglu.cpp), triton (fastllm/kernels/swiglu.py), ref.
"""

import math

import torch
import torch.nn.functional as F

from fastllm import _backend, _extension, _lowp
from fastllm._library import (direct_op, first_order_only, lib, on_forward_backend,
                              plain_eager, register_autograd, remember_backend)
from fastllm.ops.linear import _linear as _linear_op, _linear_backward, linear_is_plain

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_ref(gate, up):
    """Plain-PyTorch silu(gate) * up in fp32 (fp64 for fp64), rounded once."""
    op = _opmath(gate.dtype)
    return (F.silu(gate.to(op)) * up.to(op)).to(gate.dtype)


def geglu_ref(gate, up):
    """Plain-PyTorch gelu(gate, approximate="tanh") * up in fp32 (fp64 for fp64), rounded once
    (what Gemma's MLP computes with act_fn gelu_pytorch_tanh)."""
    op = _opmath(gate.dtype)
    return (F.gelu(gate.to(op), approximate="tanh") * up.to(op)).to(gate.dtype)


def check_swiglu_args(gate, up, where="fastllm.swiglu"):
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


def _backward_ref(dy, gate, up, need_h):
    op = _opmath(gate.dtype)
    g, u, d = gate.to(op), up.to(op), dy.to(op)
    sig = torch.sigmoid(g)
    h = swiglu_ref(gate, up) if need_h else None
    return (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(gate.dtype), h


def _geglu_backward_ref(dy, gate, up, need_h):
    # PyTorch's own tanh-GELU derivative (aten.gelu_backward), not the kernels' sigmoid form
    op = _opmath(gate.dtype)
    g, u, d = gate.to(op), up.to(op), dy.to(op)
    dg = torch.ops.aten.gelu_backward(d * u, g, approximate="tanh")
    h = geglu_ref(gate, up) if need_h else None
    return dg.to(gate.dtype), (d * F.gelu(g, approximate="tanh")).to(gate.dtype), h


def _kernels(gelu):
    """({backend: forward(gate, up)}, {backend: backward(dy, gate, up, need_h)}) of one
    activation."""
    name = "geglu" if gelu else "swiglu"
    entry, backward_entry = f"{name}_cpu", f"{name}_backward_cpu"

    def forward_cpp(gate, up):
        return getattr(_extension.extension(), entry)(gate, up)

    def backward_cpp(dy, gate, up, need_h):
        dg, du, h = getattr(_extension.extension(), backward_entry)(dy, gate, up, need_h)
        return dg, du, (h if need_h else None)

    def forward_triton(gate, up):
        from fastllm.kernels.swiglu import swiglu_fwd_triton

        return swiglu_fwd_triton(gate, up, gelu)

    def backward_triton(dy, gate, up, need_h):
        from fastllm.kernels.swiglu import swiglu_bwd_triton

        return swiglu_bwd_triton(dy, gate, up, need_h, gelu)

    forward_ref = geglu_ref if gelu else swiglu_ref
    backward_ref = _geglu_backward_ref if gelu else _backward_ref
    return ({"ref": forward_ref, "cpp": forward_cpp, "triton": forward_triton},
            {"ref": backward_ref, "cpp": backward_cpp, "triton": backward_triton})


def _register(name, forward, backward):
    """Registers fastllm::<name> and <name>_backward (impls, fakes, autograd); returns (the
    autograd-aware op, the backward op called directly, and pick(x): the kernels a node of
    fastllm's that has checked for plain eager code calls instead)."""
    where = f"fastllm.{name}"

    def select(x):
        return _backend.select_kernel(name, x.device.type, x.dtype, _PREFERENCE, forward,
                                      cpp_entry=f"{name}_cpu",
                                      kernel_dtypes={"triton": _backend.KERNEL_DTYPES})

    def impl(gate, up):
        check_swiglu_args(gate, up, where)
        with _backend.device_guard(gate.device):
            return forward[select(gate)](gate.contiguous(), up.contiguous())

    def backward_impl(grad_out, gate, up, need_h=False):
        with _backend.device_guard(gate.device):
            dg, du, h = backward[select(gate)](grad_out.contiguous(), gate.contiguous(),
                                               up.contiguous(), need_h)
        return dg, du, (gate.new_empty(0) if h is None else h)

    for device in ("CPU", "CUDA"):
        lib.impl(name, impl, device)
        lib.impl(f"{name}_backward", backward_impl, device)
    backward_op = direct_op(f"{name}_backward", backward_impl)

    @torch.library.register_fake(f"fastllm::{name}")
    def _fake(gate, up):
        check_swiglu_args(gate, up, where)
        return gate.new_empty(gate.shape)

    @torch.library.register_fake(f"fastllm::{name}_backward")
    def _backward_fake(grad_out, gate, up, need_h=False):
        return (gate.new_empty(gate.shape), gate.new_empty(gate.shape),
                gate.new_empty(gate.shape) if need_h else gate.new_empty(0))

    @first_order_only(where)
    def _backward(ctx, grad_y):
        gate, up = ctx.saved_tensors
        dg, du, _ = backward_op(grad_y, gate, up, False)
        return dg, du

    def pick(x):
        """(backend, its forward and backward kernels): what a call over x of this op runs now,
        for a node of fastllm's that has checked its arguments; the kernels called under
        device_guard, with contiguous tensors (_direct)."""
        backend = select(x)
        return backend, forward[backend], backward[backend]

    op = register_autograd(f"fastllm::{name}", _backward, setup_context=_setup_context,
                           impl=impl)
    return op, backward_op, pick


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


_FORWARD, _BACKWARD = _kernels(False)
_swiglu, _swiglu_backward, _swiglu_pick = _register("swiglu", _FORWARD, _BACKWARD)
_geglu, _geglu_backward, _geglu_pick = _register("geglu", *_kernels(True))
# the activation's (op, backward op), by swiglu_linear's gelu flag; and its pick(x), for plain
# eager code (fastllm._library.plain_eager), where the ops' own checks and call layers cost the
# host more than the kernel launches (bench/host_gpu_path.py)
_OPS = {False: (_swiglu, _swiglu_backward), True: (_geglu, _geglu_backward)}
_PICK = {False: _swiglu_pick, True: _geglu_pick}


def swiglu(gate, up):
    """silu(gate) * up; gate, up (...,) of one shape and dtype."""
    return _swiglu(gate, up)


def geglu(gate, up):
    """gelu(gate, approximate="tanh") * up (Gemma's MLP); gate, up (...,) of one shape and
    dtype."""
    return _geglu(gate, up)


class _SwiGLULinear(torch.autograd.Function):
    """silu(gate) * up (gelu: the tanh GELU's), then the down projection, keeping gate and up
    only: the product h (as large as gate) is recomputed in the backward when the weight's
    gradient needs it, by the same pass that computes dgate and dup (one read of gate and up for
    both)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, gelu):
        where = f"fastllm.{'geglu' if gelu else 'swiglu'}_linear"
        act = forward_activation(ctx, gate, gelu, (gate, up, weight),
                                 check=lambda: check_swiglu_args(gate, up, where))
        h = act(gate, up)
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
    @first_order_only(lambda ctx: f"fastllm.{'geglu' if ctx.gelu else 'swiglu'}_linear")
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        act, act_backward = backward_activation(ctx)
        need_g, need_u, need_w, need_b = ctx.needs_input_grad[:4]
        need_h, need_b = need_g or need_u, need_b and ctx.has_bias
        dgate = dup = h = dw = db = None
        if not ctx.plain:  # fastllm.linear's backward op: dh, dW and db in one call
            h = act(gate, up) if need_w else gate  # (dh = dy W reads only h's shape)
            dh, dw, db = _linear_backward(grad_out, h, weight, [need_h, need_w, need_b])
            del h
            if need_h:
                dgate, dup, _ = act_backward(dh, gate, up, False)
            return dgate, dup, (dw if need_w else None), (db if need_b else None), None
        if need_h:
            # dh = dy W reads nothing of h but its shape (gate's); then dgate, dup and, when dW
            # needs it, the product h itself from one pass over dh, gate and up
            dh = _plain_linear_grads(grad_out, gate, weight, True, False, False)[0]
            dgate, dup, h = act_backward(dh, gate, up, need_w)
            del dh
        elif need_w:
            h = act(gate, up)
        if need_w or need_b:
            _, dw, db = _plain_linear_grads(grad_out, h if need_w else gate, weight, False,
                                            need_w, need_b)
        return dgate, dup, dw, db, None


def forward_activation(ctx, x, gelu, tensors, check=None):
    """The activation forward(gate, up) a node of fastllm's runs over x (SwiGLU, or GeGLU where
    gelu); keeps in ctx what backward_activation(ctx) needs. In plain eager code (checked once
    here, over `tensors`; then `check()`, the arguments' own check) the kernels of the backend
    pick(x) chooses, called as the ops' implementations call them (under device_guard, on
    contiguous tensors), without the ops' dispatch checks and call layers; the choice is kept in
    ctx.backend, so the backward runs it by construction, on whatever thread autograd runs it.
    Traced or under a mode, the op itself."""
    ctx.gelu = gelu
    ctx.direct = plain_eager(tensors)
    if not ctx.direct:
        return _OPS[gelu][0]
    if check is not None:
        check()
    ctx.backend, forward, backward = _PICK[gelu](x)
    device = x.device

    def act(gate, up):
        with _backend.device_guard(device):
            return forward(gate.contiguous(), up.contiguous())

    def act_backward(dy, gate, up, need_h):  # (h None unless need_h)
        with _backend.device_guard(device):
            return backward(dy.contiguous(), gate.contiguous(), up.contiguous(), need_h)

    ctx.kernels = act, act_backward
    return act


def backward_activation(ctx):
    """(forward, backward) of the activation for the backward of a node whose forward called
    forward_activation: its kernels, or the ops (also where compiled autograd traces it)."""
    if ctx.direct and not _backend.intercepted():
        return ctx.kernels
    return _OPS[ctx.gelu]


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
    return _gated_linear(gate, up, weight, bias, False)


def geglu_linear(gate, up, weight, bias=None):
    """F.linear(gelu(gate, approximate="tanh") * up, weight, bias) as swiglu_linear: Gemma's
    MLP after its projections, the product not kept for the backward."""
    return _gated_linear(gate, up, weight, bias, True)


def _gated_linear(gate, up, weight, bias, gelu):
    where = f"fastllm.{'geglu' if gelu else 'swiglu'}_linear"
    if weight.dtype != gate.dtype:
        raise TypeError(f"{where}: weight has dtype {weight.dtype}, gate has {gate.dtype}")
    if bias is not None and bias.dtype != gate.dtype:
        raise TypeError(f"{where}: bias has dtype {bias.dtype}, gate has {gate.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{where}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    return _SwiGLULinear.apply(gate, up, weight, bias, gelu)
