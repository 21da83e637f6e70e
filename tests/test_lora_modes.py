"""LoRA layers take the mode of the layer they replace (an eval model, as from_pretrained returns
one, keeps LoRA dropout off, as PEFT's PeftModel.from_pretrained does), and a DoRA layer's norm
follows its base weight through any write, `.data` included."""

import torch
from torch import nn

import fastllm
from fastllm.dora import DoRALinear, dora_linear_ref


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))


def test_injected_layers_take_the_mode_of_the_layer_they_replace():
    x = torch.randn(4, 16)
    for training in (False, True):
        model = _model().train(training)
        fastllm.lora.inject_lora(model, ["0", "2"], r=4, alpha=8, dropout=0.5)
        layers = [m for _, m in fastllm.lora.lora_modules(model)]
        assert len(layers) == 2 and all(m.training == training for m in layers)
        with torch.no_grad():
            for m in layers:
                m.lora_B.normal_()
            same = torch.equal(model(x), model(x))
        assert same != training  # dropout only in training


def test_dora_norm_follows_a_write_through_data():
    torch.manual_seed(0)
    layer = DoRALinear(nn.Linear(16, 8), r=4, alpha=8)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 16)
    layer(x)  # a norm computed (and, before, cached) for the first weight
    layer.base_layer.weight.data.mul_(2.0)  # moves neither the version nor the address
    want = dora_linear_ref(x, layer.base_layer.weight, layer.lora_A, layer.lora_B,
                           layer.lora_magnitude_vector, layer.scaling, layer.base_layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


def test_hooks_on_the_base_layer_run_unmerged_as_merged():
    """A forward hook or pre-hook on an adapted layer's base layer (registered on the nn.Linear
    before injection) ran only once the adapter was merged: the fused op read the base weights
    around it. Now the base layer is called: a hook that changes nothing leaves LoRA's and DoRA's
    outputs and grads as without it, and one that does applies to the base part only (PEFT's
    order: hook(base(x)) + the low-rank part)."""
    torch.manual_seed(0)
    x = torch.randn(5, 16, requires_grad=True)
    for cls in (fastllm.lora.LoRALinear, DoRALinear):
        layer = cls(nn.Linear(16, 8), r=4, alpha=8).eval()
        with torch.no_grad():
            layer.lora_B.normal_()
        plain = layer(x)
        want_grads = torch.autograd.grad(plain.square().sum(), (x, layer.lora_A))
        calls = []
        hooks = [layer.base_layer.register_forward_pre_hook(lambda m, a: calls.append("pre")),
                 layer.base_layer.register_forward_hook(lambda m, a, o: calls.append("post"))]
        hooked = layer(x)
        assert calls == ["pre", "post"], cls
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)
        for got, want in zip(torch.autograd.grad(hooked.square().sum(), (x, layer.lora_A)),
                             want_grads):  # (another order of the sums: 1e-4 on grads)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for h in hooks:
            h.remove()
    layer = fastllm.lora.LoRALinear(nn.Linear(16, 8), r=4, alpha=8).eval()
    with torch.no_grad():
        layer.lora_B.normal_()
        delta = layer(x) - layer.base_layer(x)
        layer.base_layer.register_forward_hook(lambda m, a, o: o * 0.5)
        base = nn.functional.linear(x, layer.base_layer.weight, layer.base_layer.bias)
        torch.testing.assert_close(layer(x), 0.5 * base + delta, rtol=1e-5, atol=1e-6)


def test_accelerate_device_alignment_keeps_the_fused_op(monkeypatch):
    """accelerate's AlignDevicesHook without offloading (what a multi-device dispatch puts on
    every layer) only moves inputs: the LoRA layer keeps its fused op; an offloading one (the
    weights loaded for the call) or a hook of another kind makes it call the base layer."""
    import fastllm.lora as lora_module

    class AlignDevicesHook:  # (accelerate's class, by name: accelerate is optional here)
        def __init__(self, offload):
            self.offload = offload

    class SequentialHook:
        def __init__(self, *hooks):
            self.hooks = hooks

    calls = []
    real = lora_module.lora_linear
    monkeypatch.setattr(lora_module, "lora_linear",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, 16)
    layer = fastllm.lora.LoRALinear(nn.Linear(16, 8), r=4, alpha=8).eval()
    want = layer(x)
    for hook, fused in ((AlignDevicesHook(False), True),
                        (SequentialHook(AlignDevicesHook(False)), True),
                        (AlignDevicesHook(True), False), (object(), False)):
        layer.base_layer._hf_hook = hook
        del calls[:]
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
        assert bool(calls) == fused, hook
