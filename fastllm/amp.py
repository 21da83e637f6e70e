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
whether it overflowed. fastllm.optim.AdamW's Triton step prologue (kernels/l2norm.py) advances
the same state inside its launch. `get_scale()` and `state_dict()` read the device. A collapse
is flagged on the device and raised by `update()` / `poll()` as soon as the host can read the
flag without waiting (at once for CPU state, within a step or two on a GPU).

Policy (Megatron-LM's DynamicGradScaler, megatron/core/optimizer/grad_scaler.py): an overflow
resets the growth count and uses up one unit of hysteresis; once the hysteresis is used up, every
overflow multiplies the scale by backoff_factor (not below min_scale). After growth_interval
steps in a row without overflow the scale is multiplied by growth_factor and the hysteresis is
restored. An overflow that would need a scale below min_scale raises LossScaleCollapsedError.
"""

import collections
import math

import torch

__all__ = ["LossScaleCollapsedError", "LossScaler", "ScalerState"]

# What a kernel needs to advance a LossScaler on the device (kernels/l2norm.py): the scale
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


class LossScaleCollapsedError(RuntimeError):
    """Gradients overflow even at the minimum loss scale: scaling is not what is wrong."""


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
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"fastllm.amp.LossScaler: init_scale must be finite and > 0, got "
                             f"{init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"fastllm.amp.LossScaler: growth_factor must be > 1, got "
                             f"{growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"fastllm.amp.LossScaler: backoff_factor must be in (0, 1), got "
                             f"{backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError(f"fastllm.amp.LossScaler: growth_interval must be a positive "
                             f"integer, got {growth_interval}")
        if int(hysteresis) != hysteresis or hysteresis < 1:
            raise ValueError(f"fastllm.amp.LossScaler: hysteresis must be a positive integer, "
                             f"got {hysteresis}")
        if not (math.isfinite(min_scale) and 0 < min_scale <= init_scale):
            raise ValueError(f"fastllm.amp.LossScaler: min_scale must be in (0, init_scale], "
                             f"got {min_scale}")
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
        bool or a tensor (read on the device: no synchronisation)."""
        if not self.enabled:
            return
        device = self._scale.device
        if isinstance(found_inf, torch.Tensor):
            found = found_inf.to(device=device, dtype=torch.bool)
        else:
            found = torch.full((), bool(found_inf), dtype=torch.bool, device=device)
        self._advance(found)
        self.poll()

    def _advance(self, found):
        """The policy, on the device (kernels/l2norm.py's _advance_scaler is the same in
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
        scale = torch.where(grow, scale * self.growth_factor,
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

    def load_state_dict(self, state_dict):
        """Restore a state_dict(); every value is checked (as the constructor checks them)
        before any is set."""
        where = "fastllm.amp.LossScaler.load_state_dict"
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"{where}: missing {sorted(missing)}")
        merged = dict(self.state_dict(), **state_dict)

        def number(key):
            value = merged[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: {key} must be a number, got {value!r}")
            return float(value)

        checks = (
            ("scale", lambda v: math.isfinite(v) and v > 0, "finite and > 0"),
            ("growth_factor", lambda v: v > 1.0, "> 1"),
            ("backoff_factor", lambda v: 0.0 < v < 1.0, "in (0, 1)"),
            ("min_scale", lambda v: math.isfinite(v) and v > 0, "finite and > 0"),
            ("growth_interval", lambda v: v.is_integer() and v >= 1, "an integer >= 1"),
            ("hysteresis", lambda v: v.is_integer() and v >= 1, "an integer >= 1"),
            ("growth_tracker", lambda v: v.is_integer() and v >= 0, "an integer >= 0"),
            ("hysteresis_tracker", lambda v: v.is_integer(), "an integer"),
            ("overflows", lambda v: v.is_integer() and v >= 0, "an integer >= 0"),
        )
        for key, ok, want in checks:
            if not ok(number(key)):
                raise ValueError(f"{where}: {key} must be {want}, got {merged[key]!r}")
        for key in ("growth_factor", "backoff_factor", "min_scale"):
            if key in state_dict:
                setattr(self, key, float(state_dict[key]))
        for key in ("growth_interval", "hysteresis"):
            if key in state_dict:
                setattr(self, key, int(state_dict[key]))
        if "enabled" in state_dict:
            self.enabled = bool(state_dict["enabled"])
        self._scale.fill_(float(state_dict["scale"]))
        self._trackers.copy_(torch.tensor(
            [int(state_dict["growth_tracker"]), int(state_dict["hysteresis_tracker"]),
             int(merged["overflows"]), 0], dtype=torch.int32))
        self._pending = None

    def __repr__(self):
        growth, left, _, _ = self._trackers.tolist()
        return (f"LossScaler(scale={self.get_scale():g}, growth_tracker={growth}, "
                f"hysteresis_tracker={left}, enabled={self.enabled})")
