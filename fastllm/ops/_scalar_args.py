"""The one-element tensor arguments of the ops: the AdamW ops' grad_scale, clip_coef, found_inf
and tensor learning rate, scaled_copy's divisor. One check, so every op refuses the same things
in the same words, before it changes anything.

Every backend reads such a tensor as one value: the C++ kernels and the reference on the host,
the GPU kernels through a pointer to its first element. A tensor of two elements (a per-device
flag vector) would have its first element read and the rest ignored, so a step would run with
an overflow flagged; an empty one would be read out of bounds. Hence exactly one element.
"""

import torch


def check_scalar_tensor(where, name, t, device=None, *, allow_bool=False):
    """Raise TypeError/ValueError naming `where` (the op) and `name` (the argument) unless `t` is
    a dense one-element floating-point tensor (or bool, when allow_bool: a flag such as
    found_inf) on `device` or on the CPU (anywhere when device is None); touches nothing.

    One test when it passes (this runs on every step outside fastllm.optim's step plan)."""
    if (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() == 1
            and (t.dtype.is_floating_point or (allow_bool and t.dtype == torch.bool))
            and (device is None or t.device == device or t.device.type == "cpu")):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: {name} is {t.layout}; it must be a dense tensor")
    if t.numel() != 1:
        raise ValueError(f"{where}: {name} must have one element, has {t.numel()} (shape "
                         f"{tuple(t.shape)})")
    if not (t.dtype.is_floating_point or (allow_bool and t.dtype == torch.bool)):
        kinds = "floating point or bool" if allow_bool else "floating point"
        raise TypeError(f"{where}: {name} has dtype {t.dtype}; it must be {kinds}")
    raise ValueError(f"{where}: {name} is on {t.device}; it must be on the params' device "
                     f"({device}) or the CPU")


def check_scalar_args(where, device, *, grad_scale=None, clip_coef=None, found_inf=None):
    """check_scalar_tensor for each of an AdamW op's optional scalars that is given (found_inf,
    a flag, may be bool); device: params[0]'s (None when there are no params)."""
    if grad_scale is not None:
        check_scalar_tensor(where, "grad_scale", grad_scale, device)
    if clip_coef is not None:
        check_scalar_tensor(where, "clip_coef", clip_coef, device)
    if found_inf is not None:
        check_scalar_tensor(where, "found_inf", found_inf, device, allow_bool=True)
