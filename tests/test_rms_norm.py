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
SHAPES = [(1, 7), (3, 5, 123), (37, 576)]


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
