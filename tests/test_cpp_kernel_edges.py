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
