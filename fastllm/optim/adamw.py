"""fastllm.optim.AdamW: a drop-in replacement for torch.optim.AdamW backed by fastllm::adamw_step.

Same signature, defaults, param-group keys and state_dict layout as torch.optim.AdamW (per
parameter: `step` as a 0-dim fp32 tensor, `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` when
amsgrad), so a torch state_dict loads here and the other way round. Each step validates every
parameter first, then runs one fused op per (param group, device, dtype).
"""

import math

import torch

from fastllm.ops.adamw import adamw_step

__all__ = ["AdamW"]


def _scalar(value, name):
    """A hyperparameter as a Python float; tensors must hold one element."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"fastllm.optim.AdamW: tensor {name} must have one element, "
                             f"got shape {tuple(value.shape)}")
        value = value.item()
    return float(value)


def _check_hyperparameters(where, lr, betas, eps, weight_decay):
    lr = _scalar(lr, "lr")
    if not math.isfinite(lr) or lr < 0.0:
        raise ValueError(f"fastllm.optim.AdamW: {where}: invalid learning rate {lr}")
    if not math.isfinite(eps) or eps < 0.0:
        raise ValueError(f"fastllm.optim.AdamW: {where}: invalid epsilon {eps}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"fastllm.optim.AdamW: {where}: betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        beta = _scalar(beta, f"betas[{i}]")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"fastllm.optim.AdamW: {where}: invalid beta parameter at index "
                             f"{i}: {beta}")
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"fastllm.optim.AdamW: {where}: invalid weight_decay value "
                         f"{weight_decay}")


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay, one fused pass per parameter tensor.

    Args are those of torch.optim.AdamW. `foreach`, `fused` and `capturable` are accepted and
    recorded in the param groups (for state_dict compatibility) but do not change the kernel:
    fastllm always runs its own fused implementation. `differentiable=True` is refused, since the
    fused step is not differentiable.

    Works with torch.amp.GradScaler through the fused-optimizer protocol: the scaler hands over
    `grad_scale` and `found_inf`, grads are unscaled inside the kernel, and a step with inf/nan
    grads changes nothing (params, moments and step counts stay as they were).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        _check_hyperparameters("defaults", lr, betas, eps, weight_decay)
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("fastllm.optim.AdamW: tensor lr must have one element")
        if differentiable:
            raise NotImplementedError(
                "fastllm.optim.AdamW: differentiable=True is not supported (the fused step is "
                "not differentiable); use torch.optim.AdamW(differentiable=True)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        # GradScaler passes grad_scale/found_inf instead of unscaling grads itself.
        self._step_supports_amp_scaling = True

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", True)

    @staticmethod
    def _name(group, group_index, param_index, param):
        names = group.get("param_names")
        label = names[param_index] if names else f"param {param_index}"
        return f"{label} of param group {group_index} (shape {tuple(param.shape)})"

    def _validate(self):
        """Check every group and every parameter with a grad; raise before anything changes."""
        for gi, group in enumerate(self.param_groups):
            _check_hyperparameters(f"param group {gi}", group["lr"], group["betas"],
                                   group["eps"], group["weight_decay"])
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                where = self._name(group, gi, pi, p)
                if grad.is_sparse or grad.layout != torch.strided:
                    raise RuntimeError(f"fastllm.optim.AdamW does not support sparse gradients "
                                       f"({where})")
                if torch.is_complex(p) or torch.is_complex(grad):
                    raise RuntimeError(f"fastllm.optim.AdamW does not support complex "
                                       f"parameters or gradients ({where}); use "
                                       f"torch.view_as_real")
                if not p.dtype.is_floating_point:
                    raise TypeError(f"fastllm.optim.AdamW: {where} has dtype {p.dtype}")
                if grad.device != p.device:
                    raise RuntimeError(f"fastllm.optim.AdamW: the grad of {where} is on "
                                       f"{grad.device} but the parameter is on {p.device}")
                if grad.dtype != p.dtype or grad.shape != p.shape:
                    raise RuntimeError(f"fastllm.optim.AdamW: the grad of {where} has dtype "
                                       f"{grad.dtype} and shape {tuple(grad.shape)}; expected "
                                       f"{p.dtype} and {tuple(p.shape)}")
                if not p.is_contiguous():
                    raise RuntimeError(f"fastllm.optim.AdamW: {where} is not contiguous")
                if not grad.is_contiguous():
                    raise RuntimeError(f"fastllm.optim.AdamW: the grad of {where} is not "
                                       f"contiguous")
                state = self.state.get(p)
                if state:
                    self._check_state(where, p, state, group["amsgrad"])

    @staticmethod
    def _check_state(where, p, state, amsgrad):
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        for key in keys:
            t = state.get(key)
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} is missing")
            if t.shape != p.shape:
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} has shape "
                                   f"{tuple(t.shape)}, expected {tuple(p.shape)}")
            if t.device != p.device or t.dtype != p.dtype or not t.is_contiguous():
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"contiguous {p.dtype} tensor on {p.device}, got {t.dtype} "
                                   f"on {t.device}")
        step = state.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1:
            raise RuntimeError(f"fastllm.optim.AdamW: state 'step' of {where} must be a "
                               f"one-element tensor")

    def load_state_dict(self, state_dict):
        """torch.optim.Optimizer.load_state_dict, after checking every state tensor's shape.

        Accepts state_dicts of torch.optim.AdamW as well. A state whose shape does not match its
        parameter raises, naming the parameter, and leaves the optimizer unchanged.
        """
        saved_groups = state_dict.get("param_groups", [])
        saved_state = state_dict.get("state", {})
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"fastllm.optim.AdamW: the state_dict has {len(saved_groups)} param "
                             f"groups, this optimizer has {len(self.param_groups)}")
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"fastllm.optim.AdamW: param group {gi} of the state_dict has "
                                 f"{len(saved['params'])} params, this optimizer's has "
                                 f"{len(group['params'])}")
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
                state = saved_state.get(pid)
                if not state:
                    continue
                where = self._name(group, gi, pi, p)
                for key, value in state.items():
                    if key == "step":
                        if not isinstance(value, torch.Tensor) and not isinstance(value, (int, float)):
                            raise RuntimeError(f"fastllm.optim.AdamW: state 'step' of {where} "
                                               f"is {type(value).__name__}")
                        continue
                    if isinstance(value, torch.Tensor) and value.shape != p.shape:
                        raise RuntimeError(f"fastllm.optim.AdamW: cannot load state '{key}' of "
                                           f"{where}: the state_dict has shape "
                                           f"{tuple(value.shape)}")
        super().load_state_dict(state_dict)
        for state in self.state.values():
            step = state.get("step")
            if step is not None and not isinstance(step, torch.Tensor):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter that has a grad. Returns closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate()

        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item()):
            return loss  # inf/nan grads under GradScaler: change nothing

        for group in self.param_groups:
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format)
                elif group["amsgrad"] and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                lists = buckets.setdefault((p.device, p.dtype), ([], [], [], [], [], []))
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                          state.get("max_exp_avg_sq"), state["step"])):
                    lst.append(t)
            beta1, beta2 = (_scalar(b, "beta") for b in group["betas"])
            for (device, _), (ps, gs, ms, vs, vmaxs, steps) in buckets.items():
                scale = grad_scale
                if scale is not None and scale.device != device:
                    scale = scale.to(device, non_blocking=True)
                adamw_step(
                    ps, gs, ms, vs, vmaxs if group["amsgrad"] else [], steps,
                    lr=_scalar(group["lr"], "lr"), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                    maximize=group["maximize"], grad_scale=scale,
                )
        return loss
