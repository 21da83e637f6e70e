"""fastllm::adamw_step: torch.optim.AdamW's update over many tensors in one call.

    adamw_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2,
               eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None)

params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs when amsgrad) are updated in place. All tensors
at one index share shape, dtype and device, are dense and contiguous. grads are read, divided by
`grad_scale` when given; nothing changes when `found_inf` is nonzero (torch.amp.GradScaler's
fused-optimizer protocol). grad_scale and found_inf: one-element floating-point tensors
(found_inf may be bool) on the params' device or the CPU (fastllm/ops/_scalar_args.py).
`steps` holds each parameter's step count, already incremented (>= 1): one-element
floating-point tensors on the params' device or the CPU. A grad or step carrying
the negative bit (x._neg_view()) is read by value; a written tensor carrying it is refused.
`lr` is a float or a one-element tensor, which the GPU kernels read on the device (the op's
`lr_tensor` argument; see fastllm/ops/_lr.py).

Backends: cpp (CPU), cuda and triton (GPU; triton on CPU under TRITON_INTERPRET=1), and
`adamw_step_ref`, plain PyTorch.
"""

import math

import torch

from fastllm import _backend, _extension
from fastllm._library import lib
from fastllm.ops._overlap import labelled, refuse_overlap
from fastllm.ops._lr import check_lr_tensor, for_backend, ieee_div, split_lr
from fastllm.ops._scalar_args import check_scalar_args

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("cuda", "triton", "ref")}
# The Triton kernel computes in fp32; fp64 params on a GPU go to the CUDA kernel or the reference.
_PREFERENCE_FP64 = {"cpu": ("cpp", "ref"), "cuda": ("cuda", "ref")}
_CPU = torch.device("cpu")


def adamw_step_ref(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None,
):
    """Plain-PyTorch AdamW step: the oracle and the fallback. Computes in fp32 (fp64 for fp64).
    `lr` may be a one-element tensor (read here)."""
    if found_inf is not None and bool(found_inf.item()):
        return
    lr = float(lr) if isinstance(lr, torch.Tensor) else lr
    inv_scale = None if grad_scale is None else ieee_div(1.0, grad_scale)
    for i, param in enumerate(params):
        opmath = torch.float64 if param.dtype == torch.float64 else torch.float32
        g = grads[i].to(opmath)
        if inv_scale is not None:
            g = g * inv_scale
        if maximize:
            g = -g
        p = param.to(opmath, copy=True)
        m = exp_avgs[i].to(opmath, copy=True)
        v = exp_avg_sqs[i].to(opmath, copy=True)
        step = float(steps[i])
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        p.mul_(1.0 - lr * weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if amsgrad:
            v_max = torch.maximum(max_exp_avg_sqs[i].to(opmath), v)
            max_exp_avg_sqs[i].copy_(v_max)
            denom = (v_max.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)
        param.copy_(p)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)


def _compiled(name):
    def run(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2,
            eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None,
            lr_tensor=None):
        extra = (lr_tensor,) if name.endswith("_cuda") else ()  # (the CPU kernel: never)
        getattr(_extension.extension(), name)(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
            weight_decay, amsgrad, maximize, grad_scale, found_inf, *extra,
        )

    return run


def _adamw_step_triton(*args, **kwargs):
    from fastllm.kernels.adamw import adamw_step_triton

    adamw_step_triton(*args, **kwargs)


_IMPLS = {
    "ref": adamw_step_ref,
    "cpp": _compiled("adamw_step_cpu"),
    "cuda": _compiled("adamw_step_cuda"),
    "triton": _adamw_step_triton,
}


def check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
                     lr, beta1, beta2, eps, weight_decay, amsgrad, lr_tensor=None,
                     grad_scale=None, found_inf=None):
    """Raise ValueError/TypeError naming the first bad argument; touches nothing."""
    scalar_device = params[0].device if params else None
    check_lr_tensor("fastllm.adamw_step", lr_tensor, scalar_device)
    check_scalar_args("fastllm.adamw_step", scalar_device, grad_scale=grad_scale,
                      found_inf=found_inf)
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"fastllm.adamw_step: {name} must be finite and >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"fastllm.adamw_step: {name} must be in [0, 1), got {value}")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"fastllm.adamw_step: {name} has {len(lst)} tensors, params has {n}")
    if n == 0:
        return
    device = params[0].device
    checked = [("params", params)] + [(k, v) for k, v in lists.items() if k != "steps"]
    for name, lst in checked:
        for i, (t, p) in enumerate(zip(lst, params)):
            # One cheap test per tensor on the hot path; the diagnosis only when it fails.
            if not (t.layout == torch.strided and t.device == device and t.dtype == p.dtype
                    and t.dtype.is_floating_point and t.shape == p.shape and t.is_contiguous()
                    and (name == "grads" or not t.is_neg())):
                _raise_bad_tensor(f"fastllm.adamw_step: {name}[{i}]", t, p, i, device)
    check_steps("fastllm.adamw_step", steps, device)


def check_steps(op, steps, device):
    """The step counts' checks every AdamW op (`op`: its name in messages) makes with its other
    argument checks, in its fake (torch.compile) too: one-element floating-point tensors."""
    for i, s in enumerate(steps):
        # Every backend reads a step on the CPU or on the params' device (the GPU kernels take
        # either: a checkpoint of torch's non-capturable AdamW keeps its steps on the CPU).
        if not (isinstance(s, torch.Tensor) and s.numel() == 1 and s.layout == torch.strided
                and s.dtype.is_floating_point and s.device in (device, _CPU)):
            _raise_bad_step(f"{op}: steps[{i}]", s, device)


def _raise_bad_step(where, s, device):
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{where} is a {type(s).__name__}, not a tensor")
    if s.numel() != 1 or s.layout != torch.strided:
        raise ValueError(f"{where} must be a dense one-element tensor, got {s.layout} of shape "
                         f"{tuple(s.shape)}")
    if not s.dtype.is_floating_point:
        raise TypeError(f"{where} has dtype {s.dtype}; step counts are floating point")
    raise ValueError(f"{where} is on {s.device}; steps must be on params[0]'s device ({device}) "
                     f"or on the CPU")


def check_step_values(op, steps):
    """Refuse a step count < 1 (the bias corrections divide by 1 - beta^step) where reading it
    is free: CPU tensors. A step on a GPU is not read: that would wait for the device each call
    (and cannot be captured in a CUDA graph); fastllm.optim.AdamW advances its steps itself.
    Every AdamW op calls it after check_steps, outside the optimizer's plan (prevalidated), where
    a fake tensor (torch.compile) is not seen."""
    for i, s in enumerate(steps):
        if s.device.type == "cpu" and not float(s) >= 1.0:
            raise ValueError(f"{op}: steps[{i}] is {float(s)}; step counts must be >= 1 (already "
                             f"incremented)")


def _raise_bad_tensor(where, t, p, i, device):
    if t.layout != torch.strided:
        raise TypeError(f"{where} is {t.layout}; only dense tensors are supported")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{where} has dtype {t.dtype}; AdamW needs floating point")
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}, params[0] on {device}")
    if t.dtype != p.dtype:
        raise TypeError(f"{where} has dtype {t.dtype}, params[{i}] has {p.dtype}")
    if t.shape != p.shape:
        raise ValueError(f"{where} has shape {tuple(t.shape)}, params[{i}] has {tuple(p.shape)}")
    if t.is_neg():
        raise ValueError(f"{where} carries the negative bit (a _neg_view()), which the kernels "
                         f"cannot write through; call .resolve_neg() first")
    raise ValueError(f"{where} is not contiguous; call .contiguous() first")


def _adamw_step_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
                     lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
                     grad_scale=None, found_inf=None, lr_tensor=None):
    if not _backend.prevalidated():
        check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, lr_tensor=lr_tensor, grad_scale=grad_scale,
                         found_inf=found_inf)
        check_step_values("fastllm.adamw_step", steps)
        refuse_overlap("fastllm.adamw_step", labelled(
            params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
            max_exp_avg_sqs=max_exp_avg_sqs), labelled(grads=grads, steps=steps))
        # The kernels read raw memory, blind to a negative bit (x._neg_view()): the read-only
        # lists are resolved here, as torch.ops' fallback does, since the direct call skips it.
        # (fastllm.optim.AdamW's plan hands over resolved grads and steps.)
        if any(map(torch.Tensor.is_neg, grads)):
            grads = [g.resolve_neg() for g in grads]
        if any(map(torch.Tensor.is_neg, steps)):
            steps = [s.resolve_neg() for s in steps]
    if not params:
        return
    device_type = params[0].device.type
    table = _PREFERENCE_FP64 if params[0].dtype == torch.float64 else _PREFERENCE
    backend = _backend.select("adamw_step", device_type, table.get(device_type, ("ref",)))
    lr, lr_tensor = for_backend(lr, lr_tensor, backend, params[0].device)
    kwargs = {} if lr_tensor is None else {"lr_tensor": lr_tensor}
    with _backend.device_guard(params[0].device):
        _IMPLS[backend](
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            grad_scale=grad_scale, found_inf=found_inf, **kwargs,
        )


lib.impl("adamw_step", _adamw_step_impl, "CPU")
lib.impl("adamw_step", _adamw_step_impl, "CUDA")


@torch.library.register_fake("fastllm::adamw_step")
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
                     lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
                     grad_scale=None, found_inf=None, lr_tensor=None):
    check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr,
                     beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     amsgrad=amsgrad, lr_tensor=lr_tensor, grad_scale=grad_scale,
                     found_inf=found_inf)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2,
               eps, weight_decay, amsgrad=False, maximize=False, grad_scale=None, found_inf=None):
    """Functional form of the op (see the module docstring); a no-op for empty lists. `lr`: a
    float or a one-element tensor."""
    if len(params) == 0:
        return
    lr, lr_tensor = split_lr(lr)
    if _backend.direct(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
        _adamw_step_impl(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            grad_scale=grad_scale, found_inf=found_inf, lr_tensor=lr_tensor,
        )
        torch.autograd.graph.increment_version(params)  # what the in-place op would have done
        return
    torch.ops.fastllm.adamw_step(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
        grad_scale=grad_scale, found_inf=found_inf, lr_tensor=lr_tensor,
    )
