"""fastllm.optim.AdamW: a drop-in replacement for torch.optim.AdamW backed by fastllm::adamw_step,
with optional mixed-precision training (fastllm::adamw_master_step, fastllm::l2norm).

Same signature, defaults, param-group keys and state_dict layout as torch.optim.AdamW (per
parameter: `step` as a 0-dim fp32 tensor, `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` when
amsgrad), so a torch state_dict loads here and the other way round. Each step validates every
parameter first, then runs one fused op per (param group, device, dtype).

The keyword-only options master_weights, stochastic_rounding, kahan_summation, max_grad_norm and
loss_scaler (all off by default, which leaves the drop-in behaviour exactly as above) add:
    - one norm pass over all grads (fastllm::l2norm) that gives the global grad norm
      (`optimizer.grad_norm`) and detects inf/nan: such a step is skipped, nothing changes, and
      `optimizer.step_skipped` / `optimizer.skipped_steps` report it;
    - clipping by that norm and unscaling by the loss scale, fused into the update;
    - for bf16/fp16 params: fp32 master weights and fp32 moments (master_weights=True), or pure
      bf16 params with fp32 moments, stochastic rounding and/or a bf16 Kahan compensation buffer.
"""

import math

import torch

from fastllm.amp import LossScaler
from fastllm.ops.adamw import adamw_step
from fastllm.ops.adamw_master import adamw_master_step
from fastllm.ops.l2norm import l2norm

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# State tensors kept in fp32 for a low-precision param in master / pure mode.
_FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")
_MASK64 = (1 << 64) - 1


def _mix_seed(*values):
    """A 63-bit seed from integers (splitmix64 steps): the stochastic-rounding key of one call."""
    z = 0
    for value in values:
        z = (z + 0x9E3779B97F4A7C15 + (int(value) & _MASK64)) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z >> 1

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


class _LazyName:
    """A parameter's description for error messages, built only when a message is formatted."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args

    def __str__(self):
        name, *rest = self.args
        return name(*rest)

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay, one fused pass per parameter tensor.

    Args are those of torch.optim.AdamW. `foreach`, `fused` and `capturable` are accepted and
    recorded in the param groups (for state_dict compatibility) but do not change the kernel:
    fastllm always runs its own fused implementation. `differentiable=True` is refused, since the
    fused step is not differentiable.

    Works with torch.amp.GradScaler through the fused-optimizer protocol: the scaler hands over
    `grad_scale` and `found_inf`, grads are unscaled inside the kernel, and a step with inf/nan
    grads changes nothing (params, moments and step counts stay as they were).

    Mixed precision (keyword-only, all off by default):
        master_weights: bf16/fp16 params get an fp32 master copy (state 'master_param') and fp32
            moments; each step updates the master and writes back its rounding. fp32 params are
            unaffected.
        stochastic_rounding: round the written-back bf16/fp16 params stochastically (unbiased).
            Without master_weights this is pure bf16 training: the bf16 param is the only copy
            of the weight (moments in fp32).
        kahan_summation: pure bf16 training with a bf16 compensation buffer per param (state
            'kahan_comp') holding what rounding to bf16 dropped; param + kahan_comp carries ~16
            significant bits. Not with master_weights (it replaces them).
        max_grad_norm: clip grads by their global L2 norm (over every param of every group,
            torch.nn.utils.clip_grad_norm_'s formula), fused into the update.
        loss_scaler: a fastllm.amp.LossScaler; grads are divided by its scale inside the update
            and the optimizer calls its update() after each step.
    With any of them set, each step first computes the global grad norm (exposed, unscaled and
    before clipping, as `self.grad_norm`, a 0-dim fp32 tensor); if it is inf or nan the step is
    skipped, nothing changes bitwise, `self.step_skipped` is True and `self.skipped_steps` counts
    it. Training without master weights is implemented for bf16 params only; amsgrad is not
    supported together with these options.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False,
                 stochastic_rounding=False, kahan_summation=False, max_grad_norm=None,
                 loss_scaler=None):
        _check_hyperparameters("defaults", lr, betas, eps, weight_decay)
        if max_grad_norm is not None:
            max_grad_norm = float(max_grad_norm)
            if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
                raise ValueError(f"fastllm.optim.AdamW: max_grad_norm must be finite and > 0, "
                                 f"got {max_grad_norm}")
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(f"fastllm.optim.AdamW: loss_scaler must be a "
                            f"fastllm.amp.LossScaler, got {type(loss_scaler).__name__}")
        if kahan_summation and master_weights:
            raise ValueError("fastllm.optim.AdamW: kahan_summation is for pure bf16 training and "
                             "replaces master weights; set one of master_weights or "
                             "kahan_summation")
        if amsgrad and (master_weights or stochastic_rounding or kahan_summation):
            raise ValueError("fastllm.optim.AdamW: amsgrad is not supported with master_weights, "
                             "stochastic_rounding or kahan_summation")
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
        self.master_weights = bool(master_weights)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.kahan_summation = bool(kahan_summation)
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = loss_scaler
        # Drawn only when used, so the default optimizer leaves the global RNG alone.
        self._sr_seed = (int(torch.randint(0, 2**62, ()).item())
                         if self.stochastic_rounding else None)
        self.grad_norm = None
        self.step_skipped = False
        self.skipped_steps = 0

    @property
    def _mixed(self):
        """Whether any mixed-precision option is on (and with it the guarded norm pass)."""
        return (self.master_weights or self.stochastic_rounding or self.kahan_summation
                or self.max_grad_norm is not None or self.loss_scaler is not None)

    def _kind(self, p):
        """'master', 'pure' or 'plain': which update a param gets."""
        if p.dtype in _LOW_PRECISION:
            if self.master_weights:
                return "master"
            if self.stochastic_rounding or self.kahan_summation:
                return "pure"
        return "plain"

    # Optimizer.__getstate__ keeps only defaults, state and param_groups; the options below and the
    # stochastic-rounding seed travel with a pickled or deep-copied optimizer too.
    _EXTRA_ATTRS = {"master_weights": False, "stochastic_rounding": False,
                    "kahan_summation": False, "max_grad_norm": None, "loss_scaler": None,
                    "_sr_seed": None, "grad_norm": None, "step_skipped": False,
                    "skipped_steps": 0}

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: getattr(self, k, v) for k, v in self._EXTRA_ATTRS.items()})
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        for key, value in self._EXTRA_ATTRS.items():
            self.__dict__.setdefault(key, value)
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
                where = _LazyName(self._name, group, gi, pi, p)  # formatted only on error
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
                kind = self._kind(p)
                if p.dtype == torch.float16 and kind == "pure":
                    raise NotImplementedError(
                        f"fastllm.optim.AdamW: {where} is float16; training without master "
                        f"weights (stochastic_rounding or kahan_summation alone) is implemented "
                        f"for bfloat16 params only. Use master_weights=True for fp16 params")
                state = self.state.get(p)
                if state:
                    self._check_state(where, p, state, group["amsgrad"], kind)

    @staticmethod
    def _check_state(where, p, state, amsgrad, kind="plain"):
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        for key in keys:
            t = state.get(key)
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} is missing")
            if t.shape != p.shape:
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} has shape "
                                   f"{tuple(t.shape)}, expected {tuple(p.shape)}")
            # Mixed-precision params keep fp32 moments (a drop-in state in p.dtype is upcast).
            dtype_ok = t.dtype == p.dtype or (kind != "plain" and t.dtype == torch.float32)
            if t.device != p.device or not dtype_ok or not t.is_contiguous():
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"contiguous {p.dtype} tensor on {p.device}, got {t.dtype} "
                                   f"on {t.device}")
        for key, dtype in (("master_param", torch.float32), ("kahan_comp", p.dtype)):
            t = state.get(key)
            if t is None:
                continue
            if (not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype
                    or t.device != p.device or not t.is_contiguous()):
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"contiguous {dtype} tensor of shape {tuple(p.shape)} on "
                                   f"{p.device}")
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
        extra = state_dict.get("fastllm")
        if extra is not None and extra.get("loss_scaler") is not None and self.loss_scaler is None:
            raise ValueError("fastllm.optim.AdamW: the state_dict holds a loss scaler's state but "
                             "this optimizer has no loss_scaler")
        super().load_state_dict(state_dict)
        for state in self.state.values():
            step = state.get("step")
            if step is not None and not isinstance(step, torch.Tensor):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
            elif step is not None and step.device.type != "cpu":
                # torch's fused/capturable AdamW keeps steps on the param's device; fastllm's
                # kernels take the bias corrections from CPU steps (no device sync per tensor).
                state["step"] = step.detach().to("cpu", torch.float32)
        # torch casts every floating state tensor to its param's dtype on load; the fp32 masters
        # and moments of low-precision params are put back as saved, bit for bit.
        saved_ids = [pid for g in saved_groups for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = saved_state.get(pid)
            if not saved or p.dtype not in _LOW_PRECISION:
                continue
            for key in _FP32_STATE_KEYS:
                value = saved.get(key)
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    self.state[p][key] = value.to(device=p.device, copy=True)
        if extra is not None:
            if extra.get("sr_seed") is not None:
                self._sr_seed = int(extra["sr_seed"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            if extra.get("loss_scaler") is not None:
                self.loss_scaler.load_state_dict(extra["loss_scaler"])

    def state_dict(self):
        """torch.optim.Optimizer.state_dict; with a mixed-precision option set it also holds a
        'fastllm' entry: the loss scaler's state, the stochastic-rounding seed and the skip count.
        Master weights ('master_param') and Kahan buffers ('kahan_comp') are per-param state."""
        state_dict = super().state_dict()
        if self._mixed:
            state_dict["fastllm"] = {
                "sr_seed": self._sr_seed,
                "skipped_steps": self.skipped_steps,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            }
        return state_dict

    def _init_state(self, p, group, kind):
        state = self.state[p]
        fp32 = kind != "plain"
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            like = (lambda: torch.zeros_like(p, dtype=torch.float32)) if fp32 else (
                lambda: torch.zeros_like(p, memory_format=torch.preserve_format))
            state["exp_avg"] = like()
            state["exp_avg_sq"] = like()
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p)
        if fp32:
            for key in ("exp_avg", "exp_avg_sq"):
                if state[key].dtype != torch.float32:  # a drop-in state loaded into this mode
                    state[key] = state[key].float()
        if kind == "master" and "master_param" not in state:
            state["master_param"] = p.detach().float()
        if kind == "pure" and self.kahan_summation and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p)
        return state

    def _global_grad_norm(self):
        """The L2 norm of every grad of every group (as the grads are, i.e. still scaled)."""
        by_device = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.device, []).append(p.grad)
        if not by_device:
            return None
        norms = [l2norm(grads) for grads in by_device.values()]
        if len(norms) == 1:
            return norms[0]
        first = norms[0].device
        return torch.stack([n.to(first) for n in norms]).square().sum().sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter that has a grad. Returns closure's loss, if any.

        With a mixed-precision option set, `self.grad_norm` holds the global grad norm afterwards
        and `self.step_skipped` whether inf/nan grads made the step a no-op.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate()

        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self.loss_scaler is not None:
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError("fastllm.optim.AdamW: this optimizer has a loss_scaler and is "
                                   "also being stepped by torch.amp.GradScaler; use one of them")
            grad_scale = self.loss_scaler.scale_tensor()
        if found_inf is not None and bool(found_inf.item()):
            self.step_skipped = True
            self.skipped_steps += 1
            return loss  # inf/nan grads under GradScaler: change nothing

        clip_coef = None
        if self._mixed:
            norm = self._global_grad_norm()
            if norm is not None and grad_scale is not None:
                norm = norm / grad_scale.to(norm.device)
            self.grad_norm = norm
            if norm is not None and not bool(torch.isfinite(norm)):
                self.step_skipped = True
                self.skipped_steps += 1
                if self.loss_scaler is not None:
                    self.loss_scaler.update(found_inf=True)
                return loss
            if norm is not None and self.max_grad_norm is not None:
                # torch.nn.utils.clip_grad_norm_'s coefficient.
                clip_coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        self.step_skipped = False

        for gi, group in enumerate(self.param_groups):
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                kind = self._kind(p)
                state = self._init_state(p, group, kind)
                lists = buckets.setdefault((p.device, p.dtype, kind), ([], [], [], [], [], []))
                extra = (state.get("max_exp_avg_sq") if kind == "plain"
                         else state.get("master_param", state.get("kahan_comp")))
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                          extra, state["step"])):
                    lst.append(t)
            group_steps = [t for lists in buckets.values() for t in lists[5]]
            if group_steps:
                torch._foreach_add_(group_steps, 1.0)  # one call, not one tiny op per param
            beta1, beta2 = (_scalar(b, "beta") for b in group["betas"])
            lr = _scalar(group["lr"], "lr")
            for bi, ((device, _, kind), (ps, gs, ms, vs, extras, steps)) in enumerate(
                    buckets.items()):
                scale = grad_scale
                if scale is not None and scale.device != device:
                    scale = scale.to(device, non_blocking=True)
                coef = clip_coef
                if coef is not None and coef.device != device:
                    coef = coef.to(device, non_blocking=True)
                if kind == "plain":
                    if coef is not None:
                        # adamw_step divides by grad_scale: fold the clipping factor into it.
                        scale = (1.0 / coef) if scale is None else scale / coef
                    adamw_step(
                        ps, gs, ms, vs, extras if group["amsgrad"] else [], steps,
                        lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                        maximize=group["maximize"], grad_scale=scale,
                    )
                    continue
                seed = 0
                if self.stochastic_rounding:
                    seed = _mix_seed(self._sr_seed, gi, bi, int(steps[0].item()))
                adamw_master_step(
                    ps, gs, extras if kind == "master" else [], ms, vs,
                    extras if kind == "pure" and self.kahan_summation else [], steps,
                    lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], maximize=group["maximize"],
                    stochastic_rounding=self.stochastic_rounding, seed=seed,
                    grad_scale=scale, clip_coef=coef,
                )
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        return loss
