"""DTensor helpers shared by fastllm.optim and fastllm.distributed (below both, so neither imports
the other): under FSDP2 (`fully_shard`) and tensor parallel, params, grads and optimizer states
are DTensors, and fastllm's fused kernels run on each rank's local shard (the same storage)."""

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = Replicate = Shard = None
try:
    # FSDP2 over a tensor-parallel dim gives _StridedShard, which is no Shard subclass in recent
    # torch; its shards partition the tensor all the same.
    from torch.distributed.tensor.placement_types import _StridedShard
    SHARDED = (Shard, _StridedShard) if DTensor is not None else ()
except ImportError:
    SHARDED = (Shard,) if DTensor is not None else ()


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The local shard of a DTensor (same storage: in-place updates reach the DTensor), else t."""
    return t.to_local() if is_dtensor(t) else t


def local_or_none(t):
    return None if t is None else local(t)
