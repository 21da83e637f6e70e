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


@contextlib.contextmanager
def gemm_bf16f32(on):
    """fastllm._C's bf16 x bf16 -> fp32 GEMM forced on (True) or off (False) for the block, then
    back to its default; skips the test when on is asked of a build without AVX512-BF16."""
    if fastllm._backend.unavailable_reason("cpp", "cpu"):
        pytest.skip("no cpp backend")
    ext = fastllm._extension.extension()
    if on and not ext.gemm_bf16f32_available():
        pytest.skip("fastllm._C built without AVX512-BF16")
    ext.set_gemm_bf16f32(on)
    try:
        yield
    finally:
        ext.set_gemm_bf16f32(None)  # the default


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
