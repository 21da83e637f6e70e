"""Edge cases of the C++ CPU kernels (csrc/cpu/), and of the Triton and ref backends sharing their
maths, that the per-op tests do not reach: non-finite inputs, degenerate shapes and thread counts,
each against the op's `<op>_ref` or plain PyTorch. Every test here failed on the kernel it names
before its fix."""

import pytest
import torch

import fastllm
from fastllm.ops import fused_linear_cross_entropy, fused_linear_cross_entropy_ref


@pytest.mark.parametrize("backend", ["cpp", "triton", "ref"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_masked_vocab(backend, reduction):
    # A -inf bias masks vocabulary entries (padding rows of a rounded-up vocabulary): their logits
    # are -inf, which F.cross_entropy handles (probability 0); without label smoothing the
    # smoothing term 0 * mean(z) = 0 * -inf made the loss nan.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g)
    weight = torch.randn(19, 16, generator=g)
    bias = torch.zeros(19)
    bias[-4:] = float("-inf")
    labels = torch.randint(0, 15, (7,), generator=g)
    labels[2] = -100
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(*leaves, labels, bias, reduction=reduction)
    grads = torch.autograd.grad(loss.sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (hidden, weight)]
    ref = fused_linear_cross_entropy_ref(*ref_leaves, labels, bias.double(), reduction=reduction)
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "ref"])
def test_rms_norm_zero_hidden_size(backend):
    # x (..., 0): y is empty and each row's rstd is that of a mean over no elements, nan, as
    # rms_norm_ref computes it. Before, the op raised reshaping x to (-1, 0), and the kernel
    # returned rstd uninitialised.
    x = torch.randn(2, 3, 0, requires_grad=True)
    w = torch.randn(0, requires_grad=True)
    with fastllm.use_backend(backend):
        y, rstd = torch.ops.fastllm.rms_norm(x, w, 1e-6, 0.0)
    assert y.shape == (2, 3, 0) and rstd.shape == (2, 3) and rstd.dtype == torch.float32
    assert torch.isnan(rstd).all()
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("backend", ["cpp", "ref"])
def test_attention_one_key_rows_are_exactly_one(backend):
    """A query that sees one key (a 1-token document) has P = 1 exactly, so dV is the sum of
    grad_out over the group's query heads, at any score magnitude and a scale that is not a power
    of two: the kernel's exponent reads the same rounded scaled scores its max and lse were of
    (an FMA-fused exp(S * scale - lse) gave dV 1.4% off at scaled scores of 2.7e5)."""
    from fastllm.ops import attention

    T = 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, h, 4, generator=g) for h in (2, 1, 1))
    q = (q * 3e4).requires_grad_()
    k, v = k.requires_grad_(), v.requires_grad_()
    with fastllm.use_backend(backend):
        out = attention(q, k, v, scale=0.7, doc_start=torch.arange(T)[None])
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    assert torch.equal(v.grad, grad.sum(2, keepdim=True))


@pytest.mark.parametrize("backend", ["cpp", "triton", "ref"])
def test_amsgrad_keeps_a_nan_max_second_moment(backend):
    """A nan in max_exp_avg_sq (a loaded state) reaches the param, as torch.maximum and
    torch.optim.AdamW keep it (the kernels' max returned the other operand)."""
    reason = fastllm._backend.unavailable_reason(backend, "cpu")
    if reason:
        pytest.skip(reason)
    from fastllm.ops import adamw_step

    p, grad = torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5])
    m, v, vmax = torch.zeros(2), torch.zeros(2), torch.tensor([float("nan"), 0.0])
    with fastllm.use_backend(backend):
        adamw_step([p], [grad], [m], [v], [vmax], [torch.tensor(1.0)], lr=0.1, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=True)
    assert p[0].isnan() and vmax[0].isnan() and torch.isfinite(p[1]) and vmax[1] > 0
