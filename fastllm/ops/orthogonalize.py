"""fastllm::orthogonalize: Gram-Schmidt on the columns of many tall-skinny matrices, in place.

    orthogonalize(matrices, epsilon=0.0) -> None

matrices: 2-D (n, r) tensors with r <= n, fp32 or fp64, dense, contiguous, one device. Column by
column (modified Gram-Schmidt, torch's powerSGD_hook order): x_i /= ||x_i|| + epsilon, then x_i
is removed from every later column. Afterwards the columns are orthonormal and span the same
nested subspaces as before (what PowerSGD's P and Q and GaLore's range finder need). With
epsilon 0 a zero column stays zero (torch's hook would produce nan).

Backends: cpp (CPU), triton (GPU, fp32; CPU under TRITON_INTERPRET=1), `orthogonalize_ref`.
"""

import torch

from fastllm import _backend, _extension
from fastllm._library import lib

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_PREFERENCE_FP64 = {"cpu": ("cpp", "ref"), "cuda": ("ref",)}


def orthogonalize_ref(matrices, epsilon=0.0):
    """Plain-PyTorch modified Gram-Schmidt, in place, in each matrix's dtype."""
    for x in matrices:
        r = x.shape[1] if x.dim() == 2 else 0
        for i in range(r):
            col = x[:, i:i + 1]
            denom = col.norm() + epsilon
            col.mul_(torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom)))
            if i + 1 < r:
                rest = x[:, i + 1:]
                rest -= (col * rest).sum(dim=0, keepdim=True) * col


def _cpp(matrices, epsilon):
    _extension.extension().orthogonalize_cpu(matrices, epsilon)


def _triton(matrices, epsilon):
    from fastllm.kernels.orthogonalize import orthogonalize_triton

    orthogonalize_triton(matrices, epsilon)


_IMPLS = {"ref": orthogonalize_ref, "cpp": _cpp, "triton": _triton}


def check_orthogonalize_args(matrices, epsilon):
    """Raise TypeError/ValueError naming the first bad matrix; touches nothing."""
    if not epsilon >= 0:
        raise ValueError(f"fastllm.orthogonalize: epsilon must be >= 0, got {epsilon}")
    if not matrices:
        return
    device, dtype = matrices[0].device, matrices[0].dtype
    for i, x in enumerate(matrices):
        where = f"fastllm.orthogonalize: matrices[{i}]"
        if x.layout != torch.strided:
            raise TypeError(f"{where} is {x.layout}; only dense tensors are supported")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{where} has dtype {x.dtype}; expected float32 or float64")
        if x.dtype != dtype or x.device != device:
            raise ValueError(f"{where} is {x.dtype} on {x.device}; matrices[0] is {dtype} on "
                             f"{device}")
        if x.dim() != 2 or x.shape[1] > x.shape[0]:
            raise ValueError(f"{where} has shape {tuple(x.shape)}; expected (n, r) with r <= n")
        if not x.is_contiguous():
            raise ValueError(f"{where} is not contiguous; call .contiguous() first")


def _orthogonalize_impl(matrices, epsilon=0.0):
    check_orthogonalize_args(matrices, epsilon)
    if not matrices:
        return
    device_type = matrices[0].device.type
    table = _PREFERENCE_FP64 if matrices[0].dtype == torch.float64 else _PREFERENCE
    backend = _backend.select("orthogonalize", device_type, table.get(device_type, ("ref",)))
    if backend == "triton" and matrices[0].dtype == torch.float64:
        raise RuntimeError("fastllm.orthogonalize: the triton backend computes in float32; "
                           "float64 matrices run on cpp or ref")
    with _backend.device_guard(matrices[0].device):
        _IMPLS[backend](matrices, float(epsilon))


lib.impl("orthogonalize", _orthogonalize_impl, "CPU")
lib.impl("orthogonalize", _orthogonalize_impl, "CUDA")


@torch.library.register_fake("fastllm::orthogonalize")
def _orthogonalize_fake(matrices, epsilon=0.0):
    check_orthogonalize_args(matrices, epsilon)


def orthogonalize(matrices, epsilon=0.0):
    """Functional form of the op (see the module docstring); a no-op for an empty list."""
    matrices = list(matrices)
    if matrices:
        torch.ops.fastllm.orthogonalize(matrices, epsilon=float(epsilon))
