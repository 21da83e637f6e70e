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

from fastllm import _backend
from fastllm.amp import LossScaler
from fastllm.ops.adamw import adamw_step
from fastllm.ops.adamw_master import adamw_master_step
from fastllm.optim.grad_norm import clip_coefficient, global_grad_norm

# FSDP2 (fully_shard) params, grads and states are DTensors; the fused kernels run on
# each rank's local shard (same storage), and the grad norm is reduced over the mesh.
from fastllm._dtensor import local as _local

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
    # The messages contain torch.optim.AdamW's own wording, which code and tests match on.
    lr_value = _scalar(lr, "lr")
    if not math.isfinite(lr_value) or lr_value < 0.0:
        raise ValueError(f"fastllm.optim.AdamW: {where}: Invalid learning rate: {lr}")
    if not math.isfinite(eps) or eps < 0.0:
        raise ValueError(f"fastllm.optim.AdamW: {where}: Invalid epsilon value: {eps}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"fastllm.optim.AdamW: {where}: betas must be a pair, got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"fastllm.optim.AdamW: {where}: betas must be either both floats or "
                         f"both Tensors")
    for i, beta in enumerate(betas):
        value = _scalar(beta, f"betas[{i}]")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"fastllm.optim.AdamW: {where}: Invalid beta parameter at index "
                             f"{i}: {beta}")
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"fastllm.optim.AdamW: {where}: Invalid weight_decay value: "
                         f"{weight_decay}")


def _is_dense(t):
    """Whether t's elements fill one gap-free block of memory (in some order of its dims)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _dense_views(tensors, writebacks):
    """(param, grad, states...) as contiguous tensors whose elements correspond one to one.

    Contiguous tensors pass through. A non-contiguous but dense param (channels_last, a
    transposed weight) is stepped in its own memory order: each tensor with the param's strides
    becomes a flat view of its storage, any other is copied into the param's layout first. A
    param with gaps is stepped on contiguous copies. Copies of written tensors are queued in
    `writebacks` as (tensor, copy), to be copied back after the kernels ran (the grad is only
    read)."""
    if all(t is None or t.is_contiguous() for t in tensors):
        return tensors
    p = tensors[0]
    # Flat views in the param's memory order when it is dense but permuted; plain contiguous
    # copies when the param itself is contiguous or has gaps.
    flat = not p.is_contiguous() and _is_dense(p)
    out = []
    for i, t in enumerate(tensors):
        if t is None or (t.is_contiguous() and not flat):
            out.append(t)
            continue
        if flat and t.stride() == p.stride() and _is_dense(t):
            out.append(t.as_strided((t.numel(),), (1,)))
            continue
        copy = torch.empty_like(p, dtype=t.dtype) if flat else t.contiguous()
        if flat:
            copy.copy_(t)
        if i != 1:
            writebacks.append((t, copy))
        out.append(copy.as_strided((copy.numel(),), (1,)) if flat else copy)
    return out


# low-byte optimizer state lives in fastllm/optim/adamw8bit.py (imported lazily:
# it subclasses AdamW).
def _lowbyte():
    from fastllm.optim import adamw8bit

    return adamw8bit


def _lowbyte_mode(opt, p):
    return getattr(opt, "state_dtype", None) is not None and _lowbyte().mode(opt, p) is not None


def _lowbyte_block_keys():
    return ("exp_avg_absmax", "exp_avg_sq_absmax")


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
    two options that need the host: `loss_scaler` (a host-side scale; use torch.amp.GradScaler)
    and `stochastic_rounding` (its seed advances on the host each step).

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

    A parameter changed outside the optimizer (`model.load_state_dict`, an in-place clip) while it
    has a master copy is noticed through its version counter and the master is re-synced from it,
    so the next step does not write the stale master back.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False,
                 stochastic_rounding=False, kahan_summation=False, max_grad_norm=None,
                 loss_scaler=None, state_dtype=None):
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
                             "loss_scaler: fastllm.amp.LossScaler keeps its scale on the host and "
                             "must read the overflow flag back every step. Use "
                             "torch.amp.GradScaler, whose scale lives on the device")
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
        # low-byte moments (bf16, or 8-bit in AdamW8bit), fastllm/optim/adamw8bit.py.
        _lowbyte().check_options(self, state_dtype, amsgrad, self.kahan_summation,
                                 capturable=capturable)
        # Drawn only when used, so the default optimizer leaves the global RNG alone.
        self._sr_seed = (int(torch.randint(0, 2**62, ()).item())
                         if self.stochastic_rounding else None)
        self._sr_calls = 0  # host count of step() calls: keys the stochastic-rounding stream
        self.grad_norm = None
        self.step_skipped = False
        self.skipped_steps = 0
        # param -> its _version right after the optimizer last wrote it (master mode only).
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
                    "_sr_seed": None, "_sr_calls": 0, "grad_norm": None,
                    "step_skipped": False, "skipped_steps": 0,
                    "state_dtype": None, "block_size": 256, "min_8bit_size": 4096}

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: getattr(self, k, v) for k, v in self._EXTRA_ATTRS.items()})
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        for key, value in self._EXTRA_ATTRS.items():
            self.__dict__.setdefault(key, value)
        self.__dict__.setdefault("_written_versions", {})
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            # As torch.optim.AdamW: always decoupled, also after loading a torch.optim.Adam state.
            group["decoupled_weight_decay"] = True

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
                kind = self._kind(p)
                if p.dtype == torch.float16 and kind == "pure":
                    raise NotImplementedError(
                        f"fastllm.optim.AdamW: {where} is float16; training without master "
                        f"weights (stochastic_rounding or kahan_summation alone) is implemented "
                        f"for bfloat16 params only. Use master_weights=True for fp16 params")
                state = self.state.get(p)
                if state and _lowbyte_mode(self, p):
                    _lowbyte().check_state(self, where, p, state)
                elif state:
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
            if t.device != p.device or not dtype_ok:
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"{p.dtype} tensor on {p.device}, got {t.dtype} "
                                   f"on {t.device}")
        for key, dtype in (("master_param", torch.float32), ("kahan_comp", p.dtype)):
            t = state.get(key)
            if t is None:
                continue
            if (not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype
                    or t.device != p.device):
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"{dtype} tensor of shape {tuple(p.shape)} on "
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
        _lowbyte().check_loaded(self, state_dict)  # refuse mismatched moment layouts
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
                    if key in _lowbyte_block_keys():  # one value per block
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
        for p in params:
            state = self.state.get(p)
            # A load-state-dict post-hook may store anything in optimizer.state; leave it alone.
            if isinstance(state, dict) and state:
                self._convert_loaded_state(p, state)
        _lowbyte().restore_loaded(self, state_dict)  # low-byte moments bit for bit
        self._written_versions.clear()  # a loaded master is the truth, not the param
        if extra is not None:
            if extra.get("sr_seed") is not None:
                self._sr_seed = int(extra["sr_seed"])
            self._sr_calls = int(extra.get("sr_calls", 0))
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            if extra.get("loss_scaler") is not None:
                self.loss_scaler.load_state_dict(extra["loss_scaler"])

    def _convert_loaded_state(self, p, state):
        """Bring a loaded per-param state into this optimizer's mode for `p`.

        Step counts become fp32 tensors on the param's device. A checkpoint of another mode is
        converted, not refused: into plain mode the master copy and Kahan buffer are dropped and
        the moments cast to the param's dtype; into master mode a Kahan buffer is folded into the
        new master (param + comp is the pure-bf16 run's best value); into pure mode a master is
        turned into the Kahan buffer (master - param) or dropped. Moments become fp32 where the
        mode keeps them in fp32 (`_init_state`)."""
        step = state.get("step")
        if step is not None:
            if not isinstance(step, torch.Tensor):
                step = torch.tensor(float(step))
            state["step"] = step.detach().to(device=p.device, dtype=torch.float32)
        kind = self._kind(p)
        master, comp = state.get("master_param"), state.get("kahan_comp")
        if kind == "plain":
            state.pop("master_param", None)
            state.pop("kahan_comp", None)
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.dtype != p.dtype:
                    state[key] = t.to(p.dtype)
        elif kind == "master":
            if master is None and comp is not None:
                state["master_param"] = p.detach().float() + comp.float()
            state.pop("kahan_comp", None)
        else:  # pure
            if self.kahan_summation and comp is None and master is not None:
                state["kahan_comp"] = (master - p.detach().float()).to(p.dtype)
            if not self.kahan_summation:
                state.pop("kahan_comp", None)
            state.pop("master_param", None)

    def state_dict(self):
        """torch.optim.Optimizer.state_dict; with a mixed-precision option set it also holds a
        'fastllm' entry: the loss scaler's state, the stochastic-rounding seed and the skip count.
        Master weights ('master_param') and Kahan buffers ('kahan_comp') are per-param state."""
        state_dict = super().state_dict()
        if self._mixed:
            state_dict["fastllm"] = {
                "sr_seed": self._sr_seed,
                "sr_calls": self._sr_calls,
                "skipped_steps": int(self.skipped_steps),
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            }
        return state_dict

    def _init_state(self, p, group, kind):
        state = self.state[p]
        fp32 = kind != "plain"
        if len(state) == 0:
            # On the param's device, as torch's fused/capturable AdamW: the kernels read it there.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
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
        """The L2 norm of every grad of every group (as the grads are, i.e. still scaled); over
        the mesh for DTensor grads (fastllm.optim.grad_norm)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return global_grad_norm(grads) if grads else None

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
        # `found`: one fp32 flag on the device, nonzero when this step must change nothing. Every
        # kernel of the step reads it, so skipping needs no host read.
        found = None if found_inf is None else found_inf.to(torch.float32)
        clip_coef = None
        if self._mixed:
            norm = self._global_grad_norm()
            if norm is not None:
                if grad_scale is not None:
                    norm = norm / grad_scale.to(norm.device)
                bad = (~torch.isfinite(norm)).to(torch.float32)
                found = bad if found is None else torch.maximum(found.to(bad.device), bad)
                if self.max_grad_norm is not None:
                    # torch.nn.utils.clip_grad_norm_'s coefficient (nan on a skipped step).
                    clip_coef = clip_coefficient(norm, self.max_grad_norm)
                self._record("grad_norm", norm)
        if found is not None:
            self._record("step_skipped", found != 0)
            if not isinstance(self.skipped_steps, torch.Tensor):
                self.skipped_steps = torch.full((), int(self.skipped_steps), dtype=torch.int64,
                                                device=found.device)
            self.skipped_steps.add_(found.to(device=self.skipped_steps.device,
                                             dtype=torch.int64))
        elif isinstance(self.step_skipped, torch.Tensor):
            self.step_skipped.zero_()
        if self.stochastic_rounding:
            self._sr_calls += 1

        with _backend.validated():  # _validate() above checked what the ops would check
            self._step_groups(grad_scale, clip_coef, found)
        if self.master_weights:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and self._kind(p) == "master":
                        self._written_versions[p] = p._version
        if self.loss_scaler is not None:
            # fastllm's LossScaler keeps its scale on the host: its one read of the flag.
            self.loss_scaler.update(found_inf=found is not None and bool(found))
        return loss

    def _step_groups(self, grad_scale, clip_coef, found):
        """The fused kernels over every param group, bucketed by (device, dtype, kind)."""
        for gi, group in enumerate(self.param_groups):
            buckets = {}
            writebacks = []
            lowbyte = []  # params with low-byte moments, stepped by their own op
            for p in group["params"]:
                if p.grad is None:
                    continue
                if _lowbyte_mode(self, p):
                    lowbyte.append(p)
                    continue
                kind = self._kind(p)
                state = self._init_state(p, group, kind)
                if kind == "master":
                    self._resync_master(p, state)
                extra = (state.get("max_exp_avg_sq") if kind == "plain"
                         else state.get("master_param", state.get("kahan_comp")))
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                               extra, state["step"])]
                tensors[:5] = _dense_views(tensors[:5], writebacks)
                lists = buckets.setdefault((tensors[0].device, p.dtype, kind),
                                           ([], [], [], [], [], []))
                for lst, t in zip(lists, tensors):
                    lst.append(t)
            group_steps = [t for lists in buckets.values() for t in lists[5]]
            if group_steps:
                torch._foreach_add_(group_steps, 1.0)  # one call, not one tiny op per param
            beta1, beta2 = (_scalar(b, "beta") for b in group["betas"])
            lr = _scalar(group["lr"], "lr")
            for bi, ((device, _, kind), (ps, gs, ms, vs, extras, steps)) in enumerate(
                    buckets.items()):
                scale, coef, skip = (None if t is None or t.device == device
                                     else t.to(device, non_blocking=True)
                                     for t in (grad_scale, clip_coef, found))
                scale = grad_scale if scale is None else scale
                coef = clip_coef if coef is None else coef
                skip = found if skip is None else skip
                if kind == "plain":
                    if coef is not None:
                        # adamw_step divides by grad_scale: fold the clipping factor into it.
                        scale = (1.0 / coef) if scale is None else scale / coef
                    adamw_step(
                        ps, gs, ms, vs, extras if group["amsgrad"] else [], steps,
                        lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                        maximize=group["maximize"], grad_scale=scale, found_inf=skip,
                    )
                else:
                    seed = 0
                    if self.stochastic_rounding:
                        seed = _mix_seed(self._sr_seed, gi, bi, self._sr_calls)
                    adamw_master_step(
                        ps, gs, extras if kind == "master" else [], ms, vs,
                        extras if kind == "pure" and self.kahan_summation else [], steps,
                        lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], maximize=group["maximize"],
                        stochastic_rounding=self.stochastic_rounding, seed=seed,
                        grad_scale=scale, clip_coef=coef, found_inf=skip,
                    )
                if skip is not None:
                    # As torch's fused AdamW: a skipped step takes its count back, on the device.
                    torch._foreach_sub_(steps, [skip] * len(steps))
            for dst, src in writebacks:
                dst.copy_(src)
            if lowbyte:
                _lowbyte().step(self, group, gi, lowbyte, grad_scale, clip_coef, found)

    def _record(self, name, value):
        """Set a reported tensor (grad_norm, step_skipped) in place when it exists: what
        torch.compile and CUDA graphs see (a new attribute set inside a compiled step is lost)."""
        current = getattr(self, name, None)
        if (isinstance(current, torch.Tensor) and current.shape == value.shape
                and current.dtype == value.dtype and current.device == value.device):
            current.copy_(value)
        else:
            setattr(self, name, value.detach().clone())

    def _resync_master(self, p, state):
        """Re-sync the fp32 master from `p` if something outside the optimizer wrote `p` since
        the optimizer's own last write (model.load_state_dict, an in-place clip, ...): otherwise
        the next step would write the stale master back over that change."""
        written = self._written_versions.get(p)
        if written is not None and p._version != written:
            state["master_param"].copy_(_local(p).detach())
