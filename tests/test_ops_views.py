"""Model ops given what a user's tensors may be beyond plain memory: a negated view
(`x._neg_view()`, what `z.conj().imag` gives) reads as its values on every CPU backend, forward
and grads (fastllm's eager path skips the dispatcher, whose fallback resolves such views; the
kernels and the oneDNN GEMM read raw memory), in place too; and lora_linear_multi checks the
projections without LoRA as fastllm.linear does."""

import pytest
import torch

import fastllm
from fastllm.ops import linear, lora_linear, rms_norm, rotary_embedding, swiglu
from fastllm.ops.attention import attention
from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from fastllm.ops.lora_linear_multi import lora_linear_multi
from fastllm.ops.rotary_embedding import rotary_embedding_ref
from fastllm.ops.swiglu import geglu, geglu_linear, swiglu_linear

from conftest import backend_device_params

BACKENDS = [p for p in backend_device_params() if p.values == ("cpp", "cpu")
            or p.values == ("ref", "cpu")]


def _r(*shape):
    return torch.randn(*shape, generator=_GEN)


_GEN = torch.Generator().manual_seed(0)
CASES = {
    "rms_norm": (lambda x, w: rms_norm(x, w), [(3, 8), (8,)]),
    "swiglu": (swiglu, [(3, 8), (3, 8)]),
    "swiglu_linear": (swiglu_linear, [(3, 8), (3, 8), (5, 8)]),
    "geglu": (geglu, [(3, 8), (3, 8)]),
    "geglu_linear": (geglu_linear, [(3, 8), (3, 8), (5, 8)]),
    "rotary": (lambda q, k, c, s: rotary_embedding(q, k, c, s)[0],
               [(1, 3, 2, 8), (1, 3, 1, 8), (1, 3, 8), (1, 3, 8)]),
    "linear": (linear, [(3, 8), (4, 8), (4,)]),
    "lora_linear": (lambda x, w, a, b: lora_linear(x, w, a, b, 0.5),
                    [(3, 8), (4, 8), (2, 8), (4, 2)]),
    "lora_linear_multi": (lambda x, w, a, b, w2: torch.cat(lora_linear_multi(
        x, [w, w2], [a, None], [b, None], [0.5, 1.0]), -1),
        [(3, 8), (4, 8), (2, 8), (4, 2), (3, 8)]),
    "attention": (attention, [(1, 20, 2, 8), (1, 20, 1, 8), (1, 20, 1, 8)]),
    "fused_linear_cross_entropy": (
        lambda h, w: fused_linear_cross_entropy(h, w, torch.arange(6) % 5), [(6, 8), (5, 8)]),
}


def _value_and_grads(fn, inputs):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    weight = torch.linspace(0.5, 1.5, out.numel()).view(out.shape)
    # (rotary's cos and sin, and k when only q_rot is kept, get no grad)
    return [out.detach()] + list(torch.autograd.grad((out * weight).sum(), leaves,
                                                     allow_unused=True))


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("op", list(CASES))
def test_a_negated_view_reads_as_its_values(backend, device, op):
    fn, shapes = CASES[op]
    inputs = [_r(*s) for s in shapes]
    with fastllm.use_backend(backend):
        want = _value_and_grads(fn, inputs)
        for i in range(len(inputs)):
            negated = list(inputs)
            negated[i] = (-inputs[i])._neg_view()  # the same values, the bit set
            assert negated[i].is_neg() and torch.equal(negated[i], inputs[i])
            got = _value_and_grads(fn, negated)
            for g, w in zip(got, want):
                assert (g is None) == (w is None), f"input {i}"
                if g is not None:
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"input {i}")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_rotary_in_place_through_a_negated_view(backend, device):
    q, k = (-_r(1, 3, 2, 8))._neg_view(), (-_r(1, 3, 1, 8))._neg_view()
    cos, sin = _r(1, 3, 8), _r(1, 3, 8)
    want = rotary_embedding_ref(q, k, cos, sin)
    with fastllm.use_backend(backend):
        got = rotary_embedding(q, k, cos, sin, inplace=True)
    assert got[0] is q and got[1] is k and q.is_neg()
    for g, w in zip((q, k), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_lora_linear_multi_checks_projections_without_lora():
    x, w, a, b, w2 = _r(3, 8), _r(6, 8), _r(2, 8), _r(6, 2), _r(4, 8)
    with pytest.raises(ValueError, match=r"projection 1: .*bias must be \(4,\), got \(3, 1\)"):
        lora_linear_multi(x, [w, w2], [a, None], [b, None], [1.0, 1.0], [None, _r(3, 1)])
    with pytest.raises(TypeError, match="projection 1: .*weight has dtype torch.float64"):
        lora_linear_multi(x, [w, w2.double()], [a, None], [b, None], [1.0, 1.0])
