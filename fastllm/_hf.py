"""Hugging Face transformers across its releases, for the modules fastllm patches or drives.

- transformers renamed the KV-cache keyword of its models and layers from `past_key_values` to
  `cache` (5.2x; the old name is deprecated there and mapped onto the new). Code that hands a
  cache on must use the name the installed release's forward takes: a `cache=` given to an older
  release lands in **kwargs unread, and the model then decodes without its cache (wrong logits).
- `Cache.update(k, v, layer_idx, ...)`: 4.x takes a `cache_kwargs` dict (rotary sin/cos and
  `cache_position`, which static caches index by); 5.x takes **kwargs (the attention's).
- The attention function of `config._attn_implementation`: 5.x asks
  `ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)`, 4.x indexes it ("eager" is not in it)."""

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls):
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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


@functools.lru_cache(maxsize=None)
def _update_takes_cache_kwargs(cls):
    return "cache_kwargs" in inspect.signature(cls.update).parameters


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
