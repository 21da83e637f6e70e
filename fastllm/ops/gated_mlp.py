"""fastllm.ops.gated_mlp.swiglu_mlp / geglu_mlp: a gated MLP of three plain linear layers as one
autograd node, for the GPU path's host cost.

    y = down(act(gate(x)) * up(x)),   gate(x) = x Wg^T + bg, up(x) = x Wu^T + bu, down likewise

act: SiLU (Llama, Qwen2, Mistral: swiglu_mlp) or the tanh GELU (Gemma: geglu_mlp), computed by
fastllm's SwiGLU/GeGLU kernels (fp32 math, rounded once: fastllm.ops.swiglu). The products are
F.linear and torch.mm, as nn.Linear's own; what it saves is the host's work around them. On an
H200 a patched SmolLM2 step was host-bound (2026-12-04: 59 ms of kernels in a 198 ms step), and
on a CPU with the kernels' launches stubbed (bench/host_gpu_path.py) the patched MLP of three
nn.Linear calls around fastllm.ops.swiglu_linear cost the host about 130 us a layer more than
Hugging Face's (BENCHMARKS.md, 2026-12-07, fifth session): two autograd nodes of C++ and one of
Python, each op behind its argument checks and backend choice. Here the backward is one Python
node that runs the five GEMMs and one SwiGLU backward pass, with the kernels chosen once a call.

Saved for the backward: gate(x), up(x) and, where gate's or up's weight needs a grad, x, as
nn.Linear's and swiglu_linear's would be (the product act(gate) * up is not kept: the SwiGLU
backward pass writes it again where down's weight grad needs it, as in swiglu_linear). The grads
are those of the three layers one after the other, up to the order of sums: dx = dgate Wg + dup Wu
is one GEMM adding into the other (beta = 1, one rounding of their sum) where autograd adds two
rounded products.

fastllm.patch takes it for an MLP of three plain nn.Linear layers in x's dtype where fastllm's
CPU matmul policies do not apply (always on a GPU: `linear_is_plain`); LoRA layers, DTensor
weights, accelerate hooks and autocast keep their own paths (fastllm/patch.py, _mlp_forward).
"""

import math

import torch
import torch.nn.functional as F

from fastllm import _lowp
from fastllm._library import first_order_only, on_forward_backend, remember_backend
from fastllm.ops.swiglu import (_DTYPES, backward_activation, forward_activation, geglu_ref,
                                swiglu_ref)


def swiglu_mlp_ref(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None,
                   down_bias=None):
    """Plain PyTorch, differentiated by autograd: F.linear around swiglu_ref."""
    gate, up = F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)
    return F.linear(swiglu_ref(gate, up), down_weight, down_bias)


def geglu_mlp_ref(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None,
                  down_bias=None):
    """Plain PyTorch, differentiated by autograd: F.linear around geglu_ref."""
    gate, up = F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)
    return F.linear(geglu_ref(gate, up), down_weight, down_bias)


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                gelu):
        act = forward_activation(ctx, x, gelu, (x, gate_weight, up_weight, down_weight))
        gate = F.linear(x, gate_weight, gate_bias)
        up = F.linear(x, up_weight, up_bias)
        out = F.linear(act(gate, up), down_weight, down_bias)
        # x only for the weight grads of gate and up: with them frozen (LoRA elsewhere) it is
        # not kept, as autograd keeps no input of a product whose weight needs no grad
        keep_x = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if keep_x else None, gate_weight, up_weight, down_weight, gate,
                              up)
        ctx.x_shape = x.shape
        ctx.has_bias = (gate_bias is not None, up_bias is not None, down_bias is not None)
        remember_backend(ctx)
        return out

    @staticmethod
    @on_forward_backend
    @first_order_only(lambda ctx: f"fastllm.{'geglu' if ctx.gelu else 'swiglu'}_mlp")
    def backward(ctx, grad_out):
        x, wg, wu, wd, gate, up = ctx.saved_tensors
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad[:4]
        need_bg, need_bu, need_bd = (n and b for n, b in zip(ctx.needs_input_grad[4:7],
                                                               ctx.has_bias))
        act, act_backward = backward_activation(ctx)
        shape = ctx.x_shape
        rows = math.prod(shape[:-1])  # (reshape(-1, 0) cannot infer it: a 0-feature layer)
        dy = grad_out.reshape(rows, wd.shape[0])
        gate, up = gate.reshape(rows, gate.shape[-1]), up.reshape(rows, up.shape[-1])
        dgate = dup = h = None
        if need_x or need_wg or need_wu or need_bg or need_bu:
            # dh = dy Wd; then dgate, dup and, when Wd's grad needs it, the product h itself
            # from one pass over dh, gate and up
            dgate, dup, h = act_backward(torch.mm(dy, wd), gate, up, need_wd)
        elif need_wd:
            h = act(gate, up)
        x2 = None if x is None else x.reshape(rows, shape[-1])
        dx = None
        if need_x:
            dx = torch.mm(dgate, wg).addmm_(dup, wu).view(shape)
        return (dx,
                torch.mm(dgate.t(), x2) if need_wg else None,
                torch.mm(dup.t(), x2) if need_wu else None,
                torch.mm(dy.t(), h) if need_wd else None,
                dgate.sum(0) if need_bg else None,
                dup.sum(0) if need_bu else None,
                dy.sum(0) if need_bd else None,
                None)


def _check(where, x, weights, biases):
    gate_weight, up_weight, down_weight = weights
    if x.dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype {x.dtype} is not supported (fp32, bf16, fp16, fp64)")
    for name, t in (("x", x), ("gate_weight", gate_weight), ("up_weight", up_weight),
                    ("down_weight", down_weight), *zip(("gate_bias", "up_bias", "down_bias"),
                                                       biases)):
        if t is None:
            continue
        if t.layout != torch.strided:
            raise TypeError(f"{where}: {name} is {t.layout}; only dense tensors are supported")
        if t.dtype != x.dtype:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}, x has {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device}, x on {x.device}")
    ffn, hidden = gate_weight.shape if gate_weight.dim() == 2 else (None, None)
    if (hidden is None or x.dim() < 1 or x.shape[-1] != hidden
            or tuple(up_weight.shape) != (ffn, hidden) or down_weight.dim() != 2
            or down_weight.shape[1] != ffn):
        raise ValueError(f"{where}: expected x (..., H), gate_weight and up_weight (F, H), "
                         f"down_weight (O, F); got {tuple(x.shape)}, {tuple(gate_weight.shape)}, "
                         f"{tuple(up_weight.shape)}, {tuple(down_weight.shape)}")
    for name, b, size in zip(("gate_bias", "up_bias", "down_bias"), biases,
                             (ffn, ffn, down_weight.shape[0])):
        if b is not None and tuple(b.shape) != (size,):
            raise ValueError(f"{where}: {name} must be ({size},), got {tuple(b.shape)}")


def _gated_mlp(x, weights, biases, gelu):
    device_type = x.device.type
    if _lowp.autocast_enabled(device_type):  # the three products cast as F.linear's would be
        cast = _lowp.autocast_args(device_type, x, *weights, *biases)
        with torch.autocast(device_type, enabled=False):
            return _gated_mlp(cast[0], cast[1:4], cast[4:], gelu)
    _check(f"fastllm.{'geglu' if gelu else 'swiglu'}_mlp", x, weights, biases)
    return _GatedMLP.apply(x, *weights, *biases, gelu)


def swiglu_mlp(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None,
               down_bias=None):
    """down(silu(gate(x)) * up(x)) of three linear layers' weights (and biases), one autograd
    node. x: (..., H); gate_weight, up_weight: (F, H); down_weight: (O, F); one dtype and
    device. The products are F.linear / torch.mm: not fastllm's CPU matmul policies (see
    fastllm.ops.linear), which fastllm.patch keeps by taking this only where they do not apply.
    Under autocast the inputs are cast as F.linear's are."""
    return _gated_mlp(x, (gate_weight, up_weight, down_weight), (gate_bias, up_bias, down_bias),
                      False)


def geglu_mlp(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None,
              down_bias=None):
    """swiglu_mlp with the tanh GELU in place of SiLU (Gemma's MLP)."""
    return _gated_mlp(x, (gate_weight, up_weight, down_weight), (gate_bias, up_bias, down_bias),
                      True)
