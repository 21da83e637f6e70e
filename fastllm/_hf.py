"""Hugging Face transformers across its releases, for the modules fastllm patches or drives.

- transformers renamed the KV-cache keyword of its models and layers from `past_key_values` to
  `cache` (5.2x; the old name is deprecated there and mapped onto the new). Code that hands a
  cache on must use the name the installed release's forward takes: a `cache=` given to an older
  release lands in **kwargs unread, and the model then decodes without its cache (wrong logits).
- `Cache.update(k, v, layer_idx, ...)`: 4.x takes a `cache_kwargs` dict (rotary sin/cos and
  `cache_position`, which static caches index by); 5.x takes **kwargs (the attention's).
- The attention function of `config._attn_implementation`: 5.x asks
  `ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)`, 4.x indexes it ("eager" is not in it).
- Hub kernels (the `kernels` package, a dependency of 5.x): `from_pretrained` turns them on
  (`use_kernels`, default True unless USE_HUB_KERNELS=0), and then every change of mode
  (`train()`, `eval()`) kernelizes the model again: each layer the package knows (RMSNorm) gets
  its class's forward back (popped from the instance), or a hub kernel's on a GPU.
- Which forward a module runs: ~140 families copy LlamaMLP's SwiGLU line under their own name,
  others with the same attributes add multipliers, clamps, dropout or scales (FalconH1, SeedOss,
  DeepseekV4, Step3p7, Inkling, Dory, BitNet); a user's subclass may override any forward.
- TRL's trainers (SFT, DPO, GRPO, RLOO, KTO; checked on TRL 1.16.0) give the causal LM an
  instance `forward` in their __init__ (trl.trainer.utils.add_fused_lm_head): a wrapper around
  the forward it finds, which with `fused_lm_head=True` (their training and evaluation loss) runs
  the backbone and TRL's own chunked log-prob kernel over lm_head's weight, else that forward."""

import inspect

import torch

# per class, what its signature says; plain dicts, not functools.lru_cache, which torch.compile
# warns about at every compile of a patched model (it traces through the cache wrapper)
_CACHE_KEYWORD, _UPDATE_TAKES_CACHE_KWARGS = {}, {}


def _cache_keyword(cls):
    if cls not in _CACHE_KEYWORD:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORD[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORD[cls]


def take_cache(cache, kwargs):
    """The KV cache a patched forward was given under either name (its `cache` parameter, or
    `past_key_values` in kwargs, which this removes so that it is not handed on twice)."""
    old = kwargs.pop("past_key_values", None)
    return old if cache is None else cache


def cache_keyword(module):
    """"cache" or "past_key_values": the keyword module's class forward takes the KV cache by."""
    return _cache_keyword(type(module))


def cache_kwargs(module, cache):
    """{keyword: cache} to splat into a call of module's class forward."""
    return {cache_keyword(module): cache}


def per_item(loss, num_items_in_batch):
    """A summed loss over the Trainer's `num_items_in_batch` (the label count of the accumulated
    batch), as transformers' fixed_cross_entropy divides it, its gradient included: with no
    labels (0) the loss is 0 / 0 = nan and the gradient zero there (cross_entropy's backward
    writes zero for ignored labels), while the fused loss's saved gradients times 1 / 0 would be
    nan. torch.where, not an `if`: no host sync on a GPU."""
    n = torch.as_tensor(num_items_in_batch, device=loss.device)
    n = n.to(loss.dtype) if n.is_floating_point() else n  # a float count keeps the loss's dtype
    none = n == 0
    return torch.where(none, torch.full_like(loss, float("nan")), loss / torch.where(none, 1, n))


def default_loss(model):
    """Whether `model`'s training loss is transformers' causal-LM cross-entropy, which the fused
    loss computes: not a `model.loss_function = fn` of the user's nor another loss_type (the
    patched forward steps aside for those; it trained on the default one while evaluation, the
    original forward, reported the user's)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # (a transformers before its loss table: the loss was the default)
        return True
    return getattr(model, "loss_function", None) is LOSS_MAPPING.get("ForCausalLM")


def _update_takes_cache_kwargs(cls):
    if cls not in _UPDATE_TAKES_CACHE_KWARGS:
        _UPDATE_TAKES_CACHE_KWARGS[cls] = "cache_kwargs" in inspect.signature(cls.update).parameters
    return _UPDATE_TAKES_CACHE_KWARGS[cls]


def cache_update(cache, key, value, layer_idx, kwargs, cos, sin):
    """cache.update as the installed release's own attention calls it: the cached (key, value)
    of layer layer_idx with these appended. kwargs: the attention forward's **kwargs."""
    if _update_takes_cache_kwargs(type(cache)):
        return cache.update(key, value, layer_idx, {
            "sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")})
    return cache.update(key, value, layer_idx, kwargs=kwargs)


def attention_interface(name, eager):
    """The attention function transformers runs for config._attn_implementation `name`; eager:
    the model's own eager attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
    return eager if name in (None, "eager") else ALL_ATTENTION_FUNCTIONS[name]


def hub_kernels_off(model, modules):
    """Turn transformers' hub kernels off on every model inside `model` that has them on, when
    one of `modules` is a layer they replace (its class names a `kernel_layer_name`): their
    re-kernelization at the next train()/eval() would drop the forward fastllm binds there.
    Turning off (reset_kernels) puts the class's forward back on those layers now. Returns the
    models turned off, for hub_kernels_on."""
    if not any(hasattr(type(m), "kernel_layer_name") for m in modules):
        return []
    # the PreTrainedModels themselves: PEFT's wrappers forward `use_kernels` to the one inside
    on = [m for m in model.modules()
          if hasattr(type(m), "set_use_kernels") and getattr(m, "use_kernels", False) is True]
    for m in on:
        m.use_kernels = False
    return on


def hub_kernels_on(models):
    """Undo hub_kernels_off: kernelize each model again (in its current mode)."""
    for m in models:
        m.use_kernels = True


def stock_forward(module, model_types):
    """Whether module's class runs the forward transformers wrote for one of model_types (its
    modeling file's), not a subclass's own (an auxiliary loss, other maths)."""
    return getattr(type(module).forward, "__module__", None) in (
        f"transformers.models.{t}.modeling_{t}" for t in model_types)


def eager_attention_of(module):
    """transformers' eager attention function of the modeling file module's forward is from
    (stock_forward), not its class's: a subclass elsewhere that keeps that forward."""
    import sys

    return getattr(sys.modules[type(module).forward.__module__], "eager_attention_forward")


# the SwiGLU MLP forward as transformers writes it: LlamaMLP's and its copies, Qwen2MLP's
def _swiglu_forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _swiglu_forward_inline(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _code(fn):
    # what a function computes, whatever its names and line numbers: its bytecode, the
    # attribute and global names and the constants that reads, its arguments
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_code, code.co_names, code.co_consts, code.co_argcount, code.co_kwonlyargcount


_SWIGLU_CODES = (_code(_swiglu_forward), _code(_swiglu_forward_inline))


def stock_norm(module):
    """Whether an RMSNorm module's class runs a forward transformers wrote (every one of its
    RMSNorms that patch matches by name and attributes computes what fastllm's does: checked
    over transformers 5.25's 170), or one compiled to the same code as LlamaRMSNorm's (a
    trust-remote-code copy), not a subclass's own (a clamp, another cast)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    forward = type(module).forward
    return (getattr(forward, "__module__", None) or "").startswith("transformers.models.") or (
        _code(forward) == _code(LlamaRMSNorm.forward))


def is_swiglu_forward(forward):
    """Whether `forward` (an MLP class's) computes down_proj(act_fn(gate_proj(x)) * up_proj(x))
    and nothing else, compiled to the same code as transformers' own."""
    return _code(forward) in _SWIGLU_CODES


def trl_fused_head(forward):
    """Whether an instance `forward` is TRL's fused LM head, or a wrapper around it (accelerate's
    autocast one, which sets __wrapped__). Known by its code and the module that defines it: it
    takes the name, __module__ and signature of the class's forward (functools.wraps)."""
    f = getattr(forward, "__func__", forward)
    while f is not None:
        code, where = getattr(f, "__code__", None), getattr(f, "__globals__", {})
        if (code is not None and code.co_name == "_fused_forward"
                and str(where.get("__name__")).startswith("trl.")):
            return True
        f = getattr(f, "__wrapped__", None)
    return False


def trl_hint(modules, action):
    """What to do, for patch's or unpatch's refusal (action), when one of `modules` carries TRL's
    fused LM head; else ""."""
    if not any(trl_fused_head(m.__dict__.get("forward")) for m in modules):
        return ""
    if action == "patch":
        return (" That `forward` is TRL's fused LM head, which its trainers add in __init__: "
                "call fastllm.patch(model) before SFTTrainer(...) (or DPOTrainer, GRPOTrainer, "
                "...), or patch after it with cross_entropy=False (TRL's head computes the "
                "training loss either way; the other kernels are the same).")
    return (" That `forward` is TRL's fused LM head, which a TRL trainer put around fastllm's: "
            "after training, `del <module>.forward` removes both (the class's forward again; a "
            "new trainer adds TRL's head back), then unpatch.")
