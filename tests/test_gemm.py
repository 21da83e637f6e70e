"""fastllm/_gemm.py: fp32 CPU matmuls through oneDNN (csrc/cpu/gemm.cpp) against fp64 and
against ATen, the policy (FASTLLM_CPU_FP32_MATMUL) and that the ops really take the route."""

import pytest
import torch
import torch.nn.functional as F

from fastllm import _extension, _gemm

needs_onednn = pytest.mark.skipif(not _gemm._usable(),
                                  reason="no oneDNN matmul in this PyTorch / extension not built")
MODES = ["aten", pytest.param("onednn", marks=needs_onednn)]


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


@needs_onednn
def test_transposed_and_sliced_operands_agree_with_aten(monkeypatch, counted):
    monkeypatch.setenv(_gemm.ENV, "onednn")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(70, 50, generator=g).t()           # (50, 70), column-major
    b = torch.randn(90, 70, generator=g).t()           # (70, 90), column-major
    sliced = torch.randn(50, 140, generator=g)[:, ::2]  # neither layout: copied by oneDNN's entry
    for x in (a, sliced):
        assert _rel(_gemm.mm(x, b), x.double() @ b.double()) < 1e-5
    assert len(counted) == 2


@needs_onednn
def test_policy_routes_fp32_cpu_only(monkeypatch, counted):
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    monkeypatch.setenv(_gemm.ENV, "onednn")
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


def test_policy_typo_is_refused(monkeypatch):
    monkeypatch.setenv(_gemm.ENV, "onenn")
    with pytest.raises(ValueError, match="FASTLLM_CPU_FP32_MATMUL='onenn'"):
        _gemm.mm(torch.randn(2, 2), torch.randn(2, 2))


@needs_onednn
def test_entry_refuses_bad_arguments():
    ext = _extension.extension()
    with pytest.raises(RuntimeError, match="fp32 tensors only"):
        ext.gemm_onednn_cpu(torch.randn(2, 3).double(), torch.randn(3, 2).double(),
                            torch.empty(2, 2).double(), 0.0, 1.0)
    with pytest.raises(RuntimeError, match="shapes do not chain"):
        ext.gemm_onednn_cpu(torch.randn(2, 3), torch.randn(4, 2), torch.empty(2, 2), 0.0, 1.0)
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        ext.gemm_onednn_cpu(torch.randn(2, 3), torch.randn(3, 2), torch.empty(2, 2).t(), 0.0, 1.0)


@needs_onednn
def test_ops_take_the_route_and_agree(monkeypatch, counted):
    """fastllm.ops.linear, the LoRA op and the C++ fused loss under both settings: the same
    results (fp32, 1e-5) and oneDNN only when asked."""
    from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
    from fastllm.ops.linear import linear
    from fastllm.ops.lora_linear import lora_linear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 11, 24, generator=g)
    w, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    a, b = torch.randn(4, 24, generator=g) * 0.1, torch.randn(40, 4, generator=g) * 0.1
    labels = torch.randint(0, 40, (3, 11), generator=g)
    results = {}
    for mode in ("aten", "onednn"):
        monkeypatch.setenv(_gemm.ENV, mode)
        before = len(counted)
        leaves = [t.clone().requires_grad_() for t in (x, w, bias, a, b)]
        xl, wl, bl, al, bbl = leaves
        y = linear(xl, wl, bl) + lora_linear(xl, wl.detach(), al, bbl, scaling=2.0)
        loss = fused_linear_cross_entropy(torch.tanh(y[..., :24]), wl, labels % 40)
        (y.square().mean() + loss).backward()
        results[mode] = [y.detach(), loss.detach()] + [t.grad for t in leaves]
        assert (len(counted) > before) == (mode == "onednn")
        assert _extension.extension().onednn_fp32_gemm() == (mode == "onednn")  # the C++ loss
    for got, want in zip(results["onednn"], results["aten"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_bench_gemm_smoke(monkeypatch):
    """`fastllm bench --ops gemm` at tiny sizes: both providers per shape, the route restored."""
    from fastllm.bench import bench_gemm

    monkeypatch.setattr(bench_gemm, "SHAPES", [("t", 9, 7, 5, False), ("tt", 6, 4, 11, True)])
    monkeypatch.setattr(bench_gemm, "BF16_SHAPES", [])
    monkeypatch.setenv(_gemm.ENV, "aten")
    rows = bench_gemm.run(progress=lambda *_: None)
    assert [(r["size"].split(":")[0], r["provider"]) for r in rows] == [
        ("t", "torch.mm (ATen)"), ("t", "fastllm (oneDNN)"),
        ("tt", "torch.mm (ATen)"), ("tt", "fastllm (oneDNN)")]
    assert all(r["time_ms"] > 0 and r["flops"] > 0 for r in rows)
    assert float(rows[-1]["note"].rsplit(" ", 1)[1]) < 1e-4
    assert _gemm._mode() == "aten"


# bf16 x bf16 -> fp32 (csrc/cpu/gemm_bf16.cpp): only in builds with AVX512-BF16
def _bf16f32():
    ext = _extension.extension()
    if ext is None or not hasattr(ext, "gemm_bf16f32_available"):
        pytest.skip("extension not built")
    if not ext.gemm_bf16f32_available():
        pytest.skip("fastllm._C built without AVX512-BF16")
    return ext


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (13, 7, 3), (37, 45, 19), (150, 70, 515),
                                   (300, 33, 2), (12, 32, 256)])
def test_bf16f32_matches_fp64(m, n, k):
    """Summed in fp32 and never rounded to bf16: fp32-level error against fp64 (at::mm of bf16,
    which rounds its output, is ~2^-9 off and would fail), overwrite and accumulate; odd sizes
    run the edge tiles, k 515 three k blocks with an odd last one, m 150 two row blocks."""
    ext = _bf16f32()
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
    # the packing's layouts: pairs of k read as one word where k is contiguous (a row-major; b
    # the transpose of a row-major (n, k), as attention's K^T), element by element elsewhere:
    # the same bits either way
    a_cols, b_rows = a.t().contiguous().t(), b.t().contiguous().t()
    for x, y in ((a_cols, b), (a, b_rows), (a_cols, b_rows)):
        other = torch.empty(m, n)
        ext.gemm_bf16f32_cpu(x, y, other, False)
        assert torch.equal(other, plain), (x.stride(), y.stride())


def test_bf16f32_strided_operands_and_threads():
    """Transposed and sliced operands, an out whose rows are wider than n; the same bits with 1
    thread as with 2, whose work splits differ (one block of rows: 4 groups of column panels
    with 1 thread, 8 with 2; every element is one task's, summed in a fixed order)."""
    ext = _bf16f32()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1000, 100, generator=g).bfloat16().t()       # (100, 1000), column-major
    b = torch.randn(1000, 1400, generator=g).bfloat16()[:, ::2]   # (1000, 700), column stride 2
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
    assert torch.equal(one, out)


def test_bf16f32_empty_and_bad_arguments():
    ext = _bf16f32()
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
    """`fastllm bench --ops gemm`'s bf16 -> fp32 rows at tiny sizes: three providers per shape
    and fastllm's error note, fp32-level where torch.mm's bf16 output is not."""
    _bf16f32()
    from fastllm.bench import bench_gemm

    monkeypatch.setattr(bench_gemm, "SHAPES", [])
    monkeypatch.setattr(bench_gemm, "BF16_SHAPES", [("b", 40, 24, 70, True)])
    rows = bench_gemm.run(progress=lambda *_: None)
    assert [r["provider"] for r in rows] == ["torch.mm bf16 (bf16 out)",
                                             "torch.mm of fp32 copies", "fastllm bf16 -> fp32"]
    assert all(r["time_ms"] > 0 for r in rows)
    ours, theirs = (float(x.split(",")[0]) for x in rows[-1]["note"].split("fastllm ")[1:2] +
                    rows[-1]["note"].split("torch.mm bf16 ")[1:2])
    assert ours < 1e-4 < theirs


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


@pytest.mark.parametrize("mode", ["aten", "onednn"])
def test_addmm_refuses_an_input_that_does_not_broadcast_with_beta_0(monkeypatch, mode):
    """beta=0 ignores the input's values (nan included), not its shape: the oneDNN route took a
    (3, 4) input for a (7, 9) product, where torch.addmm (and the aten route) refuse it."""
    if mode == "onednn" and not _gemm._usable():
        pytest.skip("no oneDNN fp32 GEMM here")
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
