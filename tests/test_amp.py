"""fastllm.amp.LossScaler: a state_dict round trip, and bad states refused before anything is
set."""

import math

import pytest

from fastllm.amp import LossScaler


def test_state_dict_round_trip():
    a = LossScaler(init_scale=1024.0, hysteresis=2, growth_interval=3)
    for found in (False, True, True, False):
        a.update(found)
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


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
    import torch

    s = LossScaler(init_scale=8.0, hysteresis=1, growth_interval=2)
    scale = s.scale_tensor()
    s.update(torch.ones(()))
    assert scale.item() == 4.0 and s.overflows == 1
    s.update(torch.zeros((), dtype=torch.bool))
    s.update(torch.zeros(()))
    assert scale.item() == 8.0 and s.state_dict()["growth_tracker"] == 0
    assert s.scale(torch.tensor(0.5)).item() == 4.0
