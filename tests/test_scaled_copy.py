"""fastllm::scaled_copy (the pack/unpack and wire cast of fastllm.distributed) on every backend.

dst = src * (scale / divisor), computed in fp32 and rounded to nearest even, is exactly what
PyTorch computes for `(src.float() * factor).to(dst.dtype)` with factor an fp32 number, so every
backend must match the reference bitwise.
"""

import pytest
import torch

import fastllm
from conftest import backend_device_params
from fastllm.ops import scaled_copy, scaled_copy_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0,), (1,), (7,), (123, 5), (4097,)]


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_matches_reference_bitwise(backend, device, src_dtype, dst_dtype):
    src = [(torch.randn(s) * 100).to(device=device, dtype=src_dtype) for s in SHAPES]
    src[-1][7] = float("inf")
    src[-1][8] = float("nan")
    # flat views into one bucket, as the distributed optimizer packs them
    flat = torch.full((sum(t.numel() for t in src),), 7.0, device=device, dtype=dst_dtype)
    views, off = [], 0
    for t in src:
        views.append(flat[off:off + t.numel()])
        off += t.numel()
    want = [torch.empty(t.numel(), device=device, dtype=dst_dtype) for t in src]
    divisor = torch.tensor(3.0)
    before = [t.clone() for t in src]
    scaled_copy_ref(want, src, 0.5, divisor)
    with fastllm.use_backend(backend):
        scaled_copy(views, src, 0.5, divisor)
    for got, w, s, b in zip(views, want, src, before):
        torch.testing.assert_close(got, w, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(s.view(-1)[~s.view(-1).isnan()], b.view(-1)[~b.view(-1).isnan()])
    # and the reference is the PyTorch expression it claims to be
    factor = float(torch.tensor(0.5 / 3.0, dtype=torch.float32))
    expected = (src[3].float() * factor).to(dst_dtype).view(-1)
    torch.testing.assert_close(views[3], expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_unpack_and_in_place(backend, device):
    flat = torch.randn(4097 + 7, device=device)
    outs = [torch.empty(4097, device=device, dtype=torch.bfloat16),
            torch.empty(7, 1, device=device, dtype=torch.bfloat16)]
    with fastllm.use_backend(backend):
        scaled_copy(outs, [flat[:4097], flat[4097:]], 1.0)
        assert torch.equal(outs[0], flat[:4097].bfloat16())
        assert torch.equal(outs[1].view(-1), flat[4097:].bfloat16())
        x = torch.randn(123, device=device)
        y = x.clone()
        scaled_copy([y], [y], 0.25)  # in place: dst is src
    torch.testing.assert_close(y, x * 0.25, rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_bad_input_is_refused_before_writing(backend, device):
    dst = [torch.zeros(5, device=device), torch.zeros(4, device=device)]
    src = [torch.ones(5, device=device), torch.ones(3, device=device)]
    with fastllm.use_backend(backend):
        with pytest.raises(ValueError, match=r"dst\[1\] has 4 elements, src\[1\] has 3"):
            scaled_copy(dst, src, 1.0)
        with pytest.raises(TypeError, match=r"src\[0\] has dtype torch.int64"):
            scaled_copy([torch.zeros(2, device=device)], [torch.ones(2, dtype=torch.long)], 1.0)
        with pytest.raises(ValueError, match="not contiguous"):
            scaled_copy([torch.zeros(4, 4, device=device).t()], [torch.ones(16, device=device)])
        with pytest.raises(ValueError, match="divisor must have one element"):
            scaled_copy(dst[:1], src[:1], 1.0, torch.ones(2))
    assert not dst[0].any() and not dst[1].any()


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_overlapping_tensors_are_refused(backend, device):
    """Pairs that share memory other than a dst being exactly its own src (swapped pairs, a
    shifted view of one buffer) were copied: the cpp kernel's parallel, in-order copy read
    values it had already written and disagreed with the reference; torch's copy_ refuses."""
    a, b = torch.arange(4.0, device=device), torch.arange(4.0, device=device) + 10
    buf = torch.arange(8.0, device=device)
    with fastllm.use_backend(backend):
        for dst, src in (([a, b], [b, a]), ([buf[2:6]], [buf[0:4]]), ([buf[:4], buf[2:6]],
                                                                    [a, b])):
            before = [t.clone() for t in (a, b, buf)]
            with pytest.raises(ValueError, match="share memory"):
                scaled_copy(dst, src, 2.0)
            assert all(torch.equal(x, y) for x, y in zip(before, (a, b, buf)))
        scaled_copy([buf[:4], buf[4:]], [a, a[None]], 1.0)  # srcs may share memory
    assert torch.equal(buf, torch.tensor([0.0, 1, 2, 3] * 2, device=device))


def test_opcheck():
    dst = [torch.zeros(7), torch.zeros(3, dtype=torch.bfloat16)]
    src = [torch.randn(7, dtype=torch.float16), torch.randn(3)]
    torch.library.opcheck(torch.ops.fastllm.scaled_copy.default, (dst, src, 0.5, None))
    torch.library.opcheck(torch.ops.fastllm.scaled_copy.default,
                          (dst, src, 0.5, torch.tensor(2.0)))


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_zero_divisor_is_ieee_on_every_backend(backend, device):
    """A zero divisor (a loss scale that collapsed) gives inf and nan as the C++ and GPU kernels
    compute them; the reference used to raise ZeroDivisionError instead."""
    src = [torch.tensor([1.0, -2.0, 0.0], device=device)]
    want = [torch.empty(3, device=device)]
    scaled_copy_ref(want, src, 0.5, torch.tensor(0.0))
    assert want[0][0] == float("inf") and want[0][1] == float("-inf") and want[0][2].isnan()
    got = [torch.empty(3, device=device)]
    with fastllm.use_backend(backend):
        scaled_copy(got, src, 0.5, torch.tensor(0.0))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)
