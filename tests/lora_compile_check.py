"""Compile fastllm/kernels/lora_linear.py's Triton kernels for sm_80, sm_86, sm_89 and sm_90
without a GPU (ahead of time, through ptxas), for every dtype and rank block the dispatcher sends
to Triton, and report the shared memory each compiled config takes against that GPU's per-block
limit.

The interpreter (how the test suite runs these kernels on a CPU) executes kernels but never
compiles them: this is what catches GPU-only compile errors and shared-memory overflow. Each
config is compiled with the specialisation a real launch gets: the launchers run on CPU tensors
(sizes whose strides and pointers are 16-byte multiples, as a real model's are), their launches
are recorded instead of run, and Triton's own binder turns each recorded launch's arguments into
the signature, constants and alignment attributes it would compile on a GPU.

    python tests/lora_compile_check.py          # every config for every arch: ~400 compiles,
                                                # ~1 min on 16 cores (bench/device_check.sh)
    python tests/lora_compile_check.py --quick  # the largest rank block (128, the most shared
        # memory) in fp32, bf16 and bf16 with fp32 adapters (fp16 tiles are bf16's size) with
        # dropout on, for sm_86 (the
        # smallest limit) and sm_90 (its own codegen); the test suite runs it with --archs 86
        # (~30 s on 2 cores), sm_90 being compiled by .ci/kernel_check.py
Exits non-zero if a config fails to compile or takes more shared memory than its GPU has.
"""

import argparse
import concurrent.futures
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run without TRITON_INTERPRET=1")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import fastllm.kernels.lora_linear as K  # noqa: E402
import fastllm.ops.lora_linear  # noqa: E402,F401  (registers the op; the name is shadowed)

op = sys.modules["fastllm.ops.lora_linear"]

# Shared memory per block, opt-in maximum (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability"): A100 163 KB, consumer Ampere / Ada 99 KB, H100/H200 227 KB.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# name -> (dtype of x and W, dtype of the adapters): "+fp32a" is fp32 adapters on that base
DTYPES = {"fp32": (torch.float32,) * 2, "bf16": (torch.bfloat16,) * 2,
          "fp16": (torch.float16,) * 2, "bf16+fp32a": (torch.bfloat16, torch.float32),
          "fp16+fp32a": (torch.float16, torch.float32)}
# One rank per BLOCK_R the dispatcher can pick (ranks 1..128; above 128 it runs the reference),
# with rank 1 for an unaligned lora_B row stride.
RANKS = (1, 16, 32, 64, op._TRITON_MAX_RANK)
M, K_IN, N_OUT = 256, 256, 384


def record_launches(dtypes, r, dropout_p, target_programs, bias=False):
    """The (kernel, args, meta) of every launch one forward and backward make; dtypes: (x and W,
    adapters)."""
    dtype, adapter_dtype = dtypes
    launches = []
    saved = K._launch, K._TARGET_PROGRAMS
    K._launch = lambda kernel, grid, args, meta: launches.append((kernel, args, meta))
    K._TARGET_PROGRAMS = target_programs
    try:
        x = torch.randn(M, K_IN).to(dtype)
        w = torch.randn(N_OUT, K_IN).to(dtype)
        a = torch.randn(r, K_IN).to(adapter_dtype)
        b = torch.randn(N_OUT, r).to(adapter_dtype)
        bias_t = torch.randn(N_OUT).to(dtype) if bias else None
        _, xa_t = K.lora_linear_fwd_triton(x, w, a, b, 0.5, bias_t, dropout_p, 1)
        K.lora_linear_bwd_triton(torch.randn(M, N_OUT).to(dtype), x, w, a, b, xa_t, 0.5,
                                 dropout_p, 1, [True, True, True])
    finally:
        K._launch, K._TARGET_PROGRAMS = saved
    return launches


def compile_args(kernel, args, meta, capability):
    """What JITFunction.run would hand triton.compile for this launch on this GPU."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound_args,
                                                              specialization, options)
    return target, signature, constexprs, attrs, options.__dict__


def compile_one(job):
    name, capability, args = job
    kernel = getattr(K, name)
    target, signature, constexprs, attrs, options = args
    compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options)
    return compiled.metadata.shared


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--archs", help="comma-separated compute capabilities, e.g. 80,90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    opts = parser.parse_args()
    default_archs = "86,90" if opts.quick else ",".join(map(str, SHARED_LIMIT))
    archs = [int(a) for a in (opts.archs or default_archs).split(",")]
    dtypes = {k: DTYPES[k] for k in ("fp32", "bf16", "bf16+fp32a")} if opts.quick else DTYPES
    ranks = RANKS[-1:] if opts.quick else RANKS
    dropouts = (0.1,) if opts.quick else (0.0, 0.1)

    jobs = {}  # one compile per distinct (kernel, arch, signature, constants, attributes, options)
    for dname, dtype in dtypes.items():
        for r in ranks:
            for p in dropouts:
                # split reductions (a short M) and unsplit ones (a long M store in place)
                for target_programs in (K._TARGET_PROGRAMS, 1):
                    for kernel, args, meta in record_launches(dtype, r, p, target_programs):
                        for cap in archs:
                            spec = compile_args(kernel, args, meta, cap)
                            key = (kernel.fn.__name__, cap, repr(spec[1:]))
                            block_r = meta["BLOCK_R"]
                            pointers = ",".join(v[1:] for v in spec[1].values()
                                                if v.startswith("*"))
                            label = (f"{kernel.fn.__name__:18s} {dname:10s} BLOCK_R={block_r:<3d} "
                                     f"dropout={meta['HAS_DROPOUT']!s:5s} "
                                     f"ptrs={pointers:19s} sm_{cap}")
                            jobs.setdefault(key, (label, (kernel.fn.__name__, cap, spec)))

    failures = 0
    with concurrent.futures.ProcessPoolExecutor(max(1, opts.jobs)) as pool:
        futures = {pool.submit(compile_one, job): label for label, job in jobs.values()}
        results = []
        for future in concurrent.futures.as_completed(futures):
            label = futures[future]
            cap = int(label.rsplit("sm_", 1)[1])
            try:
                shared = future.result()
            except Exception as exc:  # report every failure, not only the first
                results.append((label, f"COMPILE FAILED: {type(exc).__name__}: {exc}"[:300]))
                failures += 1
                continue
            ok = shared <= SHARED_LIMIT[cap]
            failures += not ok
            results.append((label, f"{shared:7d} B shared of {SHARED_LIMIT[cap]} "
                                   f"{'ok' if ok else 'OVER THE LIMIT'}"))
    for label, result in sorted(results):
        print(f"{label}  {result}")
    print(f"{len(results)} configs compiled for sm_{', sm_'.join(map(str, archs))}; "
          f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
