"""fastllm._backend.select_kernel, the backend choice of the model ops (rms_norm, swiglu,
rotary_embedding, attention, fused_linear_cross_entropy, lora_linear), through the ops
themselves: a call a compiled kernel cannot take (fp64, an extension built before the op) runs
the reference unless a backend was forced, and then it says why; a forced backend the op has no
kernel for is refused by name."""

import contextlib
import importlib
import os
import threading

import pytest
import torch

import fastllm
from fastllm import _backend, _extension
from fastllm.ops.attention import attention
from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from fastllm.ops.lora_linear import lora_linear
from fastllm.ops.rms_norm import rms_norm
from fastllm.ops.rotary_embedding import rotary_embedding
from fastllm.ops.swiglu import geglu, geglu_linear, swiglu, swiglu_linear


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "rms_norm": lambda: rms_norm(r(3, 8), r(8)),
        "swiglu": lambda: swiglu(r(3, 8), r(3, 8)),
        "geglu": lambda: geglu(r(3, 8), r(3, 8)),
        "rotary_embedding": lambda: rotary_embedding(r(1, 4, 2, 8), r(1, 4, 1, 8), r(1, 4, 8),
                                                     r(1, 4, 8))[0],
        "attention": lambda: attention(r(1, 5, 2, 8), r(1, 5, 1, 8), r(1, 5, 1, 8)),
        "fused_linear_cross_entropy": lambda: fused_linear_cross_entropy(
            r(5, 8), r(11, 8), torch.tensor([1, 0, 10, -100, 3])),
        # with dropout, forward and backward: the cpp backend's dropout-add (the entry checked)
        # runs in dX's backward only
        "lora_linear": lambda: _lora_with_grad(r(5, 8), r(6, 8), r(2, 8), r(6, 2)),
    }


def _lora_with_grad(x, w, a, b):
    x.requires_grad_()  # dX is where the backward adds the dropped low-rank term
    y = lora_linear(x, w, a, b, 2.0, dropout_p=0.3, seed=11)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    return torch.cat([y.detach().flatten(), dx.flatten()])


OPS = list(_inputs(torch.float32))
# the cpp function each op's cpp backend calls first
CPP_ENTRY = {"rms_norm": "rms_norm_cpu", "swiglu": "swiglu_cpu", "geglu": "geglu_cpu",
             "rotary_embedding": "rotary_embedding_cpu", "attention": "attention_cpu",
             "fused_linear_cross_entropy": "fused_linear_cross_entropy_cpu",
             "lora_linear": "lora_dropout_add_cpu"}
# ops whose compiled kernel (cpp, or triton on the CPU under the interpreter) refuses fp64
FP64_REFUSED = [("attention", "cpp"), ("fused_linear_cross_entropy", "cpp"),
                ("fused_linear_cross_entropy", "triton"), ("rms_norm", "triton"),
                ("swiglu", "triton"), ("geglu", "triton"), ("rotary_embedding", "triton")]

needs_cpp = pytest.mark.skipif(_backend.unavailable_reason("cpp", "cpu") is not None,
                               reason="fastllm._C is not built")


def _run(op, dtype, backend=None):
    call = _inputs(dtype)[op]
    with fastllm.use_backend(backend):
        return call()


@pytest.mark.parametrize("op,backend", FP64_REFUSED)
def test_fp64_forced_kernel_says_why(op, backend):
    if _backend.unavailable_reason(backend, "cpu") is not None:
        pytest.skip(_backend.unavailable_reason(backend, "cpu"))
    with pytest.raises(RuntimeError, match=rf"fastllm\.{op}: backend '{backend}' was forced but "
                                           r"its kernels take float32, bfloat16, float16, not "
                                           r"torch\.float64"):
        _run(op, torch.float64, backend)


@needs_cpp
@pytest.mark.parametrize("op", ["attention", "fused_linear_cross_entropy"])
def test_fp64_unforced_runs_the_reference(op):
    got = _run(op, torch.float64)
    assert got.dtype == torch.float64
    assert torch.equal(got, _run(op, torch.float64, "ref"))


@needs_cpp
@pytest.mark.parametrize("op", OPS)
def test_extension_without_the_entry(op, monkeypatch):
    """An extension built before the op: the reference runs (same result as forcing ref), and a
    forced cpp says to rebuild."""
    real = _extension.extension()

    class Stale:
        def __getattr__(self, name):
            if name == CPP_ENTRY[op]:
                raise AttributeError(name)
            return getattr(real, name)

    expected = _run(op, torch.float32, "ref")
    monkeypatch.setattr(_extension, "extension", lambda: Stale())
    assert torch.equal(_run(op, torch.float32), expected)
    with pytest.raises(RuntimeError, match=rf"fastllm\.{op}: backend 'cpp' was forced but "
                                           rf"fastllm\._C predates {CPP_ENTRY[op]}; rebuild it"):
        _run(op, torch.float32, "cpp")


def test_forced_backend_without_a_kernel_is_refused_by_name():
    """FASTLLM_BACKEND=cuda on a GPU reaches ops whose GPU path is Triton: refused by name (it was
    a KeyError), before anything changes."""
    galore = importlib.import_module("fastllm.ops.galore_adam_step")  # (the module)

    with pytest.raises(RuntimeError, match=r"fastllm\.galore_adam_step: backend 'cuda' was forced "
                                           r"but this op has no cuda kernel \(it has cpp, ref, "
                                           r"triton\)"):
        _backend.implementation("galore_adam_step", galore._IMPLS, "cuda")


def test_forced_backend_the_op_lacks():
    if _backend.unavailable_reason("triton", "cpu") is not None:
        pytest.skip(_backend.unavailable_reason("triton", "cpu"))
    with pytest.raises(RuntimeError, match=r"fastllm\.attention: backend 'triton' was forced but "
                                           r"this op has no triton kernel \(it has cpp, ref\)"):
        _run("attention", torch.float32, "triton")


class _NoopMode(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: with one active, ops go through the dispatcher."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _forward_needing_grads(op, leaves=None):
    """The op's output from inputs that require grad (appended to `leaves` if given)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        t = torch.randn(*shape, generator=g).requires_grad_()
        if leaves is not None:
            leaves.append(t)
        return t

    cos, sin = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    return {
        "rms_norm": lambda: rms_norm(r(3, 8), r(8)),
        "swiglu": lambda: swiglu(r(3, 8), r(3, 8)),
        "geglu": lambda: geglu(r(3, 8), r(3, 8)),
        "rotary_embedding": lambda: rotary_embedding(r(1, 4, 2, 8), r(1, 4, 1, 8), cos, sin)[0],
        "attention": lambda: attention(r(1, 5, 2, 8), r(1, 5, 1, 8), r(1, 5, 1, 8)),
        # (reduction "none": grads computed in the backward, not in the forward)
        "fused_linear_cross_entropy": lambda: fused_linear_cross_entropy(
            r(5, 8), r(11, 8), torch.tensor([1, 0, 10, -100, 3]), reduction="none"),
        "lora_linear": lambda: lora_linear(r(5, 8), torch.randn(6, 8, generator=g), r(2, 8),
                                           r(6, 2), 2.0, dropout_p=0.3, seed=11),
        # the patched MLP's SwiGLU + down projection, an autograd.Function of its own
        "swiglu_linear": lambda: swiglu_linear(r(3, 8), r(3, 8), r(5, 8), r(5)),
        "geglu_linear": lambda: geglu_linear(r(3, 8), r(3, 8), r(5, 8), r(5)),
    }[op]()


@pytest.mark.parametrize("dispatcher", [False, True], ids=["direct", "dispatcher"])
@pytest.mark.parametrize("op", OPS + ["swiglu_linear", "geglu_linear"])
def test_backward_on_another_thread_runs_on_the_forward_backend(op, dispatcher, monkeypatch):
    """use_backend holds for one thread, and autograd runs the backward of CUDA tensors on a
    device thread of its own: a forward forced to ref had its backward on Triton (an H200,
    2026-12-04). The backward, run here on another thread, selects the forward's backend, on
    the eager path and through the dispatcher (a mode active)."""
    seen, errors = [], []
    real = _backend.select

    def spy(name, *args):
        seen.append((name, _backend.forced_backend()))
        return real(name, *args)

    with fastllm.use_backend("ref"), (_NoopMode() if dispatcher else contextlib.nullcontext()):
        y = _forward_needing_grads(op)
    monkeypatch.setattr(_backend, "select", spy)

    def backward():
        try:
            y.float().sum().backward()
        except Exception as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    if not seen and not dispatcher and op in ("swiglu_linear", "geglu_linear"):
        # in plain eager code these nodes keep the kernels their forward picked (no select in
        # the backward): the forward's backend by construction
        assert y.grad_fn.backend == "ref"
        return
    assert seen and all(forced == "ref" for _, forced in seen), seen


@pytest.mark.parametrize("op", OPS)
def test_plain_eager_calls_skip_the_dispatcher_and_compute_the_same(op):
    """In plain eager code an op with autograd runs as an autograd.Function of its own forward,
    setup_context and backward, without the dispatcher's Python round trip (fastllm._library
    plain_eager: on an H200 the patched step's host cost, not its kernels, set its time); with
    a mode active (or under torch.compile, or on DTensors) it goes through torch.ops as before.
    Both give the same output and gradients, bit for bit."""
    results = {}
    for path, mode in (("direct", contextlib.nullcontext()), ("dispatcher", _NoopMode())):
        leaves = []
        with mode:
            y = _forward_needing_grads(op, leaves)
        grads = torch.autograd.grad(y.float().sum(), leaves)
        results[path] = (y.detach(), grads, type(y.grad_fn).__name__)
    (y0, g0, n0), (y1, g1, n1) = results["direct"], results["dispatcher"]
    assert torch.equal(y0, y1) and len(g0) == len(g1) > 0
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert n0.startswith("Direct_") and not n1.startswith("Direct_"), (n0, n1)


def test_jit_trace_records_the_op():
    """torch.jit.trace records torch.ops calls: on the eager path it would record only the ATen
    ops around the kernel (a replay read uninitialised memory), so a trace takes the dispatcher."""
    x, w = torch.randn(3, 8), torch.randn(8)
    traced = torch.jit.trace(lambda x, w: rms_norm(x, w), (x, w))
    assert "fastllm::rms_norm" in str(traced.graph)
    x2, w2 = torch.randn(4, 8), torch.randn(8)
    torch.testing.assert_close(traced(x2, w2), rms_norm(x2, w2))


@pytest.mark.parametrize("op", ["rms_norm", "fused_linear_cross_entropy", "lora_linear"])
def test_eager_backward_fills_no_zeros_for_non_differentiable_outputs(op):
    """The eager path's backward gets None, not zeros, for the non-differentiable outputs (rstd,
    the fused loss's precomputed grads, LoRA's xa): autograd would otherwise allocate and fill
    them on every backward (a weight-sized tensor for the fused loss), only to ignore them."""
    from torch.profiler import profile

    from fastllm.ops import fused_linear_cross_entropy, lora_linear, rms_norm

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    y = {"rms_norm": lambda: rms_norm(r(3, 8), r(8)),
         "fused_linear_cross_entropy": lambda: fused_linear_cross_entropy(
             r(5, 8), r(11, 8), torch.tensor([1, 0, 10, -100, 3])),
         "lora_linear": lambda: lora_linear(r(5, 8), torch.randn(6, 8, generator=g), r(2, 8),
                                            r(6, 2), 2.0)}[op]()
    loss, seed = y.sum(), torch.ones(())
    assert type(y.grad_fn).__name__.startswith("Direct_")
    with profile() as prof:
        loss.backward(seed)
    filled = [e.name for e in prof.events()
              if e.name in ("aten::zeros", "aten::zero_", "aten::fill_")]
    assert not filled, filled


def test_list_ops_take_tensor_subclasses_under_no_grad():
    """The no_grad fast path of the list ops (l2norm, the AdamW steps) skipped the dispatcher for
    any tensor: a wrapper subclass (as DTensor is) reached the kernel, which read its data
    pointer, and segfaulted. Run in a child process, so a crash fails this test only."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from torch.testing._internal.two_tensor import TwoTensor\n"
        "from fastllm.ops import adamw_step, l2norm\n"
        "def step(make):\n"
        "    p, g, m, v = make(0.0), make(1.0), make(1.0), make(1.0)\n"
        "    adamw_step([p], [g], [m], [v], [], [torch.tensor(1.0)], lr=0.1, beta1=0.9,\n"
        "               beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False,\n"
        "               maximize=False)\n"
        "    return p\n"
        "with torch.no_grad():\n"
        "    n = l2norm([TwoTensor(torch.full((4,), 3.0), torch.full((4,), 4.0))])\n"
        "    two = step(lambda x: TwoTensor(torch.full((4,), x), torch.full((4,), x)))\n"
        "    plain = step(lambda x: torch.full((4,), x))\n"
        "assert (float(n.a), float(n.b)) == (6.0, 8.0), n\n"
        "assert torch.equal(two.a, plain) and torch.equal(two.b, plain), (two, plain)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_environment_reads_follow_os_environ(monkeypatch):
    """_backend.getenv (FASTLLM_BACKEND and the CPU policies, read at every op call) reads
    os.environ's own mapping: it sees every set and delete through os.environ (monkeypatch's
    included) as os.environ.get does, and a backend forced on one thread is not another's."""
    name = "FASTLLM_TEST_GETENV"
    assert _backend.getenv(name) is None and _backend.getenv(name, "d") == "d"
    monkeypatch.setenv(name, "a")
    assert _backend.getenv(name) == os.environ.get(name) == "a"
    os.environ[name] = "b"
    assert _backend.getenv(name) == "b"
    monkeypatch.delenv(name)
    assert _backend.getenv(name) is None
    monkeypatch.setattr(os, "environ", {name: "c"})  # replaced by a plain mapping (a mock's)
    assert _backend.getenv(name) == "c"
    monkeypatch.undo()
    assert _backend.getenv(name) is None
    monkeypatch.setenv("FASTLLM_BACKEND", "ref")
    assert _backend.forced_backend() == "ref"
    monkeypatch.setenv("FASTLLM_BACKEND", "fortran")
    with pytest.raises(ValueError, match="FASTLLM_BACKEND='fortran'"):
        _backend.forced_backend()
    monkeypatch.delenv("FASTLLM_BACKEND")
    seen = []
    with fastllm.use_backend("ref"):
        worker = threading.Thread(target=lambda: seen.append(_backend.forced_backend()))
        worker.start()
        worker.join()
        assert _backend.forced_backend() == "ref"
    assert seen == [None] and _backend.forced_backend() is None
