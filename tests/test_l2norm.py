"""fastllm::l2norm against a float64 reference on every backend that can run here.

Squares are accumulated in fp32 per chunk, so the norm matches the fp64 reference to rtol 1e-5
(the relative error of an fp32 sum of n positive terms is about n * 2^-24 at worst, ~1e-7
typical at these sizes).
"""

import pytest
import torch

import fastllm
from _launches import count_launches
from conftest import backend_device_params as _all_backend_device_params
from fastllm.ops import l2norm, l2norm_ref


def backend_device_params():
    """conftest's (backend, device) pairs. A fastllm._C without this op's kernels fails the
    tests (tests/test_extension.py names the cause) rather than skipping them."""
    return _all_backend_device_params()


SHAPES = [(0,), (1,), (7,), (123, 45), (4097,)]


def reference(tensors):
    return sum(t.double().square().sum() for t in tensors).sqrt()


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_matches_float64_reference(backend, device, dtype):
    tensors = [(torch.randn(s) * 3).to(device=device, dtype=dtype) for s in SHAPES]
    before = [t.clone() for t in tensors]
    with fastllm.use_backend(backend):
        norm = l2norm(tensors)
    # fp64 inputs give an fp64 norm (torch.nn.utils.get_total_norm's dtype), summed in fp64.
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert norm.dtype == expected_dtype and norm.shape == () and norm.device == tensors[0].device
    # fp64: the fp64 sum's rounding (~1e-15 per add); fp32 per-chunk sums allow ~1e-6 and more.
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(norm.double().cpu(), reference(tensors).cpu(), rtol=rtol, atol=0)
    for a, b in zip(tensors, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_mixed_dtypes_and_chunks(backend, device):
    # Several chunks of the C++ kernel (64K elements) and of the Triton launcher's blocks.
    tensors = [torch.randn(150_001).to(device=device, dtype=torch.bfloat16),
               torch.randn(3, device=device), torch.randn(70_000).to(device=device,
                                                                    dtype=torch.float16)]
    with fastllm.use_backend(backend):
        norm = l2norm(tensors)
    torch.testing.assert_close(norm.double().cpu(), reference(tensors).cpu(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_element_makes_the_norm_non_finite(backend, device, bad, dtype):
    tensors = [torch.randn(s).to(device=device, dtype=dtype) for s in [(5,), (4097,), (33,)]]
    tensors[1][1234] = bad
    with fastllm.use_backend(backend):
        norm = l2norm(tensors)
    assert not torch.isfinite(norm)


def test_empty_list_is_zero():
    assert l2norm([]).item() == 0.0


def test_deterministic_across_thread_counts():
    tensors = [torch.randn(300_000).bfloat16(), torch.randn(200_000)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = l2norm(tensors)
        torch.set_num_threads(max(2, threads))
        many = l2norm(tensors)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("case,error,match", [
    ("int", TypeError, "floating-point"),
    ("strided", ValueError, "not contiguous"),
])
def test_bad_input_is_refused(case, error, match):
    bad = {"int": torch.arange(4), "strided": torch.randn(4, 4).t()}[case]
    with pytest.raises(error, match=match):
        l2norm([torch.randn(3), bad])


@pytest.mark.parametrize("backend", ["ref", "cpp"])
def test_opcheck(backend):
    if fastllm._backend.unavailable_reason(backend, "cpu"):
        pytest.skip("backend unavailable")
    tensors = [torch.randn(5).bfloat16(), torch.randn(3, 4)]
    with fastllm.use_backend(backend):
        torch.library.opcheck(torch.ops.fastllm.l2norm.default, (tensors,))


def test_ref_is_the_reference():
    tensors = [torch.randn(100), torch.randn(7).bfloat16()]
    torch.testing.assert_close(l2norm_ref(tensors).double(), reference(tensors), rtol=1e-7,
                               atol=0)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("magnitude", [1e25, 1e-30])
def test_fp64_inputs_accumulate_in_fp64(backend, device, magnitude):
    """Squares of these fp64 values overflow (1e50) or underflow (1e-60) fp32: only an fp64
    accumulator gives the norm, which itself fits fp32 (to its rounding, ~6e-8)."""
    gen = torch.Generator().manual_seed(9)
    tensors = [(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5) * magnitude
               for n in (3, 5000, 70001)]
    tensors = [t.to(device) for t in tensors]
    with fastllm.use_backend(backend):
        norm = fastllm.ops.l2norm(tensors)
    expected = reference([t.cpu() for t in tensors])
    assert torch.isfinite(norm) and norm.item() > 0
    torch.testing.assert_close(norm.double().cpu(), expected, rtol=2e-7, atol=0)


def _triton_only():
    if fastllm._backend.unavailable_reason("triton", "cpu"):
        pytest.skip("triton is not available")


def test_triton_one_launch_many_tensors_and_deterministic(monkeypatch):
    """Mixed dtypes, empty tensors, several chunks and blocks per tensor (small sizes patched
    in): one launch, the fp64 reference's value, the same bits twice (the ticket counter is
    back at 0 after each launch)."""
    _triton_only()
    from fastllm.kernels import l2norm as kernel

    monkeypatch.setattr(kernel, "_sizes", lambda: (64, 2))
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float64]
    tensors = [(torch.randn(0 if i % 4 == 0 else (i * 41) % 300 + 1, generator=gen,
                            dtype=torch.float64) * 3).to(dtypes[i % 4]) for i in range(24)]
    launches = count_launches(monkeypatch, kernel, "_sum_squares_kernel")
    with fastllm.use_backend("triton"):
        first = l2norm(tensors)
        second = l2norm(tensors)
    assert len(launches) == 2
    torch.testing.assert_close(first.double(), reference(tensors), rtol=1e-6, atol=0)
    assert torch.equal(first, second)
    assert all(int(t) == 0 for t in kernel._TICKETS.values())
    with fastllm.use_backend("triton"):
        assert l2norm([torch.zeros(0)]).item() == 0.0
