"""fastllm.ops.linear and fastllm/_lowp.py's policy for bf16/fp16 matmuls on the CPU (widened to
fp32 on CPUs without a native low-precision GEMM): output and every gradient against the fp64
oracle and against F.linear / F.scaled_dot_product_attention in the same dtype (what the user
would otherwise run), with the policy forced both ways (FASTLLM_CPU_LOWP_MATMUL=fp32|native) so
both paths run on any CPU; that low-precision tensors are what the ops keep; and the LoRA ops,
the fused loss and the patched attention on the widened path."""

import pytest
import torch
import torch.nn.functional as F

from fastllm import _lowp
from fastllm.ops.fused_linear_cross_entropy import (fused_linear_cross_entropy,
                                                    fused_linear_cross_entropy_ref)
from fastllm.ops.linear import linear, linear_ref
from fastllm.ops.lora_linear import lora_linear_ref
from fastllm.ops.lora_linear_multi import lora_linear_multi

from _model_ops import check_close, grads

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = ["fp32", "native"]


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", request.param)
    return request.param


def _leaf(t, dtype):
    return t.to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7, 5), (3, 33, 17), (2, 5, 129, 65)])
def test_linear_matches_oracle_and_torch(mode, dtype, shape):
    *lead, n_in, n_out = shape
    x = _leaf(torch.randn(*lead, n_in), dtype)
    w = _leaf(torch.randn(n_out, n_in) / n_in ** 0.5, dtype)
    b = _leaf(torch.randn(n_out), dtype)
    g = torch.randn(*lead, n_out).to(dtype)
    got = grads([linear(x, w, b)], [x, w, b], [g])
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    oracle = grads([linear_ref(*ref)], ref, [g.double()])
    theirs_in = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    theirs = grads([F.linear(*theirs_in)], theirs_in, [g])
    for name, a, t, o in zip(("y", "dx", "dw", "db"), got, theirs, oracle):
        assert a.dtype == dtype, name
        check_close(name, a, t, o, dtype, fp32_rtol=1e-5 if name == "y" else 1e-4)


def test_linear_keeps_its_inputs_low_precision_and_frozen_weights_get_no_grad(mode):
    x = torch.randn(4, 9, 16).bfloat16().requires_grad_()
    w = torch.randn(8, 16).bfloat16()  # frozen
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear(x, w)
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.bfloat16]
    # a frozen weight needs no dW, so x itself is not kept (as autograd does for F.linear)
    assert saved[0].shape == x.shape and saved[0].untyped_storage().nbytes() == 2
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad is None
    torch.testing.assert_close(x.grad.float(), w.float().sum(0).expand(4, 9, 16),
                               rtol=1e-2, atol=1e-2)


def test_linear_under_autocast_casts_like_f_linear(mode):
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, theirs = linear(x, w), F.linear(x, w)
    assert got.dtype == theirs.dtype == torch.bfloat16
    oracle = linear_ref(x.bfloat16().double(), w.bfloat16().double())
    check_close("y", got, theirs, oracle, torch.bfloat16)


@pytest.mark.parametrize("out_f,in_f", [(0, 6), (4, 0)])
def test_linear_with_no_outputs_or_no_inputs_matches_f_linear(out_f, in_f):
    x = torch.randn(2, 3, in_f, requires_grad=True)
    w = torch.randn(out_f, in_f, requires_grad=True)
    b = torch.randn(out_f, requires_grad=True)
    y = linear(x, w, b)
    y.sum().backward()
    want = F.linear(x, w, b)
    torch.testing.assert_close(y, want)
    assert [t.grad.shape for t in (x, w, b)] == [x.shape, w.shape, b.shape]
    assert torch.equal(b.grad, torch.full((out_f,), 6.0))


def test_linear_bad_input_is_refused():
    with pytest.raises(TypeError, match="weight has dtype"):
        linear(torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected x"):
        linear(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="bias must be"):
        linear(torch.randn(3, 4), torch.randn(5, 4), torch.randn(4))
    with pytest.raises(ValueError, match="FASTLLM_CPU_LOWP_MATMUL"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FASTLLM_CPU_LOWP_MATMUL", "fp16")
            linear(torch.randn(3, 4).bfloat16(), torch.randn(5, 4).bfloat16())


def test_linear_opcheck_and_compile(mode):
    x = torch.randn(3, 7, 16).bfloat16().requires_grad_()
    w = torch.randn(8, 16).bfloat16().requires_grad_()
    b = torch.randn(8).bfloat16().requires_grad_()
    torch.library.opcheck(torch.ops.fastllm.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.fastllm.linear_backward.default,
                          (torch.randn(3, 7, 8).bfloat16(), x.detach(), w.detach(),
                           [True, True, True]))
    fn = torch.compile(lambda x, w, b: linear(x, w, b).float().square().sum(), fullgraph=True,
                       backend="aot_eager")
    gx, gw = torch.autograd.grad(fn(x, w, b), [x, w])
    ex, ew = torch.autograd.grad(linear(x, w, b).float().square().sum(), [x, w])
    torch.testing.assert_close(gx, ex, rtol=0, atol=0)
    torch.testing.assert_close(gw, ew, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["causal_gqa", "causal_gqa_repeated", "bool_mask", "float_mask"])
def test_wide_attention_matches_sdpa(monkeypatch, dtype, case):
    """causal_gqa_repeated: the path for torch < 2.9, whose CPU flash backward cannot share key
    and value heads (the heads repeated, their gradients summed back), on this torch."""
    if case == "causal_gqa_repeated":
        monkeypatch.setattr(_lowp, "_CPU_FLASH_GQA", False)
        case = "causal_gqa"
    b, hq, hkv, t, d = 2, 6, 2 if case == "causal_gqa" else 6, 13, 8
    q = _leaf(torch.randn(b, hq, t, d), dtype)
    k = _leaf(torch.randn(b, hkv, t, d), dtype)
    v = _leaf(torch.randn(b, hkv, t, d), dtype)
    mask = None
    if case == "bool_mask":  # two packed documents, block-diagonal causal (as HF builds it)
        doc = torch.arange(t) >= 6
        mask = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
        mask = mask.expand(b, 1, t, t)
    elif case == "float_mask":
        mask = torch.zeros(b, 1, t, t).masked_fill_(torch.ones(t, t).triu(1).bool(), -1e9)
    causal = case == "causal_gqa"
    g = torch.randn(b, hq, t, d).to(dtype)
    got = grads([_lowp.scaled_dot_product_attention(q, k, v, mask, causal, 0.3)], [q, k, v], [g])
    ref = [t_.detach().double().requires_grad_() for t_ in (q, k, v)]
    ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    oracle = grads([F.scaled_dot_product_attention(*ref, attn_mask=ref_mask, is_causal=causal,
                                                   scale=0.3, enable_gqa=True)], ref,
                   [g.double()])
    th = [t_.detach().clone().requires_grad_() for t_ in (q, k, v)]
    th_mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    theirs = grads([F.scaled_dot_product_attention(*th, attn_mask=th_mask, is_causal=causal,
                                                   scale=0.3, enable_gqa=True)], th, [g])
    for name, a, t_, o in zip(("out", "dq", "dk", "dv"), got, theirs, oracle):
        assert a.dtype == dtype and a.shape == o.shape, name
        check_close(name, a, t_, o, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_ops_widened(monkeypatch, dtype):
    """lora_linear (dropout included) and lora_linear_multi on the widened path: as close to the
    fp64 oracle as the native path is, or closer, and low precision out."""
    x = _leaf(torch.randn(3, 11, 24), dtype)
    w = torch.randn(16, 24).to(dtype) / 5
    a = _leaf(torch.randn(4, 24) / 5, dtype)
    bb = _leaf(torch.randn(16, 4) / 2, dtype)
    seed = torch.tensor(7)
    g = torch.randn(3, 11, 16).to(dtype)
    results = {}
    for m in MODES:
        monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", m)
        y, _ = torch.ops.fastllm.lora_linear(x, w, a, bb, 2.0, None, 0.25, seed)
        results[m] = grads([y], [x, a, bb], [g])
        assert all(t.dtype == dtype for t in results[m])
    # the dropout mask is a hash of (seed, row, col): the fp64 reference draws the same one
    ref = [t.detach().double().requires_grad_() for t in (x, a, bb)]
    oracle = grads([lora_linear_ref(ref[0], w.double(), ref[1], ref[2], 2.0, None, 0.25, seed)],
                   ref, [g.double()])
    for name, wide, native, o in zip(("y", "dx", "da", "db"), results["fp32"], results["native"],
                                     oracle):
        check_close(name, wide, native, o, dtype)

    ws = [torch.randn(o, 24).to(dtype) / 5 for o in (16, 8)]
    a_s = [a, None]
    b_s = [bb, None]
    outs = {}
    for m in MODES:
        monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", m)
        ys = lora_linear_multi(x, ws, a_s, b_s, [2.0, 1.0])
        outs[m] = grads(ys, [x, a, bb], [torch.ones_like(ys[0]), torch.ones_like(ys[1])])
    for name, wide, native in zip(("y_q", "y_k", "dx", "da", "db"), outs["fp32"], outs["native"]):
        assert wide.dtype == dtype
        torch.testing.assert_close(wide.float(), native.float(), rtol=3e-2, atol=3e-2,
                                   msg=name)


def test_fused_loss_widened_is_no_worse_than_torch_bf16(monkeypatch):
    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", "fp32")
    h = _leaf(torch.randn(37, 24), torch.bfloat16)
    w = _leaf(torch.randn(101, 24) / 5, torch.bfloat16)
    y = torch.randint(0, 101, (37,))
    got = grads([fused_linear_cross_entropy(h, w, y)], [h, w], [torch.tensor(1.0)])
    ref = [h.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    oracle = grads([fused_linear_cross_entropy_ref(*ref, y)], ref, [torch.tensor(1.0).double()])
    th = [h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
    theirs = grads([F.cross_entropy(F.linear(*th).float(), y)], th, [torch.tensor(1.0)])
    for name, a, t, o in zip(("loss", "dh", "dw"), got, theirs, oracle):
        check_close(name, a, t, o, torch.bfloat16)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
