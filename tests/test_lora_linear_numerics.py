"""fastllm::lora_linear's numerics past the basic comparisons of test_lora_linear.py: the fp32
results of the Triton kernels' tensor-core products (fp32 operands as bf16 terms) and inputs with
unusual layouts, on every backend."""

import pytest
import torch

import fastllm
from fastllm.ops.lora_linear import lora_linear_ref
from test_lora_linear import BACKENDS, _inputs


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16+fp32a"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=["p0", "p.25"])
def test_fp32_low_rank_products_keep_fp32_accuracy(backend, device, x_dtype, dropout_p):
    """The fp32 results of the low-rank products (xa, dA, dB; dX of an fp32 model) no further
    from fp64 than twice the reference's fp32 matmuls: the Triton kernels run fp32 operands on
    tensor cores as three bf16 terms each (fastllm/kernels/lora_linear.py `_dot`), which must keep
    what an fp32 product keeps (dropping the smallest term costs ~1.5e-5 relative)."""
    # on a GPU a layer's size: K-long sums whose fp32 accumulation is the tensor cores' own
    rows, k, n = (2048, 4096, 1024) if device == "cuda" else (97, 150, 140)
    x, w, a, b, _ = _inputs((rows,), k, n, 16, x_dtype, device, bias=False)
    x, a, b = x.detach(), a.detach().float(), b.detach().float()
    g = torch.randn(rows, n, device=device).to(x_dtype)

    def run(chosen, cast):
        args = [cast(t) for t in (x, w, a, b)]
        with fastllm.use_backend(chosen), torch.no_grad():
            y, xa_t = torch.ops.fastllm.lora_linear(*args, 0.5, None, dropout_p, torch.tensor(5))
            dx, da, db = torch.ops.fastllm.lora_linear_backward(
                cast(g), *args, xa_t, 0.5, dropout_p, torch.tensor(5), [True, True, True])
        return [xa_t, da, db] + ([dx] if x_dtype == torch.float32 else [])

    oracle = run("ref", lambda t: t.double())
    got, ref = run(backend, lambda t: t), run("ref", lambda t: t)
    for name, o, ours, theirs in zip(("xa", "dA", "dB", "dX"), oracle, got, ref):
        scale = o.abs().max().item()
        err, ref_err = ((t.double() - o).abs().max().item() / scale for t in (ours, theirs))
        assert ours.dtype == torch.float32, name
        # + 1e-6: on an H200 dA's 2048-long sums came to 6.5e-7 against cuBLAS's 2.5e-7
        # (2026-12-04: the tensor cores' accumulation order); a dropped term costs ~1.5e-5
        assert err <= 2 * ref_err + 1e-6, f"{name}: {err:.2e} vs the reference's {ref_err:.2e}"


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_strided_bias(backend, device):
    """A bias that is a strided view (every other element of a buffer) is read as its values:
    the Triton seed kernel reads the bias at stride 1 and must get a contiguous one."""
    x, w, a, b, _ = _inputs((3, 5), 24, 18, 4, torch.float32, device, bias=False)
    bias = torch.randn(36, device=device)[::2]
    with fastllm.use_backend(backend), torch.no_grad():
        got = fastllm.ops.lora_linear(x, w, a, b, 0.5, bias)
    want = lora_linear_ref(x, w, a, b, 0.5, bias.contiguous())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.values[0] != "triton"])
def test_fp64_with_dropout_is_fp64_accurate(backend, device):
    """fp64 (the cpp and ref backends take it) with dropout: y and every grad equal the autograd
    reference to fp64 rounding (the C++ dropout once scaled in fp32: ~3e-7 off)."""
    x, w, a, b, bias_t = _inputs((33,), 40, 30, 8, torch.float64, device, bias=True)
    g = torch.randn(33, 30, device=device, dtype=torch.float64)
    inputs = [x, a, b, bias_t]
    with fastllm.use_backend(backend):
        y = fastllm.ops.lora_linear(x, w, a, b, 0.5, bias_t, 0.3, seed=3)
        got = [y] + list(torch.autograd.grad(y, inputs, g))
    y = lora_linear_ref(x, w, a, b, 0.5, bias_t, 0.3, 3)
    for ours, want in zip(got, [y] + list(torch.autograd.grad(y, inputs, g))):
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_mixed_precision_dropout_is_applied_in_fp32_as_in_peft(backend, device):
    """fp32 adapters on a bf16 base with dropout: PEFT casts x to the adapter's dtype and drops
    out in fp32, as the kernels do; the reference (lora_linear_ref, every test's oracle) dropped
    out in bf16 first, its scaled values rounded: its fp32 dA ~1e-3 off the kernels'."""
    from fastllm.ops.lora_linear import lora_linear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen).bfloat16().to(device)
    w = torch.randn(40, 48, generator=gen).bfloat16().to(device)
    a0 = (torch.randn(4, 48, generator=gen) * 0.1).to(device)
    b0 = torch.randn(40, 4, generator=gen).to(device)
    g = torch.randn(64, 40, generator=gen).bfloat16().to(device)

    def grads(fn):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        fn(x, w, a, b, 2.0, None, 0.3, seed=7).backward(g)
        return a.grad, b.grad

    want = grads(lora_linear_ref)
    with fastllm.use_backend(backend):
        got = grads(lora_linear)
    for ours, theirs in zip(got, want):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max())
