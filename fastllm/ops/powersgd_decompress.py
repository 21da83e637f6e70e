"""fastllm::powersgd_decompress: PowerSGD's decompression and error update in one pass.

    powersgd_decompress(matrices, ps, qs, local_qs, errors, scale) -> None

For each i, with M = matrices[i] (n, m), P = ps[i] (n, r), Q = qs[i] (m, r) and
Q_local = local_qs[i] (m, r):
    errors[i] = M - P Q_local^T   (when errors is not empty);   M = scale * P Q^T
M holds the local gradient (error already added back), P the all-reduced orthonormal factor,
Q_local = M^T P this rank's factor and Q the all-reduced (summed) one, scale = 1 / world size.
Afterwards M is the averaged low-rank gradient and errors[i] = (I - P P^T) M the local
compression error that error feedback adds back next step (PowerSGD's, arXiv:1905.13727
Algorithm 1). All tensors fp32 or fp64 (one dtype), dense, contiguous, one device; errors[i]
has M's shape; errors and local_qs are both empty or both full.

Backends: cpp (CPU), triton (GPU, fp32; CPU under TRITON_INTERPRET=1),
`powersgd_decompress_ref`.
"""

import torch

from fastllm import _backend, _extension
from fastllm._library import lib

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_PREFERENCE_FP64 = {"cpu": ("cpp", "ref"), "cuda": ("ref",)}


def powersgd_decompress_ref(matrices, ps, qs, local_qs, errors, scale):
    """Plain PyTorch: two matmuls, a subtraction and a copy per matrix."""
    for i, (mat, p, q) in enumerate(zip(matrices, ps, qs)):
        if errors:
            torch.sub(mat, p @ local_qs[i].t(), out=errors[i])
        mat.copy_((p @ q.t()) * scale)


def _cpp(matrices, ps, qs, local_qs, errors, scale):
    _extension.extension().powersgd_decompress_cpu(matrices, ps, qs, local_qs, errors, scale)


def _triton(matrices, ps, qs, local_qs, errors, scale):
    from fastllm.kernels.powersgd_decompress import powersgd_decompress_triton

    powersgd_decompress_triton(matrices, ps, qs, local_qs, errors, scale)


_IMPLS = {"ref": powersgd_decompress_ref, "cpp": _cpp, "triton": _triton}


def check_powersgd_decompress_args(matrices, ps, qs, local_qs, errors):
    """Raise TypeError/ValueError naming the first bad tensor; touches nothing."""
    op = "fastllm.powersgd_decompress"
    if len(ps) != len(matrices) or len(qs) != len(matrices):
        raise ValueError(f"{op}: {len(matrices)} matrices but {len(ps)} ps and {len(qs)} qs")
    if len(errors) != len(local_qs) or (errors and len(errors) != len(matrices)):
        raise ValueError(f"{op}: errors has {len(errors)} tensors and local_qs "
                         f"{len(local_qs)}; expected both 0 or both {len(matrices)}")
    if not matrices:
        return
    device, dtype = matrices[0].device, matrices[0].dtype
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: matrices[0] has dtype {dtype}; expected float32 or float64")
    for i, mat in enumerate(matrices):
        p, q = ps[i], qs[i]
        named = [("matrices", mat), ("ps", p), ("qs", q)]
        if errors:
            named += [("errors", errors[i]), ("local_qs", local_qs[i])]
        for name, t in named:
            where = f"{op}: {name}[{i}]"
            if t.layout != torch.strided:
                raise TypeError(f"{where} is {t.layout}; only dense tensors are supported")
            if t.dtype != dtype or t.device != device:
                raise TypeError(f"{where} is {t.dtype} on {t.device}; expected {dtype} on "
                                f"{device}")
            if t.dim() != 2:
                raise ValueError(f"{where} has shape {tuple(t.shape)}; expected a matrix")
            if not t.is_contiguous():
                raise ValueError(f"{where} is not contiguous; call .contiguous() first")
        if p.shape[0] != mat.shape[0] or q.shape[0] != mat.shape[1] or p.shape[1] != q.shape[1]:
            raise ValueError(f"{op}: matrices[{i}] {tuple(mat.shape)}, ps[{i}] {tuple(p.shape)} "
                             f"and qs[{i}] {tuple(q.shape)} do not fit M (n, m), P (n, r), "
                             f"Q (m, r)")
        if errors and errors[i].shape != mat.shape:
            raise ValueError(f"{op}: errors[{i}] has shape {tuple(errors[i].shape)}, "
                             f"matrices[{i}] {tuple(mat.shape)}")
        if errors and local_qs[i].shape != q.shape:
            raise ValueError(f"{op}: local_qs[{i}] has shape {tuple(local_qs[i].shape)}, "
                             f"qs[{i}] {tuple(q.shape)}")


def _impl(matrices, ps, qs, local_qs, errors, scale):
    check_powersgd_decompress_args(matrices, ps, qs, local_qs, errors)
    if not matrices:
        return
    device_type = matrices[0].device.type
    table = _PREFERENCE_FP64 if matrices[0].dtype == torch.float64 else _PREFERENCE
    backend = _backend.select("powersgd_decompress", device_type,
                              table.get(device_type, ("ref",)))
    if backend == "triton" and matrices[0].dtype == torch.float64:
        raise RuntimeError("fastllm.powersgd_decompress: the triton backend computes in "
                           "float32; float64 matrices run on cpp or ref")
    impl = _backend.implementation("powersgd_decompress", _IMPLS, backend)
    with _backend.device_guard(matrices[0].device):
        impl(matrices, ps, qs, local_qs, errors, float(scale))


lib.impl("powersgd_decompress", _impl, "CPU")
lib.impl("powersgd_decompress", _impl, "CUDA")


@torch.library.register_fake("fastllm::powersgd_decompress")
def _fake(matrices, ps, qs, local_qs, errors, scale):
    check_powersgd_decompress_args(matrices, ps, qs, local_qs, errors)


def powersgd_decompress(matrices, ps, qs, local_qs, errors, scale):
    """Functional form of the op (see the module docstring); local_qs and errors may be None."""
    matrices = list(matrices)
    if matrices:
        torch.ops.fastllm.powersgd_decompress(matrices, list(ps), list(qs), list(local_qs or []),
                                              list(errors or []), float(scale))
