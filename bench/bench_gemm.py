"""fp32 CPU GEMMs: ATen's (torch.mm: MKL's sgemm on x86) against fastllm's routes (fastllm/_gemm.py:
oneDNN, csrc/cpu/gemm.cpp, and the AVX2 kernel, csrc/cpu/sgemm_avx2.cpp, each where it exists on
this CPU), on the products of a SmolLM2-135M training step.

    fastllm bench --ops gemm

Shapes (m x n x k, 8 x 512 tokens): the MLP's x W^T (4096 x 1536 x 576) and its dX / dW
(4096 x 576 x 1536, 576 x 1536 x 4096 with a transposed operand, as the backward passes it), the
attention projections (4096 x 576 x 576, 4096 x 192 x 576), a LoRA r=16 down product and its
dA (4096 x 16 x 576, 16 x 576 x 4096), and the LM head over one chunk of the fused loss
(1024 x 49152 x 576). All providers are timed in the same interleaved rounds; each route is
forced (FASTLLM_CPU_FP32_MATMUL=onednn / avx2) whatever the CPU's default. CPU only.

bf16 x bf16 -> fp32 (csrc/cpu/gemm_bf16.cpp, builds with AVX512-BF16), on the products it serves:
the fused loss's dW over one 682-row chunk of bf16 tokens (49152 x 576 x 682, G^T read
transposed) and the attention's S = Q K^T of a 128-position block of 3 stacked heads against 512
keys (384 x 512 x 64); against torch.mm of the bf16 operands (which rounds its output to bf16)
and of fp32 copies (what they replace: a cast, then fp32's GEMM).
"""

import functools
import os
from unittest import mock

import torch

from fastllm import _gemm
from fastllm.bench import harness

# fastllm's GPU matmuls are cuBLAS's: `fastllm bench --ops all --device cuda` leaves it out
DEVICES = ("cpu",)
# (label, m, n, k, transposed a): a is (k, m) read transposed when set (dW = dY^T X)
SHAPES = [
    ("MLP x W^T", 4096, 1536, 576, False),
    ("MLP dX = dY W", 4096, 576, 1536, False),
    ("MLP dW = dY^T X", 1536, 576, 4096, True),
    ("o_proj x W^T", 4096, 576, 576, False),
    ("k/v_proj x W^T", 4096, 192, 576, False),
    ("LoRA x A^T, r=16", 4096, 16, 576, False),
    ("LoRA dA, r=16", 16, 576, 4096, True),
    ("LM head, 1024-row chunk", 1024, 49152, 576, False),
]


# (label, m, n, k, transposed a)
BF16_SHAPES = [
    ("fused loss dW, 682-token chunk", 49152, 576, 682, True),
    ("attention S = Q K^T, 128 x 3 heads", 384, 512, 64, False),
]


def run(device="cpu", full=False, progress=print):
    if torch.device(device).type != "cpu":
        harness.note(progress, "gemm: CPU only (fastllm's GPU matmuls are cuBLAS's); skipped")
        return []
    rows = _bf16f32(full, progress)
    routes = [r for r in ("onednn", "avx2") if _gemm._usable(r)]
    if not routes:
        harness.note(progress, "gemm: no fastllm fp32 route here (no oneDNN matmul ATen accepts "
                                "on this CPU, no AVX2, or fastllm._C not built); skipped")
        return rows
    g = torch.Generator().manual_seed(0)
    with mock.patch.dict(os.environ):  # _forced sets the route per call; restored here
        _fp32(routes, g, full, progress, rows)
    return rows


def _fp32(routes, g, full, progress, rows):
    for label, m, n, k, trans in SHAPES:
        size = f"{label}: {m} x {n} x {k}, fp32"
        progress(f"gemm {size}: ATen, fastllm {' '.join(routes)} (interleaved)")
        a = torch.randn(k, m, generator=g).t() if trans else torch.randn(m, k, generator=g)
        b = torch.randn(n, k, generator=g).t()  # (k, n) as a transposed weight, as F.linear
        out = torch.empty(m, n)
        exact = a.double() @ b.double()
        fns, errs = {"torch.mm (ATen)": lambda: torch.mm(a, b, out=out)}, []
        for r in routes:
            fns[f"fastllm ({PROVIDERS[r]})"] = functools.partial(_forced, r, out, a, b)
            err = (_forced(r, out.clone(), a, b).double() - exact).abs().max().item()
            errs.append(f"{PROVIDERS[r]} {err:.2e}")
        timings = harness.measure_many(fns, min_time_s=0.5 if not full else 2.0)
        for provider, t in timings.items():
            rows.append({"op": "gemm", "size": size, "provider": provider,
                         "time_ms": t.median_ms, "flops": 2 * m * n * k,
                         "baseline": "torch.mm (ATen)"})
        rows[-1]["note"] = f"fastllm's max abs error against fp64: {', '.join(errs)}"


PROVIDERS = {"onednn": "oneDNN", "avx2": "AVX2"}


def _forced(route, out, a, b):
    # (run() restores the variable; a mock.patch.dict per call, which copies the environment
    # twice, cost ~0.3 ms, a third of a LoRA-sized product)
    os.environ[_gemm.ENV] = route
    return _gemm.addmm_(out, a, b, beta=0)


ENGINES = {"fastllm": "fastllm kernel", "mkl": "MKL"}


def _engines(ext):
    """The bf16 x bf16 -> fp32 engines this machine has ({name: label}): the one the C++ kernels
    take by default (if they take one here) first, labelled so."""
    default = ext.gemm_bf16f32_engine() if ext.gemm_bf16f32_preferred() else None
    return {name: ENGINES[name] + (" (default)" if name == default else "")
            for name in sorted(ext.gemm_bf16f32_engines(), key=lambda e: e != default)}


def _bf16f32(full, progress):
    from fastllm import _extension

    ext = _extension.extension()
    if ext is None or not ext.gemm_bf16f32_available():
        harness.note(progress, "gemm: fastllm._C has no bf16 x bf16 -> fp32 GEMM (no "
                                "AVX512-BF16 build, no MKL); skipped")
        return []
    engines = _engines(ext)

    def ours(engine, a, b, out):
        ext.set_gemm_bf16f32_engine(engine)  # (an atomic store: nothing next to the GEMM)
        ext.gemm_bf16f32_cpu(a, b, out, False)

    rows = []
    g = torch.Generator().manual_seed(0)
    try:
        for label, m, n, k, trans in BF16_SHAPES:
            size = f"{label}: {m} x {n} x {k}, bf16 -> fp32"
            progress(f"gemm {size}: torch.mm bf16, fp32 copies, fastllm's engines (interleaved)")
            a = (torch.randn(k, m, generator=g).bfloat16().t() if trans
                 else torch.randn(m, k, generator=g).bfloat16())
            b = torch.randn(k, n, generator=g).bfloat16()
            out, low = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16)
            exact = a.double() @ b.double()
            errs = {"torch.mm bf16": (torch.mm(a, b).double() - exact).abs().max().item()}
            fns = {"torch.mm bf16 (bf16 out)": lambda: torch.mm(a, b, out=low),
                   "torch.mm of fp32 copies": lambda: torch.mm(a.float(), b.float(), out=out)}
            for engine, name in engines.items():
                ours(engine, a, b, out)
                errs[name] = (out.double() - exact).abs().max().item()
                fns[f"fastllm bf16 -> fp32, {name}"] = (
                    lambda e=engine: ours(e, a, b, out))
            timings = harness.measure_many(fns, min_time_s=0.5 if not full else 2.0)
            for provider, t in timings.items():
                rows.append({"op": "gemm", "size": size, "provider": provider,
                             "time_ms": t.median_ms, "flops": 2 * m * n * k,
                             "baseline": "torch.mm bf16 (bf16 out)"})
            rows[-1]["note"] = "max abs error against fp64: " + ", ".join(
                f"{name} {err:.2e}" for name, err in errs.items())
    finally:
        ext.set_gemm_bf16f32_engine(None)
    return rows
