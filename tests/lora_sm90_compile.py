"""Compile kernels/lora_linear.py's Triton kernels for sm_90 without a GPU (ahead of time, through
ptxas), with the GPU launch configuration. Run by tests/test_lora_linear.py in a subprocess
without TRITON_INTERPRET: the interpreter executes kernels but never compiles them, so this is
what catches GPU-only compile errors and shared-memory overflow on a CPU-only machine.

    python tests/lora_sm90_compile.py    # prints one line per kernel, exits 0 when all compile
"""

import inspect
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run without TRITON_INTERPRET=1")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

import fastllm.kernels.lora_linear as K  # noqa: E402

H100_SHARED_BYTES = 227 * 1024  # per-block shared memory limit on sm_90


def _compile(kernel, pointer_types, constexprs, options):
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        elif name in ("scaling", "dropout_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    shared = compiled.metadata.shared
    assert shared <= H100_SHARED_BYTES, f"{kernel.fn.__name__}: {shared} bytes of shared memory"
    return shared


def main():
    for dtype, t in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        fwd, dx, wg, upcast, precision = K._config(dtype)
        launch = {k: fwd.pop(k) for k in ("num_warps", "num_stages")}
        dx = {k: v for k, v in dx.items() if k not in launch}
        common = dict(UPCAST=upcast, PRECISION=precision, HAS_DROPOUT=True, BLOCK_R=16)
        ptr = "*" + t
        shared = _compile(
            K._lora_fwd_kernel,
            {n: ptr for n in ("x_ptr", "w_ptr", "a_ptr", "b_ptr", "bias_ptr", "y_ptr", "xa_ptr")},
            dict(common, HAS_BIAS=True, **fwd), launch)
        print(f"{t} forward: {shared} B shared")
        shared = _compile(
            K._lora_bwd_dx_kernel,
            dict({n: ptr for n in ("dy_ptr", "w_ptr", "a_ptr", "b_ptr", "dx_ptr")},
                 dyb_ptr="*fp32"),
            dict(common, COMPUTE_DX=True, **dx), launch)
        print(f"{t} dX: {shared} B shared")
        shared = _compile(
            K._lora_bwd_pq_kernel, {"p_ptr": ptr, "q_ptr": ptr, "c_ptr": "*fp32"},
            dict(common, **wg), {})
        print(f"{t} dA/dB: {shared} B shared")


if __name__ == "__main__":
    main()
