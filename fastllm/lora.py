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

import contextlib
import math
import re
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from fastllm._hooks import user_hooked
from fastllm._modules import matches, output_layer, replace_module as _replace, unwrap
from fastllm.adapter_files import ADAPTER_WEIGHTS, write_adapter
from fastllm.adapter_files import check_lora_config as _check_supported
from fastllm.adapter_files import check_lora_settings
from fastllm.adapter_files import read_config, read_weights  # noqa: F401  (prefix, export)
from fastllm.ops.lora_linear import lora_linear
from fastllm.quant import NF4Linear, nf4_lora_linear


_PEFT_PREFIX = "base_model.model."


def init_lora_a_(weight):
    """Draw a LoRA A (r, in_features) in place from torch's generator, as every layer of
    inject_lora does on creation (nn.Linear's kaiming-uniform, PEFT's default); returns it."""
    with torch.no_grad():
        return nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class LoRALinear(nn.Module):
    """An nn.Linear plus a trainable rank-r update: y = base(x) + scaling * dropout(x) A^T B^T.

    base: nn.Linear (in_features -> out_features), kept as `base_layer` and frozen; or a 4-bit
    fastllm.quant.NF4Linear (QLoRA: the same maths on the weight dequantised on the fly).
    lora_A: (r, in_features), lora_B: (out_features, r), on the base weight's device, in
    `adapter_dtype`: None (the base weight's dtype) or torch.float32 on a bf16/fp16 base (PEFT's
    `autocast_adapter_dtype`: the low-rank products and the adapters' grads in fp32).
    """

    # disable_adapters(): forward is the base layer's (a class default: a layer pickled before
    # the flag existed reads it too)
    disabled = False

    def __init__(self, base, r=8, alpha=16, dropout=0.0, use_rslora=False, adapter_dtype=None):
        super().__init__()
        if not isinstance(base, ADAPTABLE):
            raise TypeError(f"fastllm.lora.LoRALinear wraps nn.Linear or NF4Linear, got "
                            f"{type(base).__name__}")
        check_lora_args("fastllm.lora.LoRALinear", r, alpha, dropout, use_rslora)
        check_adapter_dtype("fastllm.lora.LoRALinear", base_dtype(base), adapter_dtype)
        self.base_layer = base
        self.r = int(r)
        self.alpha = alpha
        self.dropout = float(dropout)
        self.use_rslora = use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.merged = False
        device = (base.weight_packed if isinstance(base, NF4Linear) else base.weight).device
        dtype = base_dtype(base) if adapter_dtype is None else adapter_dtype
        self.lora_A = nn.Parameter(torch.empty(self.r, base.in_features, dtype=dtype,
                                               device=device))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, self.r, dtype=dtype,
                                               device=device))
        base.requires_grad_(False)
        self.reset_lora_parameters()

    def reset_lora_parameters(self):
        # PEFT's (and Microsoft's loralib) default: A like nn.Linear's weight, B = 0.
        init_lora_a_(self.lora_A)
        nn.init.zeros_(self.lora_B)

    # nn.Linear's attributes, read through to the base layer
    in_features = property(lambda self: self.base_layer.in_features)
    out_features = property(lambda self: self.base_layer.out_features)
    weight = property(lambda self: self.base_layer.weight)
    bias = property(lambda self: self.base_layer.bias)

    def forward(self, x):
        if self.merged or self.disabled:
            return self.base_layer(x)
        if user_hooked(self.base_layer, offload_only=True):
            # the base layer is called, so that its hooks run (they did only once merged, so
            # merging changed the output), then the low-rank part in PEFT's order: on x cast to
            # the adapters' dtype, dropout included, the sum rounded to the base's output dtype
            out = self.base_layer(x)
            xd = F.dropout(x.to(self.lora_A.dtype), self.dropout, training=self.training)
            return (out + F.linear(F.linear(xd, self.lora_A), self.lora_B) * self.scaling).to(
                out.dtype)
        base = self.base_layer
        if isinstance(base, NF4Linear):
            return nf4_lora_linear(x, base.weight_packed, base.weight_absmax, base.weight_shape,
                                   base.blocksize, self.lora_A, self.lora_B, self.scaling,
                                   base.bias, self.dropout, training=self.training,
                                   compute_dtype=base.compute_dtype)
        return lora_linear(x, base.weight, self.lora_A, self.lora_B, self.scaling, base.bias,
                           self.dropout, training=self.training)

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


ADAPTABLE = (nn.Linear, NF4Linear)  # the layers LoRALinear wraps


def base_dtype(base):
    """The dtype a LoRA layer's base computes in (an NF4Linear's compute dtype)."""
    return base.compute_dtype if isinstance(base, NF4Linear) else base.weight.dtype


def check_adapter_dtype(where, base_dtype, adapter_dtype):
    """Refuse an adapter dtype lora_linear cannot take on this base, naming both."""
    from fastllm.ops.lora_linear import adapter_dtype_ok

    if adapter_dtype is not None and not (isinstance(adapter_dtype, torch.dtype)
                                          and adapter_dtype_ok(base_dtype, adapter_dtype)):
        raise ValueError(f"{where}: adapter_dtype must be None (the base weight's dtype) or "
                         f"torch.float32 on a bf16/fp16 base; got {adapter_dtype!r} on "
                         f"{base_dtype}")


def check_lora_args(where, r, alpha, dropout, use_rslora=False):
    """Refuse a LoRA rank that is not a positive integer, an alpha that is not finite and > 0,
    a dropout outside [0, 1), a use_rslora but a bool, naming the value (before any layer is
    built)."""
    if (isinstance(r, bool) or not isinstance(r, (int, float))
            or (isinstance(r, float) and not r.is_integer()) or r < 1):
        raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha) or alpha <= 0):
        raise ValueError(f"{where}: alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0):
        raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}")
    if not isinstance(use_rslora, bool):  # bool("false") is True: rsLoRA would switch on
        raise ValueError(f"{where}: use_rslora must be True or False, got {use_rslora!r}")


def no_match_message(where, targets, names, kind="nn.Linear"):
    last = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))  # q_proj, ..., lm_head
    return (f"{where}: no {kind} in the model matches {targets!r}; its {kind} layers are named "
            f"{', '.join(last[:12])}{', ...' * (len(last) > 12)} (whole names: {names[:2]})")


ALL_LINEAR = "all-linear"  # PEFT's shorthand (INCLUDE_LINEAR_LAYERS_SHORTHAND)


def all_linear(model):
    """The names of every nn.Linear of `model` but its output layer (`get_output_embeddings()`),
    as PEFT expands target_modules="all-linear"."""
    head = output_layer(model)
    return [name for name, module in model.named_modules()
            if name and isinstance(module, ADAPTABLE) and module is not head]


def lora_modules(model):
    """(name, LoRALinear) for every LoRA layer of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def inject_lora(model, target_modules=("q_proj", "v_proj"), r=8, alpha=16, dropout=0.0,
                use_rslora=False, rank_pattern=None, alpha_pattern=None, layer_cls=None,
                adapter_dtype=None):
    """Replace every nn.Linear whose name matches `target_modules` by a LoRALinear, in place.

    target_modules: module-name suffixes (a list), or one regex string matched against the whole
    name (PEFT's rule for both), or "all-linear": every nn.Linear but the output layer (PEFT's
    shorthand, `all_linear`). Every other parameter of the model is frozen. rank_pattern /
    alpha_pattern map a key to its own r / alpha (PEFT's fields of the same names, matched by
    PEFT's rule: the key is a regex for the name's last dotted components, e.g. "q_proj",
    "(q|v)_proj" or "layers.1.self_attn.q_proj"; the first matching key wins).
    Refused, the model unchanged: a model with LoRA layers (unload() first) or a fastllm prefix,
    ill-typed arguments (check_lora_settings: target_modules, use_rslora, the patterns' keys,
    regexes that do not compile), targets selecting a module but nn.Linear. layer_cls: the layer
    to build (default LoRALinear; inject_dora passes DoRALinear). adapter_dtype: None (each base
    weight's dtype) or torch.float32 on a bf16/fp16 model (PEFT's `autocast_adapter_dtype=True`,
    its default). Returns the model.
    """
    existing = lora_modules(model)
    if existing:
        raise ValueError(
            f"fastllm.lora.inject_lora: LoRA is already injected into this model ({len(existing)} "
            f"LoRALinear layers, e.g. {existing[0][0]!r}); call fastllm.lora.unload(model) or "
            "merge_and_unload(model) before injecting again")
    _refuse_prefix(model, "fastllm.lora.inject_lora", "Nothing was changed")
    check_lora_settings("fastllm.lora.inject_lora:", target_modules, rank_pattern, alpha_pattern,
                        use_rslora=use_rslora)
    rank_pattern, alpha_pattern = dict(rank_pattern or {}), dict(alpha_pattern or {})
    target_modules, targets = _targets(model, target_modules)
    other = [(n, m) for n, m in targets if not isinstance(m, ADAPTABLE)]
    if other:
        raise ValueError(_unadaptable_message(target_modules, other))
    if not targets:
        linear = [n for n, m in model.named_modules() if n and isinstance(m, ADAPTABLE)]
        raise ValueError(no_match_message("fastllm.inject_lora", target_modules, linear))
    # every layer's values are checked before the model changes (no half-injected model)
    values = []
    for name, module in targets:
        layer_r = _pattern_value(name, rank_pattern, r)
        layer_alpha = _pattern_value(name, alpha_pattern, alpha)
        check_lora_args(f"fastllm.lora.inject_lora: {name}", layer_r, layer_alpha, dropout)
        check_adapter_dtype(f"fastllm.lora.inject_lora: {name}", base_dtype(module), adapter_dtype)
        values.append((int(layer_r), layer_alpha))
    layer_cls = layer_cls or LoRALinear
    with _undone_on_error(model):  # a layer failing to build (out of memory) undoes the others
        model.requires_grad_(False)
        for (name, module), (layer_r, layer_alpha) in zip(targets, values):
            extra = {} if adapter_dtype is None else {"adapter_dtype": adapter_dtype}
            layer = layer_cls(module, layer_r, layer_alpha, dropout, use_rslora, **extra)
            _replace(model, name, layer.train(module.training))  # (eval: no dropout, as PEFT)
    # save_adapter writes a regex back as the regex: its suffixes would adapt other layers too
    model._fastllm_lora_target_modules = (
        target_modules if isinstance(target_modules, str) else None)
    return model


def _refuse_prefix(model, where, outcome):
    """A model with a fastllm prefix (fastllm.prefix.attach_prefix) takes no LoRA layers: PEFT has
    no one adapter file for both (save_adapter would drop one), and "all-linear" would wrap the
    prefix encoder's MLP."""
    if hasattr(model, "_fastllm_prefix"):
        raise ValueError(
            f"{where}: the model has a fastllm prefix (fastllm.prefix.attach_prefix); a prefix "
            "and LoRA/DoRA layers on one model are not supported (PEFT has no single adapter file "
            f"holding both). {outcome}: fastllm.prefix.remove_prefix(model) first, or use "
            "another model")


def _targets(model, target_modules):
    """(target_modules, [(name, module)] it selects), "all-linear" expanded to the names."""
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        target_modules = all_linear(model)  # full names: the suffix rule selects exactly them
    return target_modules, [(n, m) for n, m in model.named_modules()
                            if n and matches(n, target_modules)]


@contextlib.contextmanager
def _undone_on_error(model):
    """Whatever the body raises (a refused adapter, a failed allocation, an interrupt), the
    model comes back without LoRA layers (it had none) and with each parameter's requires_grad."""
    trainable = {p: p.requires_grad for p in model.parameters()}
    try:
        yield
    except BaseException:
        _unload(model)
        for p, requires_grad in trainable.items():
            p.requires_grad_(requires_grad)
        raise


def _unadaptable_message(target_modules, other):
    """other: the (name, module)s but nn.Linear target_modules select (PEFT refuses them too)."""
    name, module = other[0]
    entry = target_modules if isinstance(target_modules, str) else next(
        t for t in target_modules if matches(name, [t]))
    more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
    return (f"fastllm.lora.inject_lora: target_modules entry {entry!r} selects {name} "
            f"({type(module).__name__}){more}; fastllm's LoRA adapts nn.Linear layers only (PEFT "
            "also adapts nn.Embedding and convolutions, and refuses any other module it selects)."
            " Nothing was changed: leave that module out of target_modules")


def _pattern_value(name, pattern, default):
    # PEFT's rule (peft.utils.other.get_pattern_key): a key is a regex that must match a whole
    # trailing run of the name's dotted components; the first matching key in dict order wins
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
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

    Refuses, with every weight untouched, if any merged weight would be non-finite in its dtype,
    or if a base weight is shared with another module (a tied lm_head: merging into it would
    change the input embeddings too, as PEFT's merge_and_unload silently does).
    """
    layers = _check_merge_state(model, merged=False)
    if any(m.disabled for _, m in layers):  # (the block's base-only outputs would change)
        raise ValueError("fastllm.lora.merge_lora: inside disable_adapters(model); nothing was "
                         "merged: merge after the block")
    quantized = [n for n, m in layers if isinstance(m.base_layer, NF4Linear)]
    if quantized:
        raise ValueError(f"fastllm.lora.merge_lora: {quantized[0]} has a 4-bit NF4 base weight; "
                         "folding the update into it would re-quantise it (more rounding than the"
                         " update). Nothing was merged: fastllm.quant.dequantize_nf4(model) "
                         "first gives dense bases to merge into")
    _check_untied(model, layers)
    for name, layer in layers:  # check every layer before changing any
        if not torch.isfinite(layer._merged_weight(+1)).all():
            raise ValueError(f"fastllm.lora.merge_lora: merging {name} gives non-finite weights; "
                             "nothing was merged")
    for _, layer in layers:
        layer.base_layer.weight.copy_(layer._merged_weight(+1))
        layer.merged = True
    return model


def _check_untied(model, layers):
    owners = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for name, layer in layers:
        own = f"{name}.base_layer.weight" if name else "base_layer.weight"  # (a bare layer)
        others = [n for n in owners.get(id(layer.base_layer.weight), []) if n != own]
        if others:
            # untying here would not last: config.tie_word_embeddings makes from_pretrained
            # and save_pretrained tie (or drop) the merged weight again
            raise ValueError(
                f"fastllm.lora.merge_lora: the weight of {name} is shared with {others[0]} (tied "
                "weights, e.g. tie_word_embeddings); merging would change that module too. "
                "Nothing was merged: keep the adapter unmerged (save_adapter), or untie the "
                "weights and set config.tie_word_embeddings=False before injecting")


@torch.no_grad()
def unmerge_lora(model):
    """Undo merge_lora: W -= scaling B A (exact in fp32 up to rounding of W's dtype)."""
    for _, layer in _check_merge_state(model, merged=True):
        layer.base_layer.weight.copy_(layer._merged_weight(-1))
        layer.merged = False
    return model


@contextlib.contextmanager
def disable_adapters(model):
    """Inside the block every LoRA/DoRA layer of `model` computes its base layer alone (PEFT's
    `model.disable_adapter()`): the model before fine-tuning, e.g. DPO's reference model without
    a second copy of the weights. Merged layers are refused (their base weight holds the
    update: unmerge_lora first), nothing changed. Restored on exit, exceptions included."""
    layers = lora_modules(model)
    if not layers:
        raise ValueError("fastllm.lora.disable_adapters: the model has no fastllm LoRALinear "
                         "layers (a PEFT model: use its own model.disable_adapter())")
    merged = [n for n, m in layers if m.merged]
    if merged:
        raise ValueError(f"fastllm.lora.disable_adapters: {merged[0]} is merged (its base weight "
                         "holds the update); nothing was disabled: unmerge_lora(model) first")
    # (None: the class's default, put back by deleting the instance's flag; one left behind
    # would make torch.compile compile the layers again, guarded as they were on its absence)
    before = [m.__dict__.get("disabled") for _, m in layers]
    for _, m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for (_, m), was in zip(layers, before):
            if was is None:
                del m.disabled
            else:
                m.disabled = was


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
    r = Counter(m.r for _, m in layers).most_common(1)[0][0]
    alpha = Counter(m.alpha for _, m in layers).most_common(1)[0][0]
    dropouts = {m.dropout for _, m in layers}
    rslora = {m.use_rslora for _, m in layers}
    dora = {hasattr(m, "lora_magnitude_vector") for _, m in layers}
    if len(dropouts) > 1 or len(rslora) > 1 or len(dora) > 1:
        raise ValueError("fastllm.lora.save_adapter: PEFT's format needs one dropout and one "
                         "use_rslora for every LoRA layer, and all layers LoRA or all DoRA")
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None)
    return {"peft_type": "LORA", "task_type": task_type,
            "base_model_name_or_path": name_or_path or None, "r": r, "lora_alpha": alpha,
            "lora_dropout": dropouts.pop(), "use_rslora": rslora.pop(),
            "target_modules": _saved_target_modules(model, layers),
            "rank_pattern": {n: m.r for n, m in layers if m.r != r},
            "alpha_pattern": {n: m.alpha for n, m in layers if m.alpha != alpha},
            "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "use_dora": dora.pop()}


def _saved_target_modules(model, layers):
    """The injection's regex, else the layers' last name components, if it selects exactly the
    adapted layers among all the modules PEFT will match it against (its named_modules(), of any
    type: it refuses a matched module it cannot adapt); else the full names, which PEFT's list
    rule (name == t or a "." + t suffix) and fastllm's select exactly."""
    adapted = {n for n, _ in layers}
    inside = tuple(n + "." for n in adapted)  # base_layer: not in the model PEFT loads into
    names = [n for n, _ in model.named_modules() if not n.startswith(inside)]
    regex = getattr(model, "_fastllm_lora_target_modules", None)
    short = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    for targets in ([regex] if isinstance(regex, str) else []) + [short]:
        if {n for n in names if matches(n, targets)} == adapted:
            return targets
    return sorted(adapted)


def save_adapter(model, path, task_type=None):
    """Write the LoRA weights of `model` in PEFT's format: `path`/adapter_config.json and
    `path`/adapter_model.safetensors, keys `base_model.model.<module>.lora_{A,B}.weight`.

    task_type: PEFT's task type to record, e.g. "CAUSAL_LM" (None: a plain PeftModel).
    Weights are saved unmerged even if the model is merged. A refused or failed save leaves the
    adapter already in `path` as it was. A torch.compile'd or DDP-wrapped model saves the
    names of the model inside (PEFT's keys; the wrapper's `_orig_mod.` / `module.` are not).
    """
    model = unwrap(model)
    layers = lora_modules(model)
    if not layers:
        raise ValueError("fastllm.lora.save_adapter: the model has no LoRALinear layers")
    _refuse_prefix(model, "fastllm.lora.save_adapter", "Nothing was written")
    config = _adapter_config(model, layers, task_type)  # refused before anything is written
    write_adapter(path, config, peft_tensors(layers))


def peft_keys(layers):
    """(layer name, attribute, PEFT state_dict key) of each adapter tensor of lora_modules'
    (name, layer) pairs: `base_model.model.<module>.lora_{A,B}.weight`, DoRA's
    `lora_magnitude_vector`."""
    for name, layer in layers:
        yield name, "lora_A", f"{_PEFT_PREFIX}{name}.lora_A.weight"
        yield name, "lora_B", f"{_PEFT_PREFIX}{name}.lora_B.weight"
        if hasattr(layer, "lora_magnitude_vector"):  # DoRA
            yield name, "lora_magnitude_vector", f"{_PEFT_PREFIX}{name}.lora_magnitude_vector"


def peft_tensors(layers):
    """The adapter tensors of lora_modules' (name, layer) pairs under PEFT's state_dict keys
    (peft_keys), on the CPU."""
    by_name = dict(layers)
    return {key: getattr(by_name[name], attr).detach().cpu().contiguous()
            for name, attr, key in peft_keys(layers)}


def load_adapter(model, path, layer_cls=None, adapter_dtype=None):
    """Load a PEFT LoRA adapter (from PEFT or save_adapter) into `model`.

    A model without LoRA layers gets them first (inject_lora with the adapter's config); one that
    has them must have the adapter's layers and shapes, and each layer the r, alpha, use_rslora
    and dropout the config gives it (else refused, as the adapter would compute something else
    than in PEFT: unload(model) first to take the adapter's own). Fields of the config fastllm
    does not implement are refused (_check_supported). Base weights that PEFT saves beside an
    adapted layer (`<layer>.base_layer.weight`, e.g. for lm_head) are loaded into it, as PEFT
    does. A refused adapter leaves the model unchanged. layer_cls: as inject_lora's (a DoRA
    adapter needs fastllm.dora.load_adapter, which passes DoRALinear); adapter_dtype: as
    inject_lora's, for layers it creates (torch.float32 on a bf16 model: PEFT's default).
    Returns the model. A model with a fastllm prefix is refused (as by inject_lora). Into a
    torch.compile'd or DDP-wrapped model it loads the model inside, by its own names.
    """
    model, given = unwrap(model), model
    _refuse_prefix(model, "fastllm.lora.load_adapter", "Nothing was changed")
    settings = _check_supported(read_config(path))
    dora = bool(settings["use_dora"])
    if dora != bool(getattr(layer_cls, "is_dora", False)):
        raise ValueError(f"fastllm.lora.load_adapter: {path} is a {'DoRA' if dora else 'LoRA'} "
                         f"adapter; load it with fastllm.adapters.load_adapter (or "
                         f"fastllm.{'dora' if dora else 'lora'}.load_adapter)")
    state = read_weights(path)
    existing = lora_modules(model)
    if existing:
        _check_layers_agree(existing, settings)
        _load_state(model, state)
        return given
    _check_planned_shapes(model, settings, state)  # a corrupt r must not allocate first
    with _undone_on_error(model):  # a refused adapter leaves the model as it came
        inject_lora(model, target_modules=settings["target_modules"], r=settings["r"],
                    alpha=settings["lora_alpha"], dropout=settings["lora_dropout"],
                    use_rslora=settings["use_rslora"], rank_pattern=settings["rank_pattern"],
                    alpha_pattern=settings["alpha_pattern"], layer_cls=layer_cls,
                    adapter_dtype=adapter_dtype)
        _load_state(model, state)
    return given


def _check_planned_shapes(model, settings, state):
    """Before inject_lora builds a layer: each nn.Linear the config adapts must find lora_A
    (r, in_features) and lora_B (out_features, r) in the adapter, r the config's for it (r or
    rank_pattern); else ValueError naming the key. Other refusals are inject_lora's."""
    for name, module in _targets(model, settings["target_modules"])[1]:
        r = _pattern_value(name, settings["rank_pattern"], settings["r"])
        alpha = _pattern_value(name, settings["alpha_pattern"], settings["lora_alpha"])
        if not isinstance(module, ADAPTABLE):
            continue
        check_lora_args(f"fastllm.lora.load_adapter: {name}", r, alpha, settings["lora_dropout"])
        want = {"lora_A": (int(r), module.in_features), "lora_B": (module.out_features, int(r))}
        for attr, shape in want.items():
            key = f"{_PEFT_PREFIX}{name}.{attr}.weight"
            have = tuple(state[key].shape) if key in state else None
            if have != shape:
                raise ValueError(
                    f"fastllm.lora.load_adapter: adapter and model disagree: adapter_config.json "
                    f"gives {name} r={r!r}, so {key} should be {shape}; it is "
                    f"{'missing' if have is None else have} in the adapter ({ADAPTER_WEIGHTS})")


def _check_layers_agree(layers, settings):
    for name, layer in layers:
        want = {"r": _pattern_value(name, settings["rank_pattern"], settings["r"]),
                "alpha": _pattern_value(name, settings["alpha_pattern"], settings["lora_alpha"]),
                "use_rslora": bool(settings["use_rslora"]),
                "dropout": float(settings["lora_dropout"])}
        have = {key: getattr(layer, key) for key in want}
        wrong = [key for key in want if want[key] != have[key]]
        if wrong:
            raise ValueError(
                f"fastllm.lora.load_adapter: the model's LoRA layer {name} has "
                f"{', '.join(f'{k}={have[k]!r}' for k in wrong)}, the adapter "
                f"{', '.join(f'{k}={want[k]!r}' for k in wrong)}; unload(model) first to load "
                "the adapter as it was saved")


def _load_state(model, state):
    layers = dict(lora_modules(model))
    expected = set()
    copies = []  # (destination, saved tensor, key), every one checked before any is copied
    for name, layer in layers.items():
        for _, attr, key in peft_keys([(name, layer)]):  # (A, B, DoRA's magnitude)
            expected.add(key)
            copies.append((getattr(layer, attr), state.get(key), key))
        # PEFT saves the base weight of an adapted embedding-like layer (lm_head) too, and loads
        # it back into the model: so do we
        for attr in ("weight", "bias"):
            key = f"{_PEFT_PREFIX}{name}.base_layer.{attr}"
            if key in state and getattr(layer.base_layer, attr, None) is not None:
                expected.add(key)
                copies.append((getattr(layer.base_layer, attr), state[key], key))
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"fastllm.lora.load_adapter: adapter and model disagree; missing "
                         f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    for name, layer in layers.items():
        if layer.merged:
            raise ValueError(f"fastllm.lora.load_adapter: {name} is merged; unmerge_lora first")
    for dst, src, key in copies:
        if src.shape != dst.shape:
            raise ValueError(f"fastllm.lora.load_adapter: {key[len(_PEFT_PREFIX):]} is "
                             f"{tuple(dst.shape)} in the model, {tuple(src.shape)} in the adapter")
    with torch.no_grad():
        for dst, src, _ in copies:
            dst.copy_(src)
    return model
