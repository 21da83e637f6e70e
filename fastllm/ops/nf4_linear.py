"""The autograd ops of fastllm.quant's NF4 layers (fastllm.quant re-exports nf4_linear and
nf4_lora_linear): a linear, and fastllm.ops.lora_linear, over a weight held as NF4 codes and
absmax (fastllm.ops.nf4), dequantised in the forward and again in the backward, never kept."""

import torch

from fastllm import _lowp
from fastllm.ops.lora_linear import bias_grad, dropout_seed
from fastllm.ops.nf4 import nf4_dense


def check_input(where, x, in_features):
    """x: a dense fp32/bf16/fp16 tensor of (..., in_features), else an error naming `where`."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        raise TypeError(f"{where}: x must be a dense tensor")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{where}: x has dtype {x.dtype}; expected float32, bfloat16 or float16")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"{where}: x must be (..., {in_features}), got {tuple(x.shape)}")


class _NF4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, absmax, bias, shape, blocksize):
        w = nf4_dense(packed, absmax, shape, blocksize, x.dtype)
        ctx.save_for_backward(packed, absmax)
        ctx.shape, ctx.blocksize, ctx.x_shape = shape, blocksize, x.shape
        return torch.ops.fastllm.linear(x, w, bias)

    @staticmethod
    def backward(ctx, dy):
        need_x, _, _, need_bias = ctx.needs_input_grad[:4]
        dx = db = None
        if need_x:
            packed, absmax = ctx.saved_tensors
            w = nf4_dense(packed, absmax, ctx.shape, ctx.blocksize, dy.dtype)
            stand_in = dy.new_empty(()).expand(ctx.x_shape)  # (x is read only for dW)
            dx = torch.ops.fastllm.linear_backward(dy, stand_in, w, [True, False, False])[0]
        if need_bias:
            db = bias_grad(dy.reshape(-1, ctx.shape[0]))
        return dx, None, None, db, None, None


def _in_compute_dtype(x, bias, compute_dtype):
    """bitsandbytes' Linear4bit rule: x (and bias) cast to the layer's compute dtype; the output
    goes back to x's dtype (returned second)."""
    out_dtype = x.dtype
    if compute_dtype is not None and x.dtype != compute_dtype:
        x = x.to(compute_dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return x, bias, out_dtype


def nf4_linear(x, packed, absmax, shape, blocksize, bias=None, compute_dtype=None):
    """x W^T + bias with W = nf4_dequantize(packed, absmax, shape, blocksize); the backward
    dequantises W again (the dense weight is never kept). Computed in compute_dtype (default:
    x's) and returned in x's dtype, as bitsandbytes' Linear4bit does; under autocast, in its
    dtype, as F.linear."""
    check_input("fastllm.quant.nf4_linear", x, shape[1])
    device_type = x.device.type
    if _lowp.autocast_enabled(device_type):
        x, bias = _lowp.autocast_args(device_type, x, bias)
        with torch.autocast(device_type, enabled=False):
            return nf4_linear(x, packed, absmax, shape, blocksize, bias)
    x, bias, out_dtype = _in_compute_dtype(x, bias, compute_dtype)
    return _NF4Linear.apply(x, packed, absmax, bias, tuple(shape), blocksize).to(out_dtype)


class _NF4LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, absmax, lora_a, lora_b, bias, seed, shape, blocksize, scaling,
                dropout_p):
        w = nf4_dense(packed, absmax, shape, blocksize, x.dtype)
        y, xa = torch.ops.fastllm.lora_linear(x, w, lora_a, lora_b, scaling, bias, dropout_p,
                                              seed)
        ctx.save_for_backward(x, packed, absmax, lora_a, lora_b, xa, seed)
        ctx.shape, ctx.blocksize, ctx.scaling, ctx.dropout_p = shape, blocksize, scaling, dropout_p
        return y

    @staticmethod
    def backward(ctx, dy):
        x, packed, absmax, lora_a, lora_b, xa, seed = ctx.saved_tensors
        need_x, _, _, need_a, need_b, need_bias = ctx.needs_input_grad[:6]
        grads = [None] * 11
        if need_x or need_a or need_b:
            w = nf4_dense(packed, absmax, ctx.shape, ctx.blocksize, x.dtype)
            dx, da, db = torch.ops.fastllm.lora_linear_backward(
                dy, x, w, lora_a, lora_b, xa, ctx.scaling, ctx.dropout_p, seed,
                [need_x, need_a, need_b])
            grads[0] = dx if need_x else None
            grads[3] = da if need_a else None
            grads[4] = db if need_b else None
        if need_bias:
            grads[5] = bias_grad(dy.reshape(-1, ctx.shape[0]))
        return tuple(grads)


def nf4_lora_linear(x, packed, absmax, shape, blocksize, lora_a, lora_b, scaling, bias=None,
                    dropout_p=0.0, training=True, seed=None, compute_dtype=None):
    """fastllm.ops.lora_linear over an NF4 base weight: y = x W^T + bias + scaling *
    dropout(x) A^T B^T with W dequantised in the forward and again in the backward (never
    kept), so the step holds the 4-bit weight only; in compute_dtype and back to x's dtype as
    nf4_linear. A and B in the compute dtype, or fp32 on a bf16/fp16 one (PEFT's fp32
    adapters). seed: as lora_linear's."""
    check_input("fastllm.quant.nf4_lora_linear", x, shape[1])
    p = float(dropout_p) if training else 0.0
    device_type = x.device.type
    if _lowp.autocast_enabled(device_type):
        x, lora_a, lora_b, bias = _lowp.autocast_args(device_type, x, lora_a, lora_b, bias)
        with torch.autocast(device_type, enabled=False):
            return nf4_lora_linear(x, packed, absmax, shape, blocksize, lora_a, lora_b, scaling,
                                   bias, p, True, seed)
    x, bias, out_dtype = _in_compute_dtype(x, bias, compute_dtype)
    return _NF4LoRALinear.apply(x, packed, absmax, lora_a, lora_b, bias,
                                dropout_seed(x, p, seed), tuple(shape), blocksize,
                                float(scaling), p).to(out_dtype)
