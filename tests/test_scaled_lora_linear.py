"""fastllm.ops.scaled_lora_linear (DoRA's scaled LoRA product, keeping the output rather than the
product before the scale for the scale's grad): the values and grads of lora_linear times the
scale under autograd, on every backend; against plain PyTorch in fp64; what it keeps; and the
same scale on swiglu_lora_linear (a DoRA down projection)."""

import pytest
import torch

import fastllm
from conftest import backend_device_params
from fastllm.ops.lora_linear import lora_linear
from fastllm.ops.scaled_lora_linear import scaled_lora_linear, scaled_lora_linear_ref
from fastllm.ops.swiglu import swiglu
from fastllm.ops.swiglu_lora_linear import swiglu_lora_linear


def _args(dtype, device="cpu", bias=True, rows=13, d_in=40, d_out=24, r=4):
    torch.manual_seed(0)  # (odd sizes)
    x = torch.randn(1, rows, d_in, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(d_out, d_in, device=device) * 0.2).to(dtype)
    lora_a = (torch.randn(r, d_in, device=device) * 0.3).to(dtype).requires_grad_()
    lora_b = (torch.randn(d_out, r, device=device) * 0.3).to(dtype).requires_grad_()
    scale = (0.5 + torch.rand(d_out, device=device)).to(dtype).requires_grad_()
    b = torch.randn(d_out, dtype=dtype, device=device).requires_grad_() if bias else None
    return x, weight, lora_a, lora_b, scale, b


def _clones(tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.requires_grad)
            for t in tensors]


def _grads(tensors):
    return [t.grad for t in tensors if t is not None and t.requires_grad]


@pytest.mark.parametrize("backend,device", backend_device_params(without=("cuda",)))
@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float32, False),
                                        (torch.bfloat16, True)])
def test_equals_lora_linear_times_the_scale(backend, device, dtype, bias):
    # output and x/A/B/bias grads bit for bit (the same ops on the same values); the scale's grad,
    # taken from the output, to rounding
    args = _args(dtype, device, bias)
    x, weight, lora_a, lora_b, scale, b = args
    with fastllm.use_backend(backend):
        y = scaled_lora_linear(x, weight, lora_a, lora_b, 1.5, scale, b)
        x2, w2, a2, b2, s2, bias2 = _clones(args)
        want = lora_linear(x2, w2, a2, b2, 1.5) * s2
        want = want if bias2 is None else want + bias2
        dy = torch.randn_like(want)
        y.backward(dy)
        want.backward(dy)
    assert y.dtype == dtype and torch.equal(y, want)
    for got, exp in ((x, x2), (lora_a, a2), (lora_b, b2), (b, bias2)):
        assert got is None or torch.equal(got.grad, exp.grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(scale.grad, s2.grad, rtol=tol, atol=tol * s2.grad.abs().max().item())


@pytest.mark.parametrize("backend", ["cpp", "triton", "ref"])
@pytest.mark.parametrize("dtype,dropout", [(torch.float32, 0.0), (torch.bfloat16, 0.0),
                                           (torch.float32, 0.3), (torch.bfloat16, 0.1)])
def test_matches_the_reference(backend, dtype, dropout):
    # against plain PyTorch (PEFT's DoRA sum, lora_linear's dropout mask) over fp64 copies: fp32
    # to 1e-5; bf16 no worse than twice the reference's own bf16 error (every output and grad)
    if backend == "triton":
        pytest.importorskip("triton")
    args = _args(dtype, rows=67, d_in=96, d_out=80, r=8)
    with fastllm.use_backend(backend):
        y = scaled_lora_linear(*args[:4], 0.75, *args[4:], dropout, seed=11)
        dy = torch.randn_like(y)
        y.backward(dy)
    got = [y] + _grads(args)
    runs = {}
    for name, cast in (("ref", dtype), ("fp64", torch.float64)):
        ts = [t.detach().to(cast).requires_grad_(t.requires_grad) for t in args]
        out = scaled_lora_linear_ref(*ts[:4], 0.75, *ts[4:], dropout, seed=11)
        out.backward(dy.to(cast))
        runs[name] = [out] + _grads(ts)
    for g, r, exact in zip(got, runs["ref"], runs["fp64"]):
        if dtype == torch.float32:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())
        else:
            ours, theirs = ((t.double() - exact).abs().max() for t in (g, r))
            assert ours <= 2 * theirs + 1e-6, (ours, theirs)


def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_keeps_the_output_not_the_product_before_the_scale():
    x, weight, lora_a, lora_b, scale, _ = _args(torch.float32, bias=False)
    y, saved = _saved(lambda: scaled_lora_linear(x, weight, lora_a, lora_b, 2.0, scale))
    big = [t for t in saved if t.dim() > 1 and t.shape[-1] == weight.shape[0]]
    # the one (rows, out) tensor kept is the output itself (which attention or SwiGLU keeps too)
    assert len(big) == 1 and big[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    # autograd's product-then-scale keeps a second (rows, out) tensor
    _, theirs = _saved(lambda: lora_linear(x, weight, lora_a, lora_b, 2.0) * scale)
    assert sum(t.dim() > 1 and t.shape[-1] == weight.shape[0] for t in theirs) == 1
    assert all(t.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for t in theirs)
    # an in-place change to the output is refused (by the change or by the backward), not used
    with pytest.raises(RuntimeError, match="inplace"):
        y.add_(1.0)
        y.sum().backward()


def test_with_dropout_keeps_x_and_one_output_sized_tensor():
    # autograd over PEFT's sum keeps d = dropout(x) and two (rows, out) products besides x; the op
    # keeps x, x A^T and d W^T + s d A^T B^T, and makes d's mask again from the seed
    x, weight, lora_a, lora_b, scale, bias = _args(torch.float32, rows=37, d_in=40, d_out=48)
    y, saved = _saved(lambda: scaled_lora_linear(x, weight, lora_a, lora_b, 2.0, scale, bias, 0.2))
    rows_by = lambda ts, n: [t for t in ts if t.dim() > 1 and t.shape[-1] == n  # noqa: E731
                             and t.shape[:-1].numel() == 37]
    assert len(rows_by(saved, 40)) == 1 and rows_by(saved, 40)[0] is x
    assert len(rows_by(saved, 48)) == 1
    ts = _clones((x, weight, lora_a, lora_b, scale, bias))
    _, theirs = _saved(lambda: scaled_lora_linear_ref(*ts[:4], 2.0, *ts[4:], 0.2, seed=3))
    assert len(rows_by(theirs, 40)) >= 2 and len(rows_by(theirs, 48)) >= 2
    # in eval (training=False) no dropout: the output is the dropout-free one
    want = scaled_lora_linear(x, weight, lora_a, lora_b, 2.0, scale, bias)
    assert torch.equal(scaled_lora_linear(x, weight, lora_a, lora_b, 2.0, scale, bias, 0.2,
                                          training=False), want)
    with pytest.raises(TypeError, match="with dropout the adapters must be in x's dtype"):
        scaled_lora_linear(x.bfloat16(), weight.bfloat16(), lora_a, lora_b, 2.0,
                           scale.bfloat16(), None, 0.2)


def test_a_zero_scale_entry_gets_a_nan_grad_and_the_rest_are_right():
    # documented: sum dy * y / scale is 0 / 0 where the scale is exactly 0 (loud, not wrong)
    x, weight, lora_a, lora_b, scale, bias = _args(torch.float32)
    with torch.no_grad():
        scale[3] = 0.0
    scaled_lora_linear(x, weight, lora_a, lora_b, 2.0, scale, bias).sum().backward()
    x2, w2, a2, b2, s2, bias2 = _clones((x, weight, lora_a, lora_b, scale, bias))
    (lora_linear(x2, w2, a2, b2, 2.0) * s2 + bias2).sum().backward()
    assert torch.isnan(scale.grad[3]) and torch.isfinite(scale.grad[torch.arange(24) != 3]).all()
    keep = torch.arange(24) != 3
    torch.testing.assert_close(scale.grad[keep], s2.grad[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(x.grad, x2.grad) and torch.equal(lora_b.grad, b2.grad)


def test_frozen_parts_and_compile():
    x, weight, lora_a, lora_b, scale, _ = _args(torch.float32, bias=False)
    scale.requires_grad_(False)
    lora_a.requires_grad_(False)
    y = scaled_lora_linear(x, weight, lora_a, lora_b, 0.5, scale)
    y.sum().backward()
    assert x.grad is not None and lora_b.grad is not None and lora_a.grad is None
    compiled = torch.compile(scaled_lora_linear, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, weight, lora_a, lora_b, 0.5, scale), y, rtol=1e-6,
                               atol=1e-6)


def test_refusals_name_the_problem():
    x, weight, lora_a, lora_b, scale, bias = _args(torch.float32)
    cases = [
        (dict(scale=scale[:-1]), ValueError, r"scale must be \(24,\) torch.float32"),
        (dict(scale=scale.double()), ValueError, "scale must be"),
        (dict(scale=scale.to_sparse()), TypeError, "scale must be a dense tensor"),
        (dict(weight=weight.clone().requires_grad_()), ValueError, "base weight requires grad"),
        (dict(lora_b=lora_b[:-1]), ValueError, "lora_b must be"),
        (dict(weight=weight.bfloat16()), TypeError, "weight has dtype torch.bfloat16"),
        (dict(scaling=float("nan")), ValueError, "scaling must be finite"),
    ]
    base = dict(x=x, weight=weight, lora_a=lora_a, lora_b=lora_b, scaling=1.0, scale=scale,
                bias=bias)
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            scaled_lora_linear(**{**base, **change})
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        scaled_lora_linear(**base)
    assert x.grad is None and scale.grad is None


@pytest.mark.parametrize("dtype,dropout", [(torch.float32, 0.0), (torch.bfloat16, 0.0),
                                           (torch.float32, 0.25)])
def test_swiglu_lora_linear_with_a_scale_is_swiglu_then_scaled_lora_linear(dtype, dropout):
    torch.manual_seed(1)
    gate, up = (torch.randn(2, 7, 40, dtype=dtype, requires_grad=True) for _ in range(2))
    _, weight, lora_a, lora_b, scale, bias = _args(dtype)
    args = (gate, up, lora_a, lora_b, scale, bias)
    y, saved = _saved(lambda: swiglu_lora_linear(gate, up, weight, lora_a, lora_b, 2.0, bias,
                                                 dropout, seed=9, scale=scale))
    # silu(gate) * up is not kept (only gate and up, as large)
    assert sum(t.shape == gate.shape for t in saved) == 2
    g2, u2, a2, b2, s2, bias2 = _clones(args)
    want = scaled_lora_linear(swiglu(g2, u2), weight, a2, b2, 2.0, s2, bias2, dropout, seed=9)
    dy = torch.randn_like(want)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(y, want)
    for got, exp in zip(_grads(args), _grads((g2, u2, a2, b2, s2, bias2))):
        assert torch.equal(got, exp)
    with pytest.raises(ValueError, match="scale must be"):
        swiglu_lora_linear(gate, up, weight, lora_a, lora_b, 2.0, bias, scale=scale[:3])
    if dtype == torch.bfloat16:
        with pytest.raises(TypeError, match="with dropout the adapters must be in x's dtype"):
            swiglu_lora_linear(gate, up, weight, lora_a.float(), lora_b.float(), 2.0, bias, 0.1,
                               scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_over_an_nf4_base_is_the_op_over_the_dequantised_weight(dtype):
    # QDoRA's forms (fastllm.quant): bit for bit the dense ops over the dequantised weight
    from fastllm import quant

    torch.manual_seed(2)
    base = quant.NF4Linear.from_linear(torch.nn.Linear(40, 24).to(dtype), blocksize=16)
    dense = base.to_linear()
    x, _, lora_a, lora_b, scale, _ = _args(dtype)
    gate, up = (torch.randn(3, 40, dtype=dtype, requires_grad=True) for _ in range(2))
    runs = []
    for nf4 in (True, False):
        ts = _clones((x, gate, up, lora_a, lora_b, scale))
        if nf4:
            y = quant.nf4_scaled_lora_linear(ts[0], base, *ts[3:5], 2.0, ts[5])
            z = quant.nf4_swiglu_lora_linear(ts[1], ts[2], base, *ts[3:5], 2.0, scale=ts[5])
        else:
            y = scaled_lora_linear(ts[0], dense.weight, *ts[3:5], 2.0, ts[5], dense.bias)
            z = swiglu_lora_linear(ts[1], ts[2], dense.weight, *ts[3:5], 2.0, dense.bias,
                                   scale=ts[5])
        (y.square().sum() + z.square().sum()).backward()
        runs.append([y, z] + _grads(ts))
    for got, want in zip(*runs):
        assert torch.equal(got, want)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match="base computes in"):
        quant.nf4_scaled_lora_linear(x.detach().to(other), base, lora_a, lora_b, 2.0, scale)
    with pytest.raises(TypeError, match="expected NF4Linear"):
        quant.nf4_scaled_lora_linear(x, dense, lora_a, lora_b, 2.0, scale)
