"""The learning rate of the AdamW ops (adamw_step, adamw_master_step, adamw8bit_step): a float
`lr`, or a one-element tensor `lr_tensor` (torch.optim.AdamW takes `lr` as either).

A tensor learning rate is what makes a step capturable: the kernels that run on the params'
device (triton, cuda) read it there, so a CUDA graph replays whatever value an LR scheduler last
wrote into it (torch's schedulers `fill_` a tensor lr in place), and torch.compile traces the
step without reading it on the host. Every other backend (cpp, ref), and a tensor on the CPU
for params elsewhere, gets its value as a float: read inside the op, where it costs no device
synchronisation (a CPU tensor) and is hidden from torch.compile's tracing.

Its value is not checked by the ops (that would be a host read of a device tensor per step, as
torch's fused AdamW does not do either); fastllm.optim.AdamW checks it when it is set.
"""

import math

import torch

from fastllm.ops._scalar_args import check_scalar_tensor


def split_lr(lr):
    """(float lr, lr_tensor) of the functional API's `lr`, a float or a one-element tensor."""
    if isinstance(lr, torch.Tensor):
        return 0.0, lr
    return lr, None


def check_lr_tensor(where, lr_tensor, device):
    """Raise naming the problem when lr_tensor is not a one-element floating-point tensor on the
    params' device or the CPU; touches nothing."""
    if lr_tensor is not None:
        check_scalar_tensor(where, "lr_tensor", lr_tensor, device)


def for_backend(lr, lr_tensor, backend, device):
    """(lr, lr_tensor) as `backend` takes them: the device-reading kernels (triton, cuda) get an
    lr_tensor on the params' device; every other case gets its value as the float lr (the
    double of the tensor's value, which is what the kernels compute with either way)."""
    if lr_tensor is None:
        return lr, None
    if backend in ("triton", "cuda") and lr_tensor.device == device:
        return lr, lr_tensor
    return float(lr_tensor.reshape(()).item()), None


def ieee_div(a, b):
    """a / b in IEEE arithmetic, as the C++ and GPU kernels compute a grad_scale's or divisor's
    reciprocal: a zero divisor gives a signed inf (nan for 0 / 0) where Python's `/` raises
    ZeroDivisionError, so the reference backend matches the others."""
    a, b = float(a), float(b)
    if b != 0.0 or math.isnan(a):
        return a / b
    if a == 0.0:
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)
