"""Edge cases of the Triton launchers (fastllm/kernels/*.py) that the per-op tests do not reach:
argument layouts and dtypes a launcher used to mishandle. Run under TRITON_INTERPRET=1 on CPU
tensors (tests/conftest.py sets it when there is no GPU); small sizes, each against `<op>_ref`.
"""

import pytest
import torch

import fastllm
from fastllm.ops.adamw import adamw_step
from fastllm.ops.l2norm import l2norm, l2norm_ref
from fastllm.ops.rotary_embedding import rotary_embedding, rotary_embedding_ref

from conftest import backend_device_params


@pytest.mark.parametrize("gather", [False, True], ids=["per-position", "position_ids"])
@pytest.mark.parametrize("layout", ["both-sliced", "cos-sliced"])
def test_rotary_cos_and_sin_with_different_strides(gather, layout):
    # cos and sin are views of different tensors (a slice of a packed cos|sin cache, the other
    # contiguous or sliced from a wider one): each has its own row strides, which the kernel
    # must use; it used to read sin through cos's strides (wrong rows, or an out-of-bounds view).
    torch.manual_seed(0)
    b, s, hq, hk, d = 2, 3, 9, 3, 8  # 9 heads: a full and a partial block of 8
    q = torch.randn(b, s, hq, d)
    k = torch.randn(b, s, hk, d)
    rows = (b, s) if not gather else (11,)  # (B, S, D) per position, or a (positions, D) table
    cos = torch.randn(*rows, 2 * d)[..., :d]
    sin = torch.randn(*rows, 3 * d)[..., :d] if layout == "both-sliced" else torch.randn(*rows, d)
    pos = torch.randint(0, 11, (1, s)) if gather else None
    want = rotary_embedding_ref(q, k, cos, sin, pos)
    with fastllm.use_backend("triton"):
        got = rotary_embedding(q, k, cos, sin, pos)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_adamw_mixed_param_dtypes_refused():
    # The table kernel types every tensor with params[0]'s dtype, so an fp32 param after a bf16
    # one was updated as bf16 bits (and a wider one read out of bounds). The C++ kernels refuse
    # such a call; so must the Triton launcher, before anything changes.
    torch.manual_seed(0)
    shapes = ((33, torch.bfloat16), (17, torch.float32))
    params = [torch.randn(n).to(dt) for n, dt in shapes]
    grads = [torch.randn(n).to(dt) for n, dt in shapes]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    before = [p.clone() for p in params]
    with fastllm.use_backend("triton"), pytest.raises(TypeError, match="share a dtype"):
        adamw_step(params, grads, exp_avgs, exp_avg_sqs, [], [torch.tensor(1.0)] * 2, lr=1e-2,
                   beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for p, p0 in zip(params, before):
        assert torch.equal(p, p0)


def test_l2norm_unsupported_float_dtype_refused():
    # The table has fields for bf16, fp16, fp32 and fp64 only: an fp8 tensor (a floating-point
    # dtype the op's checks let through) added nothing to the norm, a silently wrong result.
    x = torch.randn(17).to(torch.float8_e4m3fn)
    y = torch.randn(5)
    assert l2norm_ref([x, y]) > l2norm_ref([y])  # the fp8 tensor does count
    with fastllm.use_backend("triton"), pytest.raises(TypeError, match="float8"):
        l2norm([x, y])


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_grad_scale_and_clip_coef_make_one_multiplier(backend, device):
    """With both a grad_scale and a clip_coef the Triton master/8-bit kernels multiplied the grad
    by each in fp32, rounding it twice: 1 ulp off the C++ kernel and the reference (one
    multiplier built in double) on ~20% of the moments."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(4096, generator=gen).bfloat16()
    g = torch.randn(4096, generator=gen).bfloat16()
    out = {}
    for chosen in ("ref", backend):
        params, m, v = [p.clone().to(device)], [torch.zeros(4096, device=device)], [
            torch.zeros(4096, device=device)]
        with fastllm.use_backend(chosen):
            fastllm.ops.adamw_master_step(
                params, [g.to(device)], [params[0].float()], m, v, [], [torch.tensor(1.0)],
                lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                grad_scale=torch.tensor(3.0), clip_coef=torch.tensor(0.7))
        out[chosen] = m[0].cpu()
    assert torch.equal(out[backend], out["ref"])
