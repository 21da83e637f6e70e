"""fastllm.optim.AdamW: a drop-in replacement for torch.optim.AdamW backed by fastllm::adamw_step,
with optional mixed-precision training (fastllm::adamw_master_step, fastllm::l2norm), and
AdamW8bit, the same optimizer with 8-bit moments.

Same signature, defaults, param-group keys and state_dict layout as torch.optim.AdamW (per
parameter: `step` as a 0-dim fp32 tensor, `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` when
amsgrad), so a torch state_dict loads here and the other way round. Every parameter is validated
before anything changes, then one fused op runs per (param group, device, dtype, state layout).

The keyword-only options master_weights, stochastic_rounding, kahan_summation, max_grad_norm and
loss_scaler (all off by default, which leaves the drop-in behaviour exactly as above) add:
    - one norm pass over all grads (fastllm.optim.global_grad_norm) that gives the global grad
      norm (`optimizer.grad_norm`) and detects inf/nan: such a step is skipped, nothing changes,
      and `optimizer.step_skipped` / `optimizer.skipped_steps` report it;
    - clipping by that norm and unscaling by the loss scale, fused into the update;
    - for bf16/fp16 params: fp32 master weights and fp32 moments (master_weights=True), or pure
      bf16 params with fp32 moments, stochastic rounding and/or a bf16 Kahan compensation buffer.
The moment layouts (torch's, bf16, 8-bit) live in fastllm/optim/state_layout.py.

Host cost. What does not change between steps is kept in a step plan (fastllm/optim/_plan.py):
the fused calls' tensor lists per group and dtype, the checks of params and state, the step
counts as views of one buffer per call (one add instead of one per tensor). The plan is checked
each step against the params and their grads (by identity) and rebuilt when they change; new
grad tensors (zero_grad(set_to_none=True)) are checked alone. State replaced through
load_state_dict, add_param_group or a new `optimizer.state` is noticed; a state tensor swapped
by hand inside `optimizer.state[p]` is not: call `optimizer.invalidate_plan()` after doing so.
"""

import contextlib
import math
from collections import OrderedDict

import torch

from fastllm import _backend
from fastllm.amp import LossScaler
from fastllm.optim._hyper import check_hyperparameters, describe, refuse_duplicates
from fastllm.optim._master_versions import (refuse_stale_masters_in_capture,
                                            versions_after_copy, versions_in_sync)
from fastllm.optim._plan import Plan, check_amsgrad, kind_of
from fastllm.optim.grad_norm import clip_coefficient, global_grad_norm, grad_norm_step
from fastllm.optim.state_layout import Moments

__all__ = ["AdamW", "AdamW8bit"]


@contextlib.contextmanager
def held_back(opt, *names):
    """Empty torch.optim.Optimizer's hook dicts `names` while torch's own state_dict /
    load_state_dict runs, and yield them: fastllm's versions call those hooks themselves, where
    torch calls them (the pre-hooks before the checks, the post-hooks once the state is as the
    optimizer keeps it)."""
    saved = [getattr(opt, name) for name in names]
    for name in names:
        setattr(opt, name, OrderedDict())
    try:
        yield saved
    finally:
        for name, hooks in zip(names, saved):
            setattr(opt, name, hooks)


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay, one fused pass per parameter tensor.

    Args are those of torch.optim.AdamW. `foreach` and `fused` are accepted for compatibility and
    recorded in the param groups (torch's state_dicts carry them) but change nothing: fastllm
    always runs its own fused multi-tensor kernels. `differentiable=True` is refused, since the
    fused step is not differentiable.

    No host synchronisation: step counts live on the params' device (as with torch's fused and
    capturable AdamW), the bias corrections are computed in the kernels from them, and an
    inf/nan step (GradScaler's `found_inf`, or a non-finite grad norm) is turned into a no-op
    inside the kernels, after which the step counts are decremented on the device. So `step()`
    reads nothing back from the GPU, and with `capturable=True` it can be captured in a CUDA graph
    or traced by `torch.compile(fullgraph=True)`. `capturable=True` refuses, at construction, the
    two options that need the host: `loss_scaler` (its collapse check; use torch.amp.GradScaler)
    and `stochastic_rounding` (its seed advances on the host each step). A tensor `lr` is read
    by the kernels where it lives (fastllm/ops/_lr.py), so an LR scheduler's in-place update
    reaches a captured or compiled step.

    With a mixed-precision option on plain grads on one GPU (the Triton backend, or forced), the
    step is two launches: fastllm/kernels/l2norm.py's prologue (the grad norm, the skip flag, the
    clip/unscale multiplier, the step counts, the skip count and the LossScaler's update, all on
    the device) and the update. Elsewhere (DTensors, several devices, a CUDA graph capture,
    another backend) the same values come from global_grad_norm and a few torch ops.

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
    before clipping, as `self.grad_norm`: a 0-dim fp32 tensor, fp64 when every grad is fp64;
    fastllm.optim.grad_norm); if it is inf or nan the step is skipped, nothing changes bitwise,
    `self.step_skipped` is True and `self.skipped_steps` counts it. Training without master
    weights is implemented for bf16 params only; amsgrad is not supported together with these
    options. `grad_norm`, `step_skipped` and `skipped_steps` are
    device tensors, read only when you look at them.

    A parameter changed outside the optimizer (`model.load_state_dict`, an in-place clip under
    no_grad, `p.data = w`, torch.nn.init) while it has a master copy is noticed through its
    version counter and its memory, and the master is re-synced from it, so the next step does
    not write the stale master back. In-place writes through `p.data` (`p.data.copy_(w)`,
    `p.data.normal_()` as in transformers' _init_weights, `p.data += delta` as in peft's merge)
    are not seen: they bypass the version counter, as they bypass autograd, and torch keeps no
    other record of a write; the next step overwrites them with the stale master. Write under
    torch.no_grad() instead, or after such writes call
    `torch.autograd.graph.increment_version(params)` (a param or a list of them): the next step
    then re-syncs those masters.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False,
                 stochastic_rounding=False, kahan_summation=False, max_grad_norm=None,
                 loss_scaler=None, state_dtype=None):
        check_hyperparameters("defaults", lr, betas, eps, weight_decay)
        # As torch.optim.AdamW, at construction only: OneCycleLR(cycle_momentum=True) later
        # writes (float, Tensor) betas, which torch steps with.
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError("fastllm.optim.AdamW: defaults: betas must be either both floats "
                             "or both Tensors")
        betas = tuple(betas)  # as torch.optim.AdamW
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
            raise ValueError("fastllm.optim.AdamW: Tensor lr must be 1-element")
        if foreach and fused:
            raise RuntimeError("fastllm.optim.AdamW: `fused` and `foreach` cannot be `True` "
                               "together.")
        if isinstance(lr, torch.Tensor) and foreach and not capturable:
            raise ValueError("fastllm.optim.AdamW: lr as a Tensor is not supported for "
                             "capturable=False and foreach=True")
        if isinstance(betas[0], torch.Tensor) and foreach and not capturable:
            raise ValueError("fastllm.optim.AdamW: betas[0] as a Tensor is not supported for "
                             "capturable=False and foreach=True")
        if capturable and loss_scaler is not None:
            raise ValueError("fastllm.optim.AdamW: capturable=True cannot be combined with "
                             "loss_scaler: fastllm.amp.LossScaler looks from the host, after each "
                             "step, for a scale that has collapsed, which a captured graph cannot "
                             "do. Use torch.amp.GradScaler")
        if capturable and stochastic_rounding:
            raise ValueError("fastllm.optim.AdamW: capturable=True cannot be combined with "
                             "stochastic_rounding: its random stream is re-keyed on the host "
                             "every step, which a captured graph would freeze")
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
        # The moment layout (torch's, bf16 or 8-bit): fastllm/optim/state_layout.py.
        self.moments = Moments(state_dtype)
        self.moments.check_options(amsgrad, self.kahan_summation, capturable)
        self._plan = None
        # Drawn only when used, so the default optimizer leaves the global RNG alone.
        self._sr_seed = (int(torch.randint(0, 2**62, ()).item())
                         if self.stochastic_rounding else None)
        self._sr_calls = 0  # host count of step() calls: keys the stochastic-rounding stream
        self.grad_norm = None
        self.step_skipped = False
        self.skipped_steps = 0
        # param -> its written_version (fastllm/optim/_master_versions.py) right after the
        # optimizer last wrote it (master mode only).
        self._written_versions = {}
        if capturable:
            # Reported tensors exist from the start and are only written in place, so a compiled
            # or graph-captured step updates them.
            device = next((p.device for g in self.param_groups for p in g["params"]), None)
            self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
            self.step_skipped = torch.zeros((), dtype=torch.bool, device=device)
            self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)


    @property
    def _mixed(self):
        """Whether any mixed-precision option is on (and with it the guarded norm pass)."""
        return (self.master_weights or self.stochastic_rounding or self.kahan_summation
                or self.max_grad_norm is not None or self.loss_scaler is not None)

    def _kind(self, p):
        """'master', 'pure' or 'plain': which update a param gets."""
        return kind_of(p, self.master_weights, self.stochastic_rounding, self.kahan_summation)

    # The moment layout's settings, as attributes (bitsandbytes and torchao expose them so).
    state_dtype = property(lambda self: self.moments.state_dtype)
    block_size = property(lambda self: self.moments.block_size)
    min_8bit_size = property(lambda self: self.moments.min_8bit_size)

    # Optimizer.__getstate__ keeps only defaults, state and param_groups; the options below and the
    # stochastic-rounding seed travel with a pickled or deep-copied optimizer too.
    _EXTRA_ATTRS = {"master_weights": False, "stochastic_rounding": False,
                    "kahan_summation": False, "max_grad_norm": None, "loss_scaler": None,
                    "_sr_seed": None, "_sr_calls": 0, "grad_norm": None,
                    "step_skipped": False, "skipped_steps": 0, "moments": None}

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: getattr(self, k, v) for k, v in self._EXTRA_ATTRS.items()})
        if self.__dict__.get("_plan") is not None:
            self._plan.save_versions(self)
        state["_masters_in_sync"] = versions_in_sync(self._written_versions)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        for key, value in self._EXTRA_ATTRS.items():
            self.__dict__.setdefault(key, value)
        if self.__dict__.get("moments") is None:
            self.moments = Moments()
        self._written_versions = versions_after_copy(self.__dict__.pop("_masters_in_sync", {}))
        self._plan = None
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            # As torch.optim.AdamW: always decoupled, also after loading a torch.optim.Adam state.
            group["decoupled_weight_decay"] = True

    _name = staticmethod(describe)

    def invalidate_plan(self):
        """Forget the cached step plan (fastllm/optim/_plan.py): the next step checks every
        param and state tensor again. Needed only after swapping a tensor inside
        `optimizer.state[p]` by hand; load_state_dict and add_param_group do it themselves."""
        self._drop_plan()

    def _drop_plan(self):
        """Forget the cached plan, keeping what it knows of the masters' written versions (else
        the next plan would take a master that is in sync for stale, or miss a user's write)."""
        plan = self.__dict__.get("_plan")
        if plan is not None:
            plan.save_versions(self)
        self._plan = None

    def add_param_group(self, param_group):
        refuse_duplicates("fastllm.optim.AdamW", param_group, len(self.param_groups))
        if "moments" in self.__dict__ and isinstance(param_group, dict) and param_group.get(
                "amsgrad", self.defaults["amsgrad"]):  # (after construction; a step checks all)
            check_amsgrad(self, f"param group {len(self.param_groups)}")
        super().add_param_group(param_group)
        self._drop_plan()

    def load_state_dict(self, state_dict):
        """torch.optim.Optimizer.load_state_dict, after checking the whole state_dict.

        Accepts state_dicts of torch.optim.AdamW (and Adam) as well. Another optimizer's state
        (SGD's: no betas, a momentum_buffer), a state without exp_avg_sq, or a state whose shape
        does not match its parameter raises, naming the parameter, and leaves the optimizer
        unchanged. Hooks run as torch runs them: what the load-state-dict pre-hooks return is
        what is checked and loaded, and the post-hooks see the state as this optimizer keeps it.
        """
        state_dict = state_dict.copy()  # (shallow, as torch's: the pre-hooks may edit it)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"fastllm.optim.AdamW: the state_dict has {len(saved_groups)} param "
                             f"groups, this optimizer has {len(self.param_groups)}")
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in saved]
            if missing:
                raise ValueError(f"fastllm.optim.AdamW: param group {gi} of the state_dict has "
                                 f"no {missing} (a state_dict of another optimizer?)")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"fastllm.optim.AdamW: param group {gi} of the state_dict has "
                                 f"{len(saved['params'])} params, this optimizer's has "
                                 f"{len(group['params'])}")
        self.moments.check_loaded(state_dict, self.param_groups, describe)
        extra = self._check_loaded_extra(state_dict.get("fastllm"))
        self._plan = None
        with held_back(self, "_optimizer_load_state_dict_pre_hooks",
                       "_optimizer_load_state_dict_post_hooks") as (_, post_hooks):
            super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        self.moments.restore_loaded(self.state, state_dict, params)
        for p in params:
            state = self.state.get(p)
            if isinstance(state, dict) and state:
                self.moments.convert_loaded(p, state, self._kind(p), self.kahan_summation)
                for key, t in state.items():  # (torch keeps a loaded tensor's negative bit,
                    if isinstance(t, torch.Tensor) and t.is_neg():  # which the kernels ignore)
                        state[key] = t.resolve_neg()
        self._written_versions.clear()  # a loaded master is the truth, not the param
        self._plan = None
        if extra is not None:
            if extra["sr_seed"] is not None:
                self._sr_seed = extra["sr_seed"]
            self._sr_calls, self.skipped_steps = extra["sr_calls"], extra["skipped_steps"]
            if extra["loss_scaler"] is not None:
                self.loss_scaler.load_state_dict(extra["loss_scaler"])
        for hook in post_hooks.values():
            hook(self)

    def _check_loaded_extra(self, extra):
        """The state_dict's 'fastllm' entry, checked (so that a bad one is refused before
        anything changes) and its numbers parsed; None when there is none."""
        if extra is None:
            return None
        where = "fastllm.optim.AdamW: the state_dict's 'fastllm' entry"
        if not isinstance(extra, dict):
            raise ValueError(f"{where} is a {type(extra).__name__}, not a dict")
        try:
            seed = extra.get("sr_seed")
            out = {"sr_seed": None if seed is None else int(seed),
                   "sr_calls": int(extra.get("sr_calls", 0)),
                   "skipped_steps": int(extra.get("skipped_steps", 0)),
                   "loss_scaler": extra.get("loss_scaler")}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where} is invalid: {e}") from None
        if out["loss_scaler"] is not None:
            if self.loss_scaler is None:
                raise ValueError("fastllm.optim.AdamW: the state_dict holds a loss scaler's state "
                                 "but this optimizer has no loss_scaler")
            # checked now, loaded only after the optimizer state
            self.loss_scaler.check_state_dict(out["loss_scaler"])
        return out

    def state_dict(self):
        """torch.optim.Optimizer.state_dict; with a mixed-precision option set it also holds a
        'fastllm' entry: the loss scaler's state, the stochastic-rounding seed and the skip count.
        Master weights ('master_param') and Kahan buffers ('kahan_comp') are per-param state;
        8-bit state adds the 'fastllm_lowbyte' entry (fastllm/optim/state_layout.py). The
        state-dict post-hooks see (and may replace) the whole of it, as torch's do."""
        with held_back(self, "_optimizer_state_dict_post_hooks") as (post_hooks,):
            state_dict = super().state_dict()
        if self._mixed:
            state_dict["fastllm"] = {
                "sr_seed": self._sr_seed,
                "sr_calls": self._sr_calls,
                "skipped_steps": int(self.skipped_steps),
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            }
        extra = self.moments.extra()
        if extra is not None:
            state_dict["fastllm_lowbyte"] = extra
        for hook in post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _step_plan(self):
        """The plan of this step: the cached one when params and grads still match it."""
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        if torch.compiler.is_compiling():
            return Plan(self, params, grads, cached=False)  # traced: no host-side cache
        plan = self._plan
        if plan is None or not plan.still_valid(self, params, grads):
            self._drop_plan()
            plan = self._plan = Plan(self, params, grads, cached=True)
        return plan

    def _global_grad_norm(self, plan):
        """The L2 norm of every grad of every group (as the grads are, i.e. still scaled); over
        the mesh for DTensor grads (fastllm.optim.grad_norm)."""
        return global_grad_norm(plan.all_grads) if plan.all_grads else None

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
        plan = self._step_plan()  # checks everything before anything changes
        # A cached plan re-checks only the hyperparameters a group changed since (one tuple
        # compare per group); done here, before the norm pass, the skip count and the
        # stochastic-rounding counter move, so that a refused step changes nothing.
        hyper = plan.check_hyper(self)
        refuse_stale_masters_in_capture(self, plan)

        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        device = plan.all_grads[0].device if plan.all_grads else None
        if self.loss_scaler is not None:
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError("fastllm.optim.AdamW: this optimizer has a loss_scaler and is "
                                   "also being stepped by torch.amp.GradScaler; use one of them")
            grad_scale = self.loss_scaler.scale_tensor(device)
        # `found`: one fp32 flag on the device, nonzero when this step must change nothing. Every
        # kernel of the step reads it, so skipping needs no host read.
        found = None if found_inf is None else found_inf.to(torch.float32)
        clip_coef = plain_scale = None
        fused = False
        with _backend.validated():  # the plan checked what the ops would check
            if self._mixed and plan.all_grads:
                scalars = self._fused_prologue(plan, device, grad_scale, found)
                fused = scalars is not None
                if fused:
                    # The multiplier replaces the loss scale and the clipping factor.
                    found, clip_coef, plain_scale = scalars
                    grad_scale = None
                else:
                    norm = self._global_grad_norm(plan)
                    if grad_scale is not None:
                        norm = norm / grad_scale.to(norm.device)
                    bad = (~torch.isfinite(norm)).to(torch.float32)
                    found = bad if found is None else torch.maximum(found.to(bad.device), bad)
                    if self.max_grad_norm is not None:
                        # torch.nn.utils.clip_grad_norm_'s coefficient (nan on a skipped step).
                        clip_coef = clip_coefficient(norm, self.max_grad_norm)
                    self._record("grad_norm", norm)
            if found is not None and not fused:  # (the prologue wrote them itself)
                self._record("step_skipped", found != 0)
                if not isinstance(self.skipped_steps, torch.Tensor):
                    self.skipped_steps = torch.full((), int(self.skipped_steps),
                                                    dtype=torch.int64, device=found.device)
                self.skipped_steps.add_(found.to(device=self.skipped_steps.device,
                                                 dtype=torch.int64))
            elif found is None and isinstance(self.step_skipped, torch.Tensor):
                self.step_skipped.zero_()
            if self.stochastic_rounding:
                self._sr_calls += 1
            try:
                plan.run(self, hyper, grad_scale, clip_coef, found, plain_scale=plain_scale,
                         steps_advanced=fused)
            finally:
                if plan.cached:
                    plan.release_grads()  # (zero_grad can free them: torch.optim holds none)
        if self.loss_scaler is not None:
            if fused:
                self.loss_scaler.poll()  # the prologue advanced it on the device
            else:
                self.loss_scaler.update(found if found is not None else False)
        return loss

    def _fused_prologue(self, plan, device, grad_scale, found_inf):
        """Everything a mixed-precision step computes before its update, in one launch
        (fastllm.optim.grad_norm.grad_norm_step): the grad norm into `grad_norm`, the skip flag
        into `step_skipped` and `skipped_steps`, the step counts of the flat calls, the loss
        scaler's update. Returns the update's (found, clip_coef, plain_scale) device scalars, or
        None where the prologue does not apply (then the step computes them with torch ops)."""
        if self.defaults.get("capturable"):
            return None  # its reported tensors must keep their addresses across a capture
        out = getattr(self, "_prologue_out", None)
        if out is None or out[0].device != device:
            scalars = torch.zeros(4, dtype=torch.float32, device=device)
            # (buffer, skip flag, its views: the norm, found, multiplier, adamw_step's divisor)
            out = self._prologue_out = (scalars, torch.zeros((), dtype=torch.bool, device=device),
                                        scalars.unbind(0))
        if (not isinstance(self.skipped_steps, torch.Tensor)
                or self.skipped_steps.device != device):
            self.skipped_steps = torch.full((), int(self.skipped_steps), dtype=torch.int64,
                                            device=device)
        scaler = None if self.loss_scaler is None else self.loss_scaler.device_state(device)
        if not grad_norm_step(plan.all_grads, out[0], skipped=out[1],
                              skipped_steps=self.skipped_steps, grad_scale=grad_scale,
                              found_inf=found_inf, max_norm=self.max_grad_norm,
                              steps=plan.flat_steps.get(device), scaler=scaler):
            return None
        self.step_skipped = out[1]
        self.grad_norm, found, mult, divisor = out[2]
        if grad_scale is None and self.max_grad_norm is None:
            return found, None, None
        return found, mult, divisor

    def _record(self, name, value):
        """Set a reported tensor (grad_norm, step_skipped) in place when it exists: what
        torch.compile and CUDA graphs see (a new attribute set inside a compiled step is lost)."""
        current = getattr(self, name, None)
        if (isinstance(current, torch.Tensor) and current.shape == value.shape
                and current.dtype == value.dtype and current.device == value.device):
            current.copy_(value)
        else:
            setattr(self, name, value.detach().clone())


class AdamW8bit(AdamW):
    """AdamW with 8-bit block-quantised moments: a drop-in for bitsandbytes.optim.AdamW8bit and
    torchao.optim.AdamW8bit (the arguments they share: lr, betas, eps, weight_decay, amsgrad;
    block_size as torchao, min_8bit_size as bitsandbytes).

    Each tensor with at least `min_8bit_size` elements (the whole tensor's count, also when it
    is sharded) keeps both moments as one byte per element (bitsandbytes' dynamic map, signed
    for exp_avg, unsigned for exp_avg_sq) plus one fp32 absmax per `block_size` elements: about
    2.03 bytes per parameter instead of torch's 8. Smaller tensors keep fp32 state. The update
    is fastllm::adamw8bit_step (dequantise, AdamW, requantise in one pass). The state layout is
    in fastllm/optim/state_layout.py; convert_state() converts to and from torch AdamW's.

    Every keyword option of fastllm.optim.AdamW combines with it (master_weights,
    stochastic_rounding, max_grad_norm, loss_scaler, GradScaler), except amsgrad (refused, as
    bitsandbytes does not implement it either) and kahan_summation.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, block_size=256, min_8bit_size=4096, **kwargs):
        if "state_dtype" in kwargs:
            raise TypeError("fastllm.optim.AdamW8bit: state_dtype is always torch.uint8; use "
                            "fastllm.optim.AdamW(state_dtype=...) for other state types")
        moments = Moments(torch.uint8, block_size, min_8bit_size,
                          where="fastllm.optim.AdamW8bit")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, state_dtype=torch.uint8,
                         **kwargs)
        self.moments = moments

