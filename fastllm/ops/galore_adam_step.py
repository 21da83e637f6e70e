"""fastllm::galore_adam_step: one GaLore AdamW step of a 2-D parameter.

    galore_adam_step(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1, beta2,
                     eps, weight_decay, scale) -> None

param, grad: (rows, cols), fp32, fp64, bf16 or fp16 (one dtype). proj: orthonormal columns,
(rows, r) when left else (cols, r). exp_avg, exp_avg_sq: the low-rank moments, (r, cols) when
left else (rows, r). proj and the moments are fp32 (fp64 for an fp64 param). step: the step
count, already incremented. Maths (GaLore, arXiv:2403.03507, with torch.optim.AdamW's rule):
    R = P^T G (left) or G P (right)
    m = lerp(m, R, 1 - beta1);  v = beta2 v + (1 - beta2) R^2
    U = m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
    W = (1 - lr wd) W - lr / (1 - beta1^step) * scale * (P U (left) or U P^T (right))
param, exp_avg and exp_avg_sq are updated in place; grad and proj are only read.

Backends: cpp (CPU: BLAS projections, a fused C++ Adam pass, one addmm_ for the back-projection
with the weight decay), triton (GPU: the same with a Triton Adam kernel; CPU under
TRITON_INTERPRET=1), `galore_adam_step_ref`.
"""

import math

import torch

from fastllm import _backend, _extension
from fastllm._library import lib

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_PREFERENCE_FP64 = {"cpu": ("cpp", "ref"), "cuda": ("ref",)}


def galore_adam_step_ref(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1,
                         beta2, eps, weight_decay, scale):
    """Plain PyTorch, in the projector's dtype."""
    g = grad.to(proj.dtype)
    low = proj.t() @ g if left else g @ proj
    low_rank_adam_update_(param, low, proj, exp_avg, exp_avg_sq, step=step, left=left, lr=lr,
                          beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          scale=scale)


def low_rank_adam_update_(param, low, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1, beta2,
                          eps, weight_decay, scale):
    """galore_adam_step_ref after the projection, given the projected grad `low` (r, cols) for a
    left projection, (rows, r) for a right one: Adam in the low-rank space, back-projected into
    param with decoupled weight decay. (Also GaLore's row-sharded step under FSDP2, where `low`
    is all-reduced first.)"""
    exp_avg.lerp_(low, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    update = exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + eps)
    back = proj @ update if left else update @ proj.t()
    w = param.to(proj.dtype)
    w = w * (1.0 - lr * weight_decay) - (lr * scale / bc1) * back
    param.copy_(w)


def _cpp(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1, beta2, eps,
         weight_decay, scale):
    _extension.extension().galore_adam_step_cpu(param, grad, proj, exp_avg, exp_avg_sq, step,
                                                left, lr, beta1, beta2, eps, weight_decay, scale)


def _triton(*args, **kwargs):
    from fastllm.kernels.galore_adam_step import galore_adam_step_triton

    galore_adam_step_triton(*args, **kwargs)


_IMPLS = {"ref": galore_adam_step_ref, "cpp": _cpp, "triton": _triton}


def check_galore_adam_step_args(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr,
                                beta1, beta2, eps, weight_decay, scale):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing."""
    op = "fastllm.galore_adam_step"
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                        ("scale", scale)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{op}: {name} must be finite and >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")
    if not step >= 1:
        raise ValueError(f"{op}: step must be >= 1 (already incremented), got {step}")
    opmath = torch.float64 if param.dtype == torch.float64 else torch.float32
    if param.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: param has dtype {param.dtype}; expected a floating-point dtype")
    for name, t in (("param", param), ("grad", grad), ("proj", proj), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        if t.layout != torch.strided or t.dim() != 2:
            raise ValueError(f"{op}: {name} must be a dense 2-D tensor, got {t.layout} of "
                             f"shape {tuple(t.shape)}")
        if t.device != param.device:
            raise ValueError(f"{op}: {name} is on {t.device}, param on {param.device}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} is not contiguous; call .contiguous() first")
        expected = param.dtype if name in ("param", "grad") else opmath
        if t.dtype != expected:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {expected}")
    rows, cols = param.shape
    if grad.shape != param.shape:
        raise ValueError(f"{op}: grad has shape {tuple(grad.shape)}, param "
                         f"{tuple(param.shape)}")
    r = proj.shape[1]
    if proj.shape[0] != (rows if left else cols):
        raise ValueError(f"{op}: proj has shape {tuple(proj.shape)}; a "
                         f"{'left' if left else 'right'} projector of a {tuple(param.shape)} "
                         f"param is ({rows if left else cols}, r)")
    low_shape = (r, cols) if left else (rows, r)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tuple(t.shape) != low_shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected the low-rank "
                             f"shape {low_shape}")


def _impl(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1, beta2, eps,
          weight_decay, scale):
    kwargs = dict(step=step, left=left, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, scale=scale)
    check_galore_adam_step_args(param, grad, proj, exp_avg, exp_avg_sq, **kwargs)
    device_type = param.device.type
    table = _PREFERENCE_FP64 if param.dtype == torch.float64 else _PREFERENCE
    backend = _backend.select("galore_adam_step", device_type, table.get(device_type, ("ref",)))
    if backend == "triton" and param.dtype == torch.float64:
        raise RuntimeError("fastllm.galore_adam_step: the triton backend computes in float32; "
                           "float64 params run on cpp or ref")
    impl = _backend.implementation("galore_adam_step", _IMPLS, backend)
    with _backend.device_guard(param.device):
        impl(param, grad, proj, exp_avg, exp_avg_sq, **kwargs)


lib.impl("galore_adam_step", _impl, "CPU")
lib.impl("galore_adam_step", _impl, "CUDA")


@torch.library.register_fake("fastllm::galore_adam_step")
def _fake(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1, beta2, eps,
          weight_decay, scale):
    check_galore_adam_step_args(param, grad, proj, exp_avg, exp_avg_sq, step=step, left=left,
                                lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, scale=scale)


def galore_adam_step(param, grad, proj, exp_avg, exp_avg_sq, *, step, left, lr, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, scale=1.0):
    """Functional form of the op (see the module docstring)."""
    torch.ops.fastllm.galore_adam_step(
        param, grad, proj, exp_avg, exp_avg_sq, step=float(step), left=bool(left),
        lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay), scale=float(scale))
