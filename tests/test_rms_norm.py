"""fastllm.ops.rms_norm on every backend against rms_norm_ref (fp64) and Hugging Face's
LlamaRMSNorm / GemmaRMSNorm: the output and both gradients, odd sizes, fp32/bf16/fp16."""

import pytest
import torch

import fastllm
from fastllm.ops.rms_norm import RMSNorm, rms_norm, rms_norm_ref

from _model_ops import check_close, grads
from conftest import backend_device_params

BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(7,), (1, 7), (3, 5, 123), (37, 576)]


def _hf_norm(h, eps, offset, weight):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = GemmaRMSNorm(h, eps=eps) if offset else LlamaRMSNorm(h, eps=eps)
    m = m.to(weight.device, weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_ref_and_hf(backend, device, dtype, shape, offset):
    if backend == "triton" and shape[-1] > 200 and dtype != torch.float32:
        pytest.skip("interpreter time: one large case per backend is enough")
    h, eps = shape[-1], 1e-6
    x = torch.randn(*shape, device=device).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_()
    g = torch.randn(*shape, device=device).to(dtype)
    x0, w0 = x.detach().clone(), w.detach().clone()
    with fastllm.use_backend(backend):
        got = grads([rms_norm(x, w, eps, offset)], [x, w], [g])
    assert torch.equal(x.detach(), x0) and torch.equal(w.detach(), w0)
    assert got[0].dtype == dtype and got[0].shape == x.shape
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    oracle = grads([rms_norm_ref(xd, wd, eps, offset)], [xd, wd], [g.double()])
    hf = _hf_norm(h, eps, offset, w.detach())
    xh = x.detach().clone().requires_grad_()
    theirs = grads([hf(xh)], [xh, hf.weight], [g])
    for name, a, t, o in zip(("y", "dx", "dweight"), got, theirs, oracle):
        check_close(name, a, t, o, dtype, fp32_rtol=1e-5 if name == "y" else 1e-4)


@pytest.mark.parametrize("backend", ["cpp", "triton", "ref"])
def test_zero_rows_and_one_grad(backend):
    if fastllm._backend.unavailable_reason(backend, "cpu"):
        pytest.skip(fastllm._backend.unavailable_reason(backend, "cpu"))
    w = torch.ones(9, requires_grad=True)
    x = torch.randn(0, 9, requires_grad=True)
    with fastllm.use_backend(backend):
        y = rms_norm(x, w)
        y.sum().backward()
        assert y.shape == (0, 9) and torch.equal(w.grad, torch.zeros(9))
        x = torch.randn(4, 9)  # only the weight's gradient wanted
        w.grad = None
        rms_norm(x, w).sum().backward()
    assert w.grad is not None and x.grad is None


@pytest.mark.parametrize("backend", ["cpp", "ref"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fp64_gradients_are_fp64_accurate(backend, offset):
    """fp64 is computed in fp64, its backward too (rstd kept in fp64): gradcheck at tolerances
    an fp32 rstd (relative error ~1e-8) cannot meet."""
    if fastllm._backend.unavailable_reason(backend, "cpu"):
        pytest.skip(fastllm._backend.unavailable_reason(backend, "cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 11, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.randn(11, dtype=torch.float64, generator=gen).requires_grad_()
    with fastllm.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6, offset), (x, w),
                                        atol=1e-9, rtol=1e-7)


def test_module_is_a_drop_in_for_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf, ours = LlamaRMSNorm(64, eps=1e-5), RMSNorm(64, eps=1e-5)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case,error,match", [
    (dict(w=torch.ones(8, dtype=torch.float64)), TypeError, "weight has dtype"),
    (dict(w=torch.ones(7)), ValueError, "weight"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(offset=0.5), ValueError, "offset"),
    (dict(x=torch.ones(2, 8, dtype=torch.int32), w=torch.ones(8, dtype=torch.int32)), TypeError,
     "not supported"),
])
def test_bad_input_is_refused(case, error, match):
    x = case.get("x", torch.randn(2, 8))
    with pytest.raises(error, match=match):
        torch.ops.fastllm.rms_norm(x, case.get("w", torch.ones(8)), case.get("eps", 1e-6),
                                   case.get("offset", 0.0))


def test_opcheck_and_compile():
    x = torch.randn(5, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    torch.library.opcheck(torch.ops.fastllm.rms_norm.default, (x, w, 1e-6, 0.0))
    torch.library.opcheck(torch.ops.fastllm.rms_norm_backward.default,
                          (torch.randn(5, 33), x.detach(), w.detach(), torch.rand(5) + 0.5, 1.0,
                           [True, True]))
    compiled = torch.compile(lambda x, w: rms_norm(x, w, 1e-6).sum(), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), rms_norm(x, w, 1e-6).sum())
    compiled(x, w).backward()
    assert x.grad is not None and w.grad is not None


def _triton_kernels():
    if fastllm._backend.unavailable_reason("triton", "cpu"):
        pytest.skip(fastllm._backend.unavailable_reason("triton", "cpu"))
    import fastllm.kernels.rms_norm as kernels

    return kernels


def _ref_grads(x, w, dy, eps, offset):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    return grads([rms_norm_ref(xd, wd, eps, offset)], [xd, wd], [dy.double()])


@pytest.mark.parametrize("need_dx,need_w", [(True, True), (False, True), (True, False)])
def test_triton_backward_strides_over_tiles(monkeypatch, need_dx, need_w):
    """37 rows in tiles of 4 on the interpreter's 2 programs: 10 tiles, 5 per program, the last
    one partly masked; dweight from the partials by the finishing kernel, the same bits on every
    call."""
    kernels = _triton_kernels()
    h = 40
    monkeypatch.setattr(kernels, "_BWD_TILE", 4 * 64)
    assert kernels._tile(h, kernels._BWD_TILE)[0] == 4
    assert kernels._programs(torch.device("cpu"), 10) == 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, h, generator=gen)
    w = 1 + 0.1 * torch.randn(h, generator=gen)
    dy = torch.randn(37, h, generator=gen)
    x0, dy0, w0 = x.clone(), dy.clone(), w.clone()
    _, rstd = kernels.rms_norm_fwd_triton(x, w, 1e-6, 1.0)
    dx, dw = kernels.rms_norm_bwd_triton(dy, x, w, rstd, 1.0, need_dx, need_w)
    _, ref_dx, ref_dw = _ref_grads(x, w, dy, 1e-6, 1.0)
    assert (dx is None) != need_dx and (dw is None) != need_w
    if need_dx:
        torch.testing.assert_close(dx, ref_dx.float(), rtol=1e-5, atol=1e-5)
    if need_w:
        torch.testing.assert_close(dw, ref_dw.float(), rtol=1e-5, atol=1e-5)
        again = kernels.rms_norm_bwd_triton(dy, x, w, rstd, 1.0, need_dx, need_w)[1]
        assert torch.equal(dw.view(torch.int32), again.view(torch.int32))
    assert torch.equal(x, x0) and torch.equal(dy, dy0) and torch.equal(w, w0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_take_any_rank(dtype):
    """(2, 3, 5, h) x straight into the launchers: y and dx of x's shape, rstd of x.shape[:-1],
    rstd handed back in that shape."""
    kernels = _triton_kernels()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 24, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(24, generator=gen)).to(dtype)
    dy = torch.randn(2, 3, 5, 24, generator=gen).to(dtype)
    y, rstd = kernels.rms_norm_fwd_triton(x, w, 1e-5, 0.0)
    assert y.shape == x.shape and y.dtype == dtype
    assert rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32
    dx, dw = kernels.rms_norm_bwd_triton(dy, x, w, rstd, 0.0, True, True)
    assert dx.shape == x.shape and dx.dtype == dtype and dw.shape == (24,) and dw.dtype == dtype
    xd = x.double()
    want_rstd = torch.rsqrt(xd.square().mean(-1) + 1e-5)
    torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-6, atol=0)
    oracle = _ref_grads(x, w, dy, 1e-5, 0.0)
    with torch.no_grad():
        theirs = [rms_norm_ref(x, w, 1e-5, 0.0)]
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    theirs += grads([rms_norm_ref(xl, wl, 1e-5, 0.0)], [xl, wl], [dy])[1:]
    for name, a, t, o in zip(("y", "dx", "dweight"), (y, dx, dw), theirs, oracle):
        check_close(name, a, t, o, dtype, fp32_rtol=1e-5 if name == "y" else 1e-4)


def test_triton_kernels_empty_shapes():
    """No rows: dweight zeros; rows of h = 0: rstd nan (1 / sqrt(0 / 0 + eps)), empty grads."""
    kernels = _triton_kernels()
    x, w = torch.randn(0, 3, 8), torch.randn(8)
    y, rstd = kernels.rms_norm_fwd_triton(x, w, 1e-6, 0.0)
    assert y.shape == x.shape and rstd.shape == (0, 3)
    dx, dw = kernels.rms_norm_bwd_triton(torch.randn(0, 3, 8), x, w, rstd, 0.0, True, True)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros(8))
    x, w = torch.randn(4, 0), torch.randn(0)
    y, rstd = kernels.rms_norm_fwd_triton(x, w, 1e-6, 0.0)
    assert y.shape == (4, 0) and rstd.shape == (4,) and rstd.isnan().all()
    dx, dw = kernels.rms_norm_bwd_triton(torch.randn(4, 0), x, w, rstd, 0.0, True, True)
    assert dx.shape == (4, 0) and dw.shape == (0,)


def test_triton_dweight_finish_adds_partials_in_a_fixed_order():
    """The finishing kernel over 300 partials of 70 columns (3 iterations of 128 slots, 3
    column programs, both partly masked): their sum within fp32 rounding (bf16: within one bf16
    step of the fp32 sum rounded once), the same bits on every call."""
    kernels = _triton_kernels()
    gen = torch.Generator().manual_seed(2)
    partial = torch.randn(300, 70, generator=gen)
    want = partial.double().sum(0)
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for _ in range(2):
            out = torch.empty(70, dtype=dtype)
            kernels._rms_norm_dw_kernel[(triton_cdiv(70, kernels._DW_COLUMNS),)](
                partial, out, 300, 70, SLOTS=kernels._DW_SLOTS, BLOCK_C=kernels._DW_COLUMNS,
                H_DIVISOR=kernels._divisor(70))
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        if dtype == torch.float32:
            torch.testing.assert_close(outs[0].double(), want, rtol=1e-5, atol=1e-5)
        else:
            rounded = want.float().to(dtype).float()
            torch.testing.assert_close(outs[0].float(), rounded, rtol=2 ** -7,
                                       atol=2 ** -7 * float(rounded.abs().max()))


def triton_cdiv(a, b):
    return -(-a // b)
