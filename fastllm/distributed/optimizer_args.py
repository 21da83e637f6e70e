"""DistributedOptimizer's constructor arguments checked before anything is built: the
GaLore options taken out of optimizer_kwargs, what the optimizer refuses (stage, bucket size,
grad_compression, master_weights=False, ...), the params' dtypes, and GaLore's param choice."""

import torch
import torch.distributed as dist

from fastllm.distributed.optimizer_state import _LOW_PRECISION
from fastllm.distributed.powersgd import PowerSGD

# The param dtypes the flat buckets handle: fastllm::scaled_copy's (fp32, bf16, fp16) and fp64,
# whose buckets are scaled and packed by plain torch ops.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_param_dtypes(named):
    """Refuse a trainable param of a dtype the buckets cannot reduce and update (complex,
    float8, ...), naming it, before anything is built."""
    for name, p in named:
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fastllm.distributed.DistributedOptimizer: parameter {name} is "
                            f"{p.dtype}; trainable params must be float32, bfloat16, float16 "
                            f"or float64")


def _galore_options(optimizer_class, optimizer_kwargs):
    """GaLore's projection options, taken out of optimizer_kwargs (None unless optimizer_class
    is GaLoreAdamW): they form the projected group, not the inner optimizer's defaults."""
    from fastllm.optim.galore import GaLoreAdamW

    if isinstance(optimizer_class, type) and issubclass(optimizer_class, GaLoreAdamW):
        galore = {k: optimizer_kwargs.pop(k) for k in ("rank", "update_proj_gap", "scale",
                                                        "proj_type", "galore_params")
                  if k in optimizer_kwargs}
        if "rank" not in galore:
            raise ValueError("fastllm.distributed.DistributedOptimizer: "
                             "optimizer_class=GaLoreAdamW needs rank=<projection rank>")
        return galore
    if "galore_params" in optimizer_kwargs:
        raise ValueError(f"fastllm.distributed.DistributedOptimizer: galore_params needs "
                         f"optimizer_class=fastllm.optim.GaLoreAdamW, got "
                         f"{getattr(optimizer_class, '__name__', optimizer_class)}")
    return None


def _check_arguments(model, stage, process_group, bucket_cap_mb, grad_compression,
                     optimizer_kwargs):
    """Refuse what DistributedOptimizer cannot do, before anything is built."""
    if grad_compression is not None:
        if not isinstance(grad_compression, PowerSGD):
            raise TypeError(f"fastllm.distributed.DistributedOptimizer: grad_compression "
                            f"must be a fastllm.distributed.PowerSGD, got "
                            f"{type(grad_compression).__name__}")
        if optimizer_kwargs.get("loss_scaler") is not None:
            raise NotImplementedError(
                "fastllm.distributed.DistributedOptimizer: grad_compression with a "
                "loss_scaler is not supported (the error feedback would mix loss scales "
                "and keep inf/nan); use bf16, which needs no loss scaling")
        mine = process_group if process_group is not None else dist.group.WORLD
        if grad_compression.group is not mine:
            raise ValueError("fastllm.distributed.DistributedOptimizer: grad_compression's "
                             "process_group is not this optimizer's process_group")
    if stage not in (1, 2):
        raise ValueError(f"fastllm.distributed.DistributedOptimizer: stage must be 1 or 2, "
                         f"got {stage!r}")
    if not (bucket_cap_mb > 0):
        raise ValueError(f"fastllm.distributed.DistributedOptimizer: bucket_cap_mb must be "
                         f"> 0, got {bucket_cap_mb}")
    if not dist.is_initialized():
        raise RuntimeError("fastllm.distributed.DistributedOptimizer: call "
                           "torch.distributed.init_process_group first")
    if optimizer_kwargs.get("master_weights") is False and any(
            p.dtype in _LOW_PRECISION for p in model.parameters()):
        raise ValueError("fastllm.distributed.DistributedOptimizer: bf16/fp16 params always "
                         "get fp32 master weights here; master_weights=False is not supported")
    for key in ("stochastic_rounding", "kahan_summation"):
        if optimizer_kwargs.get(key):
            raise NotImplementedError(f"fastllm.distributed.DistributedOptimizer: {key} is "
                                      f"not supported (shards keep fp32 master weights)")


def _galore_param_ids(galore, named):
    """ids of the params GaLore projects (galore["galore_params"], default every 2-D param),
    checked: trainable params of the model, 2-D, fp32."""
    chosen = galore.pop("galore_params", None)
    if chosen is None:
        chosen = [p for _, p in named if p.dim() == 2]
    chosen = list(chosen)
    known = {id(p): n for n, p in named}
    for p in chosen:
        if id(p) not in known:
            raise ValueError("fastllm.distributed.DistributedOptimizer: galore_params "
                             "holds a tensor that is not a trainable parameter of model")
        if p.dim() != 2:
            raise ValueError(f"fastllm.distributed.DistributedOptimizer: galore_params: "
                             f"{known[id(p)]} has shape {tuple(p.shape)}; GaLore "
                             f"projects 2-D params only")
        if p.dtype != torch.float32:
            raise NotImplementedError(
                f"fastllm.distributed.DistributedOptimizer: galore_params: "
                f"{known[id(p)]} is {p.dtype}; GaLore under DistributedOptimizer "
                f"supports fp32 params")
    return {id(p) for p in chosen}
