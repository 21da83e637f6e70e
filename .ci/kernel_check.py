"""Static check of fastllm's GPU kernels without a GPU (issue 18 item 7).

Triton: every kernel is compiled for sm_90 (Hopper, the H200) with the constexprs and argument
specialisation a production launch gets. The launchers run on CPU tensors (16-byte aligned, as
real ones are) with Triton's launch replaced by a recorder (JITFunction.run), so a launcher that
sizes grids or picks constexprs is checked as it is, and the number of launches of one step is
counted. Each distinct recorded launch is compiled ahead of time (no device needed) and
    - a bandwidth kernel whose PTX has no 128-bit global load (ld.global.v4.b32 / .v2.b64, or a
      16-byte cp.async) fails: its loads are scalar;
    - a kernel that spills registers (ptxas -v: spill stores or loads > 0) fails;
    - a kernel meant to run once per optimizer step, launched more than once in a step of four
      tensors, fails.
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
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the check compiles, the interpreter does not")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said quietly

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import triton  # noqa: E402

CAPABILITY = 90
# 128-bit global accesses in PTX: 4 x 32-bit or 2 x 64-bit vectors, or a 16-byte async copy.
WIDE_LOAD = re.compile(r"ld\.global[\w:.]*\.v4\.[bfus]32|ld\.global[\w:.]*\.v2\.[bfus]64"
                       r"|cp\.async\.c[ag]\.shared\.global[^;]*\],\s*(?:16|0x10)\s*[,;]")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")

# (check, kernel) -> why it still fails. Everything here is open work of issue 18.
KNOWN = {
    ("launches", "_adamw8bit_kernel"): "Triton 8-bit step: one launch per tensor (18.4)",
    ("launches", "_sum_squares_kernel"): "Triton l2norm: one launch per tensor (18.3)",
    # CUDA kernels (matched as a part of the demangled name)
    ("wide loads", "AdamWMasterFunctor"): "CUDA master step: scalar loads (18.3, 18.2)",
    ("wide loads", "SumSquaresFunctor"): "CUDA l2norm: scalar 2-byte loads (18.3)",
}
# Kernels whose job is streaming memory: their loads must be 128 bits wide.
BANDWIDTH = {"_adamw_kernel", "_adamw_master_kernel", "_adamw_tensor_kernel",
             "_adamw_master_tensor_kernel", "_adamw8bit_kernel", "_sum_squares_kernel",
             "_scaled_copy_kernel", "_adam_lowrank_kernel", "_lora_down_kernel",
             "_lora_up_kernel", "_lora_pq_kernel"}
# Kernels meant to run once per optimizer step, however many tensors it has.
ONE_PER_STEP = {"_adamw_kernel", "_adamw_master_kernel", "_adamw8bit_kernel",
                "_sum_squares_kernel"}
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
    from fastllm.kernels.l2norm import l2norm_triton
    from fastllm.kernels.orthogonalize import orthogonalize_triton
    from fastllm.kernels.scaled_copy import scaled_copy_triton
    from fastllm.ops.adamw8bit import build_qmaps, n_blocks

    n, k = 1 << 14, 4  # four tensors of 16K elements: a step that must be one launch
    flag, scale, coef = torch.zeros(()), torch.full((), 1024.0), torch.full((), 0.5)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def adamw(dtype, per_tensor=False):
        p, g, m, v = (_tensors(n, k, dtype) for _ in range(4))
        with _no_table(per_tensor):
            adamw_step_triton(p, g, m, v, [], _steps(k), amsgrad=False, maximize=False,
                              grad_scale=scale, found_inf=flag, **hyper)

    def master(per_tensor=False):
        p, g = _tensors(n, k, torch.bfloat16), _tensors(n, k, torch.bfloat16)
        w, m, v = (_tensors(n, k, torch.float32) for _ in range(3))
        with _no_table(per_tensor):
            adamw_master_step_triton(p, g, w, m, v, [], _steps(k), maximize=False,
                                     stochastic_rounding=False, seed=0, grad_scale=scale,
                                     clip_coef=coef, found_inf=flag, **hyper)

    def q8(dtype):
        p, g = _tensors(n, k, dtype), _tensors(n, k, dtype)
        codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2 * k)]
        absmax = [torch.ones(n_blocks(n, 256)) for _ in range(2 * k)]
        adamw8bit_step_triton(p, g, [], codes[:k], codes[k:], absmax[:k], absmax[k:],
                              _steps(k), build_qmaps(), block_size=256, maximize=False,
                              stochastic_rounding=False, seed=0, grad_scale=scale,
                              clip_coef=coef, found_inf=flag, **hyper)

    def l2norm(dtype):
        l2norm_triton(_tensors(n, k, dtype))

    def scaled_copy():
        scaled_copy_triton(_tensors(n, k, torch.bfloat16), _tensors(n, k, torch.float32), 0.5)

    def galore():
        w, g = torch.randn(256, 512), torch.randn(256, 512)
        proj = torch.randn(256, 32)
        m, v = torch.zeros(32, 512), torch.zeros(32, 512)
        galore_adam_step_triton(w, g, proj, m, v, step=3, left=True, scale=0.25, **hyper)

    def orthogonalize():
        orthogonalize_triton([torch.randn(512, 16)])

    out = {"adamw fp32": lambda: adamw(torch.float32), "adamw bf16": lambda: adamw(torch.bfloat16),
           "adamw_master bf16": master,
           # the per-tensor fallback (no table: a graph capture before the table exists)
           "adamw fp32 per-tensor": lambda: adamw(torch.float32, True),
           "adamw_master bf16 per-tensor": lambda: master(True),
           "adamw8bit fp32": lambda: q8(torch.float32),
           "adamw8bit bf16": lambda: q8(torch.bfloat16),
           "l2norm bf16": lambda: l2norm(torch.bfloat16),
           "l2norm fp32": lambda: l2norm(torch.float32),
           "scaled_copy": scaled_copy, "galore_adam_step": galore,
           "orthogonalize": orthogonalize}
    return out


@contextlib.contextmanager
def _no_table(on):
    """Within: the AdamW launchers find no table and launch once per tensor (their fallback)."""
    import fastllm.kernels.adamw as adamw
    import fastllm.kernels.adamw_master as master

    saved = adamw.table, master.table
    if on:
        adamw.table = master.table = lambda *args: None
    try:
        yield
    finally:
        adamw.table, master.table = saved


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
    """LoRA forward and backward launches, as tests/lora_compile_check.py records them."""
    import lora_compile_check as lc

    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for kernel, args, meta in lc.record_launches(dtype, 16, 0.1, lc.K._TARGET_PROGRAMS):
            out.append((f"lora_linear {dtype}".replace("torch.", ""), kernel, args, meta))
    return out


def compile_ptx(job):
    """(ptx, ptxas -v output) of one launch compiled for sm_90."""
    from lora_compile_check import compile_args
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    module, name, args, kwargs = job
    kernel = getattr(sys.modules[module], name)
    target, signature, constexprs, attrs, options = compile_args(kernel, args, kwargs,
                                                                 CAPABILITY)
    compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options)
    ptx = compiled.asm["ptx"]
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


def triton_checks(jobs):
    """[(status, check, kernel, detail)] of the Triton kernels."""
    results = []
    launches = {}
    work = {}
    for case, fn in recipes().items():
        for kernel, args, kwargs in record(fn):
            name = kernel.fn.__name__
            launches.setdefault((case, name), 0)
            launches[(case, name)] += 1
            key = (name, repr([_spec(a) for a in args]),
                   repr(sorted((k, _spec(v)) for k, v in kwargs.items())))
            work.setdefault(key, (case, kernel, args, kwargs))
    for case, kernel, args, kwargs in lora_launches():
        key = (kernel.fn.__name__, repr([_spec(a) for a in args]),
               repr(sorted((k, _spec(v)) for k, v in kwargs.items())))
        work.setdefault(key, (case, kernel, args, kwargs))
    for (case, name), count in sorted(launches.items()):
        if name in ONE_PER_STEP:
            ok = count == 1
            results.append((ok, "launches", name, f"{case}: {count} launches for one step of "
                                                  f"4 tensors"))
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs)) as pool:
        futures = {pool.submit(compile_ptx, (k.fn.__module__, k.fn.__name__, a, kw)):
                   (case, k.fn.__name__) for case, k, a, kw in work.values()}
        for future in concurrent.futures.as_completed(futures):
            case, name = futures[future]
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
            if name in BANDWIDTH:
                wide = len(WIDE_LOAD.findall(ptx))
                scalar = len(re.findall(r"ld\.global(?![\w:.]*\.v[24])[\w:.]*\s", ptx))
                results.append((wide > 0, "wide loads", name,
                                f"{case}: {wide} 128-bit global loads, {scalar} narrower"))
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
    print(f"kernel check (sm_{CAPABILITY}): {len(results)} checks, {failed} failed, {known} known "
          f"failures (issue 18)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
