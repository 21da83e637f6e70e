"""fastllm::l2norm: the global L2 norm of many tensors in one pass.

    l2norm(tensors) -> Tensor      # 0-dim on the tensors' device: fp64 if all are fp64, else fp32

sqrt(sum over every element of every tensor of x^2), what torch.nn.utils.clip_grad_norm_
computes with norm_type=2, read once. Squares are accumulated in fp32 (fp64 for fp64 tensors)
per chunk and the chunk sums added in fp64. The result is inf or nan when any element is, which
is how fastllm.optim.AdamW detects overflowed grads in the same pass as the clipping norm.
tensors: any floating-point dtypes (bf16, fp16, fp32, fp64, mixed), one device, dense and
contiguous.

Backends: cpp (CPU), cuda and triton (GPU; triton on CPU under TRITON_INTERPRET=1), and
`l2norm_ref`.
"""

import torch

from fastllm import _backend, _extension
from fastllm._library import lib

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("cuda", "triton", "ref")}


def out_dtype(tensors):
    """l2norm's result dtype: fp64 when every tensor is fp64 (as torch.nn.utils.get_total_norm
    returns fp64 for fp64 grads), else fp32."""
    fp64 = bool(tensors) and all(t.dtype == torch.float64 for t in tensors)
    return torch.float64 if fp64 else torch.float32


def l2norm_ref(tensors):
    """Plain-PyTorch global norm, accumulated in fp64; a 0-dim tensor of `out_dtype(tensors)`."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t in tensors:
        total += t.to(torch.float64).square().sum()
    return total.sqrt().to(out_dtype(tensors))


def _compiled(name):
    def run(tensors):
        fn = getattr(_extension.extension(), name, None)
        if fn is None:
            raise NotImplementedError(f"fastllm.l2norm: fastllm._C has no {name}; rebuild it "
                                      f"(pip install --no-build-isolation -e .)")
        return fn(tensors)

    return run


def _l2norm_triton(tensors):
    from fastllm.kernels.l2norm import l2norm_triton

    norm = l2norm_triton(tensors)
    # None: a CUDA graph capture before the launch's table exists (an upload cannot be
    # captured); the reference's torch ops capture.
    return l2norm_ref(tensors) if norm is None else norm


_IMPLS = {"ref": l2norm_ref, "cpp": _compiled("l2norm_cpu"), "triton": _l2norm_triton,
          "cuda": _compiled("l2norm_cuda")}


def check_l2norm_args(tensors):
    """Raise TypeError/ValueError naming the first bad tensor."""
    device = tensors[0].device
    for i, t in enumerate(tensors):
        where = f"fastllm.l2norm: tensors[{i}]"
        if t.layout != torch.strided:
            raise TypeError(f"{where} is {t.layout}; only dense tensors are supported")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{where} has dtype {t.dtype}; expected a floating-point dtype")
        if t.device != device:
            raise ValueError(f"{where} is on {t.device}, tensors[0] on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{where} is not contiguous; call .contiguous() first")


def _l2norm_impl(tensors):
    if not _backend.prevalidated():
        check_l2norm_args(tensors)
    device_type = tensors[0].device.type
    backend = _backend.select("l2norm", device_type, _PREFERENCE.get(device_type, ("ref",)))
    with _backend.device_guard(tensors[0].device):
        return _IMPLS[backend](tensors)


lib.impl("l2norm", _l2norm_impl, "CPU")
lib.impl("l2norm", _l2norm_impl, "CUDA")


@torch.library.register_fake("fastllm::l2norm")
def _l2norm_fake(tensors):
    return tensors[0].new_empty((), dtype=out_dtype(tensors))


def l2norm(tensors):
    """Functional form of the op (see the module docstring); 0 for an empty list."""
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    if _backend.direct(tensors):  # the torch.ops round trip skipped in plain eager code
        return _l2norm_impl(tensors)
    return torch.ops.fastllm.l2norm(tensors)
