"""fastllm.ops.lora_linear_multi: LoRA over several projections that share one input (q/k/v,
gate/up), the input read once for all the down products; fastllm.patch runs the projections of
fastllm.lora layers through it (over QLoRA's NF4 bases through fastllm.quant.
nf4_lora_linear_multi, the same autograd function). See the comment below for the maths."""

import math

import torch

from fastllm import _gemm, _lowp
from fastllm._library import first_order_only
from fastllm.ops.linear import check_linear_args
from fastllm.ops.lora_linear import (check_lora_linear_args, lora_linear, low_rank_seed, mixed,
                                     scaled_mm)
from fastllm.ops.nf4 import dense_weight


# --- LoRA over several projections that share one input (q/k/v, gate/up) -----------------------
#
#     y_i = x W_i^T + bias_i + s_i x A_i^T B_i^T,   i = 1..n   (no dropout: one x for all)
#
# x is read once for all the down products: xa = [A_1; ...; A_n] x^T is one (sum r_i, rows)
# matmul, and in the backward dX's low-rank part is one matmul, [s_i dY_i B_i] [A_1; ...; A_n],
# and dA for every projection one more, [s_i dY_i B_i]^T x. A projection without LoRA (A_i None:
# k_proj when only q and v are adapted) contributes its base matmul only.

def _multi_forward(x2, weights, biases, lora_as, lora_bs, scalings):
    """(outs (rows, out_i) each, a_cat, xa_t) of lora_linear_multi on 2-D x."""
    n = len(weights)
    adapted = [i for i in range(n) if lora_as[i] is not None]
    a_cat = torch.cat([lora_as[i] for i in adapted]) if adapted else None
    xa_t = _gemm.mm(a_cat, x2.t()) if adapted else None  # (sum r, rows): x read once
    outs, offset = [], 0
    for i in range(n):
        w, b = weights[i], biases[i]
        if lora_as[i] is None:
            y = _gemm.mm(x2, w.t()) if b is None else _gemm.addmm(b, x2, w.t())
        else:  # the low-rank term (+ bias) seeds y, the base GEMM adds to it (as lora_linear)
            r = lora_as[i].shape[0]
            y = low_rank_seed(xa_t[offset:offset + r].t(), lora_bs[i].t(), scalings[i], b)
            _gemm.addmm_(y, x2, w.t())
            offset += r
        outs.append(y)
    return outs, a_cat, xa_t


def _multi_backward(dys, x2, a_cat, xa_t, weights, lora_bs, spans, scalings, has_bias, need):
    """(dx2, dw, db, da, dbb) of lora_linear_multi; `need` is ctx.needs_input_grad."""
    n = len(weights)
    dw, db, da, dbb = [None] * n, [None] * n, [None] * n, [None] * n
    dyb_parts = []  # s_i (dY_i B_i)^T, (r_i, rows), in the order of a_cat
    for i in range(n):
        if i in spans:
            lo, hi = spans[i]
            if dys[i] is None:
                dyb_parts.append(x2.new_zeros(hi - lo, x2.shape[0]))
            else:
                dyb_parts.append(scaled_mm(lora_bs[i].t(), dys[i].t(), scalings[i]))
    dyb_t = torch.cat(dyb_parts) if dyb_parts else None
    dx = None
    if need[0]:
        # every projection's low-rank dX in one product, which the base GEMMs then add to
        dx = torch.zeros_like(x2) if dyb_t is None else _gemm.mm(dyb_t.t(), a_cat)
        for i in range(n):
            if dys[i] is not None:
                _gemm.addmm_(dx, dys[i], weights[i])
    want_a = any(need[3 + 2 * n + i] for i in spans)
    da_cat = _gemm.mm(dyb_t, x2) if (want_a and dyb_t is not None) else None  # x read once
    for i in range(n):
        g = dys[i]
        if g is None:
            continue
        if need[3 + i]:
            dw[i] = _gemm.mm(g.t(), x2)
        if has_bias[i] and need[3 + n + i]:
            acc = torch.float64 if g.dtype == torch.float64 else torch.float32
            db[i] = g.sum(0, dtype=acc).to(g.dtype)
        if i in spans:
            lo, hi = spans[i]
            if need[3 + 2 * n + i]:
                da[i] = da_cat[lo:hi]
            if need[3 + 3 * n + i]:
                dbb[i] = scaled_mm(g.t(), xa_t[lo:hi].t(), scalings[i])
    return dx, dw, db, da, dbb


def _dense_weights(x, weights, absmaxes, nf4):
    """The dense weights of the projections: one with an NF4 base (nf4[i] = (shape, blocksize))
    has its codes in weights[i], dequantised in x's dtype into its own scratch slot (nothing of
    it is kept)."""
    if nf4 is None:
        return list(weights)
    return [dense_weight(w, a, spec, x.dtype, slot=i)
            for i, (w, a, spec) in enumerate(zip(weights, absmaxes, nf4))]


class _LoRALinearMulti(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, scalings, nf4, *tensors):
        # nf4: None, or per projection None or (shape, blocksize) of an NF4 base whose codes
        # take the weight's place and whose absmax is tensors[4 n + i] (QLoRA: see _dense_weights;
        # None for a dense base)
        weights, biases = tensors[:n], tensors[n:2 * n]
        lora_as, lora_bs, absmaxes = tensors[2 * n:3 * n], tensors[3 * n:4 * n], tensors[4 * n:]
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (not -1: 0-feature layers)
        dense = _dense_weights(x, weights, absmaxes, nf4)
        args = (x2, dense, list(biases), list(lora_as), list(lora_bs), scalings)
        # bf16/fp16 on a CPU without native low-precision GEMMs: the products in fp32 (_lowp.py)
        outs, a_cat, xa_t = _lowp.in_fp32(_multi_forward, *args) if _lowp.widen(x) \
            else _multi_forward(*args)
        spans, offset = {}, 0
        for i in range(n):
            if lora_as[i] is not None:
                spans[i] = (offset, offset + lora_as[i].shape[0])
                offset += lora_as[i].shape[0]
        ctx.n, ctx.scalings, ctx.spans, ctx.nf4 = n, scalings, spans, nf4
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, a_cat, xa_t, *weights, *lora_bs, *absmaxes)
        return tuple(y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(outs, dense))

    @staticmethod
    @first_order_only("fastllm.lora_linear_multi")
    def backward(ctx, *grads):
        n = ctx.n
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor only once
        x, a_cat, xa_t = saved[:3]
        weights = _dense_weights(x, saved[3:3 + n], saved[3 + 2 * n:], ctx.nf4)
        lora_bs = list(saved[3 + n:3 + 2 * n])
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        dys = [None if g is None else g.reshape(x2.shape[0], weights[i].shape[0])
               for i, g in enumerate(grads)]
        args = (dys, x2, a_cat, xa_t, weights, lora_bs, ctx.spans, ctx.scalings, ctx.has_bias,
                ctx.needs_input_grad[:3] + ctx.needs_input_grad[4:])  # (without nf4's flag)
        dx, dw, db, da, dbb = _lowp.in_fp32(_multi_backward, *args) if _lowp.widen(x) \
            else _multi_backward(*args)
        return (None if dx is None else dx.view(x.shape), None, None, None, *dw, *db, *da, *dbb,
                *([None] * n))


def check_multi_lengths(weights, lora_as, lora_bs, scalings, biases):
    n = len(weights)
    if not (len(lora_as) == len(lora_bs) == len(scalings) == len(biases) == n):
        raise ValueError("fastllm.lora_linear_multi: weights, lora_as, lora_bs, scalings and "
                         "biases must have one entry per projection")
    for i in range(n):
        if (lora_as[i] is None) != (lora_bs[i] is None):
            raise ValueError(f"fastllm.lora_linear_multi: projection {i} has only one of A, B")


def check_multi_args(x, weights, lora_as, lora_bs, scalings, biases):
    """Raise TypeError/ValueError naming the first bad projection; touches nothing."""
    for i in range(len(weights)):
        if lora_as[i] is not None:
            check_lora_linear_args(x, weights[i], lora_as[i], lora_bs[i], scalings[i], biases[i],
                                   0.0)
            continue
        try:  # a projection without LoRA: fastllm.linear's checks (a bias broadcast per token)
            check_linear_args(x, weights[i], biases[i])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"fastllm.lora_linear_multi: projection {i}: {exc}") from None


def lora_linear_multi(x, weights, lora_as, lora_bs, scalings, biases=None):
    """[x W_i^T + bias_i + s_i x A_i^T B_i^T for each i], the input read once for every A.

    x: (..., in_features); weights[i]: (out_i, in_features); lora_as[i]: (r_i, in_features) or
    None (that projection has no LoRA); lora_bs[i]: (out_i, r_i) or None; scalings[i]: float;
    biases[i]: (out_i,) or None. One dtype and device. No dropout (with dropout each projection
    sees its own dropout(x): use lora_linear per projection). fp32 adapters on a bf16/fp16 base
    run per projection through lora_linear. Returns a list of (..., out_i).
    Under autocast every floating input is cast to the autocast dtype, as F.linear's are.
    """
    n = len(weights)
    biases = list(biases) if biases is not None else [None] * n
    lora_as, lora_bs = list(lora_as), list(lora_bs)
    check_multi_lengths(weights, lora_as, lora_bs, scalings, biases)
    # (before the dtype checks, as F.linear casts before its own: the call checks the cast ones)
    device_type = x.device.type
    if _lowp.autocast_enabled(device_type):
        cast = _lowp.autocast_args(device_type, x, *weights, *biases, *lora_as, *lora_bs)
        with torch.autocast(device_type, enabled=False):
            return lora_linear_multi(cast[0], cast[1:1 + n], cast[1 + 2 * n:1 + 3 * n],
                                     cast[1 + 3 * n:], scalings, cast[1 + n:1 + 2 * n])
    check_multi_args(x, weights, lora_as, lora_bs, scalings, biases)
    if any(a is not None and mixed(x, a) for a in lora_as):
        # fp32 adapters on a bf16/fp16 base: each projection through lora_linear (x read once
        # per adapted projection; the shared read is for one dtype)
        from fastllm.ops.linear import linear

        return [linear(x, w, b) if a is None else lora_linear(x, w, a, bb, s, b)
                for w, a, bb, s, b in zip(weights, lora_as, lora_bs, scalings, biases)]
    return list(_LoRALinearMulti.apply(x, n, [float(s) for s in scalings], None, *weights,
                                       *biases, *lora_as, *lora_bs, *([None] * n)))
