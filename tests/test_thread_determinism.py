"""The cpp backend's model ops do not depend on the thread count: forward and backward run with
torch.set_num_threads(1), (2) and (3) (oversubscribed on a 2-core machine, which is fine) give
the same bits. Reductions across rows (rms_norm's dweight, attention's dK/dV) are where a split
that follows the thread count would change the order of the sums; the elementwise ops are here
so that a future split of theirs is held to the same rule."""

import pytest
import torch

import fastllm
from fastllm.ops.attention import attention
from fastllm.ops.l2norm import l2norm
from fastllm.ops.rms_norm import rms_norm
from fastllm.ops.rotary_embedding import rotary_embedding
from fastllm.ops.swiglu import swiglu

from _model_ops import grads
from conftest import gemm_bf16f32

pytestmark = pytest.mark.skipif(bool(fastllm._backend.unavailable_reason("cpp", "cpu")),
                                reason="no cpp backend")

THREADS = (1, 2, 3)

# Not here: fused_linear_cross_entropy and lora_linear. Their own splits (chunks, the order dW
# and db are accumulated in) follow the sizes, but they multiply through torch's fp32 GEMM
# (at::mm, MKL's sgemm here), whose threads split the inner dimension of small-output products:
# a (8 x 101) @ (101 x 19) product differs between 2 and 3 threads, even under
# MKL_CBWR=AUTO,STRICT (measured, torch 2.13, AMD EPYC), as the model's own nn.Linear does.
DTYPES = [torch.float32, torch.bfloat16]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _at_each_thread_count(run):
    """[run() under each of THREADS]; the caller's thread count restored afterwards."""
    before = torch.get_num_threads()
    results = []
    try:
        for n in THREADS:
            torch.set_num_threads(n)
            torch.manual_seed(0)
            with fastllm.use_backend("cpp"):
                results.append([t.detach().clone() for t in run()])
    finally:
        torch.set_num_threads(before)
    return results


def _assert_same_bits(results, names):
    first = results[0]
    for n, other in zip(THREADS[1:], results[1:]):
        for name, a, b in zip(names, first, other):
            assert torch.equal(a, b), (f"{name}: {THREADS[0]} vs {n} threads differ by "
                                       f"{(a.double() - b.double()).abs().max().item():.3g}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(37, 123), (133, 57)])
def test_rms_norm(dtype, rows, h):
    x = torch.randn(rows, h).to(dtype)
    w = (1 + 0.1 * torch.randn(h)).to(dtype)
    dy = torch.randn(rows, h).to(dtype)

    def run():
        xl, wl = _leaves(x, w)
        return grads([rms_norm(xl, wl, 1e-6)], [xl, wl], [dy])

    _assert_same_bits(_at_each_thread_count(run), ("y", "dx", "dweight"))


# bf16's S and dP: the bf16 GEMM on fastllm's kernel and on MKL's, and fp32 copies, each forced
# (any can be a CPU's default: csrc/cpu/attention.cpp, bf16_products)
@pytest.mark.parametrize("dtype,bf16_products", [(torch.float32, None),
                                                 (torch.bfloat16, "fastllm"),
                                                 (torch.bfloat16, "mkl"), (torch.bfloat16, False)],
                         ids=["fp32", "bf16-gemm", "bf16-mkl", "bf16-copies"])
@pytest.mark.parametrize("b,t,hq,hkv,packed", [(1, 300, 2, 1, False), (1, 300, 3, 1, True),
                                               (2, 261, 6, 3, False), (1, 100, 3, 1, False),
                                               (17, 130, 2, 1, True),
                                               # one task of one part: on the calling thread
                                               (1, 64, 64, 1, False)])
def test_attention(dtype, bf16_products, b, t, hq, hkv, packed):
    d = 8
    q = torch.randn(b, t, hq, d).to(dtype)
    k = torch.randn(b, t, hkv, d).to(dtype)
    v = torch.randn(b, t, hkv, d).to(dtype)
    dy = torch.randn(b, t, hq, d).to(dtype)
    doc_start = None
    if packed:  # documents of 100 tokens: block boundaries and document starts disagree
        pos = torch.arange(t)
        doc_start = (pos - pos % 100).expand(b, t).contiguous()

    def run():
        ql, kl, vl = _leaves(q, k, v)
        return grads([attention(ql, kl, vl, doc_start=doc_start)], [ql, kl, vl], [dy])

    with gemm_bf16f32(bf16_products):
        results = _at_each_thread_count(run)
    _assert_same_bits(results, ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops(dtype):
    gate, up, dy = (torch.randn(37, 1031).to(dtype) for _ in range(3))
    q, k = torch.randn(3, 67, 5, 16).to(dtype), torch.randn(3, 67, 1, 16).to(dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    angle = torch.randn(3, 67, 16)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    tensors = [torch.randn(s).to(dtype) for s in ((123, 45), (70001,), (7,))]

    def run():
        gl, ul, ql, kl = _leaves(gate, up, q, k)
        out = grads([swiglu(gl, ul)], [gl, ul], [dy])
        out += grads(list(rotary_embedding(ql, kl, cos, sin)), [ql, kl], [gq, gk])
        return out + [l2norm(tensors)]

    _assert_same_bits(_at_each_thread_count(run),
                      ("swiglu", "dgate", "dup", "q", "k", "dq", "dk", "l2norm"))
