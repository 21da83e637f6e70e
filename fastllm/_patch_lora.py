"""The paths fastllm.patch takes for fastllm.lora layers (plain nn.Linear bases, or QLoRA's
fastllm.quant.NF4Linear):

    q/k/v, gate/up   -> x read once for every LoRA down product (fastllm.ops.lora_linear_multi;
                        fastllm.quant.nf4_lora_linear_multi where a base is NF4)
    down_proj        -> the LoRA layer over silu(gate) * up without keeping the product for the
                        backward (fastllm.ops.swiglu_lora_linear; nf4_swiglu_lora_linear), DoRA
                        layers too (their scale per output feature passed in)

Every other case (DoRA's shared-input projections, merged adapters, sharded or hooked layers,
autocast, an NF4 layer whose compute dtype is not the input's, fp32 adapters beside a bf16 base
in the shared read) calls the layers one by one, which gives the same values.
"""

import torch
from torch import nn

from fastllm import _lowp
from fastllm._dtensor import is_dtensor
from fastllm._hooks import hooked
from fastllm.lora import LoRALinear
from fastllm.quant import NF4Linear

# (These run for every projection call of a patched model: parameters and submodules are read
# from the modules' _parameters and _modules, not through nn.Module.__getattr__, 0.6 us each,
# and is_dora from the class, whose absence on a plain layer would raise and catch an
# AttributeError there.)


_PLAIN = (torch.Tensor, nn.Parameter)


def base_kind(layer):
    """"dense" (a plain nn.Linear whose weight is a plain tensor: not a DTensor, nor another
    subclass, nor taken out of _parameters by torch.nn.utils.prune or weight_norm), "nf4"
    (fastllm.quant's NF4Linear), unsharded; else None."""
    if type(layer) is nn.Linear and type(layer._parameters.get("weight")) in _PLAIN:
        return "dense"
    if type(layer) is NF4Linear and not is_dtensor(layer.weight_packed):
        return "nf4"
    return None


def _adapter(layer, dora=False):
    """A fastllm LoRALinear that runs unmerged on an unsharded plain or NF4 base; else None.
    (DoRA layers, with a magnitude the shared-input path knows nothing of, unless `dora`, and
    layers sharded by fastllm.parallel run their own forward.)"""
    if not isinstance(layer, LoRALinear):
        return None
    params = layer._parameters
    if base_kind(layer._modules.get("base_layer")) and (dora or not getattr(
            type(layer), "is_dora", False)) and not layer.merged and not layer.disabled and (
            type(params.get("lora_A")) in _PLAIN and type(params.get("lora_B")) in _PLAIN):
        return layer
    return None


def lora_parts(layer):
    """(A, B, scaling) of a fastllm LoRALinear that lora_linear_multi can take, else None (with
    dropout in training each projection sees its own dropout(x): no shared read)."""
    if _adapter(layer) is not None and (layer.dropout == 0.0 or not layer.training):
        return layer._parameters["lora_A"], layer._parameters["lora_B"], layer.scaling
    return None


def project(x, layers):
    """[layer(x) for layer in layers], with x read once for every LoRA down product when two or
    more of them are fastllm LoRALinear layers and the rest plain nn.Linear or NF4Linear."""
    parts = [lora_parts(layer) for layer in layers]
    if sum(p is not None for p in parts) < 2:  # (first: a model without LoRA pays this alone)
        return [layer(x) for layer in layers]
    bases = [layer if p is None else layer._modules["base_layer"]
             for layer, p in zip(layers, parts)]
    kinds = [base_kind(b) for b in bases]
    # (a layer neither LoRA nor a plain base, e.g. a DoRA layer, has kind None)
    if None in kinds or any(map(hooked, layers)):
        return [layer(x) for layer in layers]
    from fastllm.ops.lora_linear_multi import lora_linear_multi

    lora_as, lora_bs = ([None if p is None else p[j] for p in parts] for j in (0, 1))
    scalings = [1.0 if p is None else p[2] for p in parts]
    if "nf4" not in kinds:
        return lora_linear_multi(x, [b._parameters["weight"] for b in bases], lora_as, lora_bs,
                                 scalings, [b._parameters.get("bias") for b in bases])
    from fastllm.quant import nf4_lora_linear_multi

    # (the layers' own rules otherwise: x cast to the compute dtype, autocast, fp32 adapters)
    if _lowp.autocast_enabled(x.device.type) or any(
            k == "nf4" and b.compute_dtype != x.dtype for k, b in zip(kinds, bases)) or any(
            a is not None and a.dtype != x.dtype for a in lora_as):
        return [layer(x) for layer in layers]
    return nf4_lora_linear_multi(x, bases, lora_as, lora_bs, scalings)


def down_projection(down, gate, up):
    """down(silu(gate) * up) through swiglu_lora_linear when `down` is a fastllm LoRALinear it
    can run (frozen base, gate in the base's dtype, no autocast), or a DoRA layer it can (the
    same, adapters in gate's dtype); else None."""
    layer = _adapter(down, dora=True)
    if layer is None or hooked(layer) or _lowp.autocast_enabled(gate.device.type):
        return None
    base, kind = layer.base_layer, base_kind(layer.base_layer)
    if (base.compute_dtype if kind == "nf4" else base.weight.dtype) != gate.dtype or (
            kind == "dense" and base.weight.requires_grad):
        return None
    scale = None
    if getattr(type(layer), "is_dora", False):
        if layer.lora_A.dtype != gate.dtype:
            return None  # (DoRA's fp32-adapter sum: the layer's own forward)
        scale = layer.row_scale(gate.dtype)
    if kind == "nf4":
        from fastllm.quant import nf4_swiglu_lora_linear

        return nf4_swiglu_lora_linear(gate, up, base, layer.lora_A, layer.lora_B, layer.scaling,
                                      layer.dropout, layer.training, scale=scale)
    from fastllm.ops.swiglu_lora_linear import swiglu_lora_linear

    return swiglu_lora_linear(gate, up, base.weight, layer.lora_A, layer.lora_B, layer.scaling,
                              base.bias, layer.dropout, layer.training, scale=scale)
