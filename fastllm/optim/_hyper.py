"""The checks of fastllm.optim.AdamW's hyperparameters (at construction and in its step plan,
fastllm/optim/_plan.py) and of param groups (AdamW, GaLoreAdamW). The messages contain
torch.optim.AdamW's own wording, which code and tests match on."""

import math

import torch


def scalar(value, name):
    """A hyperparameter as a Python float; tensors must hold one element."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            # torch.optim's wording first: user tests match on it.
            raise ValueError(f"fastllm.optim.AdamW: Tensor {name} must be 1-element (got shape "
                             f"{tuple(value.shape)})")
        value = value.item()
    return float(value)


def _finite(value):
    """math.isfinite(value) (nan fails both comparisons) in a form torch.compile can trace: a
    float hyperparameter changed between compiled steps becomes a symbolic float (dynamo's
    specialize_float off), and math.isfinite of one fails a fullgraph trace."""
    return -math.inf < value < math.inf


def check_hyperparameters(where, lr, betas, eps, weight_decay, owner="fastllm.optim.AdamW"):
    """Raise ValueError on a bad hyperparameter; the messages contain torch.optim.AdamW's own
    wording, which code and tests match on, after `owner` (the optimizer's name).

    A tensor lr is the one value not read on the host while torch.compile traces a step (its
    shape and dtype are checked; its value when it is set, as torch does): the kernels read it
    on the device (fastllm/ops/_lr.py)."""
    if isinstance(lr, torch.Tensor):
        check_tensor_lr(where, lr, owner)
    else:
        lr_value = scalar(lr, "lr")
        if not _finite(lr_value) or lr_value < 0.0:
            raise ValueError(f"{owner}: {where}: Invalid learning rate: {lr}")
    if not _finite(eps) or eps < 0.0:
        raise ValueError(f"{owner}: {where}: Invalid epsilon value: {eps}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{owner}: {where}: betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        value = scalar(beta, f"betas[{i}]")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{owner}: {where}: Invalid beta parameter at index "
                             f"{i}: {beta}")
    if not _finite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"{owner}: {where}: Invalid weight_decay value: "
                         f"{weight_decay}")


def check_tensor_lr(where, lr, owner="fastllm.optim.AdamW"):
    """A tensor lr: one floating-point element (torch.optim's wording first); its value is read
    and checked unless a step is being traced by torch.compile."""
    if lr.numel() != 1:
        raise ValueError(f"{owner}: Tensor lr must be 1-element (got shape "
                         f"{tuple(lr.shape)})")
    if not lr.dtype.is_floating_point or lr.layout != torch.strided:
        raise TypeError(f"{owner}: {where}: a Tensor lr must be a dense floating-point "
                        f"tensor, got {lr.dtype} ({lr.layout})")
    if not torch.compiler.is_compiling():
        value = lr.item()
        if not math.isfinite(value) or value < 0.0:
            raise ValueError(f"{owner}: {where}: Invalid learning rate: {value}")


def refuse_duplicates(where, param_group, group_index):
    """Raise ValueError when a param group lists a parameter twice (torch warns that this will
    become an error; stepping a tensor twice per step is never what was meant)."""
    if not isinstance(param_group, dict) or isinstance(param_group.get("params"),
                                                       (torch.Tensor, set, type(None))):
        return  # torch.optim.Optimizer.add_param_group's own checks answer these
    params = param_group["params"]
    if not isinstance(params, list):  # a generator (model.parameters()) is read once, here
        params = param_group["params"] = list(params)
    params = [p[1] if isinstance(p, tuple) else p for p in params]  # (name, param) pairs
    if len(set(map(id, params))) != len(params):
        seen, first = set(), None
        for i, p in enumerate(params):
            if id(p) in seen:
                first = i
                break
            seen.add(id(p))
        raise ValueError(f"{where}: param group {group_index} lists a parameter twice (the one "
                         f"at index {first}, shape {tuple(params[first].shape)}); each parameter "
                         f"may appear once")


def describe(group, group_index, param_index, param):
    names = group.get("param_names")
    label = names[param_index] if names else f"param {param_index}"
    return f"{label} of param group {group_index} (shape {tuple(param.shape)})"


def slot_name(opt, slot, p):
    """describe() of the param at flat index `slot` of opt's param groups."""
    for gi, group in enumerate(opt.param_groups):
        if slot < len(group["params"]):
            return describe(group, gi, slot, p)
        slot -= len(group["params"])
    return f"a param of shape {tuple(p.shape)}"
