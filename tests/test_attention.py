"""fastllm.ops.attention (causal, grouped-query, packed documents) on the cpp and ref backends
against attention_ref in fp64 and against what users run otherwise
(F.scaled_dot_product_attention with enable_gqa and the mask transformers builds for packed
rows): the output and the grads of q, k and v, fp32 (1e-5 on the output, 1e-4 on grads) and
bf16/fp16 (at most twice PyTorch's own error against fp64), at odd sizes: one token, more
query positions than the kernel's 128-position block, GQA groups of 1 to 3."""

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm import _lowp
from fastllm.ops.attention import attention, attention_ref, doc_start_from_position_ids

from _model_ops import check_close, count_varlen_calls, grads
from conftest import backend_device_params, gemm_bf16f32

_module = sys.modules["fastllm.ops.attention"]
BACKENDS = [p for p in backend_device_params() if p.values[0] in ("cpp", "ref")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (batch, tokens, query heads, kv heads, head_dim, packed)
CASES = [
    (2, 11, 6, 2, 8, False),
    (2, 11, 6, 2, 8, True),
    (1, 1, 2, 1, 4, False),
    (2, 133, 3, 1, 16, True),  # two query blocks; documents across the block boundary
    (1, 130, 2, 2, 8, False),
]


def _case_id(case):
    b, t, hq, hk, d, packed = case
    return f"{b}x{t}-h{hq}/{hk}-d{d}" + ("-packed" if packed else "")


def _position_ids(b, t, g):
    """Rows of documents of random lengths, positions restarting at 0 at each."""
    rows = []
    for _ in range(b):
        pos, left = [], t
        while left:
            n = int(torch.randint(1, max(2, t // 3) + 1, (1,), generator=g))
            n = min(n, left)
            pos += list(range(n))
            left -= n
        rows.append(pos)
    return torch.tensor(rows)


def _inputs(case, dtype):
    b, t, hq, hk, d, packed = case
    g = torch.Generator().manual_seed(0)
    q = (2 * torch.randn(b, t, hq, d, generator=g)).to(dtype).requires_grad_()
    k = (2 * torch.randn(b, t, hk, d, generator=g)).to(dtype).requires_grad_()
    v = torch.randn(b, t, hk, d, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(b, t, hq, d, generator=g).to(dtype)
    doc_start = doc_start_from_position_ids(_position_ids(b, t, g)) if packed else None
    return q, k, v, dy, doc_start


def _per_document_sdpa(q, k, v, doc_start):
    """Each document of each row through SDPA's causal kernel (flash on a GPU), the key/value
    heads repeated: the flash-accurate peer of packed rows (the mask route of _sdpa leaves a GPU
    only the memory-efficient or math kernels, which round less than flash does)."""
    group = q.shape[2] // k.shape[2]
    rows = []
    for b in range(q.shape[0]):
        idx = torch.arange(q.shape[1], device=q.device)
        starts = (doc_start[b] == idx).nonzero().flatten().tolist() + [q.shape[1]]
        parts = []
        for s, e in zip(starts[:-1], starts[1:]):
            qs, ks, vs = (t[b:b + 1, s:e].transpose(1, 2) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                         .transpose(1, 2))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def _sdpa(q, k, v, doc_start):
    """What a user runs otherwise: SDPA in (B, H, T, D) with the block-diagonal causal mask; on a
    GPU in bf16/fp16, packed rows document by document through flash (what the GPU route of
    `attention`, PyTorch's varlen flash attention, is to be as accurate as)."""
    if q.is_cuda and doc_start is not None and q.dtype in (torch.bfloat16, torch.float16):
        return _per_document_sdpa(q, k, v, doc_start)
    if not q.is_cuda and not _lowp._CPU_FLASH_GQA and k.shape[2] != q.shape[2]:
        # torch < 2.9 runs enable_gqa through its math kernel on the CPU (its flash kernel
        # cannot share key/value heads there), which rounds less than the flash kernel torch
        # >= 2.9 runs and fastllm matches: the heads repeated, the flash kernel is the peer
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    t = q.shape[1]
    i = torch.arange(t, device=q.device)
    mask = i[None, :] <= i[:, None]
    if doc_start is not None:
        mask = (mask[None] & (i[None, None, :] >= doc_start[:, :, None]))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_ref_and_sdpa(backend, device, dtype, case):
    q, k, v, dy, doc_start = _inputs(case, dtype)
    # on a GPU `attention` is PyTorch's SDPA (no kernel of fastllm's own), on the CPU the op
    q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    dy = dy.to(device)
    doc_start = None if doc_start is None else doc_start.to(device)
    with fastllm.use_backend(backend):
        got = grads([attention(q, k, v, doc_start=doc_start)], [q, k, v], [dy])
    wide = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    cpu_start = None if doc_start is None else doc_start.cpu()
    oracle = grads([attention_ref(*wide, doc_start=cpu_start)], wide, [dy.cpu().double()])
    theirs_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    theirs = grads([_sdpa(*theirs_in, doc_start)], theirs_in, [dy])
    for name, a, t, o in zip(("out", "dq", "dk", "dv"), got, theirs, oracle):
        a, t = a.detach().cpu(), t.detach().cpu()
        assert a.dtype == dtype and a.shape == o.shape, name
        if name in ("dq", "dk") and case[1] == 1:
            # one key: the output is v whatever q and k are; dq, dk are 0 (up to the softmax's
            # rounding)
            scale = (dy.double().abs().max() * v.double().abs().max()).cpu().item()
            assert a.double().abs().max().item() <= 4 * torch.finfo(dtype).eps * scale
            continue
        check_close(name, a, t, o, dtype, fp32_rtol=1e-5 if name == "out" else 1e-4)


@pytest.mark.parametrize("bf16_products", ["fastllm", "mkl", False],
                         ids=["bf16-gemm", "bf16-mkl", "fp32-copies"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=_case_id)
def test_cpp_bf16_both_product_paths(bf16_products, case):
    """bf16 on the cpp kernel by each of its ways: S = QK^T and dP = dO V^T of the bf16 inputs
    through the bf16 x bf16 -> fp32 GEMM, on fastllm's kernel (AVX512-BF16 builds; the default
    there, but where PyTorch's bf16 GEMMs run on AMX) and on MKL's (the default on AMX), and of
    fp32 copies (without either): each within twice PyTorch's own error against fp64."""
    q, k, v, dy, doc_start = _inputs(case, torch.bfloat16)
    with gemm_bf16f32(bf16_products), fastllm.use_backend("cpp"):
        got = grads([attention(q, k, v, doc_start=doc_start)], [q, k, v], [dy])
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    oracle = grads([attention_ref(*wide, doc_start=doc_start)], wide, [dy.double()])
    theirs_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    theirs = grads([_sdpa(*theirs_in, doc_start)], theirs_in, [dy])
    for name, a, t, o in zip(("out", "dq", "dk", "dv"), got, theirs, oracle):
        check_close(name, a.detach(), t.detach(), o, torch.bfloat16, None)


@pytest.mark.parametrize("dtype,bf16_products", [(torch.float32, None),
                                                   (torch.bfloat16, "fastllm"),
                                                   (torch.bfloat16, "mkl"),
                                                   (torch.bfloat16, False), (torch.float16, None)],
                         ids=["fp32", "bf16-gemm", "bf16-mkl", "bf16-copies", "fp16"])
def test_cpp_reads_and_writes_any_layout(dtype, bf16_products):
    """The cpp kernel's row copies (plain loops for rows of head_dim contiguous, ATen's copy_ for
    the rest; bf16's S and dP read through the bf16 GEMM, which takes strided rows, or from fp32
    copies, each forced: any can be a CPU's default): q, k, v as (B, H, T, D) tensors seen
    through transposes, and with head_dim strided, give the bits of contiguous inputs, forward
    and every grad; negative views are read as their values; bf16 and fp16 results are the fp32
    ones rounded to nearest even."""
    case = (2, 133, 6, 2, 8, True)
    q, k, v, dy, doc_start = _inputs(case, dtype)
    with gemm_bf16f32(bf16_products), fastllm.use_backend("cpp"):
        want = grads([attention(q, k, v, doc_start=doc_start)], [q, k, v], [dy])
        for how in ("transposed", "strided head_dim"):
            if how == "transposed":  # (B, H, T, D) storage, rows of D contiguous
                bases = [t.detach().transpose(1, 2).contiguous().requires_grad_()
                         for t in (q, k, v)]
                views = [t.transpose(1, 2) for t in bases]
            else:  # every other element of a (.., 2 D) tensor
                bases = [torch.stack([t.detach(), torch.zeros_like(t)], -1).requires_grad_()
                         for t in (q, k, v)]
                views = [t[..., 0] for t in bases]
            assert not views[0].is_contiguous()
            got = grads([attention(*views, doc_start=doc_start)], views, [dy])
            for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, w), (how, name)
        negs = [torch._neg_view(-t.detach()) for t in (q, k, v)]
        assert all(t.is_neg() for t in negs)
        assert torch.equal(attention(*negs, doc_start=doc_start),
                           attention(q.detach(), k.detach(), v.detach(), doc_start=doc_start))
    if dtype != torch.float32:
        # the stores' rounding against torch's: with fp32 products (the bf16 GEMM off) the kernels
        # on bf16 or fp16 inputs are the kernels on their fp32 widening, rounded once at the end
        ext = fastllm._extension.extension()
        ins = [t.detach() for t in (q, k, v)]
        start = doc_start if doc_start is not None else torch.empty(0, dtype=torch.long)
        with gemm_bf16f32(False):
            out, lse = ext.attention_cpu(*ins, start, 0.3)
            out32, lse32 = ext.attention_cpu(*[t.float() for t in ins], start, 0.3)
            assert torch.equal(out, out32.to(dtype)) and torch.equal(lse, lse32)
            low = ext.attention_backward_cpu(dy, *ins, out, lse, start, 0.3)
            wide = ext.attention_backward_cpu(*[t.float() for t in (dy, *ins, out)], lse, start,
                                              0.3)
        for name, a, w in zip(("dq", "dk", "dv"), low, wide):
            assert a.dtype == dtype and torch.equal(a, w.to(dtype)), name


@pytest.mark.parametrize("engine", ["fastllm", "mkl"])
def test_cpp_bf16_scores_follow_the_switch(engine):
    """The bf16 scores really come from the bf16 -> fp32 GEMM when it is on: the logsumexp (fp32,
    from S) differs in its last bits from the fp32 copies' (another order of the sums), and
    agrees to fp32's precision. MKL's engine where it runs on AMX tiles only (elsewhere it may
    sum widened copies as the fp32 GEMM does: the same bits)."""
    if engine == "mkl" and not (fastllm._extension.has_cpp()
                                and fastllm._extension.extension().bf16_gemm_on_amx()):
        pytest.skip("MKL's engine differs from fp32 copies by its AMX sums only")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 40, h, 64, generator=g).bfloat16() for h in (2, 1, 1))
    lse = {}
    for on in (engine, False):
        with gemm_bf16f32(on):
            lse[on] = fastllm._extension.extension().attention_cpu(
                q, k, v, torch.empty(0, dtype=torch.long), 0.125)[1]
    assert not torch.equal(lse[engine], lse[False])
    torch.testing.assert_close(lse[engine], lse[False], rtol=1e-5, atol=1e-5)


def test_scale_and_documents_are_honoured():
    """A document's output depends on its own tokens only, and scale multiplies q k^T."""
    q, k, v, _, _ = _inputs((1, 9, 2, 1, 4, False), torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    ds = doc_start_from_position_ids(pos)
    both = attention(q, k, v, doc_start=ds)
    second = attention(q[:, 4:], k[:, 4:], v[:, 4:])
    torch.testing.assert_close(both[:, 4:], second)
    torch.testing.assert_close(both[:, :4], attention(q[:, :4], k[:, :4], v[:, :4]))
    torch.testing.assert_close(attention(q, k, v, scale=0.3), attention(q * 0.3 * 2, k, v, scale=0.5))


@pytest.mark.parametrize("packed", [False, True])
def test_gpu_path_through_sdpa_matches_ref(packed):
    """Off the CPU `attention` runs F.scaled_dot_product_attention (no GPU kernel of its own):
    the same contract, checked here on CPU tensors through the same function."""
    q, k, v, dy, ds = _inputs((2, 19, 6, 3, 8, packed), torch.float64)
    got = grads([_module._sdpa_attention(q, k, v, 0.3, ds)], [q, k, v], [dy])
    want = grads([attention_ref(q, k, v, scale=0.3, doc_start=ds)], [q, k, v], [dy])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_fewer_tasks_than_threads_split_the_query_blocks(packed):
    """One row and one kv head (fewer tasks than the kernel's 16 parts): the cpp kernel splits
    the task's 3 query blocks into parts (dK, dV summed per part afterwards); same results as
    the reference, and the same bits on every call."""
    if fastllm._backend.unavailable_reason("cpp", "cpu"):
        pytest.skip("no cpp backend")
    q, k, v, dy, ds = _inputs((1, 300, 2, 1, 8, packed), torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with fastllm.use_backend("cpp"):
            got = grads([attention(q, k, v, doc_start=ds)], [q, k, v], [dy])
            again = grads([attention(q, k, v, doc_start=ds)], [q, k, v], [dy])
    finally:
        torch.set_num_threads(threads)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    oracle = grads([attention_ref(*wide, doc_start=ds)], wide, [dy.double()])
    for name, a, b, o in zip(("out", "dq", "dk", "dv"), got, again, oracle):
        assert torch.equal(a, b), name
        check_close(name, a.detach(), None, o, torch.float32, 1e-5 if name == "out" else 1e-4)


def test_threads_keep_the_callers_mode():
    """The kernel's worker threads write tensors the caller made: under inference_mode those are
    inference tensors (several tasks, so every thread of the pool takes some)."""
    q, k, v, _, ds = _inputs((4, 9, 4, 2, 8, True), torch.float32)
    want = attention_ref(q, k, v, doc_start=ds)
    with torch.inference_mode():
        got = attention(q, k, v, doc_start=ds)
    torch.testing.assert_close(got, want)


def test_empty_and_one_token_shapes():
    pos = torch.zeros(3, 1, dtype=torch.int64)
    assert doc_start_from_position_ids(pos).tolist() == [[0]] * 3
    assert doc_start_from_position_ids(torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0)
    for b, t in ((0, 5), (2, 0)):
        q, k, v = torch.randn(b, t, 4, 8), torch.randn(b, t, 2, 8), torch.randn(b, t, 2, 8)
        assert attention(q, k, v).shape == (b, t, 4, 8)
    ds = doc_start_from_position_ids(torch.tensor([[0, 1, 0, 1]])).expand(2, 4)  # not contiguous
    q, k, v = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    torch.testing.assert_close(attention(q, k, v, doc_start=ds),
                               attention_ref(q, k, v, doc_start=ds.contiguous()))


def test_doc_start_follows_transformers():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
                        [5, 6, 7, 0, 1, 2, 3, 9, 10, 11]])
    ds = doc_start_from_position_ids(pos)
    assert ds.tolist()[0] == [0, 0, 0, 3, 3, 5, 6, 6, 6, 6]
    assert ds.tolist()[1] == [0] * 10
    seq = masking_utils.find_packed_sequence_indices(pos)  # one id per document
    same_doc = seq[:, :, None] == seq[:, None, :]
    t = torch.arange(10)
    ours = (t[None, None, :] >= ds[:, :, None]) & (t[None, :] <= t[:, None])
    assert torch.equal(ours, same_doc & (t[None, :] <= t[:, None]))


def test_backward_keeps_no_scores():
    q, k, v, _, _ = _inputs((1, 64, 2, 1, 8, False), torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attention(q, k, v)
    assert saved and max(t.numel() for t in saved) <= q.numel()  # q, k, v, out, lse: no T x T


def test_bad_input_is_refused():
    q, k, v, _, _ = _inputs((1, 5, 4, 2, 8, False), torch.float32)
    with pytest.raises(TypeError, match="k has dtype"):
        attention(q, k.double(), v)
    with pytest.raises(ValueError, match="not a multiple"):
        attention(q, k[:, :, :1].expand(1, 5, 3, 8), v[:, :, :1].expand(1, 5, 3, 8))
    with pytest.raises(ValueError, match="batch, tokens, heads"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match=r"doc_start must be \(1, 5\) int64"):
        attention(q, k, v, doc_start=torch.zeros(1, 4, dtype=torch.int64))
    for backend in ("ref", "cpp"):
        if fastllm._backend.unavailable_reason(backend, "cpu"):
            continue
        with fastllm.use_backend(backend), pytest.raises(ValueError, match="document start"):
            attention(q, k, v, doc_start=torch.tensor([[0, 0, 3, 1, 1]]))
    with pytest.raises(ValueError, match="head_dim must be positive"):
        attention(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(ValueError, match="finite"):
        attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="FASTLLM_CPU_ATTENTION"), pytest.MonkeyPatch.context() as m:
        m.setenv("FASTLLM_CPU_ATTENTION", "fastest")
        _module._mode()


def test_auto_policy_by_route_dtype_and_packing(monkeypatch):
    """FASTLLM_CPU_ATTENTION=auto: plain rows on the routed CPUs (oneDNN, AVX2), bf16 past 2048
    tokens only where it is widened to fp32; packed rows on every CPU at any length. The plan
    reads whether rows are packed whatever the model's dtype decides for plain rows (a bf16
    model's packed rows of 4096 tokens on a native-bf16 CPU went to the dense mask)."""
    from fastllm._attention_plan import attention_plan

    if not _module.cpu_attention_available():
        pytest.skip("fastllm._C has no CPU attention kernel")
    monkeypatch.delenv(_module.ENV, raising=False)
    bf16, long = torch.bfloat16, _module.AUTO_MAX_LOWP_TOKENS + 1
    for route, plain in (("onednn", True), ("avx2", True), ("aten", False)):
        monkeypatch.setattr(_module._gemm, "route", lambda r=route: r)
        assert _module.cpu_attention_enabled() is plain
        assert _module.worth_it(4 * long, torch.float32) is plain
        assert _module.worth_it(4 * long, bf16, packed=True)
        for widened in (False, True):
            monkeypatch.setattr(_module._lowp, "widens", lambda device, dtype, w=widened: w)
            assert _module.worth_it(long - 1, bf16) is plain
            assert _module.worth_it(long, bf16) is (plain and widened)
    config = type("Config", (), {"_attn_implementation": "sdpa"})()
    model = type("Model", (), {"config": config, "dtype": bf16})()  # what the plan reads
    monkeypatch.setattr(_module._gemm, "route", lambda: "onednn")  # and native bf16 (not widened)
    monkeypatch.setattr(_module._lowp, "widens", lambda device, dtype: False)
    inputs = torch.zeros(1, long, 0, dtype=bf16)
    assert attention_plan(model, inputs, None, torch.arange(long)[None], None) is None
    plan = attention_plan(model, inputs, None, (torch.arange(long) % 1000)[None], None)
    assert plan is not None and plan.packed
    monkeypatch.setenv(_module.ENV, "torch")
    assert not _module.worth_it(8, torch.float32, packed=True)
    monkeypatch.delenv(_module.ENV)
    with fastllm.use_backend("triton"):  # the GPU's path: PyTorch's attention, not a failure
        assert not _module.worth_it(8, torch.float32, packed=True)
    with fastllm.use_backend("ref"):
        assert _module.worth_it(8, torch.float32, packed=True)
    monkeypatch.setenv(_module.ENV, "fastllm")
    monkeypatch.setattr(_module._gemm, "route", lambda: "aten")
    assert _module.worth_it(4 * long, bf16)


def test_opcheck_and_compile():
    q, k, v, dy, ds = _inputs((1, 7, 4, 2, 8, True), torch.float32)
    torch.library.opcheck(torch.ops.fastllm.attention.default, (q, k, v, ds, 0.25))
    torch.library.opcheck(torch.ops.fastllm.attention.default, (q, k, v, None, 0.25))
    out, lse = torch.ops.fastllm.attention(q, k, v, ds, 0.25)
    torch.library.opcheck(torch.ops.fastllm.attention_backward.default,
                          (dy, q.detach(), k.detach(), v.detach(), out.detach(), lse, ds, 0.25))
    fn = torch.compile(lambda a, b, c: attention(a, b, c, doc_start=ds).sum(), fullgraph=True,
                       backend="aot_eager")
    torch.testing.assert_close(fn(q, k, v), attention(q, k, v, doc_start=ds).sum())
    fn(q, k, v).backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_compile_with_symbolic_sizes_and_scale():
    """dynamic=True: the default scale (head_dim ** -0.5) and a module's float scale are symbolic
    while traced; the op checks them when it runs (a non-finite one is still refused)."""
    q, k, v, _, _ = _inputs((1, 7, 4, 2, 8, False), torch.float32)

    class Attn(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, a, b, c):
            return attention(a, b, c, scale=self.scale)

    for scale in (None, 0.5):
        torch._dynamo.reset()
        fn = torch.compile(Attn(scale), fullgraph=True, dynamic=True, backend="aot_eager")
        for t in (7, 5):  # a second size: the same graph
            a, b, c = (x[:, :t] for x in (q, k, v))
            torch.testing.assert_close(fn(a, b, c), attention(a, b, c, scale=scale))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="scale must be finite"):
        torch.compile(Attn(float("inf")), fullgraph=True, backend="aot_eager")(q, k, v)


# --- the GPU's varlen route (PyTorch's variable-length flash attention for packed documents) ---

def test_document_segments():
    ds = torch.tensor([[0, 0, 0, 3, 3], [0, 1, 1, 1, 1]])
    seg = _module.document_segments(ds)
    assert seg.cu_seqlens.dtype == torch.int32
    assert seg.cu_seqlens.tolist() == [0, 3, 5, 6, 10] and seg.max_len == 4
    g = torch.Generator().manual_seed(3)
    ds = doc_start_from_position_ids(_position_ids(3, 40, g))
    seg = _module.document_segments(ds)
    # every token's document start, rebuilt from the segments, is doc_start
    flat = torch.zeros(3 * 40, dtype=torch.int64)
    for a, b in zip(seg.cu_seqlens[:-1].tolist(), seg.cu_seqlens[1:].tolist()):
        flat[a:b] = a % 40
    assert torch.equal(flat.view(3, 40), ds)
    assert seg.max_len == int(torch.diff(seg.cu_seqlens).max())


def _stand_in(calls, new_signature=True):
    """A CPU stand-in for torch.nn.attention.varlen.varlen_attn (CUDA only): each document of the
    flat (N, H, D) tokens through attention_ref, after checking what a caller must pass."""
    def run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, enable_gqa):
        assert causal and cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32
        assert max_q == max_k == int(torch.diff(cu_seq_q).max())
        assert enable_gqa == (query.shape[1] != key.shape[1])
        calls.append(1)
        out = torch.empty_like(query)
        cu = cu_seq_q.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            out[a:b] = attention_ref(query[None, a:b], key[None, a:b], value[None, a:b],
                                     scale=scale)[0]
        return out

    if new_signature:  # torch >= 2.11
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        scale=None, window_size=(-1, -1), enable_gqa=False):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                       tuple(window_size) == (-1, 0), scale, enable_gqa)
    else:  # torch 2.10: is_causal, no scale, no enable_gqa
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                        return_aux=None):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None,
                       False)
    return varlen_attn


@pytest.mark.parametrize("new_signature", [True, False], ids=["torch2.11+", "torch2.10"])
def test_varlen_route_plumbing(new_signature, monkeypatch):
    """_varlen_attention's flattening, segments and keyword arguments, on the CPU through a
    stand-in kernel, against attention_ref with doc_start (grads included)."""
    calls = []
    fn = _stand_in(calls, new_signature)
    monkeypatch.setattr(_module, "_varlen_kernel",
                        lambda: (fn, frozenset(__import__("inspect").signature(fn).parameters)))
    hq, hk = (6, 2) if new_signature else (4, 4)
    scale = 0.3 if new_signature else 8 ** -0.5
    q, k, v, dy, ds = _inputs((2, 19, hq, hk, 8, True), torch.float64)
    for segments in (None, _module.document_segments(ds)):
        got = grads([_module._varlen_attention(q, k, v, scale, ds, segments)], [q, k, v], [dy])
        want = grads([attention_ref(q, k, v, scale=scale, doc_start=ds)], [q, k, v], [dy])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert len(calls) == 2


def test_varlen_refusal_falls_back_once(monkeypatch):
    """A varlen_attn that raises on its argument checks: one warning, then SDPA for that
    (device, dtype, head_dim, grouping) without trying again."""
    def refuses(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    monkeypatch.setattr(_module, "_varlen_kernel",
                        lambda: (refuses, frozenset(["scale", "window_size", "enable_gqa"])))
    monkeypatch.setattr(_module, "_VARLEN_FAILED", set())
    q, k, v, _, ds = _inputs((1, 9, 2, 1, 8, True), torch.float32)
    with pytest.warns(RuntimeWarning, match="varlen attention refused"):
        assert _module._varlen_attention(q, k, v, 0.5, ds, None) is None
    assert _module._varlen_key(q, k) in _module._VARLEN_FAILED


def test_partial_documents_stay_off_varlen(monkeypatch):
    """A doc_start that is not whole documents (a sliding window's max(0, t - 2), which the op
    takes) has no varlen form: document_segments says None and the GPU route falls back to SDPA
    with its mask, quietly, without marking varlen as refused."""
    t = torch.arange(6)
    window = (t - 2).clamp_min(0)[None]
    assert _module.document_segments(window) is None
    assert _module.document_segments(torch.tensor([[1, 1, 2]])) is None  # token 0 starts none
    assert _module.document_segments(torch.zeros(2, 0, dtype=torch.int64)).max_len == 0
    calls = []
    monkeypatch.setattr(_module, "_varlen_kernel",
                        lambda: (_stand_in(calls), frozenset(["scale", "window_size"])))
    monkeypatch.setattr(_module, "_VARLEN_FAILED", set())
    q, k, v, _, _ = _inputs((1, 6, 2, 2, 8, False), torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _module._varlen_attention(q, k, v, 0.5, window, None) is None
    assert not calls and not _module._VARLEN_FAILED
    torch.testing.assert_close(_module._sdpa_attention(q, k, v, 0.5, window),
                               attention_ref(q, k, v, scale=0.5, doc_start=window))


def test_varlen_applies_only_where_it_can(monkeypatch):
    q = torch.empty(1, 4, 2, 8, dtype=torch.bfloat16)
    assert not _module.gpu_varlen_applies(q, q)  # a CPU tensor
    # the SDPA route with a mask repeats grouped key/value heads (with enable_gqa a GPU would
    # have only the math kernel), and gives the op's result
    qq, kk, vv, dy, ds = _inputs((2, 19, 6, 2, 8, True), torch.float64)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((a[1].shape[1], kw["enable_gqa"]))
                        or real(*a, **kw))
    torch.testing.assert_close(_module._sdpa_attention(qq, kk, vv, 0.3, ds),
                               attention_ref(qq, kk, vv, scale=0.3, doc_start=ds))
    assert calls == [(6, False)]
    monkeypatch.undo()
    if torch.cuda.is_available():
        qc = q.cuda()
        monkeypatch.setenv("FASTLLM_GPU_ATTENTION", "sdpa")
        assert not _module.gpu_varlen_applies(qc, qc)
        monkeypatch.setenv("FASTLLM_GPU_ATTENTION", "auto")
        assert not _module.gpu_varlen_applies(qc.float(), qc.float())  # flash: bf16/fp16 only
        monkeypatch.setenv("FASTLLM_GPU_ATTENTION", "varlen")
        with pytest.raises(ValueError, match="FASTLLM_GPU_ATTENTION='varlen' is not one of"):
            _module.gpu_varlen_applies(qc, qc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_packed_documents_through_varlen(dtype, monkeypatch):
    """On a GPU with torch.nn.attention.varlen: packed documents run PyTorch's varlen flash
    attention (checked by counting its calls), as accurate as SDPA with the document mask
    (output and grads at most twice SDPA's error against fp64)."""
    if _module._varlen_kernel() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    calls = count_varlen_calls(monkeypatch, _module)
    q, k, v, dy, ds = _inputs((3, 200, 9, 3, 64, True), dtype)
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    got = grads([attention(q, k, v, doc_start=ds.cuda())], [q, k, v], [dy.cuda()])
    assert calls, "the varlen route was not taken"
    wide = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    oracle = grads([attention_ref(*wide, doc_start=ds)], wide, [dy.double()])
    theirs_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    theirs = grads([_sdpa(*theirs_in, ds.cuda())], theirs_in, [dy.cuda()])
    for name, a, t, o in zip(("out", "dq", "dk", "dv"), got, theirs, oracle):
        check_close(name, a.detach().cpu(), t.detach().cpu(), o, dtype)
