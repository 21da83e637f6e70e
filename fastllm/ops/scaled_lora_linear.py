"""fastllm.ops.scaled_lora_linear: LoRA's product with a trainable scale per output feature, as a
DoRA layer (fastllm.dora) computes it (PEFT's sum, Liu et al. 2024):

    y = x W^T + bias + (scale - 1) * d W^T + scale * scaling d A^T B^T,   d = dropout(x)

scale: (out,); without dropout (d = x) that is scale * (x W^T + scaling x A^T B^T) + bias.

Without dropout, autograd's `out * scale` keeps `out` (rows x out) for the scale's grad, beside
what the LoRA product keeps (x and x A^T): one more activation per layer. Here the scale
multiplies `out` in place, and the backward takes the scale's grad from the output itself,

    d scale = sum over rows of dy * y / scale        (y without the bias),

so that where the next op keeps y anyway (attention keeps v; SwiGLU keeps gate and up) the layer
adds nothing to the step's memory, and elsewhere what `out` took. A layer with a bias keeps its
output before the bias (y - bias would lose digits to a large bias), as much as `out`. The grads
of x, A and B are lora_linear's, taken from dy * scale, as autograd takes them. A scale entry of
exactly 0 (a magnitude trained to 0, which training from DoRA's initialisation, the row norms of
W, does not reach) gives that entry a NaN grad, 0 / 0, where autograd's gives sum dy * out: loud
rather than silently wrong.

With dropout the base weight sees both x and d: two GEMMs each way, as in PEFT. The forward is
lora_linear (x W^T + bias + scaling d A^T B^T, its own dropout) plus (scale - 1) * U, U = d W^T +
scaling d A^T B^T, with d made transiently by lora_linear's dropout (the same mask: one seed);
the backward keeps x, x A^T and U (for the scale's grad) and makes d's mask again from the seed:
dx = lora_linear's dx for dy * scale, plus dropout(R) - R for R = ((scale - 1) * dy) W. Autograd
over PEFT's sum keeps d, d W^T and the low-rank output besides.

The base weight W is frozen (LoRA's contract) and may be an NF4 weight (QDoRA:
fastllm.quant.nf4_scaled_lora_linear), dequantised in the forward and again in the backward.
"""

import torch
import torch.nn.functional as F

from fastllm import _lowp
from fastllm._library import first_order_only
from fastllm.ops.lora_linear import (_base_linear, _base_mm, bias_grad, check_lora_linear_args,
                                     dropout_seed, lora_dropout, lora_dropout_ref)
from fastllm.ops.nf4 import dense_weight

__all__ = ["scaled_lora_linear", "scaled_lora_linear_ref"]


def scaled_lora_linear_ref(x, weight, lora_a, lora_b, scaling, scale, bias=None, dropout_p=0.0,
                           seed=0):
    """Plain PyTorch, differentiated by autograd, in PEFT's order: x W^T + bias + (scale - 1) *
    d W^T + scale * scaling * d A^T B^T, d = dropout(x) with lora_linear's mask for seed."""
    rows = x.shape[:-1].numel()
    d = lora_dropout_ref(x.reshape(rows, x.shape[-1]), dropout_p, seed).reshape(x.shape)
    low = F.linear(F.linear(d, lora_a), lora_b)
    return F.linear(x, weight, bias) + (scale - 1) * F.linear(d, weight) + scale * scaling * low


def _column_dot(dy2, t):
    """sum over rows of dy2 * t, (rows, out) each: summed in fp32 (fp64 for fp64)."""
    acc = torch.promote_types(dy2.dtype, torch.float32)
    return (dy2 * t.reshape(dy2.shape)).sum(0, dtype=acc)


def scale_grad(dy2, y, scale):
    """The scale's grad, sum over rows of dy * out, as sum dy * y / scale: dy2 (rows, out), y
    the scaled output before any bias."""
    acc = torch.promote_types(dy2.dtype, torch.float32)
    return (_column_dot(dy2, y) / scale.to(acc)).to(scale.dtype)


def scaled_forward(x, w, lora_a, lora_b, scale, bias, seed, scaling, dropout_p):
    """(y, xa, kept) on a dense weight w: y the op's output, xa lora_linear's x A^T, kept what
    the backward takes the scale's grad from (the scaled output before any bias; with dropout,
    d W^T + scaling d A^T B^T). Called with grad mode off (inside an autograd.Function)."""
    if dropout_p == 0.0:
        y, xa = torch.ops.fastllm.lora_linear(x, w, lora_a, lora_b, scaling, None, 0.0, seed)
        kept = y.mul_(scale)  # scale * out
        return (y if bias is None else y + bias), xa, kept
    # x W^T + bias + scaling d A^T B^T, then + (scale - 1) * (d W^T + scaling d A^T B^T)
    y, xa = torch.ops.fastllm.lora_linear(x, w, lora_a, lora_b, scaling, bias, dropout_p, seed)
    kept = _base_linear(lora_dropout(x.reshape(-1, x.shape[-1]), dropout_p, seed), w, None, True)
    kept.addmm_(xa.t(), lora_b.t(), alpha=scaling)
    y.view(kept.shape).addcmul_(kept, scale - 1)
    return y, xa, kept


def scaled_backward(dy, x, w, lora_a, lora_b, xa, seed, scale, kept, scaling, dropout_p,
                    need_x, need_a, need_b, need_scale):
    """(dx, da, db, dscale) of scaled_forward's inputs (None where not needed) for dy, its
    output's grad."""
    dy2 = dy.reshape(-1, scale.shape[0])
    dscale = dx = da = db = None
    if need_scale:
        dscale = (scale_grad(dy2, kept, scale) if dropout_p == 0.0
                  else _column_dot(dy2, kept).to(scale.dtype))
    if need_x or need_a or need_b:
        dx, da, db = torch.ops.fastllm.lora_linear_backward(
            dy * scale, x, w, lora_a, lora_b, xa, scaling, dropout_p, seed,
            [need_x, need_a, need_b])
        if need_x and dropout_p != 0.0:
            # the base's product with d: its dx is dropout(R) with R = ((scale - 1) dy) W,
            # where lora_linear's, for dy * scale, gave scale dy W = dy W + R
            r = _base_mm(dy2 * (scale - 1), w, True)
            lora_dropout(r, dropout_p, seed, add_to=dx.view(r.shape)).sub_(r)
    return (dx if need_x else None, da if need_a else None, db if need_b else None, dscale)


class _ScaledLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, absmax, lora_a, lora_b, scale, bias, seed, nf4, scaling,
                dropout_p):
        # nf4: None, or (shape, blocksize) of an NF4 weight whose codes are `weight`
        w = dense_weight(weight, absmax, nf4, x.dtype)
        y, xa, kept = scaled_forward(x, w, lora_a, lora_b, scale, bias, seed, scaling,
                                     dropout_p)
        ctx.save_for_backward(x, weight, absmax, lora_a, lora_b, xa, seed, scale, kept)
        ctx.nf4, ctx.scaling, ctx.dropout_p = nf4, scaling, dropout_p
        return y

    @staticmethod
    @first_order_only("fastllm.scaled_lora_linear")
    def backward(ctx, dy):
        x, weight, absmax, lora_a, lora_b, xa, seed, scale, kept = ctx.saved_tensors
        need_x, _, _, need_a, need_b, need_scale, need_bias = ctx.needs_input_grad[:7]
        grads = [None] * 11
        w = (dense_weight(weight, absmax, ctx.nf4, x.dtype)
             if need_x or need_a or need_b else None)
        grads[0], grads[3], grads[4], grads[5] = scaled_backward(
            dy, x, w, lora_a, lora_b, xa, seed, scale, kept, ctx.scaling, ctx.dropout_p,
            need_x, need_a, need_b, need_scale)
        if need_bias:
            grads[6] = bias_grad(dy.reshape(-1, scale.shape[0]))
        return tuple(grads)


def check_scaled_lora_args(where, x, weight, lora_a, lora_b, scaling, scale, bias, dropout_p=0.0):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing. `weight`: the
    base weight, or a stand-in of its shape, dtype and device."""
    if isinstance(x, torch.Tensor) and _lowp.autocast_enabled(x.device.type):
        raise ValueError(f"{where}: not under autocast (cast the inputs to one dtype first)")
    if weight.requires_grad:
        raise ValueError(f"{where}: the base weight requires grad; LoRA's base is frozen")
    try:
        check_lora_linear_args(x, weight, lora_a, lora_b, scaling, bias, dropout_p)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}".replace("fastllm.lora_linear: ", "")) from None
    check_scale(where, scale, x, weight.shape[0], lora_a, dropout_p)


def check_scale(where, scale, x, out_features, lora_a, dropout_p):
    """A scale per output feature: (out_features,), in x's dtype, on x's device; with dropout,
    adapters in x's dtype."""
    if dropout_p != 0.0 and lora_a.dtype != x.dtype:
        raise TypeError(f"{where}: with dropout the adapters must be in x's dtype {x.dtype}, got "
                        f"{lora_a.dtype} (fastllm.dora sums fp32 adapters as PEFT does)")
    if not isinstance(scale, torch.Tensor) or scale.layout != torch.strided:
        raise TypeError(f"{where}: scale must be a dense tensor")
    if scale.shape != (out_features,) or scale.dtype != x.dtype or scale.device != x.device:
        raise ValueError(f"{where}: scale must be ({out_features},) {x.dtype} on {x.device}, "
                         f"got {tuple(scale.shape)} {scale.dtype} on {scale.device}")


def scaled_lora_linear(x, weight, lora_a, lora_b, scaling, scale, bias=None, dropout_p=0.0,
                       training=True, seed=None):
    """x W^T + bias + (scale - 1) * d W^T + scale * scaling * d A^T B^T, d = dropout(x): without
    dropout scale * (x W^T + scaling x A^T B^T) + bias, keeping no more than the output for the
    scale's grad (see the module docstring).

    x: (..., in); weight: (out, in), frozen; lora_a: (r, in) and lora_b: (out, r) in x's dtype,
    or fp32 on a bf16/fp16 x (as lora_linear's); scale: (out,) in x's dtype; bias: (out,) or
    None. dropout_p applies only when `training`; seed: as lora_linear's (the same mask). Not
    under autocast."""
    where = "fastllm.scaled_lora_linear"
    p = float(dropout_p) if training else 0.0
    check_scaled_lora_args(where, x, weight, lora_a, lora_b, scaling, scale, bias, p)
    return _ScaledLoRALinear.apply(x, weight, None, lora_a, lora_b, scale, bias,
                                   dropout_seed(x, p, seed), None, float(scaling), p)
