"""Gradient clipping by the global norm over data, tensor and pipeline parallel ranks."""

import torch

from fastllm.optim.grad_norm import clip_coefficient, global_grad_norm


def clip_grad_norm_(parameters, max_norm, pp_group=None, norm_type=2.0):
    """Clip in place by the norm of all gradients of the whole model; returns that norm (fp32).

    The norm is fastllm.optim.global_grad_norm's: DTensor gradients (tensor parallel, FSDP2)
    count their shards once per mesh (Partial ones reduced first), and the squares are summed
    over pp_group, whose ranks hold different layers. Every rank returns the same norm, equal
    to the single-process `torch.nn.utils.clip_grad_norm_`.
    """
    if norm_type != 2.0:
        raise ValueError(f"only the 2-norm is supported, got norm_type={norm_type}")
    if isinstance(parameters, torch.Tensor):  # one tensor, as torch's clip_grad_norm_ takes
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_grad_norm(grads, groups=[pp_group]).float()
    if max_norm is not None and grads:
        coef = clip_coefficient(total, max_norm)
        for g in grads:  # one by one: a foreach op refuses DTensors on different meshes
            g.mul_(coef.to(g.dtype))
    return total
