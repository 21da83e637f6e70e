"""LoRA for existing models, on fastllm's fused op, with adapters in PEFT's on-disk format.

    model = LlamaForCausalLM(config)
    inject_lora(model, target_modules=["q_proj", "v_proj"], r=8, alpha=16, dropout=0.05)
    ...train (only LoRA parameters require grad)...
    save_adapter(model, "out/")          # adapter_config.json + adapter_model.safetensors
    peft.PeftModel.from_pretrained(fresh_model, "out/")   # a PEFT user reads it as is
    load_adapter(other_model, "peft_adapter/")            # and fastllm reads PEFT's
    merge_and_unload(model)              # the plain model again, LoRA folded into its weights

LoRALinear(base) computes base(x) + scaling * B A dropout(x) with fastllm.ops.lora_linear; the
parameter names and initialisation follow PEFT (lora_A kaiming-uniform, lora_B zero, scaling =
alpha / r, or alpha / sqrt(r) with use_rslora), so a fresh layer is exactly its base layer.
"""

import json
import math
import os
import re
from collections import Counter

import torch
from torch import nn

from fastllm.ops.lora_linear import lora_linear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    """An nn.Linear plus a trainable rank-r update: y = base(x) + scaling * dropout(x) A^T B^T.

    base: nn.Linear (in_features -> out_features), kept as `base_layer` and frozen.
    lora_A: (r, in_features), lora_B: (out_features, r), on the base weight's device, in
    `adapter_dtype`: None (the base weight's dtype) or torch.float32 on a bf16/fp16 base (PEFT's
    `autocast_adapter_dtype`: the low-rank products and the adapters' grads in fp32).
    """

    def __init__(self, base, r=8, alpha=16, dropout=0.0, use_rslora=False, adapter_dtype=None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"fastllm.lora.LoRALinear wraps nn.Linear, got {type(base).__name__}")
        check_lora_args("fastllm.lora.LoRALinear", r, alpha, dropout)
        check_adapter_dtype("fastllm.lora.LoRALinear", base.weight.dtype, adapter_dtype)
        self.base_layer = base
        self.r = int(r)
        self.alpha = alpha
        self.dropout = float(dropout)
        self.use_rslora = bool(use_rslora)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.merged = False
        w = base.weight
        dtype = w.dtype if adapter_dtype is None else adapter_dtype
        self.lora_A = nn.Parameter(torch.empty(self.r, base.in_features, dtype=dtype,
                                               device=w.device))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, self.r, dtype=dtype,
                                               device=w.device))
        base.requires_grad_(False)
        self.reset_lora_parameters()

    def reset_lora_parameters(self):
        # PEFT's (and Microsoft's loralib) default: A like nn.Linear's weight, B = 0.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    @property
    def in_features(self):
        return self.base_layer.in_features

    @property
    def out_features(self):
        return self.base_layer.out_features

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        if self.merged:
            return self.base_layer(x)
        return lora_linear(x, self.base_layer.weight, self.lora_A, self.lora_B, self.scaling,
                           self.base_layer.bias, self.dropout, training=self.training)

    def delta_weight(self, dtype=torch.float32):
        """scaling * B A, (out_features, in_features), computed in `dtype`."""
        return (self.lora_B.detach().to(dtype) @ self.lora_A.detach().to(dtype)) * self.scaling

    def _merged_weight(self, sign):
        w = self.base_layer.weight
        opmath = torch.float64 if w.dtype == torch.float64 else torch.float32
        return (w.detach().to(opmath) + sign * self.delta_weight(opmath)).to(w.dtype)

    def extra_repr(self):
        return (f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, "
                f"dropout={self.dropout}, merged={self.merged}")


def check_adapter_dtype(where, base_dtype, adapter_dtype):
    """Refuse an adapter dtype lora_linear cannot take on this base, naming both."""
    from fastllm.ops.lora_linear import adapter_dtype_ok

    if adapter_dtype is not None and not (isinstance(adapter_dtype, torch.dtype)
                                          and adapter_dtype_ok(base_dtype, adapter_dtype)):
        raise ValueError(f"{where}: adapter_dtype must be None (the base weight's dtype) or "
                         f"torch.float32 on a bf16/fp16 base; got {adapter_dtype!r} on "
                         f"{base_dtype}")


def check_lora_args(where, r, alpha, dropout):
    """Refuse a LoRA rank that is not a positive integer, an alpha that is not finite and > 0,
    a dropout outside [0, 1), naming the value (before any layer is built)."""
    if (isinstance(r, bool) or not isinstance(r, (int, float))
            or (isinstance(r, float) and not r.is_integer()) or r < 1):
        raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha) or alpha <= 0):
        raise ValueError(f"{where}: alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0):
        raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}")


def _matches(name, target_modules):
    # PEFT's rule: a string is a regex that must match the whole name; a list matches by suffix.
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def lora_modules(model):
    """(name, LoRALinear) for every LoRA layer of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def inject_lora(model, target_modules=("q_proj", "v_proj"), r=8, alpha=16, dropout=0.0,
                use_rslora=False, rank_pattern=None, alpha_pattern=None, layer_cls=None,
                adapter_dtype=None):
    """Replace every nn.Linear whose name matches `target_modules` by a LoRALinear, in place.

    target_modules: module-name suffixes (a list), or one regex string matched against the whole
    name (PEFT's rule for both). Every other parameter of the model is frozen. rank_pattern /
    alpha_pattern map a module-name suffix to its own r / alpha (PEFT's fields of the same names).
    A model that already has LoRA layers is refused (unload() or merge_and_unload() first).
    layer_cls: the layer to build (default LoRALinear; fastllm.dora.inject_dora passes
    DoRALinear). adapter_dtype: None (each base weight's dtype) or torch.float32 on a bf16/fp16
    model (PEFT's `autocast_adapter_dtype=True`, its default). Returns the model.
    """
    existing = lora_modules(model)
    if existing:
        raise ValueError(
            f"fastllm.inject_lora: LoRA is already injected into this model ({len(existing)} "
            f"LoRALinear layers, e.g. {existing[0][0]!r}); call fastllm.lora.unload(model) or "
            "merge_and_unload(model) before injecting again"
        )
    rank_pattern, alpha_pattern = dict(rank_pattern or {}), dict(alpha_pattern or {})
    targets = [(name, module) for name, module in model.named_modules()
               if name and isinstance(module, nn.Linear) and _matches(name, target_modules)]
    if not targets:
        raise ValueError(
            f"fastllm.inject_lora: no nn.Linear in the model matches {target_modules!r}"
        )
    # every layer's values are checked before the model changes (no half-injected model)
    values = []
    for name, module in targets:
        layer_r = _pattern_value(name, rank_pattern, r)
        layer_alpha = _pattern_value(name, alpha_pattern, alpha)
        check_lora_args(f"fastllm.inject_lora: {name}", layer_r, layer_alpha, dropout)
        check_adapter_dtype(f"fastllm.inject_lora: {name}", module.weight.dtype, adapter_dtype)
        values.append((int(layer_r), layer_alpha))
    model.requires_grad_(False)
    layer_cls = layer_cls or LoRALinear
    for (name, module), (layer_r, layer_alpha) in zip(targets, values):
        extra = {} if adapter_dtype is None else {"adapter_dtype": adapter_dtype}
        _replace(model, name, layer_cls(module, layer_r, layer_alpha, dropout, use_rslora,
                                        **extra))
    # save_adapter writes a regex back as the regex: its suffixes would adapt other layers too
    model._fastllm_lora_target_modules = (
        target_modules if isinstance(target_modules, str) else None)
    return model


def _replace(model, name, module):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _pattern_value(name, pattern, default):
    for key, value in pattern.items():
        if name == key or name.endswith("." + key) or re.fullmatch(key, name):
            return value
    return default


def _check_merge_state(model, merged):
    layers = lora_modules(model)
    if not layers:
        raise ValueError("fastllm.lora: the model has no LoRALinear layers (inject_lora first)")
    return [(n, m) for n, m in layers if m.merged == merged]


@torch.no_grad()
def merge_lora(model):
    """Fold scaling * B A into each base weight (W += scaling B A); forward then runs base only.

    Refuses, with every weight untouched, if any merged weight would be non-finite in its dtype.
    """
    layers = _check_merge_state(model, merged=False)
    for name, layer in layers:  # check every layer before changing any
        if not torch.isfinite(layer._merged_weight(+1)).all():
            raise ValueError(f"fastllm.merge_lora: merging {name} gives non-finite weights; "
                             "nothing was merged")
    for _, layer in layers:
        layer.base_layer.weight.copy_(layer._merged_weight(+1))
        layer.merged = True
    return model


@torch.no_grad()
def unmerge_lora(model):
    """Undo merge_lora: W -= scaling B A (exact in fp32 up to rounding of W's dtype)."""
    for _, layer in _check_merge_state(model, merged=True):
        layer.base_layer.weight.copy_(layer._merged_weight(-1))
        layer.merged = False
    return model


def merge_and_unload(model):
    """Merge every LoRA layer into its base weight and put the plain nn.Linear back (PEFT's
    `merge_and_unload`): the model's state_dict is then the base model's (no `base_layer`, no
    `lora_` keys), loadable by a plain `from_pretrained`. Refuses, unchanged, like merge_lora.
    Layers merged already stay merged. Returns the model.
    """
    if _check_merge_state(model, merged=False):
        merge_lora(model)
    return _unload(model)


@torch.no_grad()
def unload(model):
    """Remove every LoRA layer, putting the original nn.Linear back (unmerged first where
    merged, unlike PEFT's `unload`, which keeps a merged weight): the base model again. Returns
    the model."""
    if _check_merge_state(model, merged=True):
        unmerge_lora(model)
    return _unload(model)


def _unload(model):
    for name, layer in lora_modules(model):
        _replace(model, name, layer.base_layer)
    model._fastllm_lora_target_modules = None
    return model


def _adapter_config(model, layers, task_type):
    ranks = Counter(m.r for _, m in layers)
    alphas = Counter(m.alpha for _, m in layers)
    r = ranks.most_common(1)[0][0]
    alpha = alphas.most_common(1)[0][0]
    dropouts = {m.dropout for _, m in layers}
    rslora = {m.use_rslora for _, m in layers}
    if len(dropouts) > 1 or len(rslora) > 1:
        raise ValueError("fastllm.save_adapter: PEFT's format needs one dropout and one use_rslora "
                         "for every LoRA layer")
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None)
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": name_or_path or None,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop(),
        "use_rslora": rslora.pop(),
        "target_modules": _saved_target_modules(model, layers),
        "rank_pattern": {n: m.r for n, m in layers if m.r != r},
        "alpha_pattern": {n: m.alpha for n, m in layers if m.alpha != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": _is_dora(layers),
    }


def _is_dora(layers):
    dora = {hasattr(m, "lora_magnitude_vector") for _, m in layers}
    if len(dora) > 1:
        raise ValueError("fastllm.save_adapter: PEFT's format needs all layers LoRA or all DoRA")
    return dora.pop()


def _saved_target_modules(model, layers):
    regex = getattr(model, "_fastllm_lora_target_modules", None)
    if isinstance(regex, str) and all(_matches(n, regex) for n, _ in layers):
        return regex
    return sorted({n.rsplit(".", 1)[-1] for n, _ in layers})


def save_adapter(model, path, task_type=None):
    """Write the LoRA weights of `model` in PEFT's format: `path`/adapter_config.json and
    `path`/adapter_model.safetensors, keys `base_model.model.<module>.lora_{A,B}.weight`.

    task_type: PEFT's task type to record, e.g. "CAUSAL_LM" (None: a plain PeftModel).
    Weights are saved unmerged even if the model is merged.
    """
    from safetensors.torch import save_file

    layers = lora_modules(model)
    if not layers:
        raise ValueError("fastllm.save_adapter: the model has no LoRALinear layers")
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, layer in layers:
        tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A.detach().cpu().contiguous()
        tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B.detach().cpu().contiguous()
        if hasattr(layer, "lora_magnitude_vector"):  # DoRA
            tensors[f"{_PEFT_PREFIX}{name}.lora_magnitude_vector"] = (
                layer.lora_magnitude_vector.detach().cpu().contiguous())
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(_adapter_config(model, layers, task_type), f, indent=2, sort_keys=True)


def load_adapter(model, path, layer_cls=None, adapter_dtype=None):
    """Load a PEFT LoRA adapter (from PEFT or save_adapter) into `model`.

    A model without LoRA layers gets them first (inject_lora with the adapter's config); one that
    has them must have the adapter's layers and shapes. Base weights that PEFT saves beside an
    adapted layer (`<layer>.base_layer.weight`, e.g. for lm_head) are loaded into it, as PEFT
    does. A refused adapter leaves the model unchanged. layer_cls: as inject_lora's (a DoRA
    adapter needs fastllm.dora.load_adapter, which passes DoRALinear); adapter_dtype: as
    inject_lora's, for layers it creates (torch.float32 on a bf16 model: PEFT's default).
    Returns the model.
    """
    from safetensors.torch import load_file

    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    _check_supported(config)
    dora = bool(config.get("use_dora"))
    if dora != bool(getattr(layer_cls, "is_dora", False)):
        raise ValueError(f"fastllm.load_adapter: {path} is a {'DoRA' if dora else 'LoRA'} "
                         f"adapter; load it with fastllm.adapters.load_adapter (or "
                         f"fastllm.{'dora' if dora else 'lora'}.load_adapter)")
    state = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    if lora_modules(model):
        return _load_state(model, state)
    trainable = {p: p.requires_grad for p in model.parameters()}
    inject_lora(model, target_modules=config["target_modules"], r=config["r"],
                alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
                use_rslora=config.get("use_rslora", False),
                rank_pattern=config.get("rank_pattern"),
                alpha_pattern=config.get("alpha_pattern"),
                layer_cls=layer_cls, adapter_dtype=adapter_dtype)
    try:
        return _load_state(model, state)
    except ValueError:
        _unload(model)  # a refused adapter leaves the model as it came
        for p, requires_grad in trainable.items():
            p.requires_grad_(requires_grad)
        raise


def _load_state(model, state):
    layers = dict(lora_modules(model))
    expected = set()
    copies = []  # (destination, saved tensor, key), every one checked before any is copied
    for name, layer in layers.items():
        for attr in ("lora_A", "lora_B"):
            key = f"{_PEFT_PREFIX}{name}.{attr}.weight"
            expected.add(key)
            copies.append((getattr(layer, attr), state.get(key), key))
        if hasattr(layer, "lora_magnitude_vector"):  # DoRA
            key = f"{_PEFT_PREFIX}{name}.lora_magnitude_vector"
            expected.add(key)
            copies.append((layer.lora_magnitude_vector, state.get(key), key))
        # PEFT saves the base weight of an adapted embedding-like layer (lm_head) too, and loads
        # it back into the model: so do we
        for attr in ("weight", "bias"):
            key = f"{_PEFT_PREFIX}{name}.base_layer.{attr}"
            if key in state and getattr(layer.base_layer, attr) is not None:
                expected.add(key)
                copies.append((getattr(layer.base_layer, attr), state[key], key))
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"fastllm.load_adapter: adapter and model disagree; missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}"
        )
    for name, layer in layers.items():
        if layer.merged:
            raise ValueError(f"fastllm.load_adapter: {name} is merged; unmerge_lora first")
    for dst, src, key in copies:
        if src.shape != dst.shape:
            raise ValueError(f"fastllm.load_adapter: {key[len(_PEFT_PREFIX):]} is "
                             f"{tuple(dst.shape)} in the model, {tuple(src.shape)} in the adapter")
    with torch.no_grad():
        for dst, src, _ in copies:
            dst.copy_(src)
    return model


def _check_supported(config):
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"fastllm.load_adapter: not a LoRA adapter ({config.get('peft_type')})")
    unsupported = {
        "fan_in_fan_out": False, "modules_to_save": None,
        "layers_to_transform": None, "bias": "none",
    }
    for key, default in unsupported.items():
        if config.get(key, default) not in (default, [], {}):
            raise ValueError(f"fastllm.load_adapter: {key}={config[key]!r} is not supported")
