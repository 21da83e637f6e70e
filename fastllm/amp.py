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

Policy (Megatron-LM's DynamicGradScaler, megatron/core/optimizer/grad_scaler.py): an overflow
resets the growth count and uses up one unit of hysteresis; once the hysteresis is used up, every
overflow multiplies the scale by backoff_factor (not below min_scale). After growth_interval
steps in a row without overflow the scale is multiplied by growth_factor and the hysteresis is
restored. An overflow that would need a scale below min_scale raises LossScaleCollapsedError.
"""

import math

import torch

__all__ = ["LossScaleCollapsedError", "LossScaler"]


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
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self.overflows = 0  # steps skipped because of inf/nan grads, over the whole run

    def get_scale(self):
        """The current scale as a float (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale_tensor(self, device=None):
        """The current scale as a 0-dim fp32 tensor (what the optimizer divides grads by)."""
        return torch.tensor(self.get_scale(), dtype=torch.float32, device=device)

    def scale(self, loss):
        """loss * scale, to call .backward() on."""
        if not self.enabled:
            return loss
        return loss * self._scale

    def update(self, found_inf):
        """Advance the policy after a step; found_inf: whether that step's grads overflowed."""
        if not self.enabled:
            return
        if not found_inf:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor
            return
        self.overflows += 1
        self._growth_tracker = 0
        self._hysteresis_tracker -= 1
        if self._hysteresis_tracker > 0:
            return
        if self._scale <= self.min_scale:
            raise LossScaleCollapsedError(
                f"fastllm.amp.LossScaler: the gradients are inf or nan even with the loss scale "
                f"at its minimum ({self.min_scale:g}), so a smaller scale cannot help. Usually "
                f"the loss or the model itself produces inf/nan: check the batch and the loss "
                f"for nan, lower or warm up the learning rate, clip with max_grad_norm, or keep "
                f"the layers that overflow fp16 in the forward pass in fp32 (or train in bf16, "
                f"which needs no loss scaling). If the gradients are merely tiny, pass a lower "
                f"min_scale.")
        self._scale = max(self._scale * self.backoff_factor, self.min_scale)

    def state_dict(self):
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "overflows": self.overflows,
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
        for key in ("growth_interval", "hysteresis", "overflows"):
            if key in state_dict:
                setattr(self, key, int(state_dict[key]))
        if "enabled" in state_dict:
            self.enabled = bool(state_dict["enabled"])
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])

    def __repr__(self):
        return (f"LossScaler(scale={self.get_scale():g}, growth_tracker={self._growth_tracker}, "
                f"hysteresis_tracker={self._hysteresis_tracker}, enabled={self.enabled})")
