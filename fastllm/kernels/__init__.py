"""Triton kernels and their launchers, one file per op (installed as fastllm.kernels).

Import a submodule only when its backend is chosen: importing triton is slow, and on a CPU-only
machine Triton kernels run only under TRITON_INTERPRET=1.
"""
