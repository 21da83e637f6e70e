"""Prefix-tuning (Li & Liang 2021, arXiv:2101.00190) for transformers decoder models, computing
what PEFT's PREFIX_TUNING computes, with its adapters in PEFT's format both ways.

    attach_prefix(model, num_virtual_tokens=16, prefix_projection=False)  # freezes the model
    ...train (only model.prefix_encoder requires grad)...
    save_prefix(model, "out/")         # adapter_config.json + adapter_model.safetensors
    peft.PeftModel.from_pretrained(fresh_model, "out/")   # a PEFT user reads it as is
    load_prefix(other_model, "peft_adapter/")             # and fastllm reads PEFT's

Each layer gets T learned key/value vectors, (kv_heads, T, head_dim) each, that every token
attends to. They are the rows of an embedding (T, 2 * layers * kv_heads * head_dim), or with
prefix_projection (PEFT's reparameterisation) the output of a two-layer tanh MLP over an
embedding (T, kv_heads * head_dim); PEFT saves, and load_prefix reads, the computed rows
("prompt_embeddings"), so a reparameterised prefix loads as a plain one. As in PEFT the prefix
keys carry no rotary embedding and the tokens' positions start at T. The prefix rides in the
model's cache (transformers' DynamicCache, as PEFT passes it), with a 4-D additive mask that
lets every token see the prefix, its own example causally (packed rows: position ids restarting
at 0 mark the examples) and no padding; so a packed batch equals its examples one by one here
too. A forward pre-hook on the model adds them. model.generate() works, with its KV cache: a
non-empty cache the model is given already holds the prefix and is kept (its rows are then one
example each: no packing while decoding).

Sliding-window layers (Mistral's sliding_window, Qwen2's use_sliding_window, a config's
layer_types) see the prefix as PEFT's model does: a token at index i of its example (counting
leading padding, as transformers does) sees cache entry k, prefix included, only when
k > T + i - sliding_window; a mix of full and sliding layers gets one mask per layer type.
Other attention patterns (chunked, linear, ...) are refused at attach time. Gradient
checkpointing is refused (as PEFT refuses it): a checkpointed transformers layer drops the cache,
and with it the prefix.
"""

import numbers
import os
import warnings

import torch
from torch import nn

from fastllm import _hf

__all__ = ["PrefixEncoder", "attach_prefix", "remove_prefix", "save_prefix", "load_prefix",
           "prefix_mask_ref"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RESUME_WEIGHTS = "prefix_encoder.safetensors"  # the trainable tensors (MLP included), to resume


class PrefixEncoder(nn.Module):
    """PEFT's PrefixEncoder: forward() -> (T, layers * 2 * token_dim), token_dim = kv_heads *
    head_dim. Parameter names as PEFT's (embedding.weight, transform.{0,2}.{weight,bias})."""

    def __init__(self, num_virtual_tokens, num_layers, token_dim, prefix_projection=False,
                 encoder_hidden_size=None, dtype=None, device=None):
        super().__init__()
        self.num_virtual_tokens, self.num_layers = num_virtual_tokens, num_layers
        self.token_dim, self.prefix_projection = token_dim, prefix_projection
        self.encoder_hidden_size = encoder_hidden_size or token_dim
        kw = dict(dtype=dtype, device=device)
        out = num_layers * 2 * token_dim
        if prefix_projection:
            self.embedding = nn.Embedding(num_virtual_tokens, token_dim, **kw)
            self.transform = nn.Sequential(nn.Linear(token_dim, self.encoder_hidden_size, **kw),
                                           nn.Tanh(),
                                           nn.Linear(self.encoder_hidden_size, out, **kw))
        else:
            self.embedding = nn.Embedding(num_virtual_tokens, out, **kw)

    def forward(self):
        w = self.embedding.weight
        return self.transform(w) if self.prefix_projection else w


def _dims(config):
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv, head_dim


def _additive(allowed, dtype):
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def prefix_mask_ref(position_ids, num_virtual_tokens, attention_mask=None, dtype=torch.float32,
                    sliding_window=None):
    """The additive mask (batch, 1, L, T + L): 0 where a token may attend, dtype's min elsewhere.
    position_ids (batch, L): an example starts where the position does not follow the previous
    one (transformers' find_packed_sequence_indices); attention_mask (batch, L): 0 = padding.
    sliding_window: None, or W: query index q sees cache index k only when k > q - W
    (transformers' sliding_window_overlay), indices counted in the query's own example with the
    prefix at 0..T-1; leading padding belongs to the row's first example, as in PEFT's model."""
    b, n = position_ids.shape
    t, device = num_virtual_tokens, position_ids.device
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    segment = starts.cumsum(-1)
    i = torch.arange(n, device=device)
    allowed = (segment[:, :, None] == segment[:, None, :]) & (i[None, :, None] >= i[None, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
    prefix = torch.ones(b, n, t, dtype=torch.bool, device=device)
    if sliding_window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)
        start = torch.where(starts, i, 0).cummax(-1).values  # (b, L): where each example starts
        if attention_mask is not None:
            seen = attention_mask.long().cumsum(-1) - attention_mask.long()  # tokens before
            start = start.masked_fill(seen.gather(1, start) == 0, 0)
        q = t + i - start  # (b, L): the query's index in its example's cache
        prefix = q[:, :, None] - torch.arange(t, device=device) < sliding_window
    return _additive(torch.cat([prefix, allowed], dim=-1), dtype)


def _decode_mask(past, n, num_virtual_tokens, attention_mask, b, dtype, device,
                 sliding_window=None):
    """The additive mask (b, 1, n, T + past + n) of n new tokens after `past` cached ones, each
    row one example: the prefix, every earlier token but padding, and the token itself (within
    sliding_window of the query's cache index T + past + i, when given).
    attention_mask (b, past + n), 0 = padding, as generate() passes it; None: no padding."""
    i = torch.arange(n, device=device)
    j = torch.arange(num_virtual_tokens + past + n, device=device)
    q = num_virtual_tokens + past + i
    allowed = j[None, :] <= q[:, None]
    if sliding_window is not None:
        allowed = allowed & (j[None, :] > q[:, None] - sliding_window)
    allowed = allowed.expand(b, n, j.numel())
    if attention_mask is not None:
        if attention_mask.shape[-1] != past + n:
            raise ValueError(f"fastllm.prefix: attention_mask covers {attention_mask.shape[-1]} "
                             f"tokens; with {past} cached and {n} new it must cover {past + n}")
        keep = torch.cat([torch.ones(b, num_virtual_tokens, dtype=torch.bool, device=device),
                          attention_mask.bool()], dim=-1)
        allowed = allowed & keep[:, None, :]
    return _additive(allowed, dtype)


def _layer_windows(config):
    """{layer type: its sliding window or None}, keyed as the model's forward looks its masks up;
    {None: window} when every layer takes the same mask. As transformers' create_masks_for_generate
    reads a config: layer_types when the config has them, else sliding_window for every layer."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        if getattr(config, "attention_chunk_size", None) is not None:
            raise ValueError("fastllm.prefix: chunked attention (config.attention_chunk_size) is "
                             "not supported by prefix tuning")
        return {None: window}
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"fastllm.prefix: prefix tuning supports full and sliding-window "
                         f"attention layers; the model has {unknown} (config.layer_types)")
    windows = {kind: window if kind == "sliding_attention" else None for kind in set(types)}
    return windows if len(set(windows.values())) > 1 else {None: next(iter(windows.values()))}


def _masks(config, build):
    """build(window) -> mask, once per distinct window: one tensor, or a dict by layer type (what
    a hybrid model's forward takes in place of its causal_mask_mapping)."""
    windows = _layer_windows(config)
    if None in windows:
        return build(windows[None])
    return {kind: build(window) for kind, window in windows.items()}


def _refuse_checkpointing(model):
    """Gradient checkpointing (transformers' GradientCheckpointingLayer, which fastllm's
    checkpoint_ratio switches on, or torch's checkpoint_wrapper) drops or replays the KV cache
    the prefix rides in; PEFT refuses the combination too."""
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True or \
                hasattr(module, "_checkpoint_wrapped_module"):
            where = f"module {name!r}" if name else type(model).__name__
            raise ValueError(f"fastllm.prefix: prefix tuning does not work with gradient "
                             f"(activation) checkpointing, which is on ({where}): a "
                             f"checkpointed layer drops the KV cache that holds the prefix. "
                             f"Turn checkpointing off (checkpoint_ratio=0, "
                             f"gradient_checkpointing_disable()) to train a prefix")


def _pre_hook(module, args, kwargs):
    from transformers import DynamicCache

    enc = module.prefix_encoder
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    b, n = (ids.shape if ids is not None else embeds.shape[:2])
    device = ids.device if ids is not None else embeds.device
    layers, kv, head_dim = _dims(module.config)
    t = enc.num_virtual_tokens
    dtype = next(p for p in module.parameters() if p.is_floating_point()).dtype
    if module.training:  # (under no_grad too: transformers 5.17's checkpointed layers drop
        _refuse_checkpointing(module)  # the cache in training mode whatever the grad mode)
    kwargs = dict(kwargs)
    cache = _hf.take_cache(kwargs.pop("cache", None), kwargs)
    pos = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    # use_cache=False: the caller decodes without a cache, but the model hands back the one this
    # hook gave it (and generate() passes that back in): start afresh from the prefix
    past = 0 if cache is None or kwargs.get("use_cache") is False else cache.get_seq_length()
    if past:
        # A cache this model filled (generate()'s, from the step before) holds the prefix and
        # the tokens so far: keep it, and let the new tokens see all of it.
        if past < t:
            raise ValueError(f"fastllm.prefix: the cache holds {past} positions, fewer than the "
                             f"{t} of the prefix; pass a cache this prefixed model filled")
        past -= t
        pos = (torch.arange(past, past + n, device=device).expand(b, n) if pos is None
               else pos.expand(b, n))
        kwargs["attention_mask"] = _masks(module.config, lambda w: _decode_mask(
            past, n, t, mask, b, dtype, device, w))
    else:
        prefix = enc().to(dtype).view(t, layers * 2, kv, head_dim).permute(1, 2, 0, 3)
        cache = DynamicCache()
        for layer in range(layers):
            cache.update(prefix[2 * layer].expand(b, kv, t, head_dim),
                         prefix[2 * layer + 1].expand(b, kv, t, head_dim), layer)
        pos = torch.arange(n, device=device).expand(b, n) if pos is None else pos.expand(b, n)
        kwargs["attention_mask"] = _masks(module.config,
                                          lambda w: prefix_mask_ref(pos, t, mask, dtype, w))
    kwargs["position_ids"] = pos + t
    kwargs[_hf.cache_keyword(module)] = cache
    kwargs["use_cache"] = True  # the model reads the prefix from its cache
    if args:
        kwargs["input_ids"] = ids
    return (), kwargs


def _positive_int(name, value, optional=False):
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"fastllm.prefix: {name} must be an int >= 1"
                         f"{' or None' if optional else ''}, got {value!r}")
    return int(value)


def attach_prefix(model, num_virtual_tokens=16, prefix_projection=False,
                  encoder_hidden_size=None):
    """Add a trainable prefix to a transformers causal LM (model.prefix_encoder), freezing the
    rest. num_virtual_tokens: int >= 1; prefix_projection: bool; encoder_hidden_size: int >= 1
    or None (token_dim). Every argument and the model's attention are checked before the model
    changes; a model with fastllm LoRA/DoRA layers is refused. Returns the model."""
    if hasattr(model, "_fastllm_prefix"):
        raise ValueError("fastllm.prefix: the model has a prefix already (remove_prefix first)")
    _refuse_lora(model, "Nothing was changed")
    num_virtual_tokens = _positive_int("num_virtual_tokens", num_virtual_tokens)
    encoder_hidden_size = _positive_int("encoder_hidden_size", encoder_hidden_size, True)
    if not isinstance(prefix_projection, bool):
        raise ValueError(f"fastllm.prefix: prefix_projection must be True or False, got "
                         f"{prefix_projection!r}")
    layers, kv, head_dim = _dims(model.config)
    _layer_windows(model.config)
    _refuse_checkpointing(model)
    w = model.get_input_embeddings().weight
    encoder = PrefixEncoder(num_virtual_tokens, layers, kv * head_dim, prefix_projection,
                            encoder_hidden_size, dtype=w.dtype, device=w.device)
    model.requires_grad_(False)
    model.prefix_encoder = encoder
    model._fastllm_prefix = model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    return model


def _refuse_lora(model, outcome):
    """A model with fastllm LoRA/DoRA layers takes no prefix: PEFT has no one adapter file for
    both (save_adapter would drop one), and freezing the model would freeze the LoRA weights."""
    from fastllm.lora import lora_modules

    layers = lora_modules(model)
    if layers:
        raise ValueError(
            f"fastllm.prefix: the model has fastllm LoRA/DoRA layers ({len(layers)}, e.g. "
            f"{layers[0][0]!r}); a prefix and LoRA on one model are not supported (PEFT has no "
            f"single adapter file holding both). {outcome}: fastllm.lora.unload(model) or "
            "merge_and_unload(model) first, or use another model")


def remove_prefix(model):
    """The model without its prefix (hook and encoder removed). Returns the model."""
    handle = model._fastllm_prefix
    # by id, on this module's own dicts: a deep copy's handle still points at the original's
    model._forward_pre_hooks.pop(handle.id, None)
    model._forward_pre_hooks_with_kwargs.pop(handle.id, None)
    del model._fastllm_prefix
    del model.prefix_encoder
    return model


def _peft_config(model):
    enc = model.prefix_encoder
    layers, kv, _ = _dims(model.config)
    return {
        "peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
        "num_virtual_tokens": enc.num_virtual_tokens, "token_dim": enc.token_dim,
        "num_layers": layers, "num_attention_heads": kv, "num_transformer_submodules": 1,
        "prefix_projection": enc.prefix_projection,
        "encoder_hidden_size": enc.encoder_hidden_size, "inference_mode": True,
        "modules_to_save": None, "revision": None,
    }


def save_prefix(model, path, task_type="CAUSAL_LM"):
    """Write PEFT's PREFIX_TUNING adapter (the computed prefix as 'prompt_embeddings') and, for
    resuming, the encoder's own tensors (RESUME_WEIGHTS); a refused or failed save leaves the
    adapter already in `path` as it was. A model with LoRA/DoRA layers too is refused."""
    from safetensors.torch import save_file

    from fastllm._files import json_writer, write_replacing

    _refuse_lora(model, "Nothing was written")
    config = dict(_peft_config(model), task_type=task_type)  # refused before anything is written
    with torch.no_grad():
        rows = model.prefix_encoder().detach().cpu().contiguous()
    encoder = {k: v.detach().cpu().contiguous()
               for k, v in model.prefix_encoder.state_dict().items()}
    write_replacing(path, {
        ADAPTER_WEIGHTS: lambda f: save_file({"prompt_embeddings": rows}, f,
                                             metadata={"format": "pt"}),
        RESUME_WEIGHTS: lambda f: save_file(encoder, f, metadata={"format": "pt"}),
        ADAPTER_CONFIG: json_writer(config)})


def load_prefix(model, path):
    """Load a PREFIX_TUNING adapter (PEFT's or save_prefix's) into `model`: a model with a prefix
    of the same shape takes the saved encoder tensors when they are there (a fastllm resume),
    else the prefix rows; a model without one gets a plain prefix of the saved rows. Checked
    before anything changes. The adapter's prompt_embeddings are the truth: encoder tensors that
    do not reproduce them (the folder re-saved by PEFT) are ignored with a warning. Returns the
    model."""
    from fastllm.adapter_files import read_config, read_weights

    config = read_config(path)
    if config.get("peft_type") != "PREFIX_TUNING":
        raise ValueError(f"fastllm.load_prefix: not a prefix-tuning adapter "
                         f"({config.get('peft_type')})")
    for key in ("num_virtual_tokens", "num_layers", "token_dim"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fastllm.load_prefix: {os.path.join(path, ADAPTER_CONFIG)} has "
                             f"{key}={value!r}" + (" (missing)" if key not in config else "")
                             + "; PEFT's PREFIX_TUNING config needs an int >= 1")
    layers, kv, head_dim = _dims(model.config)
    if (config["num_layers"], config["token_dim"]) != (layers, kv * head_dim) or \
            config.get("num_transformer_submodules", 1) != 1:
        raise ValueError(f"fastllm.load_prefix: the adapter is for {config['num_layers']} layers "
                         f"of token_dim {config['token_dim']}; the model has {layers} of "
                         f"{kv * head_dim}")
    weights = read_weights(path, where="fastllm.load_prefix")
    if "prompt_embeddings" not in weights:
        raise ValueError(f"fastllm.load_prefix: {os.path.join(path, ADAPTER_WEIGHTS)} holds no "
                         f"prompt_embeddings (keys: {sorted(weights)[:5]})")
    rows = weights["prompt_embeddings"]
    t = config["num_virtual_tokens"]
    if tuple(rows.shape) != (t, layers * 2 * kv * head_dim):
        raise ValueError(f"fastllm.load_prefix: prompt_embeddings is {tuple(rows.shape)}, "
                         f"expected {(t, layers * 2 * kv * head_dim)}")
    resume = os.path.join(path, RESUME_WEIGHTS)
    if hasattr(model, "_fastllm_prefix"):
        enc = model.prefix_encoder
        if enc.num_virtual_tokens != t:
            raise ValueError(f"fastllm.load_prefix: the adapter has {t} virtual tokens, the "
                             f"model's prefix {enc.num_virtual_tokens}")
        stale = os.path.exists(resume)  # unless _read_resume takes it
        saved = _read_resume(resume, enc, rows) if stale else None
        if saved is not None:
            enc.load_state_dict(saved)
        elif not enc.prefix_projection:
            with torch.no_grad():
                enc.embedding.weight.copy_(rows)
        else:
            why = f" ({RESUME_WEIGHTS} there is stale)" if stale else ""
            raise ValueError(f"fastllm.load_prefix: the model's prefix is reparameterised "
                             f"(prefix_projection) and the adapter holds only the computed "
                             f"rows{why}")
        return model
    attach_prefix(model, t)
    with torch.no_grad():
        model.prefix_encoder.embedding.weight.copy_(rows)
    return model


def _read_resume(file, enc, rows):
    """The encoder tensors of `file` (RESUME_WEIGHTS) when they fit `enc` and reproduce the
    adapter's prompt_embeddings `rows` (T, layers * 2 * token_dim) to rounding; else None, with a
    warning: the adapter file is the truth (PEFT re-saves it and leaves this file behind). Tensors
    that do not fit enc raise ValueError. Nothing of enc changes."""
    import copy

    from fastllm.adapter_files import read_weights

    saved = read_weights(*os.path.split(file), where="fastllm.load_prefix")
    want = {k: tuple(v.shape) for k, v in enc.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in saved.items()}
    if got != want:
        diff = {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want))
                if got.get(k) != want.get(k)}
        raise ValueError(f"fastllm.load_prefix: {file} does not fit the model's prefix encoder "
                         f"(prefix_projection={enc.prefix_projection}, encoder_hidden_size="
                         f"{enc.encoder_hidden_size}); tensor: (in the file, in the model): "
                         f"{diff}")
    probe = copy.deepcopy(enc)
    probe.load_state_dict(saved)
    with torch.no_grad():
        again = probe()
    # rounding of the coarsest dtype involved, over the MLP's sums (bf16: ~0.4%, fp32: ~1e-6)
    eps = max(torch.finfo(x.dtype).eps for x in (*saved.values(), rows, again)
              if x.is_floating_point())
    again = again.float().cpu()
    scale = rows.float().abs().max().clamp_min(1.0)
    if (again - rows.float()).abs().max() <= 16 * eps * scale:
        return saved
    warnings.warn(f"fastllm.load_prefix: {file} does not reproduce the adapter's "
                  f"prompt_embeddings (written over by another tool, e.g. PEFT's "
                  f"save_pretrained?); it is stale and ignored: the prefix is loaded from "
                  f"{ADAPTER_WEIGHTS}", stacklevel=3)
    return None
