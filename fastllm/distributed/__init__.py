"""Data parallel on ``torch.distributed``: DDP comm hooks, FSDP2 helpers and
a ZeRO-1/2 :class:`DistributedOptimizer` over flat gradient buckets."""

# data parallel (hooks, FSDP2 helpers, DistributedOptimizer)
from fastllm.distributed import checkpoint, hooks, launch
from fastllm.distributed.failure import DistributedFailure, failure_guard
from fastllm.distributed.optimizer import DistributedOptimizer

__all__ = ["DistributedFailure", "DistributedOptimizer", "checkpoint", "failure_guard", "hooks",
           "launch"]

# PowerSGD gradient compression
from fastllm.distributed.powersgd import PowerSGD, powersgd_hook  # noqa: E402

__all__ += ["PowerSGD", "powersgd_hook"]
