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
  its class's forward back (popped from the instance), or a hub kernel's on a GPU."""

import inspect

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
