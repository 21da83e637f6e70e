"""fastllm.ops.swiglu_lora_linear: a LoRA down projection over silu(gate) * up that keeps gate and
up only, as swiglu_linear does for a plain one (fastllm.patch runs a LoRA down_proj through it).

    y = h W^T + bias + scaling * dropout(h) A^T B^T,   h = silu(gate) * up

(or, given DoRA's scale per output feature, what fastllm.ops.scaled_lora_linear computes over h,
dropout included).

A LoRA layer keeps its input for the backward (dA reads it), so `down_proj(swiglu(gate, up))`
holds h, as large as gate, per layer until the backward: a third of the MLP's activations
beside gate and up. Here h is dropped after the forward and made again in the backward (one
elementwise pass over gate and up, which the SwiGLU backward reads anyway), then the LoRA
backward runs on it: the same ops on the same values, so the grads are those of the two layers
one after the other, bit for bit. The base weight W is frozen (LoRA's contract; a W that trains
takes the two-layer path) and may be an NF4 weight (QLoRA: fastllm.quant.nf4_swiglu_lora_linear),
dequantised in the forward and again in the backward.
"""

import torch

from fastllm import _lowp
from fastllm._library import first_order_only
from fastllm.ops.lora_linear import (bias_grad, check_lora_linear_args, dropout_seed,
                                     lora_linear_ref)
from fastllm.ops.nf4 import dense_weight
from fastllm.ops.scaled_lora_linear import check_scale, scaled_backward, scaled_forward
from fastllm.ops.swiglu import _swiglu, _swiglu_backward, swiglu_ref


def swiglu_lora_linear_ref(gate, up, weight, lora_a, lora_b, scaling, bias=None, dropout_p=0.0,
                           seed=0):
    """Plain PyTorch, differentiated by autograd: lora_linear_ref over swiglu_ref(gate, up)."""
    return lora_linear_ref(swiglu_ref(gate, up), weight, lora_a, lora_b, scaling, bias,
                           dropout_p, seed)


class _SwiGLULoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, absmax, lora_a, lora_b, bias, seed, nf4, scaling,
                dropout_p, scale=None):
        # nf4: None, or (shape, blocksize) of an NF4 weight whose codes are `weight`; scale: None,
        # or DoRA's (out,) scale, applied as scaled_lora_linear applies it
        h = _swiglu(gate, up)
        w = dense_weight(weight, absmax, nf4, h.dtype)
        if scale is None:
            y, xa = torch.ops.fastllm.lora_linear(h, w, lora_a, lora_b, scaling, bias, dropout_p,
                                                  seed)
            kept = None
        else:
            y, xa, kept = scaled_forward(h, w, lora_a, lora_b, scale, bias, seed, scaling,
                                         dropout_p)
        ctx.save_for_backward(gate, up, weight, absmax, lora_a, lora_b, xa, seed, scale, kept)
        ctx.nf4, ctx.scaling, ctx.dropout_p = nf4, scaling, dropout_p
        return y

    @staticmethod
    @first_order_only("fastllm.swiglu_lora_linear")
    def backward(ctx, dy):
        gate, up, weight, absmax, lora_a, lora_b, xa, seed, scale, kept = ctx.saved_tensors
        need_g, need_u, _, _, need_a, need_b, need_bias = ctx.needs_input_grad[:7]
        need_scale = scale is not None and ctx.needs_input_grad[11]
        grads = [None] * 12
        need_h = need_g or need_u
        if need_h or need_a or need_b or need_scale:
            h = _swiglu(gate, up)  # as the forward made it
            w = dense_weight(weight, absmax, ctx.nf4, h.dtype)
            if scale is None:
                dh, da, db = torch.ops.fastllm.lora_linear_backward(
                    dy, h, w, lora_a, lora_b, xa, ctx.scaling, ctx.dropout_p, seed,
                    [need_h, need_a, need_b])
            else:
                dh, da, db, grads[11] = scaled_backward(
                    dy, h, w, lora_a, lora_b, xa, seed, scale, kept, ctx.scaling,
                    ctx.dropout_p, need_h, need_a, need_b, need_scale)
            del h
            grads[4] = da if need_a else None
            grads[5] = db if need_b else None
            if need_h:
                grads[0], grads[1], _ = _swiglu_backward(dh, gate, up, False)
        if need_bias:
            grads[6] = bias_grad(dy.reshape(-1, dy.shape[-1]))
        return tuple(grads)


def check_swiglu_lora_args(where, gate, up, weight, lora_a, lora_b, scaling, bias, dropout_p,
                           scale=None):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing. `weight`: the
    base weight, or a stand-in of its shape, dtype and device."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"{where}: {name} must be a dense tensor")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"{where}: gate and up must match: {tuple(gate.shape)} {gate.dtype} on "
                         f"{gate.device} against {tuple(up.shape)} {up.dtype} on {up.device}")
    if weight.requires_grad:
        raise ValueError(f"{where}: the base weight requires grad; LoRA's base is frozen (call "
                         "the down projection on swiglu(gate, up) to train it)")
    try:
        check_lora_linear_args(gate, weight, lora_a, lora_b, scaling, bias, dropout_p)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}".replace("fastllm.lora_linear: ", "")) from None
    if scale is not None:
        check_scale(where, scale, gate, weight.shape[0], lora_a, dropout_p)


def _autocast_refused(where, device_type):
    if _lowp.autocast_enabled(device_type):
        raise ValueError(f"{where}: not under autocast (call swiglu, then the LoRA layer)")


def swiglu_lora_linear(gate, up, weight, lora_a, lora_b, scaling, bias=None, dropout_p=0.0,
                       training=True, seed=None, scale=None):
    """lora_linear(silu(gate) * up, weight, lora_a, lora_b, scaling, bias, dropout_p, training,
    seed) without keeping silu(gate) * up for the backward (see the module docstring).

    gate, up: (..., ffn) of one dtype; weight: (out, ffn), frozen; lora_a: (r, ffn); lora_b:
    (out, r), in gate's dtype or fp32 on a bf16/fp16 one; bias: (out,) or None. Not under
    autocast. seed: as lora_linear's. scale: None, or (out,) in gate's dtype: a DoRA down
    projection, fastllm.ops.scaled_lora_linear over h (with dropout, adapters in gate's
    dtype)."""
    where = "fastllm.swiglu_lora_linear"
    _autocast_refused(where, gate.device.type if isinstance(gate, torch.Tensor) else "cpu")
    p = float(dropout_p) if training else 0.0
    check_swiglu_lora_args(where, gate, up, weight, lora_a, lora_b, scaling, bias, p, scale)
    return _SwiGLULoRALinear.apply(gate, up, weight, None, lora_a, lora_b, bias,
                                   dropout_seed(gate, p, seed), None, float(scaling), p, scale)
