"""fastllm.ops.swiglu_lora_linear (a LoRA down projection over silu(gate) * up that keeps only gate
and up): the same values and grads as swiglu then lora_linear, on every backend, and
fastllm.patch's use of it for a LoRA down_proj."""

import copy

import pytest
import torch
import transformers

import fastllm
from conftest import backend_device_params
from fastllm.lora import inject_lora, lora_modules
from fastllm.ops.lora_linear import lora_linear
from fastllm.ops.swiglu import swiglu
from fastllm.ops.swiglu_lora_linear import swiglu_lora_linear, swiglu_lora_linear_ref


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


def _args(dtype, device, adapter_dtype=None, bias=True):
    torch.manual_seed(0)
    rows, ffn, out, r = 13, 40, 24, 4  # (odd sizes)
    gate = torch.randn(1, rows, ffn, dtype=dtype, device=device, requires_grad=True)
    up = torch.randn(1, rows, ffn, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(out, ffn, device=device) * 0.2).to(dtype)
    a_dtype = adapter_dtype or dtype
    lora_a = (torch.randn(r, ffn, device=device) * 0.3).to(a_dtype).requires_grad_()
    lora_b = (torch.randn(out, r, device=device) * 0.3).to(a_dtype).requires_grad_()
    b = torch.randn(out, dtype=dtype, device=device).requires_grad_() if bias else None
    return gate, up, weight, lora_a, lora_b, b


def _clones(tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.requires_grad)
            for t in tensors]


@pytest.mark.parametrize("backend,device", backend_device_params(without=("cuda",)))
@pytest.mark.parametrize("dtype,adapter_dtype,dropout", [
    (torch.float32, None, 0.0), (torch.float32, None, 0.25), (torch.bfloat16, None, 0.0),
    (torch.bfloat16, torch.float32, 0.1)])
def test_equals_swiglu_then_lora_linear_bitwise(backend, device, dtype, adapter_dtype, dropout):
    args = _args(dtype, device, adapter_dtype)
    gate, up, weight, lora_a, lora_b, bias = args
    with fastllm.use_backend(backend):
        y, saved = _saved_numels(lambda: swiglu_lora_linear(gate, up, weight, lora_a, lora_b,
                                                            2.0, bias, dropout, seed=7))
        # gate and up are kept, not the product (as large as each)
        assert saved.count(gate.numel()) == 2, saved
        g2, u2, w2, a2, b2, bias2 = _clones(args)
        want = lora_linear(swiglu(g2, u2), w2, a2, b2, 2.0, bias2, dropout, seed=7)
        dy = torch.randn_like(want)
        y.backward(dy)
        want.backward(dy)
    assert y.dtype == dtype and torch.equal(y, want)
    for got, exp in ((gate, g2), (up, u2), (lora_a, a2), (lora_b, b2), (bias, bias2)):
        assert torch.equal(got.grad, exp.grad)


@pytest.mark.parametrize("dtype,dropout", [(torch.float32, 0.0), (torch.float32, 0.3),
                                           (torch.bfloat16, 0.0)])
def test_matches_the_reference(dtype, dropout):
    # against plain PyTorch over fp64 copies: fp32 to 1e-5; bf16 no worse than twice the
    # reference's own bf16 error
    args = _args(dtype, "cpu")
    y = swiglu_lora_linear(*args[:5], 0.75, args[5], dropout, seed=5)
    dy = torch.randn_like(y)
    y.backward(dy)
    got = [y] + [t.grad for t in (args[0], args[1], args[3], args[4], args[5])]
    runs = {}
    for name, cast in (("ref", dtype), ("fp64", torch.float64)):
        ts = [t.detach().to(cast).requires_grad_(t.requires_grad) for t in args]
        out = swiglu_lora_linear_ref(*ts[:5], 0.75, ts[5], dropout, seed=5)
        out.backward(dy.to(cast))
        runs[name] = [out] + [t.grad for t in (ts[0], ts[1], ts[3], ts[4], ts[5])]
    for g, r, exact in zip(got, runs["ref"], runs["fp64"]):
        if dtype == torch.float32:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        else:
            ours, theirs = ((t.double() - exact).abs().max() for t in (g, r))
            assert ours <= 2 * theirs + 1e-6, (ours, theirs)


def test_frozen_parts_views_and_compile():
    gate, up, weight, lora_a, lora_b, _ = _args(torch.float32, "cpu", bias=False)
    up.requires_grad_(False)
    lora_a.requires_grad_(False)
    y = swiglu_lora_linear(gate, up, weight, lora_a, lora_b, 0.5)
    y.sum().backward()
    assert gate.grad is not None and lora_b.grad is not None and lora_a.grad is None
    # gate and up as the halves of one fused projection's output: non-contiguous views
    gate_up = torch.randn(5, 2 * 40, requires_grad=True)
    got = swiglu_lora_linear(*gate_up.chunk(2, -1), weight, lora_a, lora_b, 0.5)
    fused = gate_up.detach().clone().requires_grad_()
    want = lora_linear(swiglu(*fused.chunk(2, -1)), weight, lora_a, lora_b, 0.5)
    got.sum().backward()
    want.sum().backward()
    assert torch.equal(got, want) and torch.equal(gate_up.grad, fused.grad)
    compiled = torch.compile(swiglu_lora_linear, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(gate, up, weight, lora_a, lora_b, 0.5), y, rtol=1e-6,
                               atol=1e-6)


def test_refusals_name_the_problem():
    gate, up, weight, lora_a, lora_b, bias = _args(torch.float32, "cpu")
    cases = [
        (dict(up=up[..., :-1]), ValueError, "gate and up must match"),
        (dict(up=up.double()), ValueError, "gate and up must match"),
        (dict(weight=weight.clone().requires_grad_()), ValueError, "base weight requires grad"),
        (dict(lora_b=lora_b[:-1]), ValueError, "lora_b must be"),
        (dict(weight=weight.bfloat16()), TypeError, "weight has dtype torch.bfloat16"),
        (dict(dropout_p=1.0), ValueError, "dropout"),
        (dict(gate=gate.to_sparse()), TypeError, "gate must be a dense tensor"),
    ]
    base = dict(gate=gate, up=up, weight=weight, lora_a=lora_a, lora_b=lora_b, scaling=1.0,
                bias=bias)
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            swiglu_lora_linear(**{**base, **change})
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        swiglu_lora_linear(**base)
    assert gate.grad is None and lora_a.grad is None


def test_patch_runs_a_lora_down_proj_through_it(monkeypatch):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    inject_lora(model, target_modules=["down_proj", "q_proj"], r=4, alpha=8, dropout=0.1)
    with torch.no_grad():
        for _, layer in lora_modules(model):
            layer.lora_B.normal_(std=0.1)
    patched = fastllm.patch(copy.deepcopy(model))
    import fastllm.ops.swiglu_lora_linear as ops

    calls, real = [], ops.swiglu_lora_linear
    monkeypatch.setattr(ops, "swiglu_lora_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, patched):
        torch.manual_seed(3)  # the same dropout masks
        losses.append(m.train()(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), (_, b) in zip(lora_modules(model), lora_modules(patched)):
        for p, q in ((a.lora_A, b.lora_A), (a.lora_B, b.lora_B)):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
