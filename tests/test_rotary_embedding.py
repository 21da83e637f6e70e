"""fastllm.ops.rotary_embedding on every backend against rotary_embedding_ref (fp64) and Hugging
Face's apply_rotary_pos_emb: q and k together, GQA, position_ids, HF's (B, H, S, D) layout,
in place, both gradients, fp32/bf16/fp16."""

import pytest
import torch

import fastllm
from fastllm.ops.rotary_embedding import (
    apply_rotary_pos_emb,
    rotary_embedding,
    rotary_embedding_ref,
)

from _model_ops import check_close, grads
from conftest import backend_device_params

BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, S, Hq, Hk, D)
SHAPES = [(1, 1, 1, 1, 2), (2, 7, 9, 3, 64), (3, 5, 4, 4, 18)]


def _tables(positions, d, device, base=10000.0):
    """HF's default rope: cos/sin (positions, D), both halves equal."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    freqs = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def _hf_rotary(q, k, cos, sin):
    """HF's apply_rotary_pos_emb on (B, S, H, D) tensors."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    qh, kh = hf(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qh.transpose(1, 2), kh.transpose(1, 2)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gather", [False, True])
def test_matches_ref_and_hf(backend, device, dtype, shape, gather):
    b, s, hq, hk, d = shape
    q = torch.randn(b, s, hq, d, device=device).to(dtype).requires_grad_()
    k = torch.randn(b, s, hk, d, device=device).to(dtype).requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    cos64, sin64 = _tables(s + 11, d, device)
    pos = torch.stack([torch.randperm(s + 11, device=device)[:s] for _ in range(b)])
    if gather:
        args, args64 = (cos64.to(dtype), sin64.to(dtype), pos), (cos64, sin64, pos)
    else:
        args = (cos64[pos].to(dtype), sin64[pos].to(dtype))
        args64 = (cos64[pos], sin64[pos])
    q0, k0 = q.detach().clone(), k.detach().clone()
    with fastllm.use_backend(backend):
        got = grads(rotary_embedding(q, k, *args), [q, k], [gq, gk])
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0)
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    oracle = grads(rotary_embedding_ref(qd, kd, *args64), [qd, kd], [gq.double(), gk.double()])
    qh, kh = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    theirs = grads(_hf_rotary(qh, kh, cos64[pos].to(dtype), sin64[pos].to(dtype)), [qh, kh],
                   [gq, gk])
    for name, a, t, o in zip(("q", "k", "dq", "dk"), got, theirs, oracle):
        check_close(name, a, t, o, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 0, 4, 2, 8), (0, 3, 4, 2, 8), (2, 3, 0, 2, 8)],
                         ids=["no_tokens", "no_rows", "no_q_heads"])
def test_empty_inputs_have_a_backward(backend, device, shape):
    """out.sum().backward() hands an empty output's grad as a zero-stride expand, which
    .contiguous() keeps: the C++ kernel refused it ("unit last stride")."""
    b, s, hq, hk, d = shape
    q = torch.randn(b, s, hq, d, device=device, requires_grad=True)
    k = torch.randn(b, s, hk, d, device=device, requires_grad=True)
    cos, sin = (t[None].float() for t in _tables(s, d, device))
    with fastllm.use_backend(backend):
        qo, ko = rotary_embedding(q, k, cos, sin)
        (qo.sum() + ko.sum()).backward()
    qr, kr = (t.detach().double().requires_grad_() for t in (q, k))
    qo, ko = rotary_embedding_ref(qr, kr, cos.double(), sin.double())
    (qo.sum() + ko.sum()).backward()
    torch.testing.assert_close(q.grad.double(), qr.grad)
    torch.testing.assert_close(k.grad.double(), kr.grad)


@pytest.mark.parametrize("backend", ["cpp", "triton", "ref"])
def test_hf_layout_and_in_place(backend):
    """HF's (B, H, S, D) tensors (strided views), the in-place form, and the HF-signature
    wrapper all give apply_rotary_pos_emb's numbers."""
    if fastllm._backend.unavailable_reason(backend, "cpu"):
        pytest.skip(fastllm._backend.unavailable_reason(backend, "cpu"))
    b, s, hq, hk, d = 2, 6, 6, 2, 16
    q = torch.randn(b, s, hq * d).view(b, s, hq, d).transpose(1, 2)  # as LlamaAttention has it
    k = torch.randn(b, s, hk * d).view(b, s, hk, d).transpose(1, 2)
    cos, sin = (t.float()[None, :s].expand(b, s, d) for t in _tables(s, d, "cpu"))
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    want_q, want_k = hf(q, k, cos, sin)
    with fastllm.use_backend(backend):
        got_q, got_k = apply_rotary_pos_emb(q, k, cos, sin)
        assert got_q.stride() == q.stride()
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-6)
        qi, ki = q.transpose(1, 2).clone(), k.transpose(1, 2).clone()
        out = rotary_embedding(qi, ki, cos, sin, inplace=True)
        assert out[0] is qi
        torch.testing.assert_close(qi.transpose(1, 2), want_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ki.transpose(1, 2), want_k, rtol=1e-5, atol=1e-6)
        # the kernels' writes are recorded (as by mul_): a q saved before them is refused by
        # autograd instead of its rotation being used (cpp and Triton wrote silently)
        w = torch.ones(d, requires_grad=True)
        y = (qi * w).sum()
        rotary_embedding(qi, ki, cos, sin, inplace=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_in_place_refuses_autograd():
    q = torch.randn(1, 2, 1, 4, requires_grad=True)
    k = torch.randn(1, 2, 1, 4)
    cos, sin = torch.ones(1, 2, 4), torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="autograd"):
        rotary_embedding(q, k, cos, sin, inplace=True)


def test_cos_and_sin_that_require_grad_get_their_gradient():
    """A learned rotary table: the op gives cos and sin no gradient, so such a call is the
    reference maths (cos.grad was None, silently)."""
    q, k = torch.randn(2, 5, 4, 8, requires_grad=True), torch.randn(2, 5, 2, 8)
    cos, sin = (t.float().requires_grad_() for t in _tables(5, 8, "cpu"))
    ids = torch.arange(5)[None]
    out = rotary_embedding(q, k, cos, sin, ids)
    want = rotary_embedding_ref(q, k, cos, sin, ids)
    g = [torch.randn_like(t) for t in out]
    got_grads = torch.autograd.grad(out, (q, cos, sin), g)
    want_grads = torch.autograd.grad(want, (q, cos, sin), g)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    assert got_grads[1].abs().max() > 0


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_in_place_refuses_aliased_memory(backend, device):
    """An expanded head dim or q and k in the same memory would be rotated once per alias:
    refused, as torch's in-place ops refuse them; disjoint views of one qkv buffer are fine."""
    with fastllm.use_backend(backend):
        _aliased_memory_checks(device)


def _aliased_memory_checks(device):
    cos, sin = _tables(5, 8, device)
    cos, sin = cos.float()[None], sin.float()[None]  # (1, S, D)
    row = torch.randn(2, 5, 1, 8, device=device)
    with pytest.raises(RuntimeError, match="more than one element of q"):
        rotary_embedding(row.expand(2, 5, 3, 8), torch.randn(2, 5, 1, 8, device=device), cos,
                         sin, inplace=True)
    q = torch.randn(2, 5, 3, 8, device=device)
    before = q.clone()
    with pytest.raises(RuntimeError, match="same memory"):
        rotary_embedding(q, q, cos, sin, inplace=True)
    flat = torch.randn(2 * 5 * 3 * 8 + 40, device=device)
    with pytest.raises(RuntimeError, match="overlap"):
        rotary_embedding(flat[:240].view(2, 5, 3, 8), flat[40:].view(2, 5, 3, 8), cos, sin,
                         inplace=True)
    assert torch.equal(q, before)
    qkv = torch.randn(2, 5, 3, 3, 8, device=device)  # (B, S, q/k/v, H, D)
    want = rotary_embedding_ref(qkv[:, :, 0], qkv[:, :, 1], cos, sin)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    rotary_embedding(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(q, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case,error,match", [
    (dict(k=torch.randn(1, 3, 2, 6)), ValueError, "agree"),
    (dict(q=torch.randn(1, 4, 2, 5), k=torch.randn(1, 4, 1, 5)), ValueError, "even"),
    (dict(cos=torch.ones(1, 3, 6)), ValueError, "cos and sin"),
    (dict(pos=torch.tensor([[0, 1, 9, 2]])), ValueError, "span"),
    (dict(pos=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)), TypeError, "int64"),
    (dict(k=torch.randn(1, 4, 1, 6, dtype=torch.float64)), TypeError, "k has dtype"),
])
def test_bad_input_is_refused(case, error, match):
    q = case.get("q", torch.randn(1, 4, 2, 6))
    k = case.get("k", torch.randn(1, 4, 1, 6))
    d = q.shape[-1]
    if "pos" in case:
        cos = sin = torch.ones(5, d)
    else:
        cos = case.get("cos", torch.ones(1, 4, d))
        sin = torch.ones(1, 4, d) if "cos" not in case else case["cos"]
        if "cos" in case:
            sin = torch.ones(1, 3, d)
            cos = torch.ones(1, 3, d)
    q0 = q.clone()
    with pytest.raises(error, match=match):
        torch.ops.fastllm.rotary_embedding_(q, k, cos, sin, case.get("pos"))
    assert torch.equal(q, q0)
    with pytest.raises(error, match=match):  # (the backward op is public too: it read past)
        torch.ops.fastllm.rotary_embedding_backward(q, k, cos, sin, case.get("pos"))


def test_opcheck_and_compile():
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    cos, sin = (t.float() for t in _tables(9, 8, "cpu"))
    pos = torch.tensor([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]])
    torch.library.opcheck(torch.ops.fastllm.rotary_embedding.default, (q, k, cos, sin, pos))
    torch.library.opcheck(torch.ops.fastllm.rotary_embedding.default,
                          (q, k, cos[None, :5], sin[None, :5], None))
    torch.library.opcheck(torch.ops.fastllm.rotary_embedding_.default,
                          (q.detach().clone(), k.detach().clone(), cos, sin, pos))
    fn = torch.compile(lambda q, k: sum(t.sum() for t in rotary_embedding(q, k, cos, sin, pos)),
                       fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(q, k), sum(t.sum() for t in rotary_embedding(q, k, cos, sin,
                                                                                pos)))
    fn(q, k).backward()
    assert q.grad is not None and k.grad is not None
    # a learned table takes the reference maths, whose position check reads values: compiled,
    # it must not guard on them
    learned = cos.clone().requires_grad_()
    fn = torch.compile(lambda q, c: rotary_embedding(q, k, c, sin, pos)[0].sum(),
                       fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(q, learned), rotary_embedding(q, k, learned, sin, pos)[0].sum())
