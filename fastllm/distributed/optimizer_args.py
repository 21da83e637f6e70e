"""DistributedOptimizer's constructor arguments checked before anything is built: the
GaLore options taken out of optimizer_kwargs, what the optimizer refuses (stage, bucket size,
grad_compression, master_weights=False, ...), the params' dtypes, GaLore's param choice, the
no_decay names and the inner optimizer's group layout, and that the ranks' models agree."""

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


def _no_decay_ids(no_decay, named):
    """ids of the params named in no_decay (trained with weight_decay 0), checked: names of
    trainable params of the model, as fastllm.optim.BAdam's no_decay."""
    if isinstance(no_decay, str):
        raise TypeError(f"fastllm.distributed.DistributedOptimizer: no_decay must be an "
                        f"iterable of parameter names, got the string {no_decay!r}")
    no_decay = set(no_decay)
    unknown = sorted(n for n in no_decay if n not in {name for name, _ in named})
    if unknown:
        raise ValueError(f"fastllm.distributed.DistributedOptimizer: no_decay names parameters "
                         f"that are not trainable parameters of model: {unknown[:5]}")
    return {id(p) for n, p in named if n in no_decay}


def _group_layout(params, projected_ids, no_decay_ids):
    """The inner optimizer's param groups as (params in model order, projected, decayed) each:
    GaLore-projected and decayed, projected and not, flat and decayed, flat and not; only the
    groups that have params (one group of every param without GaLore and no_decay)."""
    layout = []
    for projected in (True, False):
        for decayed in (True, False):
            group = [p for p in params if (id(p) in projected_ids) == projected
                     and (id(p) not in no_decay_ids) == decayed]
            if group:
                layout.append((group, projected, decayed))
    return layout


def _check_same_model(named, buffers, world, rank, group, no_decay_ids=()):
    """Refuse models whose trainable params (names, shapes, dtypes) or buffers, or no_decay
    choices, differ across the ranks of `group`, naming the first difference (collective)."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    mine_buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in buffers]
    plain = [n for n, p in named if id(p) in no_decay_ids]
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, mine_buffers, plain), group=group)
    for r, (theirs, theirs_buffers, theirs_plain) in enumerate(everyone):
        if theirs == mine and theirs_plain != plain:
            # (another bucket layout: the ranks' collectives would not match)
            raise ValueError(f"fastllm.distributed.DistributedOptimizer: no_decay differs "
                             f"across ranks: {plain[:5]} on rank {rank}, {theirs_plain[:5]} "
                             f"on rank {r}")
        if theirs == mine and theirs_buffers != mine_buffers:
            # (they are broadcast next: differing buffers would fail or hang there)
            a, b = next(((a, b) for a, b in zip(mine_buffers, theirs_buffers) if a != b),
                        (f"{len(mine_buffers)} buffers", f"{len(theirs_buffers)} buffers"))
            raise ValueError(f"fastllm.distributed.DistributedOptimizer: the models' "
                             f"buffers differ across ranks: {a} on rank {rank}, {b} "
                             f"on rank {r}")
        if theirs == mine:
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                raise ValueError(
                    f"fastllm.distributed.DistributedOptimizer: the models differ across "
                    f"ranks: parameter {i} is {a[0]} {a[1]} {a[2]} on rank {rank} but "
                    f"{b[0]} {b[1]} {b[2]} on rank {r}")
        longer = mine if len(mine) > len(theirs) else theirs
        extra = longer[min(len(mine), len(theirs))][0]
        raise ValueError(f"fastllm.distributed.DistributedOptimizer: the models differ "
                         f"across ranks: rank {rank} has {len(mine)} trainable "
                         f"parameters, rank {r} has {len(theirs)} (first extra: {extra})")
