"""fastllm::scaled_copy: a scaled, casting copy between many tensor pairs in one pass.

    scaled_copy(dst, src, scale, divisor=None)       # in place on dst, returns nothing

dst[i] = src[i] * (scale / divisor), the product computed in fp32 and rounded to nearest even
into dst[i]'s dtype. dst[i] and src[i] are contiguous, on one device, with equal numel (shapes may
differ, so a tensor can be copied into a flat slice of a bucket and back). Dtypes: fp32, bf16,
fp16 in any combination. divisor: an optional one-element floating-point tensor (a loss scale),
on any device, read once.

It is the pack/unpack step of fastllm.distributed's flat gradient buckets and the cast of its
low-precision DDP comm hooks (1/world-size and the loss-scale unscale folded into the cast).

Backends: cpp (CPU), triton (GPU; CPU under TRITON_INTERPRET=1), and `scaled_copy_ref`.
"""

import torch

from fastllm import _backend, _extension
from fastllm._library import lib
from fastllm.ops._overlap import refuse_overlap
from fastllm.ops._lr import ieee_div
from fastllm.ops._scalar_args import check_scalar_tensor

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}


def _factor(scale, divisor):
    """scale / divisor as one fp32 value (a Python float holding it exactly)."""
    factor = float(scale)
    if divisor is not None:
        factor = ieee_div(factor, divisor.item())
    return float(torch.tensor(factor, dtype=torch.float32))


def scaled_copy_ref(dst, src, scale, divisor=None):
    """Plain PyTorch: the oracle and the fallback."""
    factor = _factor(scale, divisor)
    for d, s in zip(dst, src):
        d.view(-1).copy_(s.reshape(-1).to(torch.float32) * factor)


def _scaled_copy_cpp(dst, src, scale, divisor=None):
    fn = getattr(_extension.extension(), "scaled_copy_cpu", None)
    if fn is None:
        raise NotImplementedError("fastllm.scaled_copy: fastllm._C has no scaled_copy_cpu; "
                                  "rebuild it (pip install --no-build-isolation -e .)")
    fn(dst, src, scale, divisor)


def _scaled_copy_triton(dst, src, scale, divisor=None):
    from fastllm.kernels.scaled_copy import scaled_copy_triton

    scaled_copy_triton(dst, src, _factor(scale, divisor))


_IMPLS = {"ref": scaled_copy_ref, "cpp": _scaled_copy_cpp, "triton": _scaled_copy_triton}


def check_scaled_copy_args(dst, src, scale, divisor):
    """Raise TypeError/ValueError naming the first bad tensor; touches nothing."""
    if len(dst) != len(src):
        raise ValueError(f"fastllm.scaled_copy: dst has {len(dst)} tensors, src has {len(src)}")
    if divisor is not None:  # (read on the host by every backend: any device)
        check_scalar_tensor("fastllm.scaled_copy", "divisor", divisor)
    if not dst:
        return
    device = dst[0].device
    for i, (d, s) in enumerate(zip(dst, src)):
        for name, t in (("dst", d), ("src", s)):
            where = f"fastllm.scaled_copy: {name}[{i}]"
            if t.layout != torch.strided:
                raise TypeError(f"{where} is {t.layout}; only dense tensors are supported")
            if t.dtype not in _SUPPORTED:
                raise TypeError(f"{where} has dtype {t.dtype}; expected float32, bfloat16 or "
                                f"float16")
            if t.device != device:
                raise ValueError(f"{where} is on {t.device}, dst[0] on {device}")
            if not t.is_contiguous():
                raise ValueError(f"{where} is not contiguous")
        if d.numel() != s.numel():
            raise ValueError(f"fastllm.scaled_copy: dst[{i}] has {d.numel()} elements, src[{i}] "
                             f"has {s.numel()}")


def check_no_overlap(dst, src):
    """Raise ValueError when a dst shares memory with another dst or with a src other than its
    own pair's identical tensor (an in-place scale); torch's copy_ refuses the same. The backends
    write pairs in parallel, so such a copy would read values already written."""
    def in_place(i, s):  # (equal numel: the same elements, scaled in place)
        return s.data_ptr() == dst[i].data_ptr() and s.dtype == dst[i].dtype

    refuse_overlap("fastllm.scaled_copy", ((f"dst[{i}]", d) for i, d in enumerate(dst)),
                   ((f"src[{i}]", s) for i, s in enumerate(src) if not in_place(i, s)),
                   hint="a dst may overlap only its own src, exactly")


def _scaled_copy_impl(dst, src, scale, divisor=None):
    check_scaled_copy_args(dst, src, scale, divisor)
    check_no_overlap(dst, src)
    if not dst:
        return
    device_type = dst[0].device.type
    backend = _backend.select("scaled_copy", device_type, _PREFERENCE.get(device_type, ("ref",)))
    if backend == "cuda":  # no hand-written CUDA kernel: Triton is the GPU path
        backend = "triton"
    with _backend.device_guard(dst[0].device):
        _IMPLS[backend](dst, src, scale, divisor)


lib.impl("scaled_copy", _scaled_copy_impl, "CPU")
lib.impl("scaled_copy", _scaled_copy_impl, "CUDA")


@torch.library.register_fake("fastllm::scaled_copy")
def _scaled_copy_fake(dst, src, scale, divisor=None):
    check_scaled_copy_args(dst, src, scale, divisor)


def scaled_copy(dst, src, scale=1.0, divisor=None):
    """Functional form of the op (see the module docstring); a no-op for empty lists."""
    dst, src = list(dst), list(src)
    if not dst and not src:
        return
    torch.ops.fastllm.scaled_copy(dst, src, float(scale), divisor)
