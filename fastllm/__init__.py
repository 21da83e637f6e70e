"""fastllm: fused Triton, C++ and CUDA kernels for LLM training behind a thin PyTorch API.

    import fastllm
    opt = fastllm.optim.AdamW(model.parameters(), lr=3e-4)   # drop-in for torch.optim.AdamW

Backends per op: cpp (CPU), cuda and triton (GPU), ref (plain PyTorch). FASTLLM_BACKEND or
fastllm.use_backend(...) forces one; see fastllm/_backend.py.
"""

from fastllm import _library  # noqa: F401  (declares the fastllm:: op schemas first)
from fastllm import amp, lora, ops, optim, preference, quant
from fastllm._backend import BACKENDS, use_backend
from fastllm._extension import has_cpp, has_cuda_kernels
from fastllm.patch import KINDS as patch_kinds, patch, patched, unpatch

__version__ = "0.1.0"

__all__ = ["BACKENDS", "amp", "has_cpp", "has_cuda_kernels", "lora", "ops", "optim",
           "preference", "quant", "use_backend", "patch", "patch_kinds", "patched", "unpatch"]

_LAZY = ("distributed", "parallel")  # imported on first use: `fastllm.distributed.PowerSGD(...)`


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"fastllm.{name}")
    raise AttributeError(f"module 'fastllm' has no attribute {name!r}")
