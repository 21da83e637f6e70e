"""The ways `fastllm train` runs a model, one module each, all with the surface of
base.Strategy (wrap, forward_backward with no-sync accumulation, step, state, load):

    base.py             one process
    ddp.py              DistributedDataParallel
    fsdp.py             FSDP2 (fully_shard), and the DCP state of any DTensor model
    zero.py             ZeRO-1/2 (fastllm.distributed.DistributedOptimizer)
    tensor_parallel.py  tensor parallel (x FSDP2 over dp)
    pipeline.py         pipeline parallel (x tensor parallel x FSDP2 in each stage)
"""

from fastllm.train.strategies.base import Strategy
from fastllm.train.strategies.ddp import DDP
from fastllm.train.strategies.fsdp import FSDP
from fastllm.train.strategies.pipeline import Pipeline
from fastllm.train.strategies.tensor_parallel import TensorParallel
from fastllm.train.strategies.zero import Zero

__all__ = ["DDP", "FSDP", "Pipeline", "Strategy", "TensorParallel", "Zero", "make"]


def make(cfg, layout, device, rank):
    """The strategy of cfg.parallel on this layout (parallel.strategy=auto: DDP on several
    processes; tp/pp > 1 take their own)."""
    world = layout.world_size
    name = cfg.parallel.strategy
    if name == "auto":
        name = "ddp" if world > 1 else "none"
    if layout.pp > 1:
        strategy = Pipeline(cfg, layout, device, rank)
    elif layout.tp > 1:
        strategy = TensorParallel(cfg, layout, device, rank)
    elif name in ("zero1", "zero2"):
        if world == 1:
            raise ValueError(f"fastllm train: parallel.strategy={name} needs torchrun with more "
                             f"than one process")
        strategy = Zero(cfg, layout, device, rank, int(name[-1]))
    elif name in ("none", "ddp", "fsdp") and world == 1 or name == "none":
        strategy = Strategy(cfg, layout, device, rank)
    elif name == "ddp":
        strategy = DDP(cfg, layout, device, rank)
    elif name == "fsdp":
        strategy = FSDP(cfg, layout, device, rank)
    else:
        raise ValueError(f"fastllm train: unknown parallel.strategy {name!r}")
    if cfg.optimizer_in_backward and strategy.name != "none":
        raise ValueError("fastllm train: optimizer_in_backward runs on one process only")
    return strategy
