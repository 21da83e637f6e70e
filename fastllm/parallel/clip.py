"""Gradient clipping by the global norm over data, tensor and pipeline parallel ranks."""

import torch

from fastllm.optim.grad_norm import clip_coefficient, global_grad_norm


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None, *, pp_group=None):
    """Clip in place by the norm of all gradients of the whole model; returns that norm (fp32;
    fp64 when every grad is fp64, as torch's, whose clipping is then fp64 too; a mix of fp64 and
    other grads gets global_grad_norm's fp32 norm, where torch's would be fp64).

    torch.nn.utils.clip_grad_norm_'s arguments, in its order, and `pp_group`. The norm is
    fastllm.optim.global_grad_norm's: DTensor gradients (tensor parallel, FSDP2) count their
    shards once per mesh (Partial ones reduced first), and the squares are summed over
    pp_group, whose ranks hold different layers. Every rank returns the same norm, equal to the
    single-process `torch.nn.utils.clip_grad_norm_`. Only the 2-norm; `foreach` is accepted for
    torch's signature (the grads are scaled one by one: a foreach op refuses DTensors on
    different meshes); error_if_nonfinite reads the norm on the host, as torch's does.
    """
    if norm_type != 2.0:
        raise ValueError(f"only the 2-norm is supported, got norm_type={norm_type}")
    if isinstance(parameters, torch.Tensor):  # one tensor, as torch's clip_grad_norm_ takes
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_grad_norm(grads, groups=[pp_group])
    if total.dtype != torch.float64:
        total = total.float()
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped. To disable "
                           f"this error and scale the gradients by the non-finite norm anyway, "
                           f"set `error_if_nonfinite=False`")
    if max_norm is not None and grads:
        coef = clip_coefficient(total, max_norm)
        for g in grads:  # one by one: a foreach op refuses DTensors on different meshes
            g.mul_(coef.to(g.dtype))
    return total
