"""fastllm/_hf.py: what differs between transformers releases, for fastllm.patch and prefix
tuning. CI has one transformers release; these stand-ins keep the other releases' conventions
(4.x: `past_key_values`, `Cache.update(..., cache_kwargs)`, no `get_interface`) tested. The
patch tests themselves passed with 4.57.6, 5.17.0 and 5.24.0 (README.md)."""

import inspect

import pytest
import torch

from fastllm import _hf

transformers = pytest.importorskip("transformers")


def test_cache_keyword_follows_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            pass

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            pass

    assert _hf.cache_keyword(Old()) == "past_key_values"
    assert _hf.cache_keyword(New()) == "cache"
    assert _hf.cache_kwargs(Old(), 7) == {"past_key_values": 7}
    # the installed release's own model takes one of the two
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                      num_hidden_layers=1, num_attention_heads=2)
    model = transformers.LlamaForCausalLM(config)
    assert _hf.cache_keyword(model) in inspect.signature(type(model).forward).parameters


def test_cache_update_passes_what_each_release_takes():
    seen = {}

    class OldCache:  # transformers 4.x
        def update(self, key, value, layer_idx, cache_kwargs=None):
            seen["old"] = (layer_idx, cache_kwargs)
            return key, value

    class NewCache:  # transformers 5.x
        def update(self, key, value, layer_idx, *args, **kwargs):
            seen["new"] = (layer_idx, args, kwargs)
            return key, value

    k, v, cos, sin, position = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0), \
        torch.full((1,), 3.0), torch.arange(3)
    attention_kwargs = {"cache_position": position, "output_attentions": False}
    assert _hf.cache_update(OldCache(), k, v, 4, attention_kwargs, cos, sin) == (k, v)
    layer, cache_kwargs = seen["old"]
    assert layer == 4 and cache_kwargs.keys() == {"sin", "cos", "cache_position"}
    assert cache_kwargs["sin"] is sin and cache_kwargs["cos"] is cos
    assert cache_kwargs["cache_position"] is position
    assert _hf.cache_update(NewCache(), k, v, 5, attention_kwargs, cos, sin) == (k, v)
    assert seen["new"] == (5, (), {"kwargs": attention_kwargs})
    # the installed DynamicCache appends either way
    cache = transformers.DynamicCache()
    key = torch.randn(1, 2, 3, 4)
    got, _ = _hf.cache_update(cache, key, key, 0, attention_kwargs, cos, sin)
    assert torch.equal(got, key) and cache.get_seq_length() == 3


def test_attention_interface_without_get_interface(monkeypatch):
    import transformers.modeling_utils as mu

    def eager(*args, **kwargs):
        pass

    def sdpa(*args, **kwargs):
        pass

    assert callable(_hf.attention_interface("sdpa", eager))  # the installed release's lookup
    monkeypatch.setattr(mu, "ALL_ATTENTION_FUNCTIONS", {"sdpa": sdpa})  # 4.x: a mapping
    assert _hf.attention_interface("eager", eager) is eager
    assert _hf.attention_interface(None, eager) is eager
    assert _hf.attention_interface("sdpa", eager) is sdpa
    with pytest.raises(KeyError):
        _hf.attention_interface("flash_attention_9", eager)
