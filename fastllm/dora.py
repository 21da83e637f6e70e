"""DoRA, weight-decomposed low-rank adaptation (Liu et al. 2024, arXiv:2402.09353), as PEFT's
`use_dora=True` computes it, with its adapters in PEFT's format both ways.

    inject_dora(model, target_modules=["q_proj", "v_proj"], r=8, alpha=16)
    save_adapter(model, "out/")         # fastllm.lora's: PEFT's files, use_dora=true
    load_adapter(other_model, "peft_dora_adapter/")

A DoRA layer keeps LoRA's A and B and learns a magnitude m (out_features,), initialised to the
row norms of W:

    y = bias + (m / n) * (x W^T + s x A^T B^T),    n = ||W + s B A||_row  (detached)

n is treated as a constant in backward (the paper's section 4.3, and PEFT). fastllm computes
x W^T + s x A^T B^T with its fused lora_linear op and n without forming the (out, in) matrix
W + s B A: n^2 = ||W||^2 + 2 s <B, W A^T> + s^2 <B A A^T, B> per row, O(out r (in + r)) work
beside one pass over W, and O(out r) memory. The layer's product runs through
fastllm.ops.scaled_lora_linear, which keeps the output (not a second copy of it) for the
magnitude's grad; with dropout in training the base term sees x and the adapter the dropped x
(PEFT's sum: two base GEMMs each way), the dropped x made again from lora_linear's seed rather
than kept. Under autocast, with fp32 adapters on a bf16/fp16 base, or a base weight that trains,
the layer sums PEFT's terms itself.

QDoRA: over a 4-bit fastllm.quant.NF4Linear base, W is the dequantised weight (in the base's
compute dtype, as QLoRA's products see it): n from a transient dequantisation each forward, the
products through the NF4 ops, which keep nothing of W for the backward, so a DoRA layer over an
NF4 base computes what one over the dequantised dense weight computes. (One case keeps the dense
W for its backward, as PEFT's DoRA over bitsandbytes does: fp32 adapters with dropout in
training, whose base term is x W^T in fp32.) With dropout, scaled_lora_linear's mask is
lora_linear's (one seed drawn from torch's generator per forward); the other paths draw
F.dropout's, as PEFT.
"""

import torch
import torch.nn.functional as F
from torch import nn

from fastllm import _lowp, lora
from fastllm._hooks import user_hooked
from fastllm.lora import LoRALinear, save_adapter  # noqa: F401  (save_adapter: one for both)
from fastllm.ops.linear import linear
from fastllm.ops.lora_linear import lora_linear
from fastllm.ops.nf4 import nf4_dense
from fastllm.ops.scaled_lora_linear import scaled_lora_linear
from fastllm.quant import NF4Linear, nf4_linear, nf4_lora_linear, nf4_scaled_lora_linear

__all__ = ["DoRALinear", "inject_dora", "load_adapter", "save_adapter", "dora_weight_norm",
           "dora_weight_norm_ref", "dora_linear_ref"]


def _dense(base):
    """The base layer's weight as DoRA reads it, to be used at once: an NF4Linear's dequantised
    in its compute dtype into the CPU's reused buffer (fastllm.ops.nf4.nf4_dense), which the
    next dequantisation overwrites."""
    if isinstance(base, NF4Linear):
        return nf4_dense(base.weight_packed, base.weight_absmax, base.weight_shape,
                         base.blocksize, base.compute_dtype)
    return base.weight


def _linear(base, x, bias=None):
    """x W^T (+ bias) on the base layer's weight; an NF4 one dequantised on the fly."""
    if isinstance(base, NF4Linear):
        return nf4_linear(x, base.weight_packed, base.weight_absmax, base.weight_shape,
                          base.blocksize, bias, base.compute_dtype)
    return linear(x, base.weight, bias)


def dora_weight_norm_ref(weight, lora_A, lora_B, scaling):
    """||W + scaling B A|| of each row, fp32 (fp64 for fp64 inputs), (out_features,). weight:
    (out, in), lora_A: (r, in), lora_B: (out, r). PEFT's DoraLinearLayer.get_weight_norm."""
    dt = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.to(dt) + scaling * (lora_B.to(dt) @ lora_A.to(dt))
    return torch.linalg.norm(w, dim=1)


def dora_weight_norm(weight, lora_A, lora_B, scaling, weight_sq=None):
    """dora_weight_norm_ref without the (out, in) sum: fp32 (out_features,). weight_sq: the rows'
    ||W||^2 (fp32, (out,)) if known."""
    dt = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w, a, b = weight.to(dt), lora_A.to(dt), lora_B.to(dt)
    if weight_sq is None:
        weight_sq = (w * w).sum(1)
    cross = (b * (w @ a.t())).sum(1)
    low = ((b @ (a @ a.t())) * b).sum(1)
    return (weight_sq + 2.0 * scaling * cross + scaling * scaling * low).clamp_min(0).sqrt()


def dora_linear_ref(x, weight, lora_A, lora_B, magnitude, scaling, bias=None):
    """PEFT's DoRA forward without dropout, plain PyTorch: x (..., in) -> (..., out)."""
    norm = dora_weight_norm_ref(weight, lora_A.detach(), lora_B.detach(), scaling).detach()
    scale = (magnitude / norm).to(x.dtype)
    base = F.linear(x, weight)
    out = (scale - 1) * base + scale * F.linear(F.linear(x, lora_A), lora_B) * scaling
    out = base + out
    return out if bias is None else out + bias


class DoRALinear(LoRALinear):
    """A LoRALinear with a learned magnitude: lora_magnitude_vector (out_features,), in the
    adapters' dtype (PEFT's parameter and state name)."""

    is_dora = True

    def __init__(self, base, r=8, alpha=16, dropout=0.0, use_rslora=False, adapter_dtype=None):
        super().__init__(base, r, alpha, dropout, use_rslora, adapter_dtype)
        self._merge_norm = None
        with torch.no_grad():
            norm = dora_weight_norm(_dense(base), self.lora_A, self.lora_B, self.scaling)
        self.lora_magnitude_vector = nn.Parameter(norm.to(self.lora_A.dtype))

    def weight_norm(self):
        """n = ||W + s B A||_row, fp32, detached. ||W||^2 is not cached across calls: a write
        through `weight.data` moves neither its version nor its address (a cache keyed on them
        gave stale norms), and its pass over W is one more beside the W A^T product's."""
        with torch.no_grad():
            return dora_weight_norm(_dense(self.base_layer), self.lora_A, self.lora_B,
                                    self.scaling)

    def _norm(self):
        """weight_norm() rounded to the magnitude's dtype (PEFT's norm is in the weight's): a bf16
        magnitude over the unrounded norm made a fresh layer, and a merge of an untrained
        adapter, differ from the base by up to one bf16 step."""
        n = self.weight_norm()
        return n.to(self.lora_magnitude_vector.dtype).to(n.dtype)

    def row_scale(self, dtype):
        """m / n per output feature, in `dtype`: the factor on the layer's product."""
        n = self._norm()
        return (self.lora_magnitude_vector.to(n.dtype) / n).to(dtype)

    def forward(self, x):
        if self.merged or self.disabled:
            return self.base_layer(x)
        base = self.base_layer
        bias, dtype = base.bias, lora.base_dtype(base)
        if user_hooked(base, offload_only=True):  # (hooks run: fastllm/lora.py)
            return self._forward_fp32_adapters(x, bias, base(x))
        if self.lora_A.dtype != dtype and not _lowp.autocast_enabled(x.device.type):
            return self._forward_fp32_adapters(x, bias)
        scale = self.row_scale(x.dtype)
        p = self.dropout if self.training else 0.0
        if not _lowp.autocast_enabled(x.device.type):
            # keeps the output (or, with dropout, d W^T + s d A^T B^T) for the scale's grad
            if isinstance(base, NF4Linear) and x.dtype == base.compute_dtype:
                return nf4_scaled_lora_linear(x, base, self.lora_A, self.lora_B, self.scaling,
                                              scale, p)
            if not isinstance(base, NF4Linear) and not base.weight.requires_grad:
                return scaled_lora_linear(x, base.weight, self.lora_A, self.lora_B,
                                          self.scaling, scale, bias, p)
        if p == 0.0:  # (under autocast lora_linear casts its inputs; a base weight that trains)
            if isinstance(base, NF4Linear):
                out = nf4_lora_linear(x, base.weight_packed, base.weight_absmax,
                                      base.weight_shape, base.blocksize, self.lora_A,
                                      self.lora_B, self.scaling, None, 0.0, self.training,
                                      compute_dtype=base.compute_dtype)
            else:
                out = lora_linear(x, base.weight, self.lora_A, self.lora_B, self.scaling, None,
                                  0.0, training=self.training)
            out = out * scale
            return out if bias is None else out + bias
        # fastllm.ops.linear: F.linear, with bf16 widened on CPUs that need it (fastllm/_lowp.py)
        dropped = F.dropout(x, p, training=True)
        plain = _linear(base, dropped)
        low = linear(linear(dropped, self.lora_A), self.lora_B) * self.scaling
        return _linear(base, x, bias) + (scale - 1) * plain + scale * low

    def _forward_fp32_adapters(self, x, bias, base_out=None):
        """fp32 adapters and magnitude on a bf16/fp16 base, in PEFT's order of operations: the
        base layer's output in the base dtype; the magnitude scale, the low-rank branch (on x
        cast to fp32, dropout included) and their sum in fp32, rounded once to x's dtype. Also
        any adapters on a base layer with hooks, whose output (`base_out`, its hooks run) it
        takes."""
        dt = self.lora_A.dtype
        scale = self.lora_magnitude_vector.to(dt) / self.weight_norm()
        if base_out is None:
            base_out = _linear(self.base_layer, x, bias)  # the base layer's output, bias included
        xd = x.to(dt)
        if self.dropout == 0.0 or not self.training:
            # PEFT takes x W^T as the base output less its bias, in the base dtype
            plain = (base_out if bias is None else base_out - bias).to(dt)
        else:
            # PEFT: x W^T of the dropped fp32 x against W in fp32
            xd = F.dropout(xd, self.dropout, training=True)
            base = self.base_layer
            if isinstance(base, NF4Linear) and base.compute_dtype == dt:
                # nf4_linear dequantises again for backward: nf4_dense's buffer, which `.to(dt)`
                # would return as it is, is the next layer's before the backward reads it
                plain = _linear(base, xd)
            else:
                plain = linear(xd, _dense(base).to(dt))
        low = linear(linear(xd, self.lora_A), self.lora_B) * self.scaling
        # base + ((m / n - 1) x W^T + (m / n) s B A x), summed as PEFT sums it (scale * plain +
        # bias rounded otherwise: one bf16 step apart from PEFT on a layer with a bias)
        return (base_out.to(dt) + ((scale - 1) * plain + scale * low)).to(x.dtype)

    def _merged_weight(self, sign):
        """+1: (m / n) (W + s B A), the merged weight (PEFT's merge); -1: its inverse, with the n
        of the merge."""
        w = self.base_layer.weight
        opmath = torch.float64 if w.dtype == torch.float64 else torch.float32
        delta = self.delta_weight(opmath)
        if sign > 0:
            norm = self._norm().to(opmath)
            self._merge_norm = norm
            factor = self.lora_magnitude_vector.detach().to(opmath) / norm
            return (factor[:, None] * (w.detach().to(opmath) + delta)).to(w.dtype)
        m = self.lora_magnitude_vector.detach()  # (moved or cast since the merge: follow it)
        factor = m.to(opmath) / self._merge_norm.to(device=m.device, dtype=opmath)
        return (w.detach().to(opmath) / factor[:, None] - delta).to(w.dtype)

    def extra_repr(self):
        return super().extra_repr() + ", dora=True"


def inject_dora(model, **kwargs):
    """fastllm.lora.inject_lora with DoRA layers (the same arguments)."""
    return lora.inject_lora(model, layer_cls=DoRALinear, **kwargs)


def load_adapter(model, path, adapter_dtype=None):
    """A PEFT adapter saved with use_dora=true (by PEFT or save_adapter) into `model`, as
    fastllm.lora.load_adapter does for LoRA."""
    return lora.load_adapter(model, path, layer_cls=DoRALinear, adapter_dtype=adapter_dtype)
