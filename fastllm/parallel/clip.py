"""Gradient clipping by the global norm over data, tensor and pipeline parallel ranks."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters, max_norm, pp_group=None, norm_type=2.0):
    """Clip in place by the norm of all gradients of the whole model; returns that norm (fp32).

    DTensor gradients (tensor parallel, FSDP2) are reduced over their meshes by DTensor: Shard
    placements sum their shards' squares, Replicate ones count once, and Partial (unreduced)
    grads are summed before their norm is taken. The squares are then summed over pp_group,
    whose ranks hold different layers. Every rank returns the same norm, equal to the
    single-process `torch.nn.utils.clip_grad_norm_`.
    """
    if norm_type != 2.0:
        raise ValueError(f"only the 2-norm is supported, got norm_type={norm_type}")
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    # DTensor cannot stack norms from different meshes (2-D mesh for tp-sharded weights, the
    # dp mesh for norms FSDP2 shards but tp replicates): one reduction per mesh
    groups = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    sq = torch.zeros((), dtype=torch.float32)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.float().square()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    if max_norm is not None and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:  # one by one: a foreach op refuses DTensors on different meshes
            g.mul_(coef.to(g.dtype))
    return total
