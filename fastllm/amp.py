"""Dynamic loss scaling for fp16 training: fastllm.amp.LossScaler.

    scaler = fastllm.amp.LossScaler()                       # scale 2**16
    opt = fastllm.optim.AdamW(model.parameters(), master_weights=True, max_grad_norm=1.0,
                              loss_scaler=scaler)
    for batch in data:
        scaler.scale(loss_fn(model, batch)).backward()
        opt.step()             # unscales inside the fused update, skips the step on inf/nan
        opt.zero_grad()        # grads, and calls scaler.update(found_inf) itself

The optimizer reads the scale, divides the grads by it inside its fused update, detects
overflow in its norm pass and calls `update()`; with any other optimizer call
`update(found_inf)` yourself after each step. torch.amp.GradScaler works with
fastllm.optim.AdamW too; LossScaler adds hysteresis, a minimum scale and a clear error when the
scale collapses.

The scale and the counters live on the device (a 0-dim fp32 tensor and four int32 counters, on
the CPU until `scale()` or `scale_tensor(device)` first sees another device), and `update()`
takes the overflow flag as a device tensor: a training step never waits for the GPU to report
whether it overflowed. fastllm.optim.AdamW's Triton step prologue (fastllm/kernels/l2norm.py)
advances the same state inside its launch. `get_scale()` and `state_dict()` read the device. A
collapse is flagged on the device and raised by `update()` / `poll()` as soon as the host can read
the flag without waiting (at once for CPU state, within a step or two on a GPU).

Policy (Megatron-LM's DynamicGradScaler, megatron/core/optimizer/grad_scaler.py): an overflow
resets the growth count and uses up one unit of hysteresis; once the hysteresis is used up, every
overflow multiplies the scale by backoff_factor (not below min_scale). After growth_interval
steps in a row without overflow the scale is multiplied by growth_factor (kept as it is when that
would be inf in fp32, as torch's GradScaler does) and the hysteresis is restored. An overflow that
would need a scale below min_scale raises LossScaleCollapsedError.
"""

import collections
import math
import numbers
import sys

import torch

__all__ = ["LossScaleCollapsedError", "LossScaler", "ScalerState"]

# What a kernel needs to advance a LossScaler on the device (fastllm/kernels/l2norm.py): the scale
# (fp32 0-dim), the counters (int32: growth count, hysteresis left, overflows, collapsed) and
# the policy's constants.
ScalerState = collections.namedtuple(
    "ScalerState", "scale trackers growth_factor backoff_factor growth_interval hysteresis "
                   "min_scale")

_COLLAPSED = ("fastllm.amp.LossScaler: the gradients are inf or nan even with the loss scale at "
              "its minimum ({min_scale:g}), so a smaller scale cannot help. Usually the loss or "
              "the model itself produces inf/nan: check the batch and the loss for nan, lower or "
              "warm up the learning rate, clip with max_grad_norm, or keep the layers that "
              "overflow fp16 in the forward pass in fp32 (or train in bf16, which needs no loss "
              "scaling). If the gradients are merely tiny, pass a lower min_scale.")


_INT32_MAX = 2**31 - 1  # the counters are int32 on the device


class LossScaleCollapsedError(RuntimeError):
    """Gradients overflow even at the minimum loss scale: scaling is not what is wrong."""


def _fp32(value):
    """`value` as the fp32 the device state holds (1e39 is finite in Python, inf there)."""
    return float(torch.tensor(value, dtype=torch.float32))


def _check(where, values, scale_key):
    """Refuse, with a ValueError naming the key, a policy or state the scaler cannot run with.
    One set of rules for the constructor (scale_key "init_scale") and load_state_dict ("scale",
    with the trackers), so that a checkpoint cannot hold what a constructor would refuse."""
    def number(key):
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
        return float(value)

    def require(key, ok, want):
        if not ok(number(key)):
            raise ValueError(f"{where}: {key} must be {want}, got {values[key]!r}")

    def integer(low, high):
        return lambda v: v.is_integer() and low <= v <= high

    require(scale_key, lambda v: math.isfinite(_fp32(v)) and _fp32(v) > 0,
            "finite and > 0 in fp32 (the scale is kept in fp32)")
    require("growth_factor", lambda v: math.isfinite(v) and v > 1.0, "finite and > 1")
    require("backoff_factor", lambda v: 0.0 < v < 1.0, "in (0, 1)")
    require("growth_interval", integer(1, _INT32_MAX), f"an integer in [1, {_INT32_MAX}]")
    require("hysteresis", integer(1, _INT32_MAX), f"an integer in [1, {_INT32_MAX}]")
    # Compared in fp32, as the device compares them: a scale that rounds to min_scale is at it.
    scale = _fp32(number(scale_key))
    require("min_scale", lambda v: 0 < _fp32(v) <= scale and math.isfinite(v),
            f"finite, > 0 and at most {scale_key} ({scale:g} in fp32)")
    if scale_key == "init_scale":
        return
    # A tracker the policy can never reach would stall it: growth_tracker >= growth_interval
    # never grows again, hysteresis_tracker > hysteresis tolerates more overflows than asked.
    interval, hysteresis = int(values["growth_interval"]), int(values["hysteresis"])
    require("growth_tracker", integer(0, interval - 1),
            f"an integer in [0, growth_interval - 1 = {interval - 1}]")
    require("hysteresis_tracker", integer(-_INT32_MAX - 1, hysteresis),
            f"an integer, at most hysteresis ({hysteresis})")
    require("overflows", integer(0, _INT32_MAX), f"an integer in [0, {_INT32_MAX}]")


class LossScaler:
    """Dynamic loss scale with hysteresis.

    Args:
        init_scale: the first scale (2**16).
        growth_factor: the scale is multiplied by this after growth_interval clean steps (> 1).
        backoff_factor: and by this after an overflow once the hysteresis is used up (in (0, 1)).
        growth_interval: clean steps in a row before the scale grows.
        hysteresis: overflows tolerated (each still skips its step) before the scale backs off.
        min_scale: the scale never goes below this; an overflow at it raises
            LossScaleCollapsedError.
        enabled: False makes scale() return the loss unchanged and update() do nothing.
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=2, min_scale=1.0, enabled=True):
        _check("fastllm.amp.LossScaler", dict(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale),
            "init_scale")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.enabled = bool(enabled)
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self._trackers = torch.tensor([0, self.hysteresis, 0, 0], dtype=torch.int32)
        self._one = torch.ones((), dtype=torch.float32)
        self._pending = None  # [event, pinned flag, copy in flight]: the GPU's collapse flag

    def _place(self, device):
        """Move the state to `device` (once: a run keeps it where its loss lives)."""
        device = torch.device(device)
        if self._scale.device != device:
            self._scale = self._scale.to(device)
            self._trackers = self._trackers.to(device)
            self._one = self._one.to(device)
            self._pending = None

    @property
    def overflows(self):
        """Steps skipped because of inf/nan grads, over the whole run (reads the device)."""
        return int(self._trackers[2])

    def get_scale(self):
        """The current scale as a float (1.0 when disabled); reads the device."""
        return float(self._scale) if self.enabled else 1.0

    def scale_tensor(self, device=None):
        """The current scale as a 0-dim fp32 tensor (what the optimizer divides grads by): the
        scaler's own state, moved to `device` when given, so `update()` changes it in place."""
        if device is not None:
            self._place(device)
        return self._scale if self.enabled else self._one

    def device_state(self, device):
        """The state a kernel advances (ScalerState), on `device`; None when disabled."""
        if not self.enabled:
            return None
        self._place(device)
        return ScalerState(self._scale, self._trackers, self.growth_factor, self.backoff_factor,
                           self.growth_interval, self.hysteresis, self.min_scale)

    def scale(self, loss):
        """loss * scale, to call .backward() on (a 0-dim loss comes back in fp32)."""
        if not self.enabled:
            return loss
        self._place(loss.device)
        return loss * self._scale

    def update(self, found_inf):
        """Advance the policy after a step; found_inf: whether that step's grads overflowed, a
        bool (or number: nonzero is an overflow) or a tensor of any shape with at least one
        element, read on the device (no synchronisation). torch's own flag has shape (1,); a
        tensor of several flags (one per device, say) counts as one overflow if any is nonzero,
        as GradScaler.update counts the sum of its per-device flags."""
        if not self.enabled:
            return
        device = self._scale.device
        if isinstance(found_inf, torch.Tensor):
            if found_inf.numel() == 0:
                raise ValueError("fastllm.amp.LossScaler.update: found_inf is an empty tensor; "
                                 "pass a flag (a bool or a tensor with at least one element)")
            flag = found_inf.reshape(()) if found_inf.numel() == 1 else found_inf.any()
            found = flag.to(device=device, dtype=torch.bool)
        elif isinstance(found_inf, numbers.Real) or _numpy_bool(found_inf):
            found = torch.full((), bool(found_inf), dtype=torch.bool, device=device)
        else:
            kind = type(found_inf)
            raise TypeError(f"fastllm.amp.LossScaler.update: found_inf must be a bool or a "
                            f"tensor, got {kind.__module__}.{kind.__qualname__}")
        self._advance(found)
        self.poll()

    def _advance(self, found):
        """The policy, on the device (fastllm/kernels/l2norm.py's _advance_scaler is the same in
        Triton): see the module docstring."""
        growth, left, overflows, collapsed = self._trackers.unbind(0)
        scale = self._scale
        growth = torch.where(found, 0, growth + 1)
        grow = growth == self.growth_interval
        growth = torch.where(grow, 0, growth)
        left = torch.where(found, left - 1, torch.where(grow, self.hysteresis, left))
        back_off = found & (left <= 0)
        collapse = back_off & (scale <= self.min_scale)
        backed_off = torch.clamp(scale * self.backoff_factor, min=self.min_scale)
        # torch's _amp_update_scale_ never grows the scale to inf: an inf scale would make every
        # grad inf, skip every step, and never collapse (inf * backoff_factor is inf).
        grown = scale * self.growth_factor
        scale = torch.where(grow & torch.isfinite(grown), grown,
                            torch.where(back_off & ~collapse, backed_off, scale))
        self._trackers.copy_(torch.stack([growth, left, overflows + found.int(),
                                          collapsed | collapse.int()]))
        self._scale.copy_(scale)

    def poll(self):
        """Raise LossScaleCollapsedError if the device has flagged a collapse, without waiting for
        the device: CPU state is read at once; on a GPU the flag is copied to pinned memory and
        looked at by a later call, once that copy is done."""
        trackers = self._trackers
        if trackers.device.type != "cuda":
            if int(trackers[3]):
                raise LossScaleCollapsedError(_COLLAPSED.format(min_scale=self.min_scale))
            return
        if self._pending is None:
            self._pending = [torch.cuda.Event(), torch.empty((), dtype=torch.int32,
                                                             pin_memory=True), False]
        event, flag, in_flight = self._pending
        if in_flight:
            if not event.query():
                return  # the last copy has not landed: look next time
            if int(flag):
                raise LossScaleCollapsedError(_COLLAPSED.format(min_scale=self.min_scale))
        flag.copy_(trackers[3], non_blocking=True)
        event.record()
        self._pending[2] = True

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pending"] = None  # an event does not pickle; the flag is still on the device
        return state

    def state_dict(self):
        growth, left, overflows, _ = self._trackers.tolist()
        return {
            "scale": float(self._scale),
            "growth_tracker": growth,
            "hysteresis_tracker": left,
            "overflows": overflows,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "enabled": self.enabled,
        }

    def check_state_dict(self, state_dict):
        """Raise as load_state_dict(state_dict) would; sets nothing."""
        self._checked(state_dict)

    def _checked(self, state_dict):
        """(merged state, trackers) of a state_dict, every value checked (as the constructor
        checks them): everything that can fail in a load."""
        where = "fastllm.amp.LossScaler.load_state_dict"
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"{where}: missing {sorted(missing)}")
        merged = dict(self.state_dict(), **state_dict)
        _check(where, merged, "scale")
        trackers = torch.tensor([int(merged["growth_tracker"]), int(merged["hysteresis_tracker"]),
                                 int(merged["overflows"]), 0], dtype=torch.int32)
        return merged, trackers

    def load_state_dict(self, state_dict):
        """Restore a state_dict(); every value is checked (as the constructor checks them)
        before any is set. `enabled` stays the constructor's, as torch.amp.GradScaler's: a
        checkpoint does not turn scaling on or off (an fp16 run resumed in bf16 with
        enabled=False kept getting its loss scaled), and a disabled scaler loads nothing."""
        merged, trackers = self._checked(state_dict)
        if not self.enabled:
            return
        for key in ("growth_factor", "backoff_factor", "min_scale"):
            setattr(self, key, float(merged[key]))
        for key in ("growth_interval", "hysteresis"):
            setattr(self, key, int(merged[key]))
        self._scale.fill_(float(merged["scale"]))
        self._trackers.copy_(trackers)
        self._pending = None

    def __repr__(self):
        growth, left, _, _ = self._trackers.tolist()
        return (f"LossScaler(scale={self.get_scale():g}, growth_tracker={growth}, "
                f"hysteresis_tracker={left}, enabled={self.enabled})")


def _numpy_bool(x):
    """Whether x is numpy's bool (np.isnan's result), which is not a numbers.Real; numpy is not
    imported for this: such a flag exists only once something imported it."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.bool_)
