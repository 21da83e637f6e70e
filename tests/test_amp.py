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
