"""Loading of the compiled extension fastllm._C.

Importing fastllm never fails because the extension is missing (a source checkout that was never
built, a build without a compiler): the ops fall back to Triton or to the plain-PyTorch reference,
and one warning says what is missing and how to build it.
"""

import importlib
import warnings

_C = None
_ERROR = None
_WARNED = False

try:
    # (import_module: `from fastllm import _C` during fastllm's own import reports a missing
    # file as a "partially initialized module ... circular import")
    _C = importlib.import_module("fastllm._C")
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    _ERROR = exc


def extension():
    """The compiled module, or None when it could not be imported (after warning once)."""
    global _WARNED
    if _C is None and not _WARNED:
        _WARNED = True
        warnings.warn(
            "fastllm: the compiled extension fastllm._C is not available "
            f"({_ERROR}); C++/CUDA kernels are disabled and ops fall back to Triton or to the "
            "PyTorch reference. Build it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _C


def has_cpp():
    return _C is not None


def has_cuda_kernels():
    return _C is not None and bool(getattr(_C, "has_cuda", False))
