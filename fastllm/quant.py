"""QLoRA's frozen 4-bit base: nn.Linear layers stored in NF4 and dequantised on the fly.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    fastllm.quant.quantize_nf4(model)          # every nn.Linear but the output layer -> NF4Linear
    fastllm.lora.inject_lora(model, "all-linear", r=16, alpha=32)   # LoRA over the 4-bit bases
    ...train (only LoRA parameters require grad)...
    fastllm.lora.save_adapter(model, "out/")   # a PEFT adapter, as with a dense base
    fastllm.quant.dequantize_nf4(model)        # NF4Linear -> nn.Linear again (dequantised)
    model = fastllm.quant.from_pretrained("llama-bnb-4bit/")  # a bitsandbytes 4-bit folder

An NF4Linear keeps its weight as bitsandbytes' NF4 (4-bit codes plus an fp32 absmax per block of
64, fastllm/ops/nf4.py): 0.5625 bytes a weight instead of 2 (bf16) or 4 (fp32). Its forward
casts the input to the layer's compute dtype (and the output back, as bitsandbytes' Linear4bit
does; under autocast, autocast's dtype), dequantises the weight into it, runs fastllm's linear
(or, under a LoRALinear, the fused lora_linear op) and keeps nothing of the dense weight: the
backward dequantises it again for dX = dY W. The weight never trains (QLoRA's contract); the
bias may. Its compute dtype follows `.to(dtype)` / `.bfloat16()` like a module's parameters,
while the codes and absmax stay uint8 and fp32.

This is what `transformers`' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
does at load time, applied in place to a loaded model (as torchao's `quantize_`); the weights are
quantised identically (same code table, blocks and rounding); with double_quant=True
(transformers' bnb_4bit_use_double_quant) the absmax is double-quantised as bitsandbytes' nested
statistics (fastllm.ops.nf4.nf4_double_quantize): 0.5159 bytes a weight instead of 0.5625.
"""

import contextlib
import json
import math
import os
import threading

import torch
from torch import nn

from fastllm import _lowp
from fastllm._dtensor import local
from fastllm._modules import matches, output_layer, replace_module as _replace
from fastllm.ops.lora_linear import dropout_seed
from fastllm.ops.nf4 import (NESTED_BLOCKSIZE, check_blocksize, nested_absmax_blocks,
                             nested_absmax_bytes, nested_code, nf4_code, nf4_dequantize,
                             nf4_double_quantize, nf4_quantize, pack_nested_absmax)
from fastllm.ops.nf4_linear import check_input, nf4_linear, nf4_lora_linear

_WHERE = "fastllm.quant"


class NF4Linear(nn.Module):
    """A frozen nn.Linear whose weight is stored in NF4 (see the module docstring).

    Buffers (frozen parameters after `shardable()`, for FSDP2): weight_packed (uint8,
    ceil(out * in / 2)), weight_absmax (fp32, ceil(out * in / blocksize); double_quant=True:
    uint8, its double-quantised form, fastllm.ops.nf4.nf4_double_quantize); bias: an
    nn.Parameter in the compute dtype, or None. A state_dict loads in either absmax form (the
    layer takes the saved one).
    """

    def __init__(self, in_features, out_features, bias=True, blocksize=64, device=None,
                 dtype=None, double_quant=False):
        super().__init__()
        check_blocksize(f"{_WHERE}.NF4Linear", blocksize)
        dtype = dtype or torch.get_default_dtype()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{_WHERE}.NF4Linear: compute dtype {dtype} is not supported; "
                            "expected float32, bfloat16 or float16")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.blocksize = int(blocksize)
        self.compute_dtype = dtype
        n = self.in_features * self.out_features
        self.register_buffer("weight_packed",
                             torch.zeros(-(-n // 2), dtype=torch.uint8, device=device))
        blocks = -(-n // self.blocksize)
        self.register_buffer("weight_absmax", torch.zeros(
            nested_absmax_bytes(blocks) if double_quant else blocks,
            dtype=torch.uint8 if double_quant else torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear, blocksize=64, double_quant=False):
        """An NF4Linear holding `linear`'s weight quantised (its bias kept as is, frozen or not;
        double_quant: its absmax double-quantised); `linear` is not modified."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"{_WHERE}.NF4Linear.from_linear takes an nn.Linear, got "
                            f"{type(linear).__name__}")
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, blocksize,
                    device="meta", dtype=w.dtype if w.dtype.is_floating_point else None)
        packed, absmax = nf4_quantize(w, blocksize)  # (refuses fp64, inf/nan, sparse weights)
        layer.weight_packed = packed
        layer.weight_absmax = nf4_double_quantize(absmax) if double_quant else absmax
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(),
                                      requires_grad=linear.bias.requires_grad)
        return layer.train(linear.training)

    @property
    def weight_shape(self):
        return (self.out_features, self.in_features)

    @property
    def double_quant(self):
        """Whether the absmax is double-quantised (uint8; else fp32)."""
        return self.weight_absmax.dtype == torch.uint8

    @torch.no_grad()
    def double_quantize(self):
        """Double-quantise this layer's fp32 absmax in place (QLoRA's double quantisation: the
        weight moves by at most the absmax's 8-bit rounding); returns self. A no-op where it
        already is. Not on a sharded (DTensor) absmax: call it before FSDP2 shards the layer."""
        if not self.double_quant:
            absmax = self.weight_absmax
            if type(absmax) not in (torch.Tensor, nn.Parameter):
                raise TypeError(f"{_WHERE}.NF4Linear.double_quantize: the absmax is a "
                                f"{type(absmax).__name__} (sharded?); double-quantise first")
            self._hold("weight_absmax", nf4_double_quantize(absmax.detach()))
        return self

    def _hold(self, name, tensor):
        """`tensor` as this layer's `name`, a buffer or a frozen parameter as that one is."""
        if name in self._parameters:
            self._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        else:
            self._buffers[name] = tensor

    def dequantize(self, dtype=None):
        """The weight, (out_features, in_features), in `dtype` (default: the compute dtype)."""
        return nf4_dequantize(self.weight_packed, self.weight_absmax, self.weight_shape,
                              self.blocksize, dtype or self.compute_dtype)

    def to_linear(self):
        """An nn.Linear with the dequantised weight (frozen) and this layer's bias."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, self.bias is not None)
        linear.weight = nn.Parameter(self.dequantize(), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear.train(self.training)

    def forward(self, x):
        return nf4_linear(x, self.weight_packed, self.weight_absmax, self.weight_shape,
                          self.blocksize, self.bias, self.compute_dtype)

    def _apply(self, fn, recurse=True):
        # the codes and absmax keep their dtypes under .to(dtype) / .half() (an absmax rounded
        # to bf16 would change every weight); the compute dtype follows the cast, as a
        # parameter's dtype would
        # (detached: a parameter's conversion may swap its .data in place)
        kept = {"weight_packed": self.weight_packed.detach(),
                "weight_absmax": self.weight_absmax.detach()}
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=kept["weight_absmax"].device))
        super()._apply(fn, recurse)
        for name, before in kept.items():  # (Module.type(dtype) casts even the uint8 codes)
            held = self._buffers if name in self._buffers else self._parameters
            moved = held[name]
            if moved.dtype != before.dtype:
                before = before.to(moved.device)
                held[name] = before if held is self._buffers else nn.Parameter(
                    before, requires_grad=False)
        if probe.dtype in (torch.float32, torch.bfloat16, torch.float16):
            self.compute_dtype = probe.dtype
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "weight" in state_dict:  # bitsandbytes' Linear4bit keys, or a dense weight
            _nf4_keys(state_dict, prefix, self)
        saved, held = state_dict.get(prefix + "weight_absmax"), self.weight_absmax
        if type(saved) in (torch.Tensor, nn.Parameter) and type(held) in (torch.Tensor,
                                                                          nn.Parameter):
            self._take_absmax_form(saved, held, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _take_absmax_form(self, saved, held, prefix):
        """The saved absmax's form (plain or double-quantised, or at a checkpoint's own
        blocksize) taken where its size fits this layer: its buffer reallocated so; another
        size or a double-quantised absmax of other blocks (whose bytes can coincide) refused."""
        blocks = -(-self.in_features * self.out_features // self.blocksize)
        if saved.dtype not in (torch.uint8, torch.float32):
            raise TypeError(f"{_WHERE}: {prefix}weight_absmax is {saved.dtype}; expected "
                            "float32, or uint8 (double-quantised)")
        fits = nested_absmax_bytes(blocks) if saved.dtype == torch.uint8 else blocks
        if saved.dtype == torch.uint8 and saved.numel() == fits and (
                nested_absmax_blocks(saved) != blocks):
            raise ValueError(f"{_WHERE}: {prefix}weight_absmax holds "
                             f"{nested_absmax_blocks(saved)} double-quantised blocks; this "
                             f"layer has {blocks} (blocksize {self.blocksize})")
        if saved.shape == held.shape and saved.dtype == held.dtype:
            return
        if saved.numel() == fits and saved.dim() == 1:
            self._hold("weight_absmax", torch.empty_like(saved, device=held.device))
        elif saved.dtype != held.dtype:  # (the same dtype: the size mismatch is torch's)
            raise ValueError(f"{_WHERE}: {prefix}weight_absmax holds {saved.numel()} "
                             f"{saved.dtype} values; this layer's {blocks} blocks take {fits}")

    def shardable(self):
        """Hold the codes and absmax as frozen nn.Parameters instead of buffers (the same
        tensors under the same state_dict keys), in place; returns self. FSDP2's fully_shard
        shards parameters only: a layer made shardable has its 4-bit weight split over the
        ranks with the rest of its unit and gathered for its unit's forward and backward,
        where a buffer would be held whole by every rank. fastllm.parallel.apply_fsdp calls it;
        before a fully_shard of your own, call fastllm.quant.shardable_nf4(model). (Buffers by
        default: `torch.optim.AdamW(model.parameters(), fused=True)` refuses a uint8
        parameter, grad or none.)"""
        for name in ("weight_packed", "weight_absmax"):
            if name in self._buffers:
                tensor = self._buffers.pop(name)
                self._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        return self

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, blocksize={self.blocksize}, "
                f"double_quant={self.double_quant}, compute_dtype={self.compute_dtype}")


def _nf4_stand_in(where, base, x, name):
    """Check that `base` is an NF4Linear computing in x's dtype and x fits it; return a stand-in
    of its dense weight (shape, dtype, device) for the ops' own argument checks."""
    if not isinstance(base, NF4Linear):
        raise TypeError(f"{where}: base is a {type(base).__name__}; expected NF4Linear")
    check_input(where, x, base.in_features)
    if base.compute_dtype != x.dtype:
        raise TypeError(f"{where}: the base computes in {base.compute_dtype}, {name} is "
                        f"{x.dtype}")
    return x.new_empty(()).expand(base.weight_shape)


def nf4_lora_linear_multi(x, bases, lora_as, lora_bs, scalings):
    """fastllm.ops.lora_linear_multi over base layers that are NF4Linear (QLoRA) or nn.Linear:
    [base_i(x) + s_i x A_i^T B_i^T], x read once for every LoRA down product (q/k/v, gate/up),
    each NF4 weight dequantised in the forward and again in the backward, as nf4_lora_linear.
    lora_as[i] / lora_bs[i] None: base_i alone. x in every NF4 base's compute dtype and the
    adapters in x's dtype (no autocast): other cases run layer by layer (fastllm.patch does).
    Returns a list of (..., out_i)."""
    from fastllm.ops.lora_linear_multi import (_LoRALinearMulti, check_multi_args,
                                               check_multi_lengths)

    where = f"{_WHERE}.nf4_lora_linear_multi"
    for i, base in enumerate(bases):
        if not (type(base) is nn.Linear or isinstance(base, NF4Linear)):
            raise TypeError(f"{where}: base {i} is a {type(base).__name__}; expected NF4Linear "
                            "or nn.Linear")
    lora_as, lora_bs, biases = list(lora_as), list(lora_bs), [b.bias for b in bases]
    check_multi_lengths(bases, lora_as, lora_bs, scalings, biases)
    weights, stand_ins, nf4, absmaxes = [], [], [], []
    for i, base in enumerate(bases):
        if type(base) is nn.Linear:
            weights.append(base.weight)
            stand_ins.append(base.weight)
            nf4.append(None)
            absmaxes.append(None)
            continue
        check_input(where, x, base.in_features)
        if base.compute_dtype != x.dtype:
            raise TypeError(f"{where}: base {i} computes in {base.compute_dtype}, x is {x.dtype}")
        weights.append(base.weight_packed)  # (the stand-in: its shape, dtype and device)
        stand_ins.append(x.new_empty(()).expand(base.weight_shape))
        nf4.append((base.weight_shape, base.blocksize))
        absmaxes.append(base.weight_absmax)
    if _lowp.autocast_enabled(x.device.type):
        raise ValueError(f"{where}: not under autocast (call the layers one by one)")
    check_multi_args(x, stand_ins, lora_as, lora_bs, scalings, biases)
    if any(a is not None and a.dtype != x.dtype for a in lora_as):
        raise TypeError(f"{where}: the adapters must be in x's dtype {x.dtype} (fp32 adapters on "
                        "a bf16/fp16 base: call the layers one by one)")
    return list(_LoRALinearMulti.apply(x, len(bases), [float(s) for s in scalings], tuple(nf4),
                                       *weights, *biases, *lora_as, *lora_bs, *absmaxes))


def nf4_swiglu_lora_linear(gate, up, base, lora_a, lora_b, scaling, dropout_p=0.0,
                           training=True, seed=None, scale=None):
    """fastllm.ops.swiglu_lora_linear over an NF4Linear base (QLoRA's down_proj; QDoRA's with
    `scale`): the LoRA layer over silu(gate) * up without keeping the product, the weight
    dequantised in the forward and again in the backward. gate and up in the base's compute
    dtype; not under autocast."""
    from fastllm.ops.swiglu_lora_linear import (_autocast_refused, _SwiGLULoRALinear,
                                                check_swiglu_lora_args)

    where = f"{_WHERE}.nf4_swiglu_lora_linear"
    stand_in = _nf4_stand_in(where, base, gate, "gate")
    _autocast_refused(where, gate.device.type)
    p = float(dropout_p) if training else 0.0
    check_swiglu_lora_args(where, gate, up, stand_in, lora_a, lora_b, scaling, base.bias, p,
                           scale)
    return _SwiGLULoRALinear.apply(gate, up, base.weight_packed, base.weight_absmax, lora_a,
                                   lora_b, base.bias, dropout_seed(gate, p, seed),
                                   (base.weight_shape, base.blocksize), float(scaling), p, scale)


def nf4_scaled_lora_linear(x, base, lora_a, lora_b, scaling, scale, dropout_p=0.0,
                           training=True, seed=None):
    """fastllm.ops.scaled_lora_linear over an NF4Linear base (QDoRA): the weight dequantised in
    the forward and again in the backward. x in the base's compute dtype; not under autocast."""
    from fastllm.ops.scaled_lora_linear import _ScaledLoRALinear, check_scaled_lora_args

    where = f"{_WHERE}.nf4_scaled_lora_linear"
    stand_in = _nf4_stand_in(where, base, x, "x")
    p = float(dropout_p) if training else 0.0
    check_scaled_lora_args(where, x, stand_in, lora_a, lora_b, scaling, scale, base.bias, p)
    return _ScaledLoRALinear.apply(x, base.weight_packed, base.weight_absmax, lora_a, lora_b,
                                   scale, base.bias, dropout_seed(x, p, seed),
                                   (base.weight_shape, base.blocksize), float(scaling), p)


def quantize_nf4(model, target_modules=None, blocksize=64, double_quant=False):
    """Replace nn.Linear layers of `model` by NF4Linear, in place; returns the model.
    double_quant: their absmax double-quantised (transformers' bnb_4bit_use_double_quant).

    target_modules: None (every layer whose type is exactly nn.Linear, subclasses left alone, but
    the output layer, `get_output_embeddings()`, which
    bitsandbytes also leaves dense) or module-name suffixes / one regex, as inject_lora takes
    them. Refused, the model unchanged: no layer selected, a selected layer that is not a plain
    nn.Linear (a LoRA layer: quantise before injecting), a weight shared with another module
    (tied), a weight of another dtype than fp32/bf16/fp16 or with inf/nan values. Each dense
    weight is freed as its layer is replaced (when nothing else holds it).
    """
    check_blocksize(f"{_WHERE}.quantize_nf4", blocksize)
    head = output_layer(model)
    adapted = [n for n, m in model.named_modules() if hasattr(m, "base_layer")]
    if adapted:
        raise ValueError(f"{_WHERE}.quantize_nf4: the model has adapter layers ({adapted[0]}, "
                         f"{len(adapted)} in all); quantise the base model before injecting LoRA "
                         "(fastllm.lora.unload(model) gives it back). Nothing was changed")
    if target_modules is None:  # (exactly nn.Linear: a subclass may be used in other ways)
        chosen = [(n, m) for n, m in model.named_modules()
                  if n and type(m) is nn.Linear and m is not head]
    else:
        chosen = [(n, m) for n, m in model.named_modules() if n and matches(n, target_modules)]
    if not chosen:
        raise ValueError(f"{_WHERE}.quantize_nf4: no nn.Linear of the model is selected "
                         f"(target_modules={target_modules!r})")
    owners = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for name, module in chosen:
        if type(module) is not nn.Linear:
            raise ValueError(f"{_WHERE}.quantize_nf4: {name} is a {type(module).__name__}, not "
                             "an nn.Linear (quantise before inject_lora). Nothing was changed")
        shared = [n for n in owners.get(id(module.weight), []) if n != f"{name}.weight"]
        if shared:
            raise ValueError(f"{_WHERE}.quantize_nf4: the weight of {name} is shared with "
                             f"{shared[0]} (tied weights); a 4-bit copy would untie them. "
                             "Nothing was changed: leave it out of target_modules")
        if module.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{_WHERE}.quantize_nf4: {name} has a {module.weight.dtype} weight; "
                            "expected float32, bfloat16 or float16. Nothing was changed")
    layers = [(name, NF4Linear.from_linear(module, blocksize, double_quant))
              for name, module in chosen]
    for name, layer in layers:  # (every layer built first: a refused weight changes nothing)
        _replace(model, name, layer)
    return model


def shardable_nf4(model):
    """NF4Linear.shardable() on every NF4 layer of `model` (in place; returns the number made
    shardable): the 4-bit codes and absmax become frozen parameters that FSDP2 shards with
    their unit. Under FSDP2 mixed precision (MixedPrecisionPolicy(param_dtype=...)) an fp32
    absmax parameter would be cast with the rest: the layer refuses it when it runs; shard
    with no param_dtype (an NF4Linear casts its input to its own compute dtype anyway). Needs
    a torch whose FSDP2 shards integer parameters (>= 2.12; refused below it, nothing changed)."""
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    if layers:  # (refused before any layer changes; fastllm.parallel imports this module)
        from fastllm.parallel import _torch_support

        _torch_support.require_fsdp2_integer_params("fastllm.quant.shardable_nf4")
    for layer in layers:
        layer.shardable()
    return len(layers)


def dequantize_nf4(model):
    """Replace every NF4Linear of `model` (also a LoRALinear's base layer) by an nn.Linear with
    the dequantised weight, in place: then merge_and_unload gives a dense merged model. Returns
    the model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, NF4Linear):
            _replace(model, name, module.to_linear())
    return model


_BNB = "weight.quant_state.bitsandbytes__"  # + nf4 / fp4: Params4bit's serialised QuantState


def _nf4_keys(state, prefix, layer):
    """Rewrite, in `state`, the `weight` of an NF4Linear as its weight_packed / weight_absmax:
    bitsandbytes' Linear4bit serialisation (packed codes, absmax plain or double-quantised, the
    QuantState as JSON bytes; any quant_storage dtype), or a dense weight, quantised here."""
    where = f"{_WHERE}: {prefix}weight"
    w = state.pop(prefix + "weight")
    shape = [layer.out_features, layer.in_features]
    if not any(k.startswith(prefix + _BNB) for k in state):
        if not w.is_floating_point() or list(w.shape) != shape:
            raise ValueError(f"{where} is {w.dtype} {tuple(w.shape)}: neither a dense "
                             f"{tuple(shape)} weight nor bitsandbytes' 4-bit layout")
        packed, absmax = nf4_quantize(w, layer.blocksize)
        if layer.double_quant:
            absmax = nf4_double_quantize(absmax)
    else:
        if prefix + _BNB + "nf4" not in state:
            raise ValueError(f"{where} is bitsandbytes' FP4; only NF4 weights are supported")
        try:
            meta = json.loads(bytes(state.pop(prefix + _BNB + "nf4").tolist()).decode())
            nested = "nested_blocksize" in meta
            blocksize, stored = int(meta["blocksize"]), [int(v) for v in meta["shape"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: its quant_state is not bitsandbytes' JSON ({e})") from None
        check_blocksize(where, blocksize)
        if stored != shape:
            raise ValueError(f"{where} holds a {tuple(stored)} weight; the layer is "
                             f"{tuple(shape)}")
        code = state.pop(prefix + "weight.quant_map", None)
        if code is not None and not torch.equal(code.float().cpu(), nf4_code("cpu")):
            raise ValueError(f"{where}: its quant_map is not the NF4 code table")
        packed = w.reshape(-1).contiguous().view(torch.uint8)
        try:
            absmax = saved = state.pop(prefix + "weight.absmax")
            kept = None
            if nested:  # absmax as 8-bit codes of a 256-entry map, one scale per nested block
                scales = state.pop(prefix + "weight.nested_absmax").float()
                table = state.pop(prefix + "weight.nested_quant_map").float()
                block, offset = int(meta["nested_blocksize"]), float(meta["nested_offset"])
                if block < 1:
                    raise ValueError(f"nested_blocksize {block}")
                absmax = table[saved.long()] * scales.repeat_interleave(block)[
                    :saved.numel()] + offset
                if (saved.dtype == torch.uint8 and block == NESTED_BLOCKSIZE
                        and torch.equal(table.cpu(), nested_code("cpu"))):
                    # held as saved (fastllm's double-quantised form is this one), else fp32
                    kept = pack_nested_absmax(saved, offset, scales)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where}: bitsandbytes' absmax keys are missing or malformed "
                             f"({type(e).__name__}: {e})") from None
        absmax = absmax.float().contiguous()
        n = math.prod(shape)
        if packed.numel() != -(-n // 2) or absmax.numel() != -(-n // blocksize):
            raise ValueError(f"{where}: {packed.numel()} code bytes and {absmax.numel()} absmax "
                             f"values; a {tuple(shape)} weight at blocksize {blocksize} takes "
                             f"{-(-n // 2)} and {-(-n // blocksize)}")
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError(f"{where}: its absmax has inf or nan values")
        absmax = absmax if kept is None else kept
        layer.blocksize = blocksize  # (the checkpoint's wins: _load_from_state_dict's absmax
        # buffer follows it)
    state[prefix + "weight_packed"], state[prefix + "weight_absmax"] = packed, absmax


def bnb_4bit_config(folder):
    """config.json's quantization_config where `folder` holds a bitsandbytes 4-bit model, else
    None; ValueError for 4-bit settings NF4Linear cannot take (FP4)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("quant_method") != "bitsandbytes" or not (
            config.get("load_in_4bit") or config.get("_load_in_4bit")):
        return None
    if config.get("bnb_4bit_quant_type", "fp4") != "nf4":
        raise ValueError(f"{_WHERE}: {folder} holds bitsandbytes 4-bit "
                         f"{config.get('bnb_4bit_quant_type', 'fp4')} weights; only NF4 is "
                         "supported")
    return config


_META_LOCK = threading.Lock()


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters this thread makes within go to the meta device (buffers, rotary tables, stay
    real), as accelerate's init_empty_weights(include_buffers=False). One such block at a time
    (a lock): nn.Module.register_parameter is patched for the process, so concurrent blocks
    could restore each other's patch; other threads' modules are built as usual meanwhile."""
    with _META_LOCK:
        register = nn.Module.register_parameter
        owner = threading.get_ident()

        def on_meta(module, name, param):
            register(module, name, param)
            if param is not None and threading.get_ident() == owner:
                module._parameters[name] = nn.Parameter(param.to("meta"),
                                                        requires_grad=param.requires_grad)

        nn.Module.register_parameter = on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register


def _quantised_names(folder, files):
    """The modules a bitsandbytes folder saved in 4-bit (each has a weight.quant_state key)."""
    from safetensors import safe_open

    mark = "." + _BNB
    names = set()
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt") as handle:
            names.update(k.split(mark)[0] for k in handle.keys() if mark in k)
    return names


def from_pretrained(folder, dtype=None, blocksize=64):
    """A transformers causal LM from a local folder of safetensors with its linear layers NF4,
    built on the meta device and loaded tensor by tensor: a bitsandbytes 4-bit NF4 checkpoint
    (config.json's quantization_config; nested absmax too) as it is, without bitsandbytes, the
    layers it saved in 4-bit becoming NF4Linear (at the blocksize it saved); a dense one with
    every nn.Linear but the output layer quantised as it loads (as quantize_nf4 would, the
    dense weights read from the mmapped file). Checkpoints whose keys transformers renames as
    it loads are not read here (use from_pretrained, then quantize_nf4). dtype: that of every
    parameter and the NF4 layers' compute dtype; default, as transformers loads such a folder:
    the config's dtype for the parameters, bnb_4bit_compute_dtype for the NF4 layers."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    files = _safetensors_files(folder)
    qc = bnb_4bit_config(folder)
    param_dtype = dtype or getattr(config, "dtype", None) or torch.float32
    compute = dtype
    if qc is not None:
        compute = compute or getattr(torch, str(qc.get("bnb_4bit_compute_dtype") or "float32"))
        del config.quantization_config
    param_dtype = getattr(torch, param_dtype) if isinstance(param_dtype, str) else param_dtype
    compute = compute or param_dtype
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=param_dtype)
    head = output_layer(model)
    quantised = _quantised_names(folder, files) if qc is not None else None
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and (name in quantised if quantised is not None
                                          else module is not head):
            _replace(model, name, NF4Linear(module.in_features, module.out_features,
                                            module.bias is not None, blocksize, "meta", compute))
    if isinstance(output_layer(model), NF4Linear) and getattr(config, "tie_word_embeddings",
                                                                 False):
        raise ValueError(f"{_WHERE}.from_pretrained: {folder} ties its output layer to the "
                         "embeddings but saved it in 4-bit")
    _load(model, folder, files)
    with torch.no_grad():  # (parameters only: the rotary tables stay fp32, as transformers
        for p in model.parameters():  # leaves them)
            if p.is_floating_point() and p.dtype != param_dtype:
                p.data = p.data.to(param_dtype)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model.eval()


def _safetensors_files(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):  # (transformers' sharded layout)
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return ["model.safetensors"]
    raise FileNotFoundError(f"{_WHERE}.from_pretrained: {folder} has no model.safetensors (or "
                            "its index): only safetensors checkpoints are read")


def _load(model, folder, files):
    """Every tensor of the files into the meta-built model; refuses what does not fit."""
    import re

    from safetensors.torch import load_file

    state = {}
    for f in files:
        state.update(load_file(os.path.join(folder, f)))
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignored)
                  and not k.endswith("rotary_emb.inv_freq")]  # (checkpoints before 4.31)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"]
    if left or unexpected:
        raise ValueError(f"{_WHERE}.from_pretrained: {folder} does not fit its config's model: "
                         f"{len(left)} tensors missing (e.g. {left[:3]}), {len(unexpected)} "
                         f"unexpected (e.g. {unexpected[:3]})")


def nf4_bytes(model, held=False):
    """Bytes the NF4 weights of `model` take (codes and absmax); held=True: those this process
    holds (under FSDP2, its shards)."""
    def size(t):
        t = local(t) if held else t
        return t.numel() * t.element_size()

    return sum(size(m.weight_packed) + size(m.weight_absmax)
               for m in model.modules() if isinstance(m, NF4Linear))


__all__ = ["NF4Linear", "bnb_4bit_config", "dequantize_nf4", "from_pretrained", "nf4_bytes",
           "nf4_linear", "nf4_lora_linear", "quantize_nf4", "shardable_nf4"]
