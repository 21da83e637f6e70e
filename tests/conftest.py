import contextlib
import os

import pytest

# Triton kernels run on CPU tensors only through the interpreter, which must be chosen before
# triton is first imported. On a machine with a GPU the kernels run natively instead.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402

import torch  # noqa: E402

# examples/parallel_train.py is the tests' multi-layout training loop; spawned ranks inherit
# sys.path, so they import it too
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))

import fastllm  # noqa: E402

CPU_BACKENDS = ["ref", "cpp", "triton"]
CUDA_BACKENDS = ["ref", "triton", "cuda"]


def backend_device_params(without=()):
    """(backend, device) pairs that can run here: the CPU ones always, the CUDA ones on a GPU.
    without: backends the op has no kernel for (e.g. "cuda" where Triton is the GPU path)."""
    params = [pytest.param(b, "cpu", id=f"{b}-cpu") for b in CPU_BACKENDS if b not in without]
    if torch.cuda.is_available():
        params += [pytest.param(b, "cuda", id=f"{b}-cuda") for b in CUDA_BACKENDS
                   if b not in without]
    out = []
    for p in params:
        backend, device = p.values
        reason = fastllm._backend.unavailable_reason(backend, device)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        out.append(pytest.param(backend, device, id=p.id, marks=marks))
    return out


# Bad one-element scalar arguments of the fused optimizer ops (grad_scale, clip_coef, found_inf),
# each with the error and message the op must raise before it writes anything:
# (name, make, error, match), ids in BAD_SCALAR_IDS. An op without clip_coef skips those cases.
BAD_SCALARS = [
    ("found_inf", lambda: torch.tensor([0.0, 1.0]), ValueError, "found_inf must have one element"),
    ("found_inf", lambda: torch.zeros(0), ValueError, "found_inf must have one element, has 0"),
    ("grad_scale", lambda: torch.zeros(0), ValueError, "grad_scale must have one element"),
    ("clip_coef", lambda: torch.tensor([0.5, 2.0]), ValueError, "clip_coef must have one element"),
    ("grad_scale", lambda: torch.tensor(4), TypeError, "grad_scale has dtype torch.int64"),
    ("found_inf", lambda: torch.tensor([1], dtype=torch.int32), TypeError, "found_inf has dtype"),
    ("clip_coef", lambda: torch.tensor(0.5, device="meta"), ValueError, "clip_coef is on meta"),
    ("grad_scale", lambda: torch.tensor(4.0, device="meta"), ValueError, "grad_scale is on meta"),
]
BAD_SCALAR_IDS = ["fi2", "fi0", "gs0", "cc2", "gs_int", "fi_int", "cc_meta", "gs_meta"]


@contextlib.contextmanager
def gemm_bf16f32(on):
    """fastllm._C's bf16 x bf16 -> fp32 GEMM forced on (True: its default engine here; "fastllm"
    or "mkl": that engine) or off (False) for the block, then back to its default (None leaves
    it there); skips the test where the GEMM, or the engine asked for, does not exist."""
    if fastllm._backend.unavailable_reason("cpp", "cpu"):
        pytest.skip("no cpp backend")
    ext = fastllm._extension.extension()
    if isinstance(on, str):
        try:
            ext.set_gemm_bf16f32_engine(on)
        except RuntimeError as exc:
            pytest.skip(str(exc))
    if on and not ext.gemm_bf16f32_available():
        ext.set_gemm_bf16f32_engine(None)
        pytest.skip("no bf16 x bf16 -> fp32 GEMM here (no AVX512-BF16 build, no MKL)")
    ext.set_gemm_bf16f32(None if on is None else bool(on))
    try:
        yield
    finally:
        ext.set_gemm_bf16f32(None)  # the default
        ext.set_gemm_bf16f32_engine(None)


# the bf16 x bf16 -> fp32 GEMM's engines, forced one at a time (conftest.gemm_bf16f32)
BF16F32_ENGINES = ["fastllm", "mkl"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (pytestmark = pytest.mark.usefixtures("one_thread")): an
    in-process training run then computes bit for bit what its copy in another process does."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
