"""fastllm.amp.LossScaler: a state_dict round trip, bad states and settings refused before
anything is set, overflow flags of torch's shapes, and a scale that never grows to inf (the torch
and the Triton update)."""

import math

import pytest
import torch

from fastllm.amp import LossScaler


def test_state_dict_round_trip():
    a = LossScaler(init_scale=1024.0, hysteresis=2, growth_interval=3)
    for found in (False, True, True, False):
        a.update(found)
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


def test_enabled_is_the_constructors_not_the_checkpoints():
    """As torch.amp.GradScaler: an fp16 run's scaler state loaded by a disabled scaler (a bf16
    resume) leaves it disabled, scaling nothing; a disabled run's state does not disable an
    enabled scaler."""
    fp16 = LossScaler(init_scale=1024.0)
    off = LossScaler(enabled=False)
    off.load_state_dict(fp16.state_dict())
    assert not off.enabled and off.scale(torch.tensor(1.0)).item() == 1.0
    on = LossScaler(init_scale=8.0)
    on.load_state_dict(LossScaler(init_scale=64.0, enabled=False).state_dict())
    assert on.enabled and on.scale(torch.tensor(1.0)).item() == 64.0


@pytest.mark.parametrize("key,value", [("scale", math.nan), ("scale", 0.0), ("scale", -1.0),
                                       ("scale", math.inf), ("scale", "big"),
                                       ("growth_factor", 1.0), ("backoff_factor", 1.5),
                                       ("growth_interval", 0), ("hysteresis", 2.5),
                                       ("growth_tracker", -1), ("min_scale", 0.0)])
def test_bad_state_is_refused_before_anything_changes(key, value):
    scaler = LossScaler(init_scale=256.0)
    good = scaler.state_dict()
    with pytest.raises(ValueError, match=key):
        scaler.load_state_dict(dict(good, **{key: value}))
    assert scaler.state_dict() == good


def test_update_reads_a_device_flag_and_keeps_the_scale_in_place():
    """The overflow flag as a step leaves it (a tensor, never read on the host); the scale tensor
    handed to the optimizer is the scaler's own state, changed in place."""
    s = LossScaler(init_scale=8.0, hysteresis=1, growth_interval=2)
    scale = s.scale_tensor()
    s.update(torch.ones(()))
    assert scale.item() == 4.0 and s.overflows == 1
    s.update(torch.zeros((), dtype=torch.bool))
    s.update(torch.zeros(()))
    assert scale.item() == 8.0 and s.state_dict()["growth_tracker"] == 0
    assert s.scale(torch.tensor(0.5)).item() == 4.0


def _policy_run(flags, **policy):
    """The scaler's (scale, growth_tracker, hysteresis_tracker, overflows) after each flag."""
    s = LossScaler(**policy)
    out = []
    for flag in flags:
        s.update(flag)
        d = s.state_dict()
        out.append((d["scale"], d["growth_tracker"], d["hysteresis_tracker"], d["overflows"]))
    return out


@pytest.mark.parametrize("make", [
    lambda v: torch.full((1,), float(v)),  # torch's own found_inf (GradScaler's shape)
    lambda v: torch.full((1, 1), v, dtype=torch.bool),
    lambda v: torch.tensor([0.0, float(v), 0.0]),  # per-device flags: any one overflowed
    lambda v: torch.full((2, 2), v, dtype=torch.int32),
    lambda v: __import__("numpy").isnan(float("nan") if v else 0.0),  # a numpy bool
], ids=["fp32(1,)", "bool(1,1)", "fp32(3,)-any", "int32(2,2)", "numpy-bool"])
def test_update_takes_a_flag_of_any_shape(make):
    flags = [False, True, True, False, False, False]
    policy = dict(init_scale=64.0, hysteresis=2, growth_interval=2)
    assert _policy_run([make(f) for f in flags], **policy) == _policy_run(flags, **policy)
    s = LossScaler()
    s.update(make(True))
    assert s.scale_tensor().shape == () and s._trackers.shape == (4,)
    assert repr(s) != repr(LossScaler())  # (the flag was read: the hysteresis counted it)


@pytest.mark.parametrize("flag,error", [(torch.zeros(0), ValueError), ("yes", TypeError),
                                        (None, TypeError), ([True], TypeError)])
def test_update_refuses_what_is_not_a_flag(flag, error):
    s = LossScaler(init_scale=64.0)
    before = s.state_dict()
    with pytest.raises(error, match="found_inf"):
        s.update(flag)
    assert s.state_dict() == before


def _triton_update(scaler, found):
    """One step of fastllm.optim.AdamW's fused prologue (fastllm/kernels/l2norm.py)
    advancing `scaler`: its grads are inf when `found`."""
    from fastllm.kernels.l2norm import grad_norm_step_triton

    grads = [torch.full((8,), math.inf if found else 1.0)]
    assert grad_norm_step_triton(
        grads, torch.empty(4), skipped=torch.zeros((), dtype=torch.bool),
        skipped_steps=torch.zeros((), dtype=torch.int64), scaler=scaler.device_state("cpu"))
    scaler.poll()


# The interpreter runs the kernel's fp32 multiply in numpy, which warns at the overflow this
# test is about.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_scale_never_grows_to_inf(path):
    """GradScaler's rule (torch._amp_update_scale_): a growth that would give inf keeps the scale,
    and the growth count restarts. Compared with torch's own update, step by step."""
    if path == "triton":
        from fastllm import _backend

        if _backend.unavailable_reason("triton", "cpu"):
            pytest.skip("triton is not available")
    flags = [False, False, False, True, False, False]
    s = LossScaler(init_scale=2.0**126, growth_interval=1, hysteresis=1)
    scale, tracker = torch.full((1,), 2.0**126), torch.zeros(1, dtype=torch.int32)
    for flag in flags:
        if path == "torch":
            s.update(flag)
        else:
            _triton_update(s, flag)
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(flag)), 2.0, 0.5, 1)
        assert math.isfinite(s.get_scale())
        assert (s.get_scale(), s.state_dict()["growth_tracker"]) == (scale.item(), tracker.item())
    assert s.get_scale() == 2.0**127


@pytest.mark.parametrize("kwargs,key", [(dict(init_scale=1e39), "init_scale"),
                                        (dict(init_scale=1e-50, min_scale=1e-60), "init_scale"),
                                        (dict(min_scale=1e-50), "min_scale"),
                                        (dict(growth_factor=math.inf), "growth_factor"),
                                        (dict(hysteresis=2**31), "hysteresis"),
                                        (dict(growth_interval=2**31), "growth_interval")])
def test_constructor_refuses_what_fp32_and_int32_cannot_hold(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LossScaler(**kwargs)


@pytest.mark.parametrize("change,key", [
    (dict(growth_factor=3.0, growth_tracker=2**31), "growth_tracker"),  # not int32
    (dict(growth_interval=2, growth_tracker=5), "growth_tracker"),  # would never grow again
    (dict(growth_interval=2, growth_tracker=2), "growth_tracker"),
    (dict(min_scale=128.0, scale=1.0), "min_scale"),  # the constructor refuses it too
    (dict(scale=1e39), "scale"),  # finite in Python, inf in fp32
    (dict(hysteresis=2**31), "hysteresis"),
    (dict(hysteresis_tracker=3), "hysteresis_tracker"),  # more than hysteresis (2)
    (dict(overflows=2**31), "overflows"),
])
def test_load_checks_everything_before_setting_anything(change, key):
    scaler = LossScaler(init_scale=256.0)
    scaler.update(False)
    good = scaler.state_dict()
    with pytest.raises(ValueError, match=key):
        scaler.load_state_dict(dict(good, **change))
    assert scaler.state_dict() == good


def test_round_trip_of_a_scale_that_fp32_rounds_below_min_scale():
    # 0.7 is 0.69999998 in fp32: at min_scale as the device compares them, not below it
    a = LossScaler(init_scale=0.7, min_scale=0.7, hysteresis=1)
    a.update(False)
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
