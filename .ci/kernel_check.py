"""Static check of fastllm's GPU kernels without a GPU (issue 18 item 7).

Triton: every kernel is compiled for sm_90 (Hopper, the H200) with the constexprs and argument
specialisation a production launch gets. The launchers run on CPU tensors (16-byte aligned, as
real ones are) with Triton's launch replaced by a recorder (JITFunction.run), so a launcher that
sizes grids or picks constexprs is checked as it is, and the number of launches of one step is
counted. Each distinct recorded launch is compiled ahead of time (no device needed) and
    - a bandwidth kernel whose PTX has no 128-bit global load (ld.global.v4.b32 / .v2.b64, or a
      16-byte cp.async) fails: its loads are scalar; so does one whose main traffic is a write
      (WRITE_BANDWIDTH) without a 128-bit global store;
    - a LoRA kernel (TENSOR_CORES) whose products do not all run on tensor cores (no wgmma /
      mma, or an fp32 FMA dot) fails, in every dtype, fp32 and fp32 adapters included;
    - a kernel that spills registers (ptxas -v: spill stores or loads > 0) fails, and so does
      one with a register budget (MAX_REGISTERS) that uses more;
    - a kernel meant to run once per optimizer step, launched more than once in a step of four
      tensors, fails, and so does a whole fastllm.optim step (STEP_LAUNCHES) that makes more
      Triton launches than its budget.
CUDA (--cuda-so PATH, run by .ci/cuda_build_check.sh on the extension it builds): cuobjdump
reads every kernel's resource usage and SASS from the built fastllm._C; a kernel with local
memory (spills) fails, and so does a bandwidth kernel (AdamW, master, l2norm) without LDG.E.128.

Known failures (KNOWN below, each with its reason) are printed as such and do not fail the run:
they are the work issue 18 still lists, and the check proves them present. `--strict` fails on
them too (what the fixed kernels must eventually pass).

    python .ci/kernel_check.py                # Triton, ~1 min on 2 cores
    python .ci/kernel_check.py --strict
    python .ci/kernel_check.py --cuda-so fastllm/_C.cpython-311-x86_64-linux-gnu.so --no-triton
"""

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the check compiles, the interpreter does not")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said quietly
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # read by compile_ptx (printed, captured there)
# A cold Triton cache: a kernel found in the user's cache runs no ptxas, and assembling its PTX
# here without Triton's own ptxas options hid a spill those options cause (the RMSNorm backward:
# 80 registers and 8 bytes spilled from a cold cache, none from a warm one, 2026-12-04). CI
# starts cold anyway; a developer's run now sees what CI sees.
_CACHE = tempfile.TemporaryDirectory(prefix="fastllm-kernel-check-")
os.environ["TRITON_CACHE_DIR"] = _CACHE.name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import triton  # noqa: E402

CAPABILITY = 90
# 128-bit global accesses in PTX: 4 x 32-bit or 2 x 64-bit vectors, or a 16-byte async copy.
WIDE_LOAD = re.compile(r"ld\.global[\w:.]*\.v4\.[bfus]32|ld\.global[\w:.]*\.v2\.[bfus]64"
                       r"|cp\.async\.c[ag]\.shared\.global[^;]*\],\s*(?:16|0x10)\s*[,;]")
WIDE_STORE = re.compile(r"st\.global[\w:.]*\.v4\.[bfus]32|st\.global[\w:.]*\.v2\.[bfus]64")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")

# (check, kernel) -> why it still fails. Everything here is open work of issue 18.
# (None since the CUDA master step and l2norm took 16-byte accesses, 2026-12-02.) Entries are
# ("wide loads" | "spills" | ..., a part of the kernel's demangled name): "the reason".
KNOWN = {}
# Kernels whose job is streaming memory: their loads must be 128 bits wide.
BANDWIDTH = {"_adamw_kernel", "_adamw_master_kernel", "_adamw_tensor_kernel",
             "_adamw_master_tensor_kernel", "_adamw8bit_kernel", "_adamw8bit_tensor_kernel",
             "_sum_squares_kernel",
             "_scaled_copy_kernel", "_adam_lowrank_kernel", "_lora_down_kernel",
             "_lora_up_kernel", "_lora_pq_kernel",
             # the model ops of fastllm.patch (issue 19: each at 85% of the bandwidth limit)
             "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_swiglu_fwd_kernel",
             "_swiglu_bwd_kernel", "_rotary_kernel", "_flce_row_kernel", "_decompress_kernel"}
# Kernels whose main traffic is writing a full-size tensor (the LoRA seed of y and dX that the
# base GEMM adds to): their stores must be 128 bits wide.
# Their stores must be 128 bits wide but for the number of narrower ones given (a per-row scalar:
# RMSNorm's rstd, the loss's per-token loss).
WRITE_BANDWIDTH = {"_lora_up_kernel": 0, "_rms_norm_fwd_kernel": 1, "_rms_norm_bwd_kernel": 0,
                   "_swiglu_fwd_kernel": 0, "_swiglu_bwd_kernel": 0, "_rotary_kernel": 0,
                   "_flce_row_kernel": 1, "_decompress_kernel": 0, "_nf4_dequantize_kernel": 0}
# Kernels whose products must all run on tensor cores (wgmma / mma), in every dtype (issue 18
# item 5: no fp32 FMA dot; fp32 operands as bf16 terms, fastllm/kernels/lora_linear.py `_dot`).
# Each with the block sizes of its output tile: a dot on the CUDA cores takes (reduction block)
# fp32 FMAs per output element a thread holds, an epilogue (scale, bias) one; more than two per
# element fails.
TENSOR_CORES = {"_lora_down_kernel": ("BLOCK_M", "BLOCK_R"),
                "_lora_up_kernel": ("BLOCK_M", "BLOCK_N"),
                "_lora_pq_kernel": ("BLOCK_P", "BLOCK_R")}
MMA = re.compile(r"\bwgmma\.mma_async|\bmma\.sync")
FMA = re.compile(r"\bfma\.rn(?:\.ftz)?\.f32")
# Kernels meant to run once per optimizer step, however many tensors it has.
ONE_PER_STEP = {"_adamw_kernel", "_adamw_master_kernel", "_adamw8bit_kernel",
                "_sum_squares_kernel"}
# Whole optimizer steps (recipes below) and the Triton launches each may make in all. Their
# launches are counted, not compiled: the direct recipes compile the same kernels with a superset
# of their options (grad_norm_step: every option; adamw_master and adamw8bit bf16: grad_scale as
# well as the step's clip/unscale multiplier), which keeps the check's time down.
STEP_LAUNCHES = {"AdamW step bf16 master+clip+LossScaler": 2,
                 "AdamW8bit step bf16 master+clip+LossScaler": 2}
# Kernels that promise the C++ kernels' IEEE-rounded fp32 sqrt and division (issue 18 item 6:
# tl.sqrt and `/` are approximate on a GPU and exact in the interpreter, so no CPU test sees it):
# an approximate sqrt, division or reciprocal in their PTX fails.
EXACT = {"_adamw_kernel", "_adamw_tensor_kernel", "_adamw_master_kernel",
         "_adamw_master_tensor_kernel", "_adamw8bit_kernel", "_adamw8bit_tensor_kernel",
         "_adam_lowrank_kernel", "_orthogonalize_kernel", "_sum_squares_kernel"}
APPROX = re.compile(r"\b(?:sqrt|div|rcp|rsqrt)\.approx(?:\.ftz)?\.f32\b"
                    r"|\bdiv\.full(?:\.ftz)?\.f32\b")
# Kernels with a register budget (issue 18 item 4): a compile that uses more fails.
MAX_REGISTERS = {"_adamw8bit_kernel": 128, "_adamw8bit_tensor_kernel": 128}
CUDA_BANDWIDTH = ("AdamWFunctor", "AdamWMasterFunctor", "SumSquaresFunctor")


def _tensors(n, count, dtype):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=gen) * 0.01).to(dtype) for _ in range(count)]


def _steps(count):
    return [torch.full((), 3.0) for _ in range(count)]


def recipes():
    """name -> a function that runs one production step's launches on CPU tensors."""
    from fastllm.kernels.adamw import adamw_step_triton
    from fastllm.kernels.adamw8bit import adamw8bit_step_triton
    from fastllm.kernels.adamw_master import adamw_master_step_triton
    from fastllm.kernels.galore_adam_step import galore_adam_step_triton
    from fastllm.amp import LossScaler
    from fastllm.kernels.l2norm import grad_norm_step_triton, l2norm_triton
    from fastllm.kernels.orthogonalize import orthogonalize_triton
    from fastllm.kernels.scaled_copy import scaled_copy_triton
    from fastllm.ops.adamw8bit import build_qmaps, n_blocks
    from fastllm.optim import AdamW8bit

    n, k = 1 << 14, 4  # four tensors of 16K elements: a step that must be one launch
    flag, scale, coef = torch.zeros(()), torch.full((), 1024.0), torch.full((), 0.5)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    # a learning rate read on the device (a capturable step with a tensor lr)
    lr_tensor = {"lr_tensor": torch.full((), 1e-3)}

    def adamw(dtype, per_tensor=False, **lr):
        p, g, m, v = (_tensors(n, k, dtype) for _ in range(4))
        with _no_table(per_tensor):
            adamw_step_triton(p, g, m, v, [], _steps(k), amsgrad=False, maximize=False,
                              grad_scale=scale, found_inf=flag, **hyper, **lr)

    def master(per_tensor=False, **lr):
        p, g = _tensors(n, k, torch.bfloat16), _tensors(n, k, torch.bfloat16)
        w, m, v = (_tensors(n, k, torch.float32) for _ in range(3))
        with _no_table(per_tensor):
            adamw_master_step_triton(p, g, w, m, v, [], _steps(k), maximize=False,
                                     stochastic_rounding=False, seed=0, grad_scale=scale,
                                     clip_coef=coef, found_inf=flag, **hyper, **lr)

    def q8(dtype, per_tensor=False, state=torch.uint8, master=False, **lr):
        p, g = _tensors(n, k, dtype), _tensors(n, k, dtype)
        w = _tensors(n, k, torch.float32) if master else []
        q = state == torch.uint8
        moments = [torch.zeros(n, dtype=state) for _ in range(2 * k)]
        absmax = [torch.ones(n_blocks(n, 256)) for _ in range(2 * k)] if q else [[], []]
        with _no_table(per_tensor):
            adamw8bit_step_triton(p, g, w, moments[:k], moments[k:], absmax[:k] if q else [],
                                  absmax[k:] if q else [], _steps(k), build_qmaps(),
                                  block_size=256, maximize=False, stochastic_rounding=False,
                                  seed=0, grad_scale=scale, clip_coef=coef, found_inf=flag,
                                  **hyper, **lr)

    def l2norm(dtype):
        l2norm_triton(_tensors(n, k, dtype) if dtype is not None else
                      [t for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
                       for t in _tensors(n, 1, d)])

    def grad_norm_step():
        # AdamW's mixed-precision prologue with every option: loss scale, GradScaler-style
        # found_inf, clipping, step counts, LossScaler.
        scaler = LossScaler().device_state("cpu")
        grad_norm_step_triton(_tensors(n, k, torch.bfloat16), torch.zeros(4),
                              skipped=torch.zeros((), dtype=torch.bool),
                              skipped_steps=torch.zeros((), dtype=torch.int64),
                              grad_scale=scale, found_inf=flag, max_norm=1.0,
                              steps=torch.zeros(k), scaler=scaler)

    def optimizer_step(cls, **kwargs):
        # A whole mixed-precision step of fastllm.optim.AdamW on the Triton backend (CPU tensors
        # stand in for the GPU's: the launches are recorded, not run).
        from fastllm import _backend
        from fastllm.optim import AdamW

        params = [torch.nn.Parameter(t) for t in _tensors(n, k, torch.bfloat16)]
        for p, g in zip(params, _tensors(n, k, torch.bfloat16)):
            p.grad = g
        opt = (cls or AdamW)(params, master_weights=True, max_grad_norm=1.0,
                             loss_scaler=LossScaler(), **kwargs)
        saved = _backend.unavailable_reason
        _backend.unavailable_reason = lambda b, d: None if b == "triton" else saved(b, d)
        try:
            with _backend.use_backend("triton"):
                opt.step()
        finally:
            _backend.unavailable_reason = saved

    def scaled_copy():
        scaled_copy_triton(_tensors(n, k, torch.bfloat16), _tensors(n, k, torch.float32), 0.5)

    def galore():
        w, g = torch.randn(256, 512), torch.randn(256, 512)
        proj = torch.randn(256, 32)
        m, v = torch.zeros(32, 512), torch.zeros(32, 512)
        galore_adam_step_triton(w, g, proj, m, v, step=3, left=True, scale=0.25, **hyper)

    def orthogonalize():
        orthogonalize_triton([torch.randn(512, 16)])

    def powersgd_decompress():
        from fastllm.kernels.powersgd_decompress import powersgd_decompress_triton

        mats, errs = [torch.randn(512, 640)], [torch.zeros(512, 640)]
        p, q, local_q = [torch.randn(512, 4)], [torch.randn(640, 4)], [torch.randn(640, 4)]
        powersgd_decompress_triton(mats, p, q, local_q, errs, 0.5)

    out = {"adamw fp32": lambda: adamw(torch.float32), "adamw bf16": lambda: adamw(torch.bfloat16),
           "adamw_master bf16": master,
           # the per-tensor fallback (no table: a graph capture before the table exists)
           "adamw fp32 per-tensor": lambda: adamw(torch.float32, True),
           "adamw_master bf16 per-tensor": lambda: master(True),
           "adamw8bit fp32": lambda: q8(torch.float32),
           "adamw8bit bf16 master": lambda: q8(torch.bfloat16, master=True),
           "adamw8bit bf16 bf16-state": lambda: q8(torch.bfloat16, state=torch.bfloat16),
           "adamw8bit fp32 per-tensor": lambda: q8(torch.float32, True),
           "adamw fp32 tensor lr": lambda: adamw(torch.float32, **lr_tensor),
           "adamw fp32 per-tensor tensor lr": lambda: adamw(torch.float32, True, **lr_tensor),
           "adamw_master bf16 tensor lr": lambda: master(**lr_tensor),
           "adamw8bit fp32 tensor lr": lambda: q8(torch.float32, **lr_tensor),
           "l2norm bf16": lambda: l2norm(torch.bfloat16),
           "l2norm fp32": lambda: l2norm(torch.float32),
           "l2norm mixed dtypes": lambda: l2norm(None),
           "grad_norm_step bf16": grad_norm_step,
           "AdamW step bf16 master+clip+LossScaler": lambda: optimizer_step(None),
           "AdamW8bit step bf16 master+clip+LossScaler":
               lambda: optimizer_step(AdamW8bit, min_8bit_size=0),
           "scaled_copy": scaled_copy, "galore_adam_step": galore,
           "orthogonalize": orthogonalize, "powersgd_decompress": powersgd_decompress}
    return out


def model_recipes():
    """name -> the launches of fastllm.patch's model ops (forward and backward), at the sizes of
    SmolLM2-135M (hidden 576, ffn 1536, 9/3 heads of 64, vocab 49152) and Llama-3-8B (hidden
    4096, 32/8 heads of 128), in bf16."""
    from fastllm.kernels.fused_linear_cross_entropy import row_pass_triton
    from fastllm.kernels.rms_norm import rms_norm_bwd_triton, rms_norm_fwd_triton
    from fastllm.kernels.rotary_embedding import rotary_embedding_triton
    from fastllm.kernels.swiglu import swiglu_bwd_triton, swiglu_fwd_triton

    dt = torch.bfloat16
    rows = 64

    def rms_norm(h):
        x, w = torch.randn(rows, h).to(dt), torch.ones(h, dtype=dt)
        _, rstd = rms_norm_fwd_triton(x, w, 1e-6, 0.0)
        rms_norm_bwd_triton(torch.randn(rows, h).to(dt), x, w, rstd, 0.0, True, True)

    def swiglu(ffn, gelu=False):  # (gelu: GeGLU, Gemma's MLP)
        gate, up = torch.randn(rows, ffn).to(dt), torch.randn(rows, ffn).to(dt)
        swiglu_fwd_triton(gate, up, gelu)
        for need_h in (False, True):  # (True: swiglu_linear's backward, the product written too)
            swiglu_bwd_triton(torch.randn(rows, ffn).to(dt), gate, up, need_h, gelu)

    def rotary(hq, hk, d, gather):
        b, s = 2, 32
        q, k = torch.randn(b, s, hq, d).to(dt), torch.randn(b, s, hk, d).to(dt)
        table = 128 if gather else s
        cos, sin = torch.randn(table, d).to(dt), torch.randn(table, d).to(dt)
        pos = torch.arange(s).expand(b, s).contiguous() if gather else None
        if not gather:
            cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
        for backward in (False, True):
            rotary_embedding_triton(q, k, cos, sin, pos, torch.empty_like(q),
                                    torch.empty_like(k), backward)

    def flce_rows(vocab):
        z = torch.randn(16, vocab).to(dt)
        row_pass_triton(z, torch.zeros(16, dtype=torch.int64), torch.ones(16), 0.0, 0.0, None,
                        True)

    def nf4(n, blocksize):  # (a QLoRA base weight, dequantised in each forward and backward)
        from fastllm.kernels.nf4 import nf4_dequantize_triton
        from fastllm.ops.nf4 import nf4_code

        nf4_dequantize_triton(torch.zeros(n // 2, dtype=torch.uint8),
                              torch.ones(n // blocksize), nf4_code("cpu"),
                              torch.empty(n, dtype=dt), blocksize)

    return {"rms_norm h=576": lambda: rms_norm(576), "rms_norm h=4096": lambda: rms_norm(4096),
            "rms_norm h=520 (8 mod 16)": lambda: rms_norm(520),
            "swiglu ffn=1536": lambda: swiglu(1536),
            "geglu ffn=2048": lambda: swiglu(2048, gelu=True),
            "rotary 9/3 heads d=64 position_ids": lambda: rotary(9, 3, 64, True),
            "rotary 32/8 heads d=128": lambda: rotary(32, 8, 128, False),
            "rotary 4/1 heads d=256 (Gemma 3)": lambda: rotary(4, 1, 256, False),
            "fused_linear_cross_entropy rows vocab=49152": lambda: flce_rows(49152),
            "fused_linear_cross_entropy rows vocab=128256": lambda: flce_rows(128256),
            "nf4_dequantize 1536x576 bf16": lambda: nf4(1536 * 576, 64),
            "nf4_dequantize 4096x4096 bf16 blocksize 4096": lambda: nf4(4096 * 4096, 4096)}


@contextlib.contextmanager
def _no_table(on):
    """Within: the optimizer launchers find no table and launch once per tensor (their
    fallback)."""
    import fastllm.kernels.adamw as adamw
    import fastllm.kernels.adamw8bit as adamw8bit
    import fastllm.kernels.adamw_master as master

    modules = (adamw, master, adamw8bit)
    saved = [m.table for m in modules]
    if on:
        for m in modules:
            m.table = lambda *args: None
    try:
        yield
    finally:
        for m, t in zip(modules, saved):
            m.table = t


def record(fn):
    """The (kernel, args, kwargs) of every Triton launch fn() makes, none of them run."""
    from triton.runtime.jit import JITFunction

    launches = []
    saved = JITFunction.run

    def fake_run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = fake_run
    try:
        fn()
    finally:
        JITFunction.run = saved
    return launches


def lora_launches():
    """LoRA forward and backward launches, as tests/lora_compile_check.py records them: rank 16
    in every dtype with dropout on and off and a bias, and rank 128 (the largest the Triton path
    takes, the most registers) with fp32 operands."""
    import lora_compile_check as lc

    out = []
    for name in ("bf16", "fp32", "bf16+fp32a", "fp16+fp32a"):  # (x and W, adapters) dtypes
        for r in (16, 128) if name in ("fp32", "bf16+fp32a") else (16,):
            for p in (0.0, 0.1):
                for kernel, args, meta in lc.record_launches(lc.DTYPES[name], r, p,
                                                             lc.K._TARGET_PROGRAMS, bias=True):
                    out.append((f"lora_linear {name} r={r}", kernel, args, meta))
    return out


def compile_ptx(job):
    """(ptx, ptxas -v output) of one launch compiled for sm_90."""
    from lora_compile_check import compile_args
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    module, name, args, kwargs = job
    # Imported by name: a worker forked before the recipe that launches it was recorded.
    kernel = getattr(importlib.import_module(module), name)
    target, signature, constexprs, attrs, options = compile_args(kernel, args, kwargs,
                                                                 CAPABILITY)
    # Triton's own ptxas run (with the flags a real launch gets) already passes -v; its log is
    # printed when TRITON_DUMP_PTXAS_LOG is set (at the top of this file), so one ptxas run per
    # kernel gives both the cubin and the register report.
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=target, options=options)
    ptx = compiled.asm["ptx"]
    info = log.getvalue()
    if "registers" in info:
        return ptx, info
    # A kernel from Triton's cache ran no ptxas: assemble it here for the report.
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(CAPABILITY).path  # the ptxas Triton itself assembles sm_90 code with
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
        info = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o", path + ".cubin"],
                              capture_output=True, text=True)
    return ptx, info.stderr + info.stdout


def _job_key(kernel, args, kwargs):
    """Launches with equal keys compile to the same kernel: the runtime arguments by what Triton
    specialises on (_spec), constexprs and keyword ones (num_warps, ...) by value."""
    constexpr = [p.is_constexpr for p in kernel.params]
    return (kernel.fn.__name__,
            repr([repr(a) if i < len(constexpr) and constexpr[i] else _spec(a)
                  for i, a in enumerate(args)]),
            repr(sorted((k, _spec(v) if isinstance(v, torch.Tensor) else repr(v))
                        for k, v in kwargs.items())))


def triton_checks(jobs):
    """[(status, check, kernel, detail)] of the Triton kernels.

    Each launch is handed to the compile pool as soon as it is recorded, so the kernels compile
    while the later recipes run (the optimizer steps first import torch._dynamo, seconds)."""
    results = []
    launches = {}
    futures = {}
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs)) as pool:
        def submit(case, kernel, args, kwargs):
            key = _job_key(kernel, args, kwargs)
            if key not in futures:
                job = (kernel.fn.__module__, kernel.fn.__name__, args, kwargs)
                futures[key] = (pool.submit(compile_ptx, job), case, kernel.fn.__name__,
                                kwargs)

        steps = {**recipes(), **model_recipes()}
        for case, fn in steps.items():
            if case in STEP_LAUNCHES:
                continue  # last: counted only (below)
            for kernel, args, kwargs in record(fn):
                name = kernel.fn.__name__
                launches[(case, name)] = launches.get((case, name), 0) + 1
                submit(case, kernel, args, kwargs)
        for case, kernel, args, kwargs in lora_launches():
            submit(case, kernel, args, kwargs)
        for case in STEP_LAUNCHES:
            for kernel, args, kwargs in record(steps[case]):
                name = kernel.fn.__name__
                launches[(case, name)] = launches.get((case, name), 0) + 1
        for (case, name), count in sorted(launches.items()):
            if name in ONE_PER_STEP:
                ok = count == 1
                results.append((ok, "launches", name, f"{case}: {count} launches for one step "
                                                      f"of 4 tensors"))
        for case, limit in STEP_LAUNCHES.items():
            total = sum(count for (c, _), count in launches.items() if c == case)
            results.append((total <= limit, "launches", "optimizer step",
                            f"{case}: {total} Triton launches in one step of 4 tensors (at most "
                            f"{limit})"))
        for future, case, name, kwargs in futures.values():
            try:
                ptx, info = future.result()
            except Exception as exc:  # every failure reported, not only the first
                results.append((False, "compile", name, f"{case}: {type(exc).__name__}: "
                                                       f"{str(exc)[:200]}"))
                continue
            spills = [(int(a), int(b)) for a, b in SPILL.findall(info)]
            regs = re.findall(r"Used (\d+) registers", info)
            spilled = any(a or b for a, b in spills)
            results.append((not spilled, "spills", name,
                            f"{case}: {regs[0] if regs else '?'} registers, spill "
                            f"stores/loads {spills[0] if spills else '?'}"))
            if name in MAX_REGISTERS:
                limit = MAX_REGISTERS[name]
                results.append((bool(regs) and int(regs[0]) <= limit, "registers", name,
                                f"{case}: {regs[0] if regs else '?'} registers (at most "
                                f"{limit})"))
            if name in BANDWIDTH:
                wide = len(WIDE_LOAD.findall(ptx))
                scalar = len(re.findall(r"ld\.global(?![\w:.]*\.v[24])[\w:.]*\s", ptx))
                results.append((wide > 0, "wide loads", name,
                                f"{case}: {wide} 128-bit global loads, {scalar} narrower"))
            if name in EXACT:
                approx = sorted(set(APPROX.findall(ptx)))
                results.append((not approx, "exact math", name,
                                f"{case}: approximate {', '.join(approx) or 'nothing'}"))
            if name in TENSOR_CORES:
                rows, cols = (kwargs[b] for b in TENSOR_CORES[name])
                per_thread = rows * cols // (32 * kwargs.get("num_warps", 4))
                mma, fma = len(MMA.findall(ptx)), len(FMA.findall(ptx))
                results.append((mma > 0 and fma <= 2 * per_thread, "tensor cores", name,
                                f"{case}: {mma} wgmma/mma instructions, {fma} fp32 FMAs (at "
                                f"most {2 * per_thread})"))
            if name in WRITE_BANDWIDTH:
                wide = len(WIDE_STORE.findall(ptx))
                scalar = len(re.findall(r"st\.global(?![\w:.]*\.v[24])[\w:.]*\s", ptx))
                allowed = WRITE_BANDWIDTH[name]
                results.append((wide > 0 and scalar <= allowed, "wide stores", name,
                                f"{case}: {wide} 128-bit global stores, {scalar} narrower (at "
                                f"most {allowed})"))
    return results


def _spec(a):
    """What Triton specialises a launch on: dtype and 16-byte alignment of pointers, 1 and
    divisibility by 16 of ints (two launches with equal specs compile to the same kernel)."""
    if isinstance(a, torch.Tensor):
        return (str(a.dtype), a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        if isinstance(a, triton.language.dtype):
            return str(a)  # a constexpr element type: each compiles its own kernel
        return a if isinstance(a, (bool, str)) else type(a).__name__
    return ("int", a == 1, a % 16 == 0)


def _cuobjdump():
    """The toolkit's cuobjdump, else the one Triton ships (a CUDA 13 toolkit may lack it)."""
    found = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
    if os.path.exists(found):
        return found
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")


def cuda_checks(so_path):
    """[(status, check, kernel, detail)] of the CUDA kernels in a built fastllm._C."""
    cuobjdump = _cuobjdump()
    usage = subprocess.run([cuobjdump, "-res-usage", so_path], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([cuobjdump, "-sass", so_path], capture_output=True, text=True,
                          check=True).stdout
    results = []
    for fn, res in re.findall(r"Function ([^\s:]+):\s*\n\s*(REG:.*)", usage):
        local = int(re.search(r"LOCAL:(\d+)", res).group(1))
        short = _demangle(fn)
        results.append((local == 0, "spills", short, f"cuda: {res.strip()}"))
    for fn, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S):
        short = _demangle(fn)
        if any(k in short for k in CUDA_BANDWIDTH):
            wide = body.count("LDG.E.128") + body.count("LDG.E.ENL2.256")
            results.append((wide > 0, "wide loads", short,
                            f"cuda: {wide} LDG.E.128, {len(re.findall(r'LDG', body))} LDG"))
    return results


def _demangle(name):
    """The kernel's demangled name, shortened to its functor (multi_tensor_apply_kernel<...>)."""
    try:
        full = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    except OSError:
        full = name
    functor = re.search(r"fastllm::\(anonymous namespace\)::(\w+Functor<[^>]*>)", full)
    return functor.group(1) if functor else full[:90]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strict", action="store_true", help="known failures fail too")
    parser.add_argument("--cuda-so", help="a CUDA build of fastllm._C to inspect")
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    opts = parser.parse_args()
    results = [] if opts.no_triton else triton_checks(opts.jobs)
    if opts.cuda_so:
        results += cuda_checks(opts.cuda_so)
    failed = known = 0
    for ok, check, name, detail in sorted(results, key=lambda r: (r[1], r[2], r[3])):
        why = next((w for (c, n), w in KNOWN.items() if c == check and n in name), None)
        if ok:
            status = "ok"
        elif why and not opts.strict:
            status, known = "KNOWN", known + 1
            detail += f"  [{why}]"
        else:
            status, failed = "FAIL", failed + 1
        print(f"{status:5s} {check:10s} {name:24s} {detail}")
    print(f"kernel check (sm_{CAPABILITY}, triton {triton.__version__}): {len(results)} checks, "
          f"{failed} failed, {known} known failures (issue 18)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
