"""DTensor support for fastllm's optimizers under FSDP2 (`fully_shard`): the fused kernels run on
each rank's local shards, and the global gradient norm is reduced over the mesh."""

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = None
try:
    # FSDP2 over a tensor-parallel dim gives _StridedShard, which is no Shard subclass in recent
    # torch; its shards partition the tensor all the same.
    from torch.distributed.tensor.placement_types import _StridedShard
    _SHARDED = (Shard, _StridedShard) if DTensor is not None else ()
except ImportError:
    _SHARDED = (Shard,) if DTensor is not None else ()


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The local shard of a DTensor (same storage: in-place updates reach the DTensor), else t."""
    return t.to_local() if is_dtensor(t) else t


def global_grad_norm(grads, l2norm):
    """The L2 norm over every element of every grad, across ranks for DTensor grads.

    grads: plain tensors and/or DTensors. Local squared norms (one `l2norm` pass per device) are
    summed over each mesh dimension a DTensor is sharded on (one all-reduce per placement kind);
    replicated dimensions are counted once. Partial placements are refused. Returns a 0-dim fp32
    tensor on the first grad's device.
    """
    plain, by_layout = [], {}
    for g in grads:
        if not is_dtensor(g):
            plain.append(g)
            continue
        for placement in g.placements:
            if not isinstance(placement, _SHARDED + (Replicate,)):
                raise NotImplementedError(f"fastllm.optim: the grad norm of a DTensor placed "
                                          f"{g.placements} (Partial) is not supported")
        shard_dims = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, _SHARDED))
        by_layout.setdefault((id(g.device_mesh), shard_dims), (g.device_mesh, []))[1].append(
            g.to_local())
    device = (grads[0].to_local() if is_dtensor(grads[0]) else grads[0]).device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensors in _by_device(plain):
        total = total + l2norm(tensors).to(device).square()
    for (_, shard_dims), (mesh, tensors) in by_layout.items():
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for group in _by_device(tensors):
            sq = sq + l2norm(group).to(device).square()
        for dim in shard_dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    return total.sqrt()


def _by_device(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())
