"""Hugging Face transformers across its releases, for the modules fastllm patches or drives.

transformers renamed the KV-cache keyword of its models and layers from `past_key_values` to
`cache` (5.2x; the old name is deprecated there and mapped onto the new). Code that hands a cache
on must use the name the installed release's forward takes: a `cache=` given to an older release
lands in **kwargs unread, and the model then decodes without its cache (wrong logits)."""

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls):
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(module):
    """"cache" or "past_key_values": the keyword module's class forward takes the KV cache by."""
    return _cache_keyword(type(module))


def cache_kwargs(module, cache):
    """{keyword: cache} to splat into a call of module's class forward."""
    return {_cache_keyword(type(module)): cache}
