"""fastllm/_gemm.py: fp32 CPU matmuls through oneDNN (csrc/cpu/gemm.cpp) and fastllm's AVX2
kernel (csrc/cpu/sgemm_avx2.cpp) against fp64 and against ATen, the policy
(FASTLLM_CPU_FP32_MATMUL) and that the ops really take the route."""

import pytest
import torch
import torch.nn.functional as F

from fastllm import _extension, _gemm

from conftest import BF16F32_ENGINES, gemm_bf16f32

needs_onednn = pytest.mark.skipif(not _gemm._usable("onednn"),
                                  reason="no oneDNN matmul ATen accepts on this CPU / no extension")
needs_avx2 = pytest.mark.skipif(not _gemm._usable("avx2"),
                                reason="no AVX2 + FMA on this CPU / extension not built")
ROUTES = [pytest.param("onednn", marks=needs_onednn), pytest.param("avx2", marks=needs_avx2)]
MODES = ["aten"] + ROUTES
USABLE = [r for r in ("onednn", "avx2") if _gemm._usable(r)]
needs_a_route = pytest.mark.skipif(not USABLE, reason="no fastllm fp32 route on this CPU")


@pytest.fixture
def counted(monkeypatch):
    """How many products went through the oneDNN entry."""
    calls = []
    real = _gemm._gemm

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(_gemm, "_gemm", spy)
    return calls


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 7, 3), (33, 17, 65), (0, 4, 3), (4, 0, 3),
                                   (4, 5, 0)])
def test_products_match_fp64(monkeypatch, mode, m, n, k):
    monkeypatch.setenv(_gemm.ENV, mode)
    g = torch.Generator().manual_seed(m * 100 + n * 10 + k)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    c, bias = torch.randn(m, n, generator=g), torch.randn(n, generator=g)
    ad, bd = a.double(), b.double()
    ref = ad @ bd
    assert _rel(_gemm.mm(a, b), ref) < 1e-5 if ref.numel() else _gemm.mm(a, b).shape == (m, n)
    torch.testing.assert_close(_gemm.addmm(bias, a, b, beta=0.5, alpha=2.0).double(),
                               0.5 * bias.double() + 2 * ref, rtol=1e-5, atol=1e-5)
    out = c.clone()
    _gemm.addmm_(out, a, b, beta=0.3, alpha=-1.5)
    torch.testing.assert_close(out.double(), 0.3 * c.double() - 1.5 * ref, rtol=1e-5, atol=1e-5)
    out = torch.full((m, n), float("nan"))  # beta 0: what out held is not read (torch's rule)
    _gemm.addmm_(out, a, b, beta=0, alpha=1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    x, w = torch.randn(2, 3, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(_gemm.linear(x, w, bias).double(),
                               F.linear(x.double(), w.double(), bias.double()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_transposed_and_sliced_operands_agree_with_aten(monkeypatch, counted, route):
    monkeypatch.setenv(_gemm.ENV, route)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(70, 50, generator=g).t()           # (50, 70), column-major
    b = torch.randn(90, 70, generator=g).t()           # (70, 90), column-major
    sliced = torch.randn(50, 140, generator=g)[:, ::2]  # neither layout: copied by oneDNN's entry
    for x in (a, sliced):
        assert _rel(_gemm.mm(x, b), x.double() @ b.double()) < 1e-5
    assert len(counted) == 2


@pytest.mark.parametrize("route", ROUTES)
def test_policy_routes_fp32_cpu_only(monkeypatch, counted, route):
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    monkeypatch.setenv(_gemm.ENV, route)
    _gemm.mm(a, b)
    _gemm.mm(a.double(), b.double())            # fp64: ATen
    _gemm.mm(a.bfloat16(), b.bfloat16())        # bf16: ATen (its own oneDNN path where native)
    w = b.t().clone().requires_grad_()
    y = _gemm.linear(a, w)                       # tracked by autograd: ATen, so grads flow
    y.sum().backward()
    torch.testing.assert_close(w.grad, a.sum(0).expand(3, 4))
    assert len(counted) == 1
    monkeypatch.setenv(_gemm.ENV, "aten")
    _gemm.mm(a, b)
    assert len(counted) == 1


@needs_avx2
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (6, 16, 384), (7, 17, 385), (97, 33, 769),
                                   (13, 4111, 5)])
def test_avx2_kernel_edges_and_layouts(m, n, k):
    """The kernel's block edges: rows past a 96-row block and not whole 6-row tiles, columns past
    the 4096-column panel and not whole 16-column slivers, k past a 384 block; overwrite (beta 0:
    the nan in out is not read) and accumulate (beta, alpha) against fp64; and every layout the
    packing reads (row-major, column-major, strided both ways) giving the same bits."""
    ext = _extension.extension()
    g = torch.Generator().manual_seed(m + n + k)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    ref = a.double() @ b.double()
    plain = torch.full((m, n), float("nan"))
    ext.sgemm_avx2_cpu(a, b, plain, 0.0, 1.0)
    assert _rel(plain, ref) < 1e-5
    c = torch.randn(m, n, generator=g)
    out = c.clone()
    ext.sgemm_avx2_cpu(a, b, out, 0.5, -2.0)
    assert _rel(out, 0.5 * c.double() - 2 * ref) < 1e-5
    sliced_a = torch.zeros(m, 2 * k)
    sliced_a[:, ::2] = a
    sliced_b = torch.zeros(2 * k, 3 * n)
    sliced_b[::2, ::3] = b
    layouts = ((a.t().contiguous().t(), b), (a, b.t().contiguous().t()),
               (sliced_a[:, ::2], sliced_b[::2, ::3]))
    for x, y in layouts:
        other = torch.empty(m, n)
        ext.sgemm_avx2_cpu(x, y, other, 0.0, 1.0)
        assert torch.equal(other, plain), (x.stride(), y.stride())


@needs_avx2
def test_avx2_kernel_same_bits_on_any_thread_count():
    """Two 96-row blocks: the tasks split the column slivers in 2 groups on 1 thread and 4 on 2;
    every element is one task's, summed in a fixed k order, so the bits are the same."""
    ext = _extension.extension()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(100, 800, generator=g), torch.randn(300, 800, generator=g).t()
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            outs.append(torch.empty(100, 300))
            ext.sgemm_avx2_cpu(a, b, outs[-1], 0.0, 1.0)
    finally:
        torch.set_num_threads(threads)
    assert _rel(outs[0], a.double() @ b.double()) < 1e-5
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("context", ["fake", "meta", "fp64", "vmap", "grad"])
def test_route_probe_is_hermetic(context):
    """The first route query under torch.export's fake tensors, a meta device context, an fp64
    default dtype, vmap or torch.func.grad answered "no route" (the probe's tensors followed the
    mode and the extension refused them), and the cache kept that answer for the process."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ext = _extension.extension()
    want = {r: ext is not None and getattr(ext, _gemm._ROUTES[r][2])() for r in USABLE}
    if not want:
        pytest.skip("no fastllm fp32 route on this CPU")

    def probe(_=None):
        for r in want:
            _gemm._usable(r)
        return torch.zeros(())

    dtype = torch.get_default_dtype()
    _gemm._usable.cache_clear()
    try:
        if context == "fake":
            with FakeTensorMode():
                probe()
        elif context == "meta":
            with torch.device("meta"):
                probe()
        elif context == "fp64":
            torch.set_default_dtype(torch.float64)
            probe()
        elif context == "vmap":
            torch.vmap(probe, randomness="error")(torch.zeros(2))
        else:  # (functorch's grad level: tensors without storage)
            torch.func.grad(lambda x: (probe() + x).sum())(torch.zeros(()))
    finally:
        torch.set_default_dtype(dtype)
        got = {r: _gemm._usable(r) for r in want}
        _gemm._usable.cache_clear()
    assert got == want


@needs_a_route
def test_inplace_product_is_seen_by_autograd(monkeypatch):
    """The routes write out below the dispatcher: addmm_ bumps its version (a backward that
    saved it raises, as after torch's addmm_) and leaves inference tensors to torch's rules."""
    monkeypatch.setenv(_gemm.ENV, USABLE[0])
    a, b = torch.randn(512, 256), torch.randn(256, 256)  # 2^25: big enough for the AVX2 kernel
    w = torch.randn(512, 256, requires_grad=True)
    out = torch.zeros(512, 256)
    y = (w * out).sum()  # saves out
    before = out._version
    _gemm.addmm_(out, a, b)
    assert out._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    with torch.inference_mode():
        frozen = torch.zeros(512, 256)
        _gemm.addmm_(frozen, a, b)  # inside inference mode: written
    assert _rel(frozen, a.double() @ b.double()) < 1e-5
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        _gemm.addmm_(frozen, a, b)


@needs_a_route
def test_patched_linear_keeps_torchs_path_for_what_the_op_refuses(monkeypatch):
    """Under a route a patched nn.Linear runs fastllm.ops.linear; nested and sparse inputs (which
    the op refuses), torch.func transforms (which its autograd does not support) and tensor
    subclass weights (no rule for the op) keep F.linear, as on a CPU without a route."""
    import importlib

    patch = importlib.import_module("fastllm.patch")  # (the module: fastllm.patch is the function)
    monkeypatch.setenv(_gemm.ENV, USABLE[0])
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    lin.forward = patch._linear_forward.__get__(lin)
    x = torch.randn(5, 16)
    want = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(lin(x), want)
    nested = torch.nested.nested_tensor([x[:2], x[2:]])
    for got, ref in zip(lin(nested).unbind(), (want[:2], want[2:])):
        torch.testing.assert_close(got, ref)
    torch.testing.assert_close(lin(x.relu().to_sparse()), F.linear(x.relu(), lin.weight,
                                                                     lin.bias))
    grad = torch.func.grad(lambda t: lin(t).square().sum())(x)
    torch.testing.assert_close(grad, torch.func.grad(
        lambda t: F.linear(t, lin.weight, lin.bias).square().sum())(x))

    class Wrapped(torch.Tensor):  # a torchao-style weight: aten ops only, on its inner tensor
        @staticmethod
        def __new__(cls, t):
            return torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype,
                                                       device=t.device)

        def __init__(self, t):
            self.t = t

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func.namespace != "aten":
                raise NotImplementedError(f"no rule for {func}")
            unwrap = lambda v: v.t if isinstance(v, Wrapped) else v  # noqa: E731
            out = func(*[unwrap(a) for a in args],
                       **{k: unwrap(v) for k, v in (kwargs or {}).items()})
            return Wrapped(out) if func in (torch.ops.aten.detach.default,
                                            torch.ops.aten.alias.default) else out

    lin.weight = torch.nn.Parameter(Wrapped(lin.weight.detach()), requires_grad=False)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), want)


def test_policy_typo_is_refused(monkeypatch):
    monkeypatch.setenv(_gemm.ENV, "onenn")
    with pytest.raises(ValueError, match="FASTLLM_CPU_FP32_MATMUL='onenn'"):
        _gemm.mm(torch.randn(2, 2), torch.randn(2, 2))


@pytest.mark.parametrize("route", ROUTES)
def test_entry_refuses_bad_arguments(route):
    entry = getattr(_extension.extension(), _gemm._ROUTES[route][1])
    with pytest.raises(RuntimeError, match="fp32 tensors only"):
        entry(torch.randn(2, 3).double(), torch.randn(3, 2).double(), torch.empty(2, 2).double(),
              0.0, 1.0)
    with pytest.raises(RuntimeError, match="shapes do not chain"):
        entry(torch.randn(2, 3), torch.randn(4, 2), torch.empty(2, 2), 0.0, 1.0)
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        entry(torch.randn(2, 3), torch.randn(3, 2), torch.empty(2, 2).t(), 0.0, 1.0)
    with pytest.raises(RuntimeError, match="negative bit"):
        entry(torch._neg_view(torch.randn(2, 3)), torch.randn(3, 2), torch.empty(2, 2), 0.0, 1.0)
    if route == "avx2":  # out written while a and b are still read: aliasing refused
        x = torch.randn(4, 4)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            entry(x, torch.randn(4, 4), x, 1.0, 1.0)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            entry(torch.randn(4, 4), x[:, :4], x, 0.0, 1.0)


@needs_a_route
def test_ops_take_the_route_and_agree(monkeypatch, counted):
    """fastllm.ops.linear, the LoRA op and the C++ fused loss under every setting: the same
    results (fp32, 1e-5) and a route only when asked."""
    from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
    from fastllm.ops.linear import linear
    from fastllm.ops.lora_linear import lora_linear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 11, 24, generator=g)
    w, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    a, b = torch.randn(4, 24, generator=g) * 0.1, torch.randn(40, 4, generator=g) * 0.1
    labels = torch.randint(0, 40, (3, 11), generator=g)
    results = {}
    for mode in ["aten"] + USABLE:
        monkeypatch.setenv(_gemm.ENV, mode)
        before = len(counted)
        leaves = [t.clone().requires_grad_() for t in (x, w, bias, a, b)]
        xl, wl, bl, al, bbl = leaves
        y = linear(xl, wl, bl) + lora_linear(xl, wl.detach(), al, bbl, scaling=2.0)
        loss = fused_linear_cross_entropy(torch.tanh(y[..., :24]), wl, labels % 40)
        (y.square().mean() + loss).backward()
        results[mode] = [y.detach(), loss.detach()] + [t.grad for t in leaves]
        assert (len(counted) > before) == (mode != "aten")
        assert _extension.extension().fp32_gemm_route() == _gemm._ROUTES[mode][0]  # the C++ loss
    for mode in USABLE:
        for got, want in zip(results[mode], results["aten"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ROUTES)
def test_cpp_fused_loss_products_take_the_route(monkeypatch, route):
    """The C++ loss's fp32 GEMMs (logits, dX, dW) go through the route, none through aten::mm.
    They did not: its helper was called mm_out, and for a non-const out (the chunk buffer, dW)
    argument-dependent lookup preferred ATen's at::mm_out(Tensor&, ...) to fastllm's, silently;
    the ignored labels take the path whose dX is computed into such a buffer too. Sizes where
    the AVX2 route takes the kernel (csrc/cpu/gemm.cpp: avx2_pays)."""
    from torch.profiler import profile

    from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(300, 64, generator=g, requires_grad=True)
    weight = torch.randn(4096, 64, generator=g, requires_grad=True)
    labels = torch.randint(0, 4096, (300,), generator=g)
    labels[::7] = -100
    grads = {}
    for mode in ("aten", route):
        monkeypatch.setenv(_gemm.ENV, mode)
        with profile() as prof:
            loss = fused_linear_cross_entropy(hidden, weight, labels)
            grads[mode] = torch.autograd.grad(loss, (hidden, weight))
        mms = sum(e.name in ("aten::mm", "aten::addmm", "aten::addmm_") for e in prof.events())
        assert (mms > 0) == (mode == "aten"), (mode, mms)
    for got, want in zip(grads[route], grads["aten"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_a_route
def test_cpp_products_resolve_a_negative_bit(monkeypatch):
    """A negated view handed to a C++ kernel goes to ATen's GEMM (which resolves the bit); the
    routes refuse it, and the AVX2 route raised from inside the fused loss."""
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(300, 64, generator=g), torch.randn(4096, 64, generator=g)
    labels = torch.randint(0, 4096, (300,), generator=g)
    ext = _extension.extension()

    def loss(h):
        return ext.fused_linear_cross_entropy_cpu(h, weight, labels, None, None, 1.0, True,
                                                  -100, 0.0, 0.0, 0.0, True, False, False,
                                                  512)[0]

    for route in USABLE:
        monkeypatch.setenv(_gemm.ENV, route)
        _gemm.route()
        torch.testing.assert_close(loss(torch._neg_view(hidden)), loss(-hidden),
                                   rtol=1e-5, atol=1e-6)


def test_csrc_calls_no_unqualified_mm_out():
    """An unqualified mm_out(out, a, b) in fastllm's C++ binds to ATen's at::mm_out whenever out
    is a non-const tensor (argument-dependent lookup): the routed one is routed_mm_out."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "csrc"
    bad = [f"{path.name}:{i}" for path in sorted(root.rglob("*.cpp"))
           for i, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"(?<![\w:])mm_out\(", line.split("//")[0])]
    assert not bad, bad


@needs_a_route
def test_bench_gemm_smoke(monkeypatch):
    """`fastllm bench --ops gemm` at tiny sizes: ATen and every route here per shape, the route
    restored."""
    from fastllm.bench import bench_gemm

    monkeypatch.setattr(bench_gemm, "SHAPES", [("t", 9, 7, 5, False), ("tt", 6, 4, 11, True)])
    monkeypatch.setattr(bench_gemm, "BF16_SHAPES", [])
    monkeypatch.setenv(_gemm.ENV, "aten")
    rows = bench_gemm.run(progress=lambda *_: None)
    providers = ["torch.mm (ATen)"] + [f"fastllm ({bench_gemm.PROVIDERS[r]})" for r in USABLE]
    assert [(r["size"].split(":")[0], r["provider"]) for r in rows] == [
        (s, p) for s in ("t", "tt") for p in providers]
    assert all(r["time_ms"] > 0 and r["flops"] > 0 for r in rows)
    errs = rows[-1]["note"].split(": ", 1)[1].split(", ")
    assert len(errs) == len(USABLE) and all(float(e.split()[1]) < 1e-4 for e in errs)
    assert _gemm._mode() == "aten"


# bf16 x bf16 -> fp32 (csrc/cpu/gemm_bf16.cpp): fastllm's kernel (builds with AVX512-BF16) and
# MKL's (where libtorch_cpu exports it), each engine forced in turn
@pytest.fixture(params=BF16F32_ENGINES)
def bf16f32(request):
    """The extension with the bf16 x bf16 -> fp32 GEMM on the engine of the parameter."""
    ext = _extension.extension()
    if ext is None or not hasattr(ext, "gemm_bf16f32_available"):
        pytest.skip("extension not built")
    with gemm_bf16f32(request.param):
        yield ext


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (13, 7, 3), (37, 45, 19), (150, 70, 515),
                                   (300, 33, 2), (12, 32, 256)])
def test_bf16f32_matches_fp64(bf16f32, m, n, k):
    """Summed in fp32 and never rounded to bf16: fp32-level error against fp64 (at::mm of bf16,
    which rounds its output, is ~2^-9 off and would fail), overwrite and accumulate; odd sizes
    run the edge tiles, k 515 three k blocks with an odd last one, m 150 two row blocks."""
    ext = bf16f32
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    ref = a.double() @ b.double()
    out = torch.full((m, n), float("nan"))  # not accumulating: what out held is not read
    ext.gemm_bf16f32_cpu(a, b, out, False)
    assert _rel(out, ref) < 1e-5
    plain = out
    c = torch.randn(m, n, generator=g)
    out = c.clone()
    ext.gemm_bf16f32_cpu(a, b, out, True)
    assert _rel(out, c.double() + ref) < 1e-5
    if k >= 19:  # what the kernel is for: bf16 products without bf16's rounding
        assert _rel((a @ b).float(), ref) > 100 * _rel(out - c, ref)
    # the kernel's packing: pairs of k read as one word where k is contiguous (a row-major; b
    # the transpose of a row-major (n, k), as attention's K^T), element by element elsewhere:
    # the same bits either way; MKL's transposed operands: fp32-close (it promises no bits)
    a_cols, b_rows = a.t().contiguous().t(), b.t().contiguous().t()
    for x, y in ((a_cols, b), (a, b_rows), (a_cols, b_rows)):
        other = torch.empty(m, n)
        ext.gemm_bf16f32_cpu(x, y, other, False)
        _same_or_close(ext, other, plain)


def _same_or_close(ext, got, want):
    """The same bits on fastllm's kernel; within fp32's rounding of the sums on MKL's engine."""
    if ext.gemm_bf16f32_engine() == "fastllm":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_bf16f32_strided_operands_and_threads(bf16f32):
    """Transposed and sliced operands, an out whose rows are wider than n; on the kernel the same
    bits with 1 thread as with 2 (its work splits differ: one block of rows, 4 groups of column
    panels with 1 thread, 8 with 2; every element is one task's, summed in a fixed order) and
    with an operand read in place (a slice of rows, leading dimension 1400) or from a contiguous
    copy; on MKL's (which takes a column stride of 2 from a copy) fp32-close results."""
    ext = bf16f32
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1000, 100, generator=g).bfloat16().t()       # (100, 1000), column-major
    wider = torch.randn(1000, 1400, generator=g).bfloat16()
    b = wider[:, ::2]                                             # (1000, 700), column stride 2
    wide = torch.zeros(100, 710)
    out = wide[:, 5:705]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ext.gemm_bf16f32_cpu(a, b, out, False)
        torch.set_num_threads(1)
        one = torch.empty(100, 700)
        ext.gemm_bf16f32_cpu(a, b, one, False)
    finally:
        torch.set_num_threads(threads)
    assert _rel(out, a.double() @ b.double()) < 1e-5
    assert wide[:, :5].abs().sum() == 0 and wide[:, 705:].abs().sum() == 0
    _same_or_close(ext, one, out)
    in_place = torch.empty(100, 700)
    ext.gemm_bf16f32_cpu(a, wider[:, :700], in_place, False)
    assert _rel(in_place, a.double() @ wider[:, :700].double()) < 1e-5
    copied = torch.empty(100, 700)
    ext.gemm_bf16f32_cpu(a.contiguous(), wider[:, :700].contiguous(), copied, False)
    _same_or_close(ext, in_place, copied)


def test_bf16f32_empty_and_bad_arguments(bf16f32):
    ext = bf16f32
    out = torch.full((3, 2), 7.0)
    ext.gemm_bf16f32_cpu(torch.empty(3, 0).bfloat16(), torch.empty(0, 2).bfloat16(), out, True)
    assert (out == 7).all()
    ext.gemm_bf16f32_cpu(torch.empty(3, 0).bfloat16(), torch.empty(0, 2).bfloat16(), out, False)
    assert (out == 0).all()
    a, b = torch.randn(3, 4).bfloat16(), torch.randn(4, 2).bfloat16()
    with pytest.raises(RuntimeError, match="a and b must be bf16"):
        ext.gemm_bf16f32_cpu(a.float(), b, torch.empty(3, 2), False)
    with pytest.raises(RuntimeError, match="out must be fp32"):
        ext.gemm_bf16f32_cpu(a, b, torch.empty(3, 2).bfloat16(), False)
    with pytest.raises(RuntimeError, match="shapes do not chain"):
        ext.gemm_bf16f32_cpu(a, b.t(), torch.empty(3, 2), False)
    with pytest.raises(RuntimeError, match=r"rows must be contiguous"):
        ext.gemm_bf16f32_cpu(a, b, torch.empty(2, 3).t(), False)
    with pytest.raises(RuntimeError, match="refers to a single memory location"):
        ext.gemm_bf16f32_cpu(a, b, torch.empty(1, 2).expand(3, 2), False)
    with pytest.raises(RuntimeError, match="negative bit"):
        ext.gemm_bf16f32_cpu(torch._neg_view(a), b, torch.empty(3, 2), False)


def test_bench_gemm_bf16f32_smoke(monkeypatch):
    """`fastllm bench --ops gemm`'s bf16 -> fp32 rows at tiny sizes: torch's two providers and
    one per engine this machine has, the default first, and an error note per engine,
    fp32-level where torch.mm's bf16 output is not."""
    with gemm_bf16f32(True):
        ext = _extension.extension()
    with gemm_bf16f32(None):  # the engine the C++ kernels take by default, if any
        engine = ext.gemm_bf16f32_engine()
        default = engine if ext.gemm_bf16f32_preferred() else None
    from fastllm.bench import bench_gemm

    monkeypatch.setattr(bench_gemm, "SHAPES", [])
    monkeypatch.setattr(bench_gemm, "BF16_SHAPES", [("b", 40, 24, 70, True)])
    rows = bench_gemm.run(progress=lambda *_: None)
    providers = [r["provider"] for r in rows]
    assert providers[:2] == ["torch.mm bf16 (bf16 out)", "torch.mm of fp32 copies"]
    ours = providers[2:]
    marked = [p for p in ours if p.endswith(" (default)")]
    assert ours and marked == ([ours[0]] if default else [])
    if default:
        assert ours[0] == f"fastllm bf16 -> fp32, {bench_gemm.ENGINES[default]} (default)"
    assert all(r["time_ms"] > 0 for r in rows)
    errs = dict(e.rsplit(" ", 1) for e in rows[-1]["note"].split(": ", 1)[1].split(", "))
    assert float(errs.pop("torch.mm bf16")) > 1e-4
    assert len(errs) == len(ours) and all(float(e) < 1e-4 for e in errs.values())
    assert ext.gemm_bf16f32_engine() == engine  # the bench set the engine back to its default


def test_bf16f32_engines_and_their_default():
    """The default engine: MKL's where PyTorch's bf16 GEMMs run on AMX (and this PyTorch exports
    it), fastllm's kernel elsewhere where built, else the other; an engine by name, a bad name
    refused."""
    with gemm_bf16f32(None):
        ext = _extension.extension()
        have = ext.gemm_bf16f32_engines()
        assert set(have) <= set(BF16F32_ENGINES)
        for engine in set(BF16F32_ENGINES) - set(have):  # one that is not here cannot be set
            with pytest.raises(RuntimeError, match=f"no '{engine}'"):
                ext.set_gemm_bf16f32_engine(engine)
        default = ext.gemm_bf16f32_engine()
        # (the other engine where the first choice is missing: used when forced on)
        first = ["mkl", "fastllm"] if ext.bf16_gemm_on_amx() else ["fastllm", "mkl"]
        assert default == next((e for e in first if e in have), "none")
        # the C++ kernels take it by default only where the first choice exists
        assert ext.gemm_bf16f32_preferred() == (first[0] in have)
        for engine in have:
            ext.set_gemm_bf16f32_engine(engine)
            assert ext.gemm_bf16f32_engine() == engine
        with pytest.raises(RuntimeError, match="'fastllm' or 'mkl'.*got 'MKL'"):
            ext.set_gemm_bf16f32_engine("MKL")
        ext.set_gemm_bf16f32_engine(None)
        assert ext.gemm_bf16f32_engine() == default


def test_amx_probe_follows_the_cpu():
    """bf16_gemm_on_amx (PyTorch's cpublas::could_pack, looked up at run time: the fused loss
    keeps its native GEMMs where it is true) is false on a CPU without AMX-BF16."""
    ext = _extension.extension()
    if ext is None or not hasattr(ext, "bf16_gemm_on_amx"):
        pytest.skip("extension not built")
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    amx = ext.bf16_gemm_on_amx()
    assert isinstance(amx, bool)
    if "amx_bf16" not in flags:
        assert not amx


@pytest.mark.parametrize("mode", MODES)
def test_addmm_refuses_an_input_that_does_not_broadcast_with_beta_0(monkeypatch, mode):
    """beta=0 ignores the input's values (nan included), not its shape: the oneDNN route took a
    (3, 4) input for a (7, 9) product, where torch.addmm (and the aten route) refuse it."""
    monkeypatch.setenv(_gemm.ENV, mode)
    a, b = torch.randn(7, 13), torch.randn(13, 9)
    with pytest.raises(RuntimeError):
        _gemm.addmm(torch.randn(3, 4), a, b, beta=0, alpha=1.0)
    out = _gemm.addmm(torch.full((1, 9), float("nan")), a, b, beta=0, alpha=1.0)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)


def test_widened_attention_gives_a_learned_mask_its_gradient():
    """A float mask that requires grad (a learned bias): the widened kernel returned no grad for
    it, silently; such a call is F.scaled_dot_product_attention's."""
    from fastllm import _lowp

    q, k, v = (torch.randn(1, 2, 4, 8).half() for _ in range(3))
    bias = torch.randn(1, 2, 4, 4, requires_grad=True)
    _lowp.scaled_dot_product_attention(q, k, v, bias.half()).float().sum().backward()
    want = torch.autograd.grad(F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), bias).sum(), bias)[0]
    torch.testing.assert_close(bias.grad, want, rtol=2e-2, atol=2e-2)
