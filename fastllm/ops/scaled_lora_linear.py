"""fastllm.ops.scaled_lora_linear: LoRA's product with a trainable scale per output feature, as a
DoRA layer (fastllm.dora) computes it without dropout:

    y = scale * (x W^T + scaling x A^T B^T) + bias,    scale: (out,)

Autograd's `out * scale` keeps `out` (rows x out) for the scale's grad, beside what the LoRA
product keeps (x and x A^T): one more activation per layer. Here the scale multiplies `out` in
place, and the backward takes the scale's grad from the output itself,

    d scale = sum over rows of dy * y / scale        (y without the bias),

so that where the next op keeps y anyway (attention keeps v; SwiGLU keeps gate and up) the layer
adds nothing to the step's memory, and elsewhere what `out` took. A layer with a bias keeps its
output before the bias (y - bias would lose digits to a large bias), as much as `out`. The grads
of x, A and B are lora_linear's, taken from dy * scale, as autograd takes them. A scale entry of
exactly 0 (a magnitude trained to 0, which training from DoRA's initialisation, the row norms of
W, does not reach) gives that entry a NaN grad, 0 / 0, where autograd's gives sum dy * out: loud
rather than silently wrong.

The base weight W is frozen (LoRA's contract) and may be an NF4 weight (QDoRA:
fastllm.quant.nf4_scaled_lora_linear), dequantised in the forward and again in the backward.
"""

import torch

from fastllm import _lowp
from fastllm._library import first_order_only
from fastllm.ops.lora_linear import bias_grad, check_lora_linear_args, dropout_seed
from fastllm.ops.nf4 import dense_weight

__all__ = ["scaled_lora_linear", "scaled_lora_linear_ref"]


def scaled_lora_linear_ref(x, weight, lora_a, lora_b, scaling, scale, bias=None):
    """Plain PyTorch, differentiated by autograd: scale * (x W^T + scaling x A^T B^T) + bias."""
    low = torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a), lora_b)
    out = scale * (torch.nn.functional.linear(x, weight) + scaling * low)
    return out if bias is None else out + bias


def scale_grad(dy2, y, scale):
    """The scale's grad, sum over rows of dy * out, as sum dy * y / scale: dy2 (rows, out), y
    the scaled output before any bias; summed in fp32 (fp64 for fp64)."""
    acc = torch.promote_types(dy2.dtype, torch.float32)
    dot = (dy2 * y.reshape(dy2.shape)).sum(0, dtype=acc)
    return (dot / scale.to(acc)).to(scale.dtype)


class _ScaledLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, absmax, lora_a, lora_b, scale, bias, nf4, scaling):
        # nf4: None, or (shape, blocksize) of an NF4 weight whose codes are `weight`
        w = dense_weight(weight, absmax, nf4, x.dtype)
        seed = dropout_seed(x, 0.0, None)
        y, xa = torch.ops.fastllm.lora_linear(x, w, lora_a, lora_b, scaling, None, 0.0, seed)
        y.mul_(scale)
        ctx.save_for_backward(x, weight, absmax, lora_a, lora_b, xa, seed, scale, y)
        ctx.nf4, ctx.scaling = nf4, scaling
        return y if bias is None else y + bias

    @staticmethod
    @first_order_only("fastllm.scaled_lora_linear")
    def backward(ctx, dy):
        x, weight, absmax, lora_a, lora_b, xa, seed, scale, y = ctx.saved_tensors
        need_x, _, _, need_a, need_b, need_scale, need_bias = ctx.needs_input_grad[:7]
        grads = [None] * 9
        dy2 = dy.reshape(-1, scale.shape[0])
        if need_scale:
            grads[5] = scale_grad(dy2, y, scale)
        if need_x or need_a or need_b:
            w = dense_weight(weight, absmax, ctx.nf4, x.dtype)
            dx, da, db = torch.ops.fastllm.lora_linear_backward(
                dy * scale, x, w, lora_a, lora_b, xa, ctx.scaling, 0.0, seed,
                [need_x, need_a, need_b])
            grads[0] = dx if need_x else None
            grads[3] = da if need_a else None
            grads[4] = db if need_b else None
        if need_bias:
            grads[6] = bias_grad(dy2)
        return tuple(grads)


def check_scaled_lora_args(where, x, weight, lora_a, lora_b, scaling, scale, bias):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing. `weight`: the
    base weight, or a stand-in of its shape, dtype and device."""
    if isinstance(x, torch.Tensor) and _lowp.autocast_enabled(x.device.type):
        raise ValueError(f"{where}: not under autocast (cast the inputs to one dtype first)")
    if weight.requires_grad:
        raise ValueError(f"{where}: the base weight requires grad; LoRA's base is frozen")
    try:
        check_lora_linear_args(x, weight, lora_a, lora_b, scaling, bias, 0.0)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}".replace("fastllm.lora_linear: ", "")) from None
    check_scale(where, scale, x, weight.shape[0])


def check_scale(where, scale, x, out_features):
    """A scale per output feature: (out_features,), in x's dtype, on x's device."""
    if not isinstance(scale, torch.Tensor) or scale.layout != torch.strided:
        raise TypeError(f"{where}: scale must be a dense tensor")
    if scale.shape != (out_features,) or scale.dtype != x.dtype or scale.device != x.device:
        raise ValueError(f"{where}: scale must be ({out_features},) {x.dtype} on {x.device}, "
                         f"got {tuple(scale.shape)} {scale.dtype} on {scale.device}")


def scaled_lora_linear(x, weight, lora_a, lora_b, scaling, scale, bias=None):
    """scale * (x W^T + scaling x A^T B^T) + bias, keeping no more than the output for the
    scale's grad (see the module docstring).

    x: (..., in); weight: (out, in), frozen; lora_a: (r, in) and lora_b: (out, r) in x's dtype,
    or fp32 on a bf16/fp16 x (as lora_linear's); scale: (out,) in x's dtype; bias: (out,) or None. No dropout (DoRA's formula with dropout is
    another sum) and not under autocast."""
    where = "fastllm.scaled_lora_linear"
    check_scaled_lora_args(where, x, weight, lora_a, lora_b, scaling, scale, bias)
    return _ScaledLoRALinear.apply(x, weight, None, lora_a, lora_b, scale, bias, None,
                                   float(scaling))
