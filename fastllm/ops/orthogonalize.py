"""fastllm::orthogonalize: Gram-Schmidt on the columns of many tall-skinny matrices, in place.

    orthogonalize(matrices, epsilon=0.0) -> None

matrices: 2-D (n, r) tensors with r <= n, fp32 or fp64, dense, contiguous, one device. Column by
column (modified Gram-Schmidt, torch's powerSGD_hook order): q_i = x_i / (||x_i|| + epsilon), then
q_i is removed from every later column, x_j -= (q_i . x_j) q_i. Afterwards the columns are
orthonormal or zero and span the same nested subspaces as before (what PowerSGD's P and Q and
GaLore's range finder need).

A column that depends on the earlier ones (a rank-deficient input: duplicated columns, a gradient
of rank < r, one nonzero row) keeps only rounding residue after the removals; normalised, that
residue would be a "unit" column along the earlier ones, not orthogonal to them (torch's hook
does that). So a column whose norm after the removals is at most tol times its norm before them
is set to zero instead (multiplied by 0: a nan or inf in it stays visible), with

    tol = DEPENDENCE_C * r * eps,   DEPENDENCE_C = 16,   eps = torch.finfo(dtype).eps.

Why: take x_j = sum_k c_k q_k in the span of the earlier (orthonormal to rounding) q_k, and u =
eps / 2. One removal leaves, relative to ||x_j||, the error of the sum q_k . x (g <= ~2u: summed
in double in the C++ kernel, by torch's cascade sum here, in per-block trees in Triton), the
rounding of the product and of the subtraction (2u) and q_k's own norm error (~2(g + u)): at most
3g + 4u ~ 5 eps. Over at most r - 1 removals the residue is below 5 r eps ||x_j||; tol is 3x
that (measured: at most 0.55 r eps on ref and cpp, 2 r eps on Triton with n = 1e5, whose fp32
sum over 391 row blocks is sequential). With epsilon 0 a zero column stays zero (torch's hook
would produce nan).

Twice is enough: a kept column's residue is relative to its first norm, so after one pass of
removals a column that cancelled down to a small fraction of that norm is off orthogonal by up to
residue / norm (up to 5/16 for a column kept just above tol; the bound above also assumes the
earlier columns well conditioned, MGS losing orthogonality as eps * cond, Bjorck, BIT 7, 1967).
So a kept column whose norm fell below 1/sqrt(2) of its first one (REORTHOGONALIZE on the
squares) is projected once more against the finished q_0 .. q_{i-1} (classical Gram-Schmidt:
c = Q^T x_i, x_i -= Q c) before it is normalised; one more pass leaves it orthogonal to working
precision (Kahan's "twice is enough", Parlett, The Symmetric Eigenvalue Problem, 1980, sec. 6-9;
Giraud, Langou, Rozloznik, Comput. Math. Appl. 50, 2005). Whether a column is dependent is still
decided by its norm after the first pass, so a dependent column still comes out exactly zero.

Normalising cannot overflow: the norms are fp64, so a kept fp32 column can have a norm below
1/FLT_MAX (~2.9e-39: subnormal values, e.g. a gradient of 1e-40) whose 1 / (norm + epsilon) is
inf in fp32 (the column came out inf and nan). When inv = 1 / (norm + epsilon) exceeds SPLIT =
2^64 (so every |x| <= norm < 2^-64) the column is multiplied first by 2^64 (exact: no overflow,
subnormals scale up exactly) and then by fp32(inv / 2^64) (finite: inv <= 2^149). For a column
whose fp32(inv) is finite and normal the product is the same real number rounded once, so its
result is bitwise what x * fp32(inv) gives; every other column is multiplied by 1 first (exact).

Backends: cpp (CPU), triton (GPU, fp32; CPU under TRITON_INTERPRET=1), `orthogonalize_ref`; the
same sums in another order.
"""

import math

import torch

from fastllm import _backend, _extension
from fastllm._library import lib

DEPENDENCE_C = 16  # see the module docstring; as csrc/cpu/ and kernels/orthogonalize.py
# A kept column whose squared norm after the removals is below this fraction of its first one
# (its norm below 1/sqrt(2) of it) is projected a second time (module docstring)
REORTHOGONALIZE = 0.5
# An inv above this is applied as this times inv / this (module docstring): 2^64, exact
SPLIT = 2.0 ** 64
_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_PREFERENCE_FP64 = {"cpu": ("cpp", "ref"), "cuda": ("ref",)}


def dependence_tol(r, dtype):
    """The relative norm at or below which a column counts as dependent (module docstring)."""
    return DEPENDENCE_C * r * torch.finfo(dtype).eps


def orthogonalize_ref(matrices, epsilon=0.0):
    """Plain-PyTorch modified Gram-Schmidt, in place, in each matrix's dtype (norms in fp64)."""
    for x in matrices:
        if x.dim() != 2 or x.numel() == 0:
            continue
        r = x.shape[1]
        # Norms as sums of squares: torch's sum is a cascade (error ~ eps), its norm of a strided
        # column one sequential sum (squared, 6.6e-5 off for 16384 equal fp32 values). In fp64,
        # as the C++ kernel's: fp32 squares of a column of 1e-25 are 0, of 1e21 inf.
        def squares(t, dim=None):
            t = t.double()
            return (t * t).sum() if dim is None else (t * t).sum(dim=dim)

        first = squares(x, 0)
        limit = first.sqrt() * dependence_tol(r, x.dtype)
        for i in range(r):
            col = x[:, i:i + 1]
            norm2 = squares(col)
            keep = norm2.sqrt() > limit[i]
            if i > 0:
                # the second pass (module docstring), as masked arithmetic rather than an `if`
                # on the device's value; `prev` holds the finished q_0 .. q_{i-1}
                prev = x[:, :i]
                again = keep & (norm2 < REORTHOGONALIZE * first[i])
                proj = (prev * (prev * col).sum(dim=0, keepdim=True)).sum(dim=1, keepdim=True)
                col -= torch.where(again, proj, torch.zeros_like(proj))
                norm2 = torch.where(again, squares(col), norm2)
            norm = norm2.sqrt()
            inv = torch.where(keep, 1.0 / (norm + epsilon), torch.zeros_like(norm))
            # (x 0, not zero_(): a nan or inf stays visible.) A column of norm below 1/FLT_MAX
            # (subnormal fp32 values) has an inv that is inf in fp32: such a column (any of norm
            # below 2^-64) is first scaled up by 2^64, exactly (module docstring)
            big = inv > SPLIT
            col.mul_(torch.where(big, SPLIT, 1.0).to(x.dtype))
            col.mul_(torch.where(big, inv * (1.0 / SPLIT), inv).to(x.dtype))
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
    # inf passes `>= 0` but makes every 1 / (norm + epsilon) zero: each column comes out zero
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"fastllm.orthogonalize: epsilon must be finite and >= 0, got {epsilon}")
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
    impl = _backend.implementation("orthogonalize", _IMPLS, backend)
    with _backend.device_guard(matrices[0].device):
        impl(matrices, float(epsilon))


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
