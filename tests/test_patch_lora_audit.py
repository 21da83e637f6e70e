"""fastllm.patch against what transformers 5.x does to a loaded model behind the user's back.

transformers' hub kernels (the `kernels` package, a dependency of transformers 5.x) are on for
every model from `from_pretrained`, and every train()/eval() that changes the mode kernelizes the
model again: each RMSNorm gets its class's forward back (or a hub kernel's), over the one
fastllm.patch bound. The tiny models of tests/test_patch.py, with kernels turned on as
from_pretrained turns them on (`set_use_kernels(True)`)."""

import sys

import pytest
import torch
from torch import nn

import fastllm

from test_patch import _batch, _loss_and_grads, _model

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")
if not hasattr(transformers.PreTrainedModel, "set_use_kernels"):
    pytest.skip("this transformers has no hub kernels", allow_module_level=True)

VOCAB = 128  # (fastllm.patch is the function: its module is sys.modules["fastllm.patch"])


def _kernelized_model(mapping=None):
    """A tiny Llama with hub kernels on, as from_pretrained leaves it (optionally under `mapping`,
    kernels' {layer name: {device: repo}})."""
    model = _model(vocab_size=VOCAB)
    if mapping is None:
        model.set_use_kernels(True)
    else:
        with kernels.use_kernel_mapping(mapping):
            model.set_use_kernels(True)
    assert model.use_kernels
    return model


def _norms(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]


def _runs_ours(norm):
    f = norm.__dict__.get("forward")
    return getattr(f, "__func__", None) is sys.modules["fastllm.patch"]._rms_norm_forward


def test_patch_survives_train_and_eval_with_hub_kernels_on():
    model = _kernelized_model()
    ids, labels = _batch(vocab=VOCAB)
    reference = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    for mode in ("eval", "train", "eval", "train"):  # each change kernelized the model again
        getattr(model, mode)()
    assert all(_runs_ours(n) for n in _norms(model))
    assert fastllm.patched(model)["rms_norm"] == len(_norms(model)) == 5
    out, grads = _loss_and_grads(model, ids, labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, reference[0].loss, rtol=1e-5, atol=0)
    fastllm.unpatch(model)  # refused before ("wrapped by something other than ...")
    assert model.use_kernels  # as it came
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert _loss_and_grads(model, ids, labels)[0].loss == reference[0].loss


def test_kernelized_again_after_patch_is_patched_again_and_unpatches():
    # a user turning hub kernels back on after patch(): the norms run their class's forward, and
    # patched() says so; patch() patches them again, unpatch() clears the stale marks
    model = fastllm.patch(_kernelized_model())
    model.set_use_kernels(True)
    assert not any(_runs_ours(n) for n in _norms(model))
    assert fastllm.patched(model)["rms_norm"] == 0
    fastllm.patch(model)
    assert all(_runs_ours(n) for n in _norms(model))
    model.set_use_kernels(True)
    fastllm.unpatch(model)
    assert not any(fastllm.patched(model).values())
    assert not any(k.startswith("_fastllm") for m in model.modules() for k in m.__dict__)


class _HubRMSNorm(nn.Module):
    """A stand-in for a hub kernel (kernels binds its forward to each LlamaRMSNorm)."""

    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)


class _Repo:
    def load(self):
        return _HubRMSNorm


def test_hub_kernel_forward_is_replaced_and_given_back():
    # on a GPU from_pretrained binds the hub's RMSNorm (Liger's) to every norm; patch refused
    # such a model ("already carry an instance forward"), which the user cannot patch earlier
    mapping = {"RMSNorm": {"cpu": _Repo()}}
    model = _kernelized_model(mapping)
    hub = [n.__dict__["forward"] for n in _norms(model)]
    assert all(f.__func__ is _HubRMSNorm.forward for f in hub)
    ids, labels = _batch(vocab=VOCAB)
    reference = _loss_and_grads(model, ids, labels)[0].loss
    with kernels.use_kernel_mapping(mapping):
        fastllm.patch(model)
        model.eval()
        model.train()
        assert all(_runs_ours(n) for n in _norms(model))
        torch.testing.assert_close(_loss_and_grads(model, ids, labels)[0].loss, reference,
                                   rtol=1e-5, atol=0)
        fastllm.unpatch(model)
    assert model.use_kernels
    assert all(n.__dict__["forward"].__func__ is _HubRMSNorm.forward for n in _norms(model))


def test_compiling_the_patched_forward_warns_of_no_lru_cache():
    # fastllm/_hf.py's per-class memos, read by every patched attention under torch.compile:
    # functools.lru_cache made dynamo warn ("Dynamo detected a call to a
    # `functools.lru_cache`-wrapped function") at each compile of a patched model
    import warnings

    from transformers import DynamicCache

    from fastllm import _hf

    model = _model(vocab_size=VOCAB, num_hidden_layers=1)
    attention = model.model.layers[0].self_attn

    def step(x, cache):
        k, _ = _hf.cache_update(cache, x, x, 0, {}, None, None)
        return k * len(_hf.cache_keyword(attention))

    x = torch.ones(1, 2, 3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(step, backend="eager")(x, DynamicCache(config=model.config))
    assert torch.equal(out, x * len(_hf.cache_keyword(attention)))
    assert not [w for w in caught if "lru_cache" in str(w.message)]
