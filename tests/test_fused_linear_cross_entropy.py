"""fastllm.ops.fused_linear_cross_entropy against its oracle (logits materialised, autograd) and
against what users run otherwise (F.cross_entropy over `F.linear(...).float()`, Hugging Face's
loss), on every backend: loss and every grad, fp32 (1e-5 relative on the loss, 1e-4 on grads)
and bf16 (the op's error against fp64 at most twice PyTorch's own bf16 error). Small chunks
(CHUNK_BYTES lowered) run the multi-chunk paths at small sizes.
"""

import socket
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm.ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)

from conftest import backend_device_params, gemm_bf16f32
from fastllm.bench.harness import allocator_peak_bytes

_op_module = sys.modules["fastllm.ops.fused_linear_cross_entropy"]

# on a GPU also (triton, cuda) and (ref, cuda): the torch GEMMs, the CUDA chunking and the fp32 dW
# accumulation that only run there
BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]

# (leading shape, H, V, options): odd sizes; V=300 with 2-row chunks runs many chunks and a last
# short one, and the cpp kernel's bf16 dW over several chunks (by the bf16 -> fp32 GEMM where
# fastllm._C has it, else the residual path; test_cpp_bf16_many_tiles runs both, and V past the
# residual path's 2048-row tile).
CASES = [
    ((3, 7), 24, 37, dict()),
    ((21,), 24, 300, dict(bias=True, label_smoothing=0.1)),
    ((2, 9), 16, 130, dict(z_loss=1e-2, logit_softcap=5.0, ignore=True)),
    ((1,), 24, 37, dict(label_smoothing=0.2, z_loss=1e-3, bias=True)),
]


def _case_id(case):
    lead, h, v, opts = case
    return "x".join(map(str, lead)) + f"-H{h}-V{v}" + "".join(f"-{k}" for k in opts)


def _inputs(lead, h, v, opts, dtype, ignore_all=False, device="cpu"):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*lead, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(device, dtype).requires_grad_()
    bias = (torch.randn(v, generator=g).to(device, dtype).requires_grad_() if opts.get("bias")
            else None)
    labels = torch.randint(0, v, lead, generator=g).to(device)
    if opts.get("ignore"):
        labels[..., ::3] = -100
    if ignore_all:
        labels.fill_(-100)
    kwargs = {k: opts[k] for k in ("label_smoothing", "z_loss", "logit_softcap") if k in opts}
    return hidden, weight, bias, labels, kwargs


def _loss_and_grads(fn, hidden, weight, bias, labels, reduction, kwargs, seed_grad=None):
    loss = fn(hidden, weight, labels, bias=bias, reduction=reduction, **kwargs)
    wanted = [t for t in (hidden, weight, bias) if t is not None]
    out = loss if seed_grad is None else (loss * seed_grad).sum()
    return [loss.detach()] + [g.detach() for g in torch.autograd.grad(out, wanted)]


def _as(dtype, tensors):
    return [None if t is None else t.detach().to(dtype).requires_grad_(t.is_floating_point())
            if t.is_floating_point() else t for t in tensors]


def _check(name, got, torch_lp, oracle, dtype, rel):
    oracle = oracle.double()
    scale = oracle.abs().max().item() + 1e-30
    err = (got.double() - oracle).abs().max().item()
    if not torch.isfinite(oracle).all():
        assert torch.equal(got.isnan(), oracle.isnan()), name
        return
    if dtype == torch.float32:
        assert err <= rel * scale, f"{name}: fp32 error {err:.3g} vs scale {scale:.3g}"
    else:
        torch_err = (torch_lp.double() - oracle).abs().max().item()
        bound = 2.0 * torch_err + 1e-3 * torch.finfo(dtype).eps * scale
        assert err <= bound, f"{name}: error {err:.3g} > 2 x PyTorch's {torch_err:.3g}"


@pytest.fixture
def small_chunks(monkeypatch):
    # 2 rows of fp32 logits at V=300 per chunk: every case runs several chunks
    monkeypatch.setattr(_op_module, "CHUNK_BYTES", 2 * 300 * 4)
    monkeypatch.setattr(_op_module, "CPU_MIN_CHUNK_ROWS", 1)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_ref(backend, device, dtype, case, reduction, small_chunks):
    # "sum" differs from "mean" by one scale factor; the interpreter is slow: keep it to 3 cases
    if reduction == "sum" and dtype != torch.float32:
        pytest.skip("sum: fp32 only")
    if backend == "triton" and (reduction == "sum" or case is CASES[1]):
        pytest.skip("interpreter time")
    lead, h, v, opts = case
    hidden, weight, bias, labels, kwargs = _inputs(lead, h, v, opts, dtype, device=device)
    before = [t.detach().clone() for t in (hidden, weight, bias) if t is not None]
    seed_grad = torch.rand(lead, device=device) + 0.5 if reduction == "none" else None
    with fastllm.use_backend(backend):
        got = _loss_and_grads(fused_linear_cross_entropy, hidden, weight, bias, labels,
                              reduction, kwargs, seed_grad)
    for b, t in zip(before, (hidden, weight, bias)):
        assert torch.equal(b, t.detach()), "an input changed"
    oracle = _loss_and_grads(fused_linear_cross_entropy_ref, *_as(torch.float64,
                             (hidden, weight, bias)), labels, reduction, kwargs, seed_grad)
    torch_lp = (_loss_and_grads(fused_linear_cross_entropy_ref, hidden, weight, bias, labels,
                                reduction, kwargs, seed_grad) if dtype != torch.float32 else got)
    assert got[0].dtype == torch.float32 and got[0].shape == oracle[0].shape
    for name, g, t, o in zip(["loss", "grad_hidden", "grad_weight", "grad_bias"], got, torch_lp,
                             oracle):
        assert g.dtype == (torch.float32 if name == "loss" else dtype), name
        _check(name, g, t, o, dtype, 1e-5 if name == "loss" else 1e-4)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_matches_hugging_face_loss(backend, device):
    """The plain case against F.cross_entropy over materialised fp32 logits (transformers'
    ForCausalLMLoss after its shift), loss and grads."""
    hidden, weight, _, labels, _ = _inputs((2, 11), 32, 97, dict(ignore=True), torch.float32,
                                           device=device)
    logits = F.linear(hidden, weight).float()
    hf = F.cross_entropy(logits.view(-1, 97), labels.view(-1), ignore_index=-100)
    hf_grads = torch.autograd.grad(hf, [hidden, weight])
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(loss, [hidden, weight])
    torch.testing.assert_close(loss, hf, rtol=1e-5, atol=0)
    for g, r in zip(grads, hf_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * r.abs().max().item())


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(backend, device, reduction):
    """Every label ignored: F.cross_entropy's convention, nan for "mean", 0 for "sum" and per
    token; zero grads in every case."""
    hidden, weight, bias, labels, _ = _inputs((5,), 8, 13, dict(bias=True), torch.float32,
                                              ignore_all=True, device=device)
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction)
    expected = F.cross_entropy(F.linear(hidden, weight, bias), labels, reduction=reduction)
    torch.testing.assert_close(loss, expected, equal_nan=True)
    for g in torch.autograd.grad(loss.sum(), [hidden, weight, bias]):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp64_grads_are_fp64_accurate(reduction):
    """fp64 inputs (the ref backend): the token weights (1 / tokens) and the incoming grad were
    rounded to fp32, so the grads were 3e-8 off where the loss was exact."""
    hidden = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 4])
    loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
    want = F.cross_entropy(F.linear(hidden, weight), labels, reduction=reduction)
    seed = torch.full(loss.shape, 1 / 3, dtype=torch.float64)
    got, ref = (torch.autograd.grad((x * seed).sum(), [hidden, weight]) for x in (loss, want))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-13, atol=1e-15)


# (not Triton in the interpreter: its fp16 products are the interpreter's numpy ones, not a
# GPU's fp32-accumulating tensor cores, and at these sizes it takes half a minute)
@pytest.mark.parametrize("backend,device", [p for p in backend_device_params()
                                            if p.id != "triton-cpu"])
def test_fp16_under_a_loss_scale_is_as_accurate_as_torch(backend, device):
    """fp16 trains under a loss scale. grad_hidden was rounded to fp16 in the forward, before
    the scale reached it: about 1/tokens a token, in fp16's subnormals, 2.5x torch's error at
    2048 tokens, 8.8x at 8192 (every grad below the head of a patched fp16 model). Now no worse
    than F.cross_entropy over fp16 logits under the same scale, against fp64."""
    torch.manual_seed(0)
    n, h, v, scale = 2048, 32, 256, 65536.0
    hidden0, weight0 = torch.randn(n, h), torch.randn(v, h) * 0.05
    labels = torch.randint(0, v, (n,))

    def grads(dtype, loss_of):
        hidden = hidden0.to(device, dtype).requires_grad_()
        weight = weight0.to(device, dtype).requires_grad_()
        (loss_of(hidden, weight) * (1.0 if dtype == torch.float64 else scale)).backward()
        return [t.grad.double().cpu() / (1.0 if dtype == torch.float64 else scale)
                for t in (hidden, weight)]

    def torch_loss(hidden, weight):
        return F.cross_entropy(F.linear(hidden, weight).float(), labels.to(device))

    want = grads(torch.float64, torch_loss)
    theirs = grads(torch.float16, torch_loss)
    with fastllm.use_backend(backend):
        ours = grads(torch.float16,
                     lambda a, b: fused_linear_cross_entropy(a, b, labels.to(device)))
    for o, t, w in zip(ours, theirs, want):
        assert (o - w).norm() <= 1.25 * (t - w).norm(), ((o - w).norm() / w.norm(),
                                                        (t - w).norm() / w.norm())


def test_autocast_leaves_fp64_alone():
    """Autocast never casts fp64 (F.linear and F.cross_entropy stay fp64 under it): the fused
    loss cast fp64 inputs to bf16 (a 1e-2 error in the loss)."""
    hidden = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64)
    labels = torch.tensor([0, 3, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    want = F.cross_entropy(F.linear(hidden, weight), labels)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, want, rtol=1e-13, atol=0)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_masked_first_vocabulary_block(backend, device):
    """A bias of -inf over the first 4096 entries (the Triton row pass's whole first block of
    fp32 logits): its online softmax computed exp(-inf - -inf), a nan loss and grads."""
    hidden = torch.randn(2, 4, device=device, requires_grad=True)
    weight = torch.randn(4100, 4, device=device)
    bias = torch.zeros(4100, device=device)
    bias[:4096] = float("-inf")
    labels = torch.tensor([4097, 4099], device=device)
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias)
    (grad,) = torch.autograd.grad(loss, [hidden])
    want = F.cross_entropy(F.linear(hidden, weight, bias), labels)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(want, [hidden])[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_weight_and_no_grad(backend, device, reduction):
    """Only the grads asked for are computed (a frozen head: no dW; "none": grad_hidden in the
    forward, each token's row scaled by its own incoming grad); no_grad: loss only."""
    hidden, weight, _, labels, _ = _inputs((2, 7), 8, 13, dict(ignore=True), torch.float32,
                                           device=device)
    weight.requires_grad_(False)
    seed = torch.randn(labels.shape).to(device) if reduction == "none" else 3.0
    ref = fused_linear_cross_entropy_ref(hidden, weight, labels, reduction=reduction)
    (ref_gh,) = torch.autograd.grad((ref * seed).sum(), [hidden])
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        (gh,) = torch.autograd.grad((loss * seed).sum(), [hidden])
        with torch.no_grad():
            no_grad = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(no_grad, ref.detach())


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_grads_are_handed_out_once(backend, device):
    """The forward's grads go out scaled in place (no scaled copy); the caller may change them in
    place, and a second backward through the same graph (retain_graph) still gives the right
    grads, with any seed."""
    hidden, weight, bias, labels, _ = _inputs((2, 5), 8, 13, dict(bias=True), torch.float32,
                                              device=device)
    ref = fused_linear_cross_entropy_ref(hidden, weight, labels, bias=bias)
    want = torch.autograd.grad(ref, [hidden, weight, bias])
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias)
        first = torch.autograd.grad(loss * 0.5, [hidden, weight, bias], retain_graph=True)
        for g, w in zip(first, want):
            torch.testing.assert_close(g, 0.5 * w)
            g.zero_()  # the caller's to change: the graph must not read it again
        again = torch.autograd.grad(loss, [hidden, weight, bias], retain_graph=True)
        twice = torch.autograd.grad(loss * 2.0, [hidden, weight, bias])
    for g, g2, w in zip(again, twice, want):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(g2, 2.0 * w)


@pytest.mark.parametrize("widened", ["fastllm", "mkl", False],
                         ids=["bf16f32-gemm", "bf16f32-mkl", "residual"])
def test_cpp_bf16_many_tiles(monkeypatch, widened):
    """bf16 over several chunks and more than one 2048-row vocabulary tile: the cpp kernel's
    fp32 dW accumulation, against fp64, by each of its ways: the bf16 x bf16 -> fp32 GEMM on
    fastllm's kernel (AVX512-BF16 builds) and on MKL's (AMX CPUs' default), and the native bf16
    GEMM with its rounding residual (the fallback)."""
    with gemm_bf16f32(widened):
        _many_tiles(monkeypatch)


def _many_tiles(monkeypatch):
    monkeypatch.setattr(_op_module, "CHUNK_BYTES", 3 * 4500 * 2)
    monkeypatch.setattr(_op_module, "CPU_MIN_CHUNK_ROWS", 1)
    # ignored tokens too: the chunks' rows gathered by index_select
    hidden, weight, bias, labels, _ = _inputs((10,), 16, 4500, dict(bias=True, ignore=True),
                                              torch.bfloat16)
    with fastllm.use_backend("cpp"):
        got = _loss_and_grads(fused_linear_cross_entropy, hidden, weight, bias, labels, "mean", {})
    oracle = _loss_and_grads(fused_linear_cross_entropy_ref, *_as(torch.float64,
                             (hidden, weight, bias)), labels, "mean", {})
    torch_lp = _loss_and_grads(fused_linear_cross_entropy_ref, hidden, weight, bias, labels,
                               "mean", {})
    for name, g, t, o in zip(["loss", "grad_hidden", "grad_weight", "grad_bias"], got, torch_lp,
                             oracle):
        _check(name, g, t, o, torch.bfloat16, None)


def test_bad_arguments():
    hidden, weight, _, labels, _ = _inputs((4,), 8, 13, {}, torch.float32)
    with pytest.raises(TypeError, match="weight has dtype"):
        fused_linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="leading shape"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="logit_softcap"):
        fused_linear_cross_entropy(hidden, weight, labels, logit_softcap=0.0)
    for backend in ("ref", "cpp"):
        if fastllm._backend.unavailable_reason(backend, "cpu"):
            continue
        with fastllm.use_backend(backend), pytest.raises(ValueError, match="outside"):
            fused_linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 13, 2]))


def test_cpu_chunks_have_a_floor_of_rows():
    """CHUNK_BYTES of logits is few rows at a large vocabulary (167 at Phi-4-mini's 200064): on
    the CPU a chunk takes at least CPU_MIN_CHUNK_ROWS rows (each chunk's GEMMs stream the whole
    weight); elsewhere, and where the budget is more rows already, the budget stands."""
    from fastllm.ops.fused_linear_cross_entropy import CPU_MIN_CHUNK_ROWS, chunk_rows

    assert CPU_MIN_CHUNK_ROWS == 512
    assert chunk_rows(1024, 200064, 4, "cpu") == 512
    assert chunk_rows(1024, 200064, 4, "cuda") < 200
    assert chunk_rows(100, 200064, 4, "cpu") == 100
    assert chunk_rows(4096, 49152, 4, "cpu") == chunk_rows(4096, 49152, 4, "cuda") == 688


def test_chunks_are_balanced_whole_tiles():
    """The chunk rows (balanced_rows; the C++ kernel's chunk_rows_for is the same rule): no more
    than the tokens, within an eighth and a tile of the budget, never one chunk more than the
    equal split needs, and from 8 tiles on whole multiples of ROW_TILE (oneDNN's head GEMMs ran
    at 60-75% of their speed at 1363 and 682 rows); only the last chunk is shorter."""
    from fastllm.ops.fused_linear_cross_entropy import ROW_TILE, balanced_rows

    assert balanced_rows(4088, 1365) == 1376  # SmolLM2's bf16 step: 1376 + 1376 + 1336
    assert balanced_rows(2048, 682) == 688
    assert balanced_rows(100, 1365) == 100 and balanced_rows(0, 8) == 1
    for tokens in (1, 7, 127, 129, 500, 4088, 16384, 100003):
        for most in (1, 5, 100, 128, 682, 1365, 5000):
            rows = balanced_rows(tokens, most)
            assert 1 <= rows <= max(1, tokens), (tokens, most, rows)
            if tokens <= most:
                assert rows == tokens
                continue
            assert rows <= most + most // 8 + ROW_TILE - 1, (tokens, most, rows)
            # the fewest chunks of at most most + most // 8 rows: rounding adds none
            fewest = next(c for c in range(1, tokens + 1) if -(-tokens // c) <= most + most // 8)
            assert -(-tokens // rows) <= max(fewest, tokens // most), (tokens, most, rows)
            if rows >= 8 * ROW_TILE and rows < tokens:
                assert rows % ROW_TILE == 0, (tokens, most, rows)


def _row_pass(backend):
    reason = fastllm._backend.unavailable_reason(backend, "cpu")
    if reason:
        pytest.skip(reason)
    return {"ref": _op_module.row_pass_ref, "triton": _op_module._row_pass_triton}[backend]


@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sync_free_rows_match_gathered_rows(backend, dtype):
    """The GPU driver's sync-free form (dense: ignored tokens kept in place with a negative label,
    as under CUDA graph capture) gives the gathered form's loss and grads, ignored tokens' loss
    and hidden grad exactly 0; with per-token scales (the backward op's), and all ignored."""
    row_pass = _row_pass(backend)
    hidden, weight, bias, labels, _ = _inputs((23,), 16, 130, dict(bias=True, ignore=True), dtype)
    hidden, weight, bias = hidden.detach(), weight.detach(), bias.detach()
    opts = (-100, 0.1, 1e-3, 5.0, True, True, True)  # ignore_index, eps, z_loss, cap, masks
    for token_scale, divide, lab in ((None, True, labels), (torch.rand(23) + 0.5, False, labels),
                                     (None, True, torch.full_like(labels, -100))):
        got, want = (_op_module._chunked(row_pass, hidden, weight, lab, bias, token_scale, 1.0,
                                         divide, *opts, rows=4, dense=dense)
                     for dense in (True, False))
        ignored = lab == -100
        assert torch.equal(got[0][ignored], torch.zeros(int(ignored.sum())))
        assert torch.equal(got[1][ignored], torch.zeros_like(got[1][ignored]))
        for name, g, w in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), got, want):
            # the same maths; dW and db summed over other chunks: rounding apart
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2,
                                                                                   atol=1e-4)
            torch.testing.assert_close(g, w, **tol, msg=name)


def test_sync_free_rows_read_nothing_back():
    """dense=True makes no host read (what a CUDA graph capture refuses and what stalls the
    host): no nonzero, item or bool of a tensor; the label check is a device-side assertion.
    The gathered form does read (the spy can fail), and a bad label still raises (on a CPU the
    assertion is synchronous)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    hidden, weight, _, labels, _ = _inputs((9,), 8, 37, dict(ignore=True), torch.float32)
    args = (hidden.detach(), weight.detach(), labels, None, None, 1.0, True, -100, 0.0, 0.0,
            None, True, True, False)
    reads = {"nonzero", "_local_scalar_dense", "is_nonzero", "item", "masked_select", "equal"}
    for dense in (True, False):
        with Spy() as spy:
            _op_module._chunked(_op_module.row_pass_ref, *args, rows=4, dense=dense)
        assert (spy.ops & reads == set()) == dense, sorted(spy.ops & reads)
        assert ("_assert_async" in spy.ops) == dense
    bad = labels.clone()
    bad[4] = 37
    with pytest.raises(RuntimeError, match="outside"):
        _op_module._chunked(_op_module.row_pass_ref, *args[:2], bad, *args[3:], dense=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_capture():
    """The loss and its grads captured in a CUDA graph (the sync-free rows): each replay gives
    the eager op's values for the labels copied into the captured tensor."""
    hidden, weight, _, labels, _ = _inputs((2, 64), 32, 300, dict(ignore=True), torch.float32,
                                           device="cuda")

    def step():
        loss = fused_linear_cross_entropy(hidden, weight, labels, label_smoothing=0.1)
        return [loss] + list(torch.autograd.grad(loss, [hidden, weight]))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the row kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for new in (torch.randint(0, 300, labels.shape, device="cuda"), labels.clone().fill_(-100)):
        new[0, :5] = -100
        labels.copy_(new)
        graph.replay()
        for got, want in zip(captured, step()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_never_allocates_tokens_by_vocab(monkeypatch):
    # the fast path; ref and triton share one chunk driver (_chunked), checked by the same sizes
    backend = "ref" if fastllm._backend.unavailable_reason("cpp", "cpu") else "cpp"
    monkeypatch.setattr(_op_module, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(_op_module, "CPU_MIN_CHUNK_ROWS", 1)  # (chunks of 4 rows here)
    tokens, h, v = 512, 64, 4096  # (grads of 1.1 MiB: larger than the bound's margin)
    hidden, weight, _, labels, _ = _inputs((tokens,), h, v, {}, torch.float32)
    logits_bytes = tokens * v * 4
    grads_bytes = (tokens * h + v * h) * 4

    def step(fn):
        def run():
            loss = fn(hidden, weight, labels)
            torch.autograd.grad(loss, [hidden, weight])
        return run

    with fastllm.use_backend(backend):
        ours = allocator_peak_bytes(step(fused_linear_cross_entropy))
    materialised = allocator_peak_bytes(step(fused_linear_cross_entropy_ref))
    assert materialised > logits_bytes  # the check can fail: the reference does hold them
    # the grads (the backward scales the forward's in place: no second copy), one 64 KiB chunk,
    # small vectors
    assert ours < grads_bytes + (512 << 10), (ours, grads_bytes, logits_bytes)


def test_opcheck():
    hidden, weight, bias, labels, _ = _inputs((2, 5), 8, 13, dict(bias=True), torch.float32)
    op = torch.ops.fastllm.fused_linear_cross_entropy
    for reduction, mask in (("mean", [True, True, True]), ("sum", [True, False, False]),
                            ("none", [False, False, False]), ("none", [True, False, False])):
        torch.library.opcheck(op, (hidden, weight, labels, bias, -100, reduction, 0.1, 1e-3, 0.0,
                                   mask))
    # as autograd calls it: grad mode off, or (opcheck runs with it on) inputs that need no grad
    hidden, weight, bias = hidden.detach(), weight.detach(), bias.detach()
    torch.library.opcheck(torch.ops.fastllm.fused_linear_cross_entropy_backward,
                          (torch.rand(2, 5), hidden, weight, labels, bias, -100, "none", 0.0,
                           0.0, 3.0, [True, True, True]))


def test_compile_fullgraph():
    hidden, weight, _, labels, _ = _inputs((2, 5), 8, 13, {}, torch.float32)

    def loss_fn(h, w, y):
        return fused_linear_cross_entropy(h, w, y, label_smoothing=0.1)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    got = compiled(hidden, weight, labels)
    got_grads = torch.autograd.grad(got, [hidden, weight])
    want = loss_fn(hidden, weight, labels)
    want_grads = torch.autograd.grad(want, [hidden, weight])
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_compile_fullgraph_per_token_frozen_head():
    """reduction "none" with a frozen head: grad_hidden made in the forward, each row scaled in
    the backward by its token's own grad (DPO's log-probabilities), traced whole."""
    hidden, weight, _, labels, _ = _inputs((2, 5), 8, 13, dict(ignore=True), torch.float32)
    weight.requires_grad_(False)
    seed = torch.randn(labels.shape)

    def loss_fn(h, w, y):
        return (fused_linear_cross_entropy(h, w, y, reduction="none") * seed).sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    (got,) = torch.autograd.grad(compiled(hidden, weight, labels), [hidden])
    ref = (fused_linear_cross_entropy_ref(hidden, weight, labels, reduction="none") * seed).sum()
    (want,) = torch.autograd.grad(ref, [hidden])
    torch.testing.assert_close(got, want)


def test_compile_with_a_symbolic_softcap():
    """dynamic=True makes a module's float logit_softcap symbolic while traced: the op checks it
    when it runs."""
    hidden, weight, _, labels, _ = _inputs((2, 5), 8, 13, {}, torch.float32)

    class Loss(torch.nn.Module):
        def __init__(self, cap):
            super().__init__()
            self.cap = cap

        def forward(self, h, w, y):
            return fused_linear_cross_entropy(h, w, y, logit_softcap=self.cap)

    torch._dynamo.reset()
    got = torch.compile(Loss(3.0), fullgraph=True, dynamic=True, backend="aot_eager")(
        hidden, weight, labels)
    torch.testing.assert_close(got, Loss(3.0)(hidden, weight, labels))


@pytest.mark.parametrize("backend", ["cpp", "ref"])
def test_hidden_size_zero(backend):
    """H = 0: every logit is 0 (the bias), the loss log V as F.cross_entropy over F.linear's."""
    hidden = torch.zeros(3, 0, requires_grad=True)
    weight = torch.zeros(7, 0, requires_grad=True)
    labels = torch.tensor([0, 6, 2])
    with fastllm.use_backend(backend):
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight), labels))
    loss.backward()
    assert hidden.grad.shape == (3, 0) and weight.grad.shape == (7, 0)


# --- vocabulary-parallel form at world 2 (Gloo, one spawn) ---


def _vocab_parallel_worker(rank, world, port, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastllm.parallel.loss import vocab_parallel_linear_cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for name, kwargs in (("plain", {}), ("options", dict(label_smoothing=0.1, z_loss=1e-3,
                                                              logit_softcap=4.0))):
            hidden, weight, _, labels, _ = _inputs((3, 7), 16, 37, dict(ignore=True),
                                                   torch.float32)
            w_dt = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
            loss = vocab_parallel_linear_cross_entropy(hidden, w_dt, labels, **kwargs)
            loss.backward()
            out[name] = (loss.detach(), hidden.grad, w_dt.grad.full_tensor())
        # chunks of a budget that splits the 19 and 18 rows of the two shards into different
        # numbers of chunks were each rank's own (Gloo aborted on the mismatched all_reduces)
        module = sys.modules["fastllm.ops.fused_linear_cross_entropy"]  # (not the function)
        module.CHUNK_BYTES = 4 * 18 * 3  # rows of 2 (19 per row) and 3 (18), 6 and 4 chunks
        hidden, weight, _, labels, _ = _inputs((3, 7), 16, 37, dict(ignore=True), torch.float32)
        w_dt = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
        loss = vocab_parallel_linear_cross_entropy(hidden, w_dt, labels)
        loss.backward()
        out["uneven chunks"] = (loss.detach(), hidden.grad, w_dt.grad.full_tensor())
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_world2():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    ctx = mp.spawn(_vocab_parallel_worker, args=(2, port, results), nprocs=2, join=False)
    deadline = time.monotonic() + 120  # (a safety net: ~3 s; mismatched collectives hang)
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the ranks did not finish: their collectives no longer match")
    for name, kwargs in (("plain", {}), ("options", dict(label_smoothing=0.1, z_loss=1e-3,
                                                          logit_softcap=4.0)),
                         ("uneven chunks", {})):
        hidden, weight, _, labels, _ = _inputs((3, 7), 16, 37, dict(ignore=True), torch.float32)
        ref = fused_linear_cross_entropy_ref(hidden, weight, labels, **kwargs)
        ref_grads = torch.autograd.grad(ref, [hidden, weight])
        for rank in range(2):
            loss, gh, gw = results[rank][name]
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0)
            torch.testing.assert_close(gh, ref_grads[0], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(gw, ref_grads[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_an_empty_batch_of_more_than_two_dims_gets_its_grad(backend, device):
    """hidden (2, 0, H): the grad came back (0, H), which autograd refused, in every reduction;
    torch gives nan (mean), 0 (sum), an empty loss (none), each with a (2, 0, H) grad."""
    for reduction in ("mean", "sum", "none"):
        h = torch.randn(2, 0, 8, device=device, requires_grad=True)
        w = torch.randn(11, 8, device=device)
        with fastllm.use_backend(backend):
            loss = fused_linear_cross_entropy(h, w, torch.zeros(2, 0, dtype=torch.long,
                                                                device=device),
                                              reduction=reduction)
            loss.sum().backward()
        assert h.grad.shape == (2, 0, 8), reduction


def test_vocab_parallel_loss_with_a_masked_vocabulary(tmp_path):
    """A bias of -inf over padded vocabulary rows, label_smoothing 0: the vocab-parallel loss was
    nan (0 times the -inf sum of the logits), where F.cross_entropy and the op are finite."""
    import torch.distributed as dist

    from fastllm.ops.vocab_parallel_cross_entropy import vocab_parallel_fused_linear_cross_entropy

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        h, w, b = (torch.randn(*s, generator=g) for s in ((5, 8), (37, 8), (37,)))
        b[30:] = float("-inf")
        y = torch.tensor([0, 1, 2, -100, 3])
        got = vocab_parallel_fused_linear_cross_entropy(h, w, y, 0, 37, bias=b)
        torch.testing.assert_close(got, F.cross_entropy(F.linear(h, w, b), y))
        # a shard outside the vocabulary gathered other rows' logits (a wrong loss), silently
        for start, size in ((5, 37), (-4, 37), (0, 7)):
            with pytest.raises(ValueError, match="not inside the vocabulary"):
                vocab_parallel_fused_linear_cross_entropy(h, w, y, start, size, bias=b)
    finally:
        if made:
            dist.destroy_process_group()
