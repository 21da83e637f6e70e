"""fastllm.ops.lora_linear against the plain-PyTorch oracle (lora_linear_ref) on every backend.

Low-precision tolerances follow the house rule: the op's error against an fp64 evaluation of the
same maths (same dropout mask) must be at most twice PyTorch's own error at that precision
(lora_linear_ref run in bf16/fp16), for the output and for every gradient.
"""

import sys
import warnings

import pytest
import torch

import fastllm
from fastllm.ops.lora_linear import (
    dropout_threshold,
    lora_dropout_mask_ref,
    lora_linear,
    lora_linear_ref,
)

from _model_ops import check_close
from conftest import backend_device_params

BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]  # GPU path is triton
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (leading dims of x, in_features, out_features, r): odd sizes, no multiple of any block size.
SHAPES = [((37,), 123, 77, 1), ((3, 11), 123, 77, 64), ((1,), 7, 130, 5)]


def _inputs(lead, k, n, r, dtype, device, bias, x_grad=True):
    torch.manual_seed(0)
    x = torch.randn(*lead, k, dtype=dtype, device=device, requires_grad=x_grad)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    a = (torch.randn(r, k, device=device) / k**0.5).to(dtype).requires_grad_()
    b = torch.randn(n, r, device=device).to(dtype).requires_grad_()
    bias_t = torch.randn(n, device=device).to(dtype).requires_grad_() if bias else None
    return x, w, a, b, bias_t


def _grads(y, inputs, g):
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return [y] + list(torch.autograd.grad(y, wanted, g))


def _check_close(name, got, torch_lp, oracle, dtype):
    """got, torch_lp: results at dtype; oracle: the same maths in fp64 (_model_ops.check_close:
    fp32 1e-5 relative, low precision twice PyTorch's error or an ulp at the largest value)."""
    check_close(name, got, torch_lp, oracle, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES,
                         ids=lambda s: "x".join(map(str, s[0])) + f"-{s[1]}-{s[2]}-r{s[3]}")
# bias and dropout are independent code paths: three of the four pairs cover both (and keep the
# number of Triton compilations on a GPU down)
@pytest.mark.parametrize("bias,dropout_p", [(False, 0.0), (False, 0.25), (True, 0.25)],
                         ids=["nobias-p0", "nobias-p.25", "bias-p.25"])
def test_output_and_grads_match_ref(backend, device, dtype, shape, bias, dropout_p):
    if backend == "triton" and device == "cuda" and (dtype == torch.float16 or shape == SHAPES[2]):
        # each case compiles several kernel variants and the GPU check has a time budget: fp16
        # and M = 1 run through the interpreter on CPU, fp16 on the GPU in test_small_bias_rank1
        # and test_triton_multi_tile_other_dtypes.
        pytest.skip("GPU compile budget")
    lead, k, n, r = shape
    inputs = _inputs(lead, k, n, r, dtype, device, bias)
    x, w, a, b, bias_t = inputs
    before = [t.detach().clone() for t in inputs if t is not None]
    scaling, seed = 0.7, 1234
    g = torch.randn(*lead, n, device=device).to(dtype)

    with fastllm.use_backend(backend):
        y = lora_linear(x, w, a, b, scaling, bias_t, dropout_p, seed=seed)
        got = _grads(y, inputs, g)
    assert y.dtype == dtype and y.shape == (*lead, n)
    for t, t0 in zip([t for t in inputs if t is not None], before):
        assert torch.equal(t.detach(), t0), "an input changed"

    torch_lp = _grads(lora_linear_ref(x, w, a, b, scaling, bias_t, dropout_p, seed), inputs, g)
    inputs64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad)
                for t in inputs]
    x64, w64, a64, b64, bias64 = inputs64
    oracle = _grads(lora_linear_ref(x64, w64, a64, b64, scaling, bias64, dropout_p, seed),
                    inputs64, g.double())
    names = ["y", "dx", "dA", "dB", "dbias"]
    for name, u, v, o in zip(names, got, torch_lp, oracle):
        _check_close(name, u, v, o, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_small_bias_rank1(backend, device, dtype):
    """bias and r=1 together, at a size the Triton interpreter runs quickly."""
    x, w, a, b, bias_t = inputs = _inputs((19,), 33, 21, 1, dtype, device, bias=True)
    g = torch.randn(19, 21, device=device).to(dtype)
    with fastllm.use_backend(backend):
        got = _grads(lora_linear(x, w, a, b, 2.0, bias_t, 0.1, seed=7), inputs, g)
    torch_lp = _grads(lora_linear_ref(x, w, a, b, 2.0, bias_t, 0.1, 7), inputs, g)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    oracle = _grads(lora_linear_ref(*inputs64[:4], 2.0, inputs64[4], 0.1, 7), inputs64, g.double())
    for name, u, v, o in zip(["y", "dx", "dA", "dB", "dbias"], got, torch_lp, oracle):
        _check_close(name, u, v, o, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_grads_only_where_required(backend, device):
    """x without grad (a first layer): A and B still get correct grads; W stays frozen."""
    x, w, a, b, _ = _inputs((9,), 20, 12, 4, torch.float32, device, bias=False, x_grad=False)
    with fastllm.use_backend(backend):
        y = lora_linear(x, w, a, b, 0.5, None, 0.3, seed=3)
        y.sum().backward()
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    lora_linear_ref(x, w, ref_a, ref_b, 0.5, None, 0.3, 3).sum().backward()
    assert x.grad is None and w.grad is None
    torch.testing.assert_close(a.grad, ref_a.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, ref_b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_noncontiguous_and_empty(backend, device):
    x, w, a, b, _ = _inputs((6,), 10, 8, 3, torch.float32, device, bias=False)
    xt = x.detach().t().contiguous().t().requires_grad_()  # same values, column-major
    with fastllm.use_backend(backend):
        y = lora_linear(xt, w, a, b, 1.5)
        empty = torch.zeros(0, 10, device=device, requires_grad=True)
        y0 = lora_linear(empty, w, a, b, 1.5, dropout_p=0.5)
        (y.sum() + y0.sum()).backward()
    torch.testing.assert_close(y, lora_linear_ref(x, w, a, b, 1.5), rtol=1e-5, atol=1e-6)
    assert y0.shape == (0, 8) and empty.grad.shape == (0, 10)
    ref0 = lora_linear_ref(empty.detach(), w.detach(), a.detach(), b.detach(), 1.5, dropout_p=0.5)
    assert ref0.shape == (0, 8)  # (the reference reshaped to -1 columns: no rows, no answer)
    for out_f, in_f in ((0, 10), (8, 0)):  # a layer with no outputs or no inputs, as F.linear
        x0, w0, a0, b0, _ = _inputs((2, 3), in_f, out_f, 3, torch.float32, device, bias=False)
        with fastllm.use_backend(backend):
            lora_linear(x0, w0, a0, b0, 1.5).sum().backward()
        assert x0.grad.shape == (2, 3, in_f) and a0.grad.shape == (3, in_f)
        assert b0.grad.shape == (out_f, 3)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_dropout_same_seed_same_result_and_kept_fraction(backend, device):
    """W = 0, A = B = I: y = dropout(x) exposes the backend's mask through the op itself."""
    rows, k, p = 64, 64, 0.3
    x = torch.ones(rows, k, device=device)
    w = torch.zeros(k, k, device=device)
    eye = torch.eye(k, device=device)
    with fastllm.use_backend(backend):
        y1 = lora_linear(x, w, eye, eye, 1.0, dropout_p=p, seed=42)
        y2 = lora_linear(x, w, eye, eye, 1.0, dropout_p=p, seed=42)
        y3 = lora_linear(x, w, eye, eye, 1.0, dropout_p=p, seed=43)
        y_eval = lora_linear(x, w, eye, eye, 1.0, dropout_p=p, training=False, seed=42)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)
    assert torch.equal(y_eval, x)
    keep = lora_dropout_mask_ref(42, rows, k, p, device=device)
    torch.testing.assert_close(y1, keep.float() / (1 - p), rtol=1e-6, atol=0)
    kept = (y1 != 0).double().mean().item()
    n = rows * k
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5


def test_default_seed_follows_torch_manual_seed():
    x = torch.ones(8, 16)
    w, eye = torch.zeros(16, 16), torch.eye(16)
    torch.manual_seed(5)
    y1 = lora_linear(x, w, eye, eye, 1.0, dropout_p=0.5)
    torch.manual_seed(5)
    y2 = lora_linear(x, w, eye, eye, 1.0, dropout_p=0.5)
    y3 = lora_linear(x, w, eye, eye, 1.0, dropout_p=0.5)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_statistics(p):
    """The hash mask keeps 1 - p of the elements, independently of its neighbours."""
    rows, cols = 1024, 1024
    keep = lora_dropout_mask_ref(2024, rows, cols, p).double()
    n = rows * cols
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    both_cols = (keep[:, 1:] * keep[:, :-1]).mean().item()
    both_rows = (keep[1:] * keep[:-1]).mean().item()
    for both in (both_cols, both_rows):
        assert abs(both - (1 - p) ** 2) < 10 * sigma
    assert dropout_threshold(p) == round(p * 2**24)


@pytest.mark.skipif(not fastllm.has_cpp(), reason="fastllm._C is not built")
def test_cpp_dropout_kernel_matches_mask():
    ext = fastllm._extension.extension()
    if not hasattr(ext, "lora_dropout_cpu"):
        pytest.skip("fastllm._C predates lora_dropout_cpu (make build)")
    x = torch.randn(300, 517)
    p, seed = 0.2, 99
    keep = lora_dropout_mask_ref(seed, 300, 517, p)
    expected = torch.where(keep, x / (1 - p), 0.0)
    torch.testing.assert_close(ext.lora_dropout_cpu(x, p, seed), expected)
    out = torch.randn(300, 517)
    expected = out + 0.5 * torch.where(keep, x / (1 - p), 0.0)
    ext.lora_dropout_add_cpu(out, x, p, seed, 0.5)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_opcheck(backend, device):
    x, w, a, b, bias_t = _inputs((2, 5), 24, 16, 4, torch.float32, device, bias=True)
    seed = torch.tensor(17)
    with fastllm.use_backend(backend):
        for p in (0.0, 0.2):
            torch.library.opcheck(torch.ops.fastllm.lora_linear, (x, w, a, b, 0.5, bias_t, p, seed))
        y, xa = torch.ops.fastllm.lora_linear(x, w, a, b, 0.5, bias_t, 0.2, seed)
        g = torch.randn_like(y)
        for mask in ([True, True, True], [False, True, False]):
            torch.library.opcheck(
                torch.ops.fastllm.lora_linear_backward,
                (g, x.detach(), w, a.detach(), b.detach(), xa, 0.5, 0.2, seed, mask),
            )


def test_torch_compile_fullgraph():
    """One compiled graph (forward and backward) runs every CPU backend: the op stays opaque."""
    x, w, a, b, bias_t = inputs = _inputs((4, 7), 24, 16, 4, torch.float32, "cpu", bias=True)
    seed = torch.tensor(5)

    def step(x, w, a, b, bias_t):
        return lora_linear(x, w, a, b, 0.5, bias_t, 0.1, seed=seed).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    backends = [p.values[0] for p in BACKENDS if p.values[1] == "cpu" and not p.marks]
    # Inductor's on-disk caches do not key on a custom op's fake implementation: a cache written
    # before the fake changed would replay stale output layouts.
    with torch._inductor.config.patch(force_disable_caches=True):
        for backend in backends:
            with fastllm.use_backend(backend):
                eager = torch.autograd.grad(step(*inputs), [x, a, b, bias_t])
                got = torch.autograd.grad(compiled(*inputs), [x, a, b, bias_t])
            for u, v in zip(got, eager):
                torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast(dtype):
    x, w, a, b, bias_t = _inputs((10,), 32, 24, 4, torch.float32, "cpu", bias=True)
    with torch.autocast("cpu", dtype=dtype):
        y = lora_linear(x, w, a, b, 0.5, bias_t)
        y.float().sum().backward()
    assert y.dtype == dtype and a.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    lp = [t.detach().to(dtype) for t in (x, w, a, b, bias_t)]
    assert torch.equal(y, lora_linear(*lp[:4], 0.5, lp[4]))  # autocast only casts the inputs


def test_autocast_leaves_fp64_alone():
    """Autocast never casts fp64 (ATen's is_eligible): F.linear keeps fp64 inputs fp64 under
    bf16 autocast, and so do lora_linear and lora_linear_multi (they cast to bf16)."""
    from fastllm.ops.lora_linear_multi import lora_linear_multi

    x, w, a, b, bias_t = _inputs((3,), 8, 6, 2, torch.float64, "cpu", bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.linear(x, w).dtype == torch.float64
        y = lora_linear(x, w, a, b, 0.5, bias_t)
        ys = lora_linear_multi(x, [w], [a], [b], [0.5], [bias_t])
    want = lora_linear(x, w, a, b, 0.5, bias_t)
    assert y.dtype == ys[0].dtype == torch.float64
    assert torch.equal(y, want) and torch.equal(ys[0], want)


def test_multi_under_autocast_and_compiled_with_onednn_routing(monkeypatch):
    """lora_linear_multi casts under autocast before its dtype checks, as lora_linear and
    F.linear do (fp32 x on a bf16 model was refused, crashing a patched model); and it compiles
    in one graph with fp32 matmuls routed through oneDNN (its autograd.Function body called the
    extension, which dynamo cannot trace)."""
    from fastllm import _gemm
    from fastllm.ops.lora_linear_multi import lora_linear_multi

    x = torch.randn(5, 16)
    ws = [torch.randn(8, 16), torch.randn(4, 16)]
    adapters = [torch.randn(2, 16), torch.randn(8, 2)]
    args = (ws, [adapters[0], None], [adapters[1], None], [0.5, 1.0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = lora_linear_multi(x, *(([t.bfloat16() for t in ws],) + args[1:]))
    want = lora_linear_multi(x.bfloat16(), [t.bfloat16() for t in ws],
                             [adapters[0].bfloat16(), None], [adapters[1].bfloat16(), None],
                             [0.5, 1.0])
    assert all(y.dtype == torch.bfloat16 and torch.equal(y, w) for y, w in zip(ys, want))
    xg = x.clone().requires_grad_()

    def f(x):
        return sum(y.square().sum() for y in lora_linear_multi(x, *args))

    for route in (r for r in ("onednn", "avx2") if _gemm._usable(r)):  # fastllm's fp32 GEMMs
        monkeypatch.setenv(_gemm.ENV, route)
        torch._dynamo.reset()
        got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(xg), xg)
        torch.testing.assert_close(got, torch.autograd.grad(f(xg), xg), rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments_without_touching_anything():
    x, w, a, b, _ = _inputs((4,), 8, 6, 2, torch.float32, "cpu", bias=False)
    cases = [
        ((x, w, a, b.t(), 1.0), {}, ValueError),  # B in the wrong orientation
        ((x, w, a[:, :5], b, 1.0), {}, ValueError),
        ((x, w, a, b, 1.0), {"dropout_p": 1.0}, ValueError),
        ((x, w, a, b, float("nan")), {}, ValueError),
        ((x, w.double(), a, b, 1.0), {}, TypeError),
        ((x, w, a, b, 1.0), {"bias": torch.zeros(5)}, ValueError),
    ]
    for args, kwargs, exc in cases:
        with pytest.raises(exc, match="fastllm.lora_linear"):
            lora_linear(*args, **kwargs)
    assert x.grad is None and a.grad is None


def test_saved_activations_are_x_and_xa():
    """The backward keeps x (usually alive anyway) and the r-wide xa, never a mask or dropout(x)."""
    x, w, a, b, bias_t = _inputs((64,), 48, 40, 4, torch.float32, "cpu", bias=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_linear(x, w, a, b, 0.5, bias_t, dropout_p=0.1, seed=1)
    shapes = sorted(tuple(t.shape) for t in saved if t.numel() > 0)
    assert (64, 48) in shapes and (4, 64) in shapes  # x, and xa_t = A dropout(x)^T
    assert sum(1 for t in saved if tuple(t.shape) == (64, 48)) == 1  # x only, no mask, no copy
    assert not any(t.dtype == torch.bool for t in saved)


def test_triton_kernels_compile_for_sm86():
    """The interpreter runs the kernels but never compiles them: compile the largest configs for
    sm_86 here, the smallest shared-memory limit (sm_90's are compiled, with their launches as
    recorded in production, by `make kernel-check`, .ci/kernel_check.py; bench/device_check.sh
    compiles every config for sm_80/86/89/90)."""
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    if not hasattr(JITFunction, "_pack_args"):  # the script binds arguments as Triton 3.5+ does
        pytest.skip(f"the compile check needs Triton >= 3.5 (this is {triton.__version__})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "lora_compile_check.py")
    proc = subprocess.run([sys.executable, script, "--quick", "--archs", "86"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if " B shared of " in line]
    assert len(lines) >= 12 and all(line.endswith(" ok") for line in lines), proc.stdout
    for kernel in ("_lora_down_kernel", "_lora_up_kernel", "_lora_pq_kernel"):
        assert any(kernel in line and "sm_86" in line for line in lines), kernel


# The Triton path on CPU (interpreter) and GPU: shapes past every block size, so each kernel runs
# several tiles and the masked edges, at the ranks LoRA uses. On the CPU the sizes stay small; on a
# GPU (bench/device_check.sh) they are larger, and long enough for the unsplit reductions.
TRITON_DEVICES = [p for p in backend_device_params() if p.values[0] == "triton"]
TRITON_RANKS = [1, 16, 64, 128]


def _triton_case(device, dtype, lead, k, n, r, dropout_p=0.1, scaling=0.5, seed=11):
    inputs = _inputs(lead, k, n, r, dtype, device, bias=True)
    x, w, a, b, bias_t = inputs
    g = torch.randn(*lead, n, device=device).to(dtype)
    with fastllm.use_backend("triton"):
        got = _grads(lora_linear(x, w, a, b, scaling, bias_t, dropout_p, seed=seed), inputs, g)
    torch_lp = _grads(lora_linear_ref(x, w, a, b, scaling, bias_t, dropout_p, seed), inputs, g)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    oracle = _grads(lora_linear_ref(*inputs64[:4], scaling, inputs64[4], dropout_p, seed),
                    inputs64, g.double())
    for name, u, v, o in zip(["y", "dx", "dA", "dB", "dbias"], got, torch_lp, oracle):
        _check_close(f"{name} r={r}", u, v, o, dtype)


@pytest.mark.parametrize("backend,device", TRITON_DEVICES)
@pytest.mark.parametrize("r", TRITON_RANKS)
@pytest.mark.parametrize("unsplit", [False, True], ids=["split", "unsplit"])
def test_triton_multi_tile_ranks(backend, device, r, unsplit, monkeypatch):
    """bf16 (the dtype LoRA trains in) at every rank block; M, N, K above the block sizes."""
    import fastllm.kernels.lora_linear as K

    if unsplit:  # long-M launches store xa and dY B in place instead of summing partials
        monkeypatch.setattr(K, "_TARGET_PROGRAMS", 1)
    lead, k, n = ((2, 37), 150, 140) if device == "cpu" else ((11, 47), 389, 263)
    _triton_case(device, torch.bfloat16, lead, k, n, r)


@pytest.mark.parametrize("backend,device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_multi_tile_other_dtypes(backend, device, dtype):
    lead, k, n = ((70,), 150, 140) if device == "cpu" else ((11, 47), 389, 263)
    _triton_case(device, dtype, lead, k, n, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/device_check.sh)")
@pytest.mark.parametrize("r", [16, 128])
def test_triton_gpu_long_m(r):
    """A long M (16500 rows: more row blocks than _TARGET_PROGRAMS), the unsplit GPU path."""
    _triton_case("cuda", torch.bfloat16, (16500,), 256, 320, r)


def test_triton_out_of_resources_falls_back_once(monkeypatch):
    """A GPU without the shared memory a config needs: one warning, then the reference."""
    triton_errors = pytest.importorskip("triton.runtime.errors")
    import fastllm.kernels.lora_linear as K

    ops = sys.modules["fastllm.ops.lora_linear"]
    calls = []

    def out_of_resources(kernel, grid, args, meta):
        calls.append(kernel)
        raise triton_errors.OutOfResources(300000, 232448, "shared memory")

    reason = fastllm._backend.unavailable_reason("triton", "cpu")
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(K, "_launch", out_of_resources)
    monkeypatch.setitem(ops._PREFERENCE, "cpu", ("triton", "ref"))  # as CUDA tensors choose
    monkeypatch.setattr(ops, "_TRITON_OUT_OF_RESOURCES", set())
    x, w, a, b, bias_t = inputs = _inputs((9,), 20, 12, 4, torch.float32, "cpu", bias=True)
    with pytest.warns(RuntimeWarning, match="do not fit this GPU"):
        y = lora_linear(x, w, a, b, 0.5, bias_t, 0.2, seed=3)
    assert len(calls) == 1
    got = _grads(y, inputs, torch.ones_like(y))
    expected = _grads(lora_linear_ref(x, w, a, b, 0.5, bias_t, 0.2, 3), inputs, torch.ones_like(y))
    for u, v in zip(got, expected):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # once: no second warning or attempt
        lora_linear(x, w, a, b, 0.5, bias_t, 0.2, seed=3).sum().backward()
    assert len(calls) == 1
    other_rank = _inputs((9,), 20, 12, 40, torch.float32, "cpu", bias=False)[:4]
    with pytest.warns(RuntimeWarning):  # another rank block has its own config
        lora_linear(*other_rank, 0.5)
    monkeypatch.setattr(ops, "_TRITON_OUT_OF_RESOURCES", set())
    with fastllm.use_backend("triton"), pytest.raises(triton_errors.OutOfResources):
        lora_linear(x, w, a, b, 0.5)  # a forced backend says why instead of falling back


@pytest.mark.parametrize("backend,device", TRITON_DEVICES)
@pytest.mark.parametrize("unsplit", [False, True], ids=["split", "unsplit"])
def test_triton_rounds_to_nearest(backend, device, unsplit, monkeypatch):
    """xa and y in bf16 are the fp32 results rounded to nearest even, as a GPU rounds: the
    interpreter truncates a plain cast, which the 2x-PyTorch-error bound alone would let pass."""
    import fastllm.kernels.lora_linear as K

    if unsplit:
        monkeypatch.setattr(K, "_TARGET_PROGRAMS", 1)
    x, w, a, b, bias_t = _inputs((70,), 150, 140, 16, torch.bfloat16, device, bias=True)
    # W = 0: y is then exactly the seed the kernel writes for the base GEMM to add to
    w = torch.zeros_like(w)
    p, seed, scaling = 0.25, 9, 0.5
    with fastllm.use_backend("triton"), torch.no_grad():
        y, xa_t = torch.ops.fastllm.lora_linear(x, w, a, b, scaling, bias_t, p, torch.tensor(seed))
    xd = lora_dropout_mask_ref(seed, 70, 150, p, device=device) * (x / (1 - p))  # rounded once
    exact_xa = (a.double() @ xd.double().t()).to(torch.bfloat16)
    low_rank = scaling * xa_t.double().t() @ b.detach().double().t()
    exact_y = (bias_t.detach().double() + low_rank).bfloat16()
    for name, got, exact in (("xa", xa_t, exact_xa), ("y", y, exact_y)):
        # fp32 accumulation may differ from fp64 in the last place rarely; truncation in ~half
        mismatch = (got != exact).double().mean().item()
        assert mismatch < 0.02, f"{name}: {mismatch:.1%} of elements not rounded to nearest"


# --- fp32 adapters on a bf16/fp16 base (PEFT's autocast_adapter_dtype) -------------------------

@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias,dropout_p", [(False, 0.0), (True, 0.25)],
                         ids=["nobias-p0", "bias-p.25"])
def test_fp32_adapters_on_low_precision_base(backend, device, dtype, bias, dropout_p,
                                             monkeypatch):
    """y, dx in the base dtype, dA and dB in fp32, each no further from fp64 than twice what
    PEFT's composition gets; inputs untouched; the triton backend through its own kernels."""
    import fastllm.kernels.lora_linear as K

    launched = []
    real_launch = K._launch
    monkeypatch.setattr(K, "_launch", lambda kernel, grid, args, meta: launched.append(kernel)
                        or real_launch(kernel, grid, args, meta))
    inputs = _inputs((3, 11), 123, 77, 5, dtype, device, bias)
    x, w, a, b, bias_t = inputs
    a = a.detach().float().requires_grad_()
    b = b.detach().float().requires_grad_()
    inputs = (x, w, a, b, bias_t)
    before = [t.detach().clone() for t in inputs if t is not None]
    scaling, seed = 0.7, 1234
    g = torch.randn(3, 11, 77, device=device).to(dtype)
    with fastllm.use_backend(backend):
        got = _grads(lora_linear(x, w, a, b, scaling, bias_t, dropout_p, seed=seed), inputs, g)
    assert [t.dtype for t in got[:4]] == [dtype, dtype, torch.float32, torch.float32]
    assert bool(launched) == (backend == "triton")
    for t, t0 in zip([t for t in inputs if t is not None], before):
        assert torch.equal(t.detach(), t0), "an input changed"
    # PEFT's composition (the base layer in its dtype, the LoRA branch on x cast to fp32, the
    # sum cast back) is lora_linear_ref's for mixed dtypes
    theirs = _grads(lora_linear_ref(x, w, a, b, scaling, bias_t, dropout_p, seed), inputs, g)
    inputs64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad)
                for t in inputs]
    oracle = _grads(lora_linear_ref(*inputs64[:4], scaling, inputs64[4], dropout_p, seed),
                    inputs64, g.double())
    for name, u, v, o in zip(["y", "dx", "dA", "dB", "dbias"], got, theirs, oracle):
        _check_close(name, u, v, o, dtype)


def test_fp32_adapters_opcheck_multi_and_refusals():
    x, w, a, b, bias_t = _inputs((2, 5), 24, 16, 4, torch.bfloat16, "cpu", bias=True)
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    seed = torch.tensor(17)
    for p in (0.0, 0.2):
        torch.library.opcheck(torch.ops.fastllm.lora_linear, (x, w, a32, b32, 0.5, bias_t, p, seed))
    y, xa = torch.ops.fastllm.lora_linear(x, w, a32, b32, 0.5, bias_t, 0.2, seed)
    assert xa.dtype == torch.float32
    torch.library.opcheck(torch.ops.fastllm.lora_linear_backward,
                          (torch.randn_like(y).detach(), x.detach(), w, a32.detach(),
                           b32.detach(), xa, 0.5, 0.2, seed, [True, True, True]))
    # lora_linear_multi: per projection through lora_linear
    from fastllm.ops.lora_linear_multi import lora_linear_multi

    w2 = torch.randn(8, 24).bfloat16()
    outs = lora_linear_multi(x, [w, w2], [a32, None], [b32, None], [0.5, 1.0], [bias_t, None])
    torch.testing.assert_close(outs[0], lora_linear(x, w, a32, b32, 0.5, bias_t), rtol=0, atol=0)
    torch.testing.assert_close(outs[1], torch.nn.functional.linear(x, w2), rtol=0, atol=0)
    with pytest.raises(TypeError, match="lora_a has dtype torch.float16, x has torch.bfloat16 "
                                        r"\(adapters may be fp32 on a bf16/fp16 base\)"):
        lora_linear(x, w, a.detach().half(), b.detach().half(), 0.5)
    with pytest.raises(TypeError, match="lora_a has dtype torch.float32, lora_b torch.bfloat16"):
        lora_linear(x, w, a32, b, 0.5)
    x32, w32 = x.detach().float(), w.float()
    with pytest.raises(TypeError, match="lora_a has dtype torch.bfloat16, x has torch.float32"):
        lora_linear(x32, w32, a, b, 0.5)


# --- the dropout seed read on the device (CUDA-graph replays draw new masks) --------------------

@pytest.mark.parametrize("backend,device", TRITON_DEVICES)
def test_triton_reads_the_seed_tensor_where_it_is(backend, device, monkeypatch):
    """The Triton kernels get the seed tensor itself (read on the device: no host int baked into
    the launch), and a seed tensor gives what the same int gives, on every backend."""
    import fastllm.kernels.lora_linear as K

    seed = torch.tensor(11, device=device)
    seen = []
    real = K._launch
    monkeypatch.setattr(K, "_launch", lambda kernel, grid, args, meta: seen.append(args)
                        or real(kernel, grid, args, meta))
    inputs = _inputs((5, 7), 40, 24, 4, torch.float32, device, bias=False)
    x, w, a, b, _ = inputs
    g = torch.randn(5, 7, 24, device=device)
    with fastllm.use_backend("triton"):
        got = _grads(lora_linear(x, w, a, b, 0.5, None, 0.3, seed=seed), inputs, g)
    assert seen and all(any(torch.is_tensor(t) and t.numel() == 1 and t.data_ptr() ==
                            seed.data_ptr() for t in args) for args in seen)
    assert not any(isinstance(t, int) and t == 11 for args in seen for t in args)
    for ref_backend in ("ref", "triton"):
        with fastllm.use_backend(ref_backend):
            want = _grads(lora_linear(x, w, a, b, 0.5, None, 0.3, seed=11), inputs, g)
        for u, v in zip(got, want):
            # (atol on the grads' scale: dA sums 35 products of ~15 in fp32, and an entry that
            # cancels to ~1e-3 differs by ~2e-6 between summation orders (Intel Xeon,
            # 2026-12-07); a mask from another seed is off by O(1))
            atol = 1e-6 * float(v.abs().amax().clamp_min(1))
            torch.testing.assert_close(u, v, rtol=1e-5, atol=atol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_replays_draw_new_dropout_masks():
    """A LoRA layer with dropout captured in a CUDA graph: each replay draws its own seed on the
    GPU, so two replays give two masks (a host seed would repeat the captured one), and each
    replay's output is that of its mask."""
    from fastllm.lora import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(64, 48, device="cuda"), r=8, dropout=0.5).train()
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(32, 64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), fastllm.use_backend("triton"):
        for _ in range(2):
            layer(x)  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), fastllm.use_backend("triton"):
        y = layer(x)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y), "the same dropout mask on two replays"


def test_bad_seed_is_refused():
    x, w, a, b, _ = _inputs((3,), 8, 6, 2, torch.float32, "cpu", bias=False)
    for seed in (torch.tensor(1.5), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="seed must be an int or a one-element integer"):
            lora_linear(x, w, a, b, 0.5, None, 0.3, seed=seed)
    # an int32 or one-element seed gives the int's mask
    ys = [lora_linear(x, w, a, b, 0.5, None, 0.3, seed=s)
          for s in (7, torch.tensor(7, dtype=torch.int32), torch.tensor([7]))]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=0, atol=0)

