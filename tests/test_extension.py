"""The compiled extension under test is the one built from this checkout's csrc/.

A stale fastllm._C (built before a source change, or not rebuilt after a pull) would otherwise
make the cpp/cuda tests exercise old code, or skip them; here it fails, saying what to run.
"""

import importlib
import os

import pytest

import fastllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_CHECKOUT = os.path.isdir(os.path.join(ROOT, "csrc")) and os.path.isfile(
    os.path.join(ROOT, "setup.py"))


@pytest.mark.skipif(not IN_CHECKOUT, reason="tests run outside a source checkout")
def test_extension_is_built_from_these_sources():
    assert fastllm.has_cpp(), ("fastllm._C is missing or does not import; build it with "
                               "`make build` (pip install --no-build-isolation -e .)")
    try:
        info = importlib.import_module("fastllm._build_info")
    except ImportError:
        pytest.fail("fastllm/_build_info.py is missing: fastllm._C was not built by this "
                    "setup.py; rebuild with `make build`")
    from fastllm._sources import source_hash

    current = source_hash(ROOT)
    assert info.SOURCE_HASH == current, ("fastllm._C was built from other csrc/ sources than "
                                         "these: rebuild with `make build`")
