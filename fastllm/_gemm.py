"""fp32 matmuls on the CPU by fastllm's routes, where ATen's fp32 GEMM (MKL's sgemm) is slow.

ATen multiplies fp32 matrices on x86 with MKL, which does not take its fast code on AMD CPUs.
Measured on an AMD EPYC Zen 5 (AVX-512, 2 threads, torch 2.13; BENCHMARKS.md): MKL ran the
SmolLM2-sized products (4096 x 576) x (576 x 1536) and their backward shapes at 55-67 GFLOP/s and
a LoRA-sized 4096 x 16 x 576 at 16, where oneDNN (PyTorch's own copy, the library its bf16
matmuls go through) ran the same fp32 products at 132-154 and 188 GFLOP/s. On an AMD Zen 2
(AVX2 only), where ATen's oneDNN entry refuses the CPU, MKL ran them at 104-131 GFLOP/s on two
cores (52 on one, of the 99 a core issues) and fastllm's own AVX2 kernel (csrc/cpu/sgemm_avx2.cpp)
at 137-164 (products from 64 in every dimension and 2^25 multiply-adds; ATen's below, as fast
there). All accumulate in fp32 and round once; only the order of the sums differs (max error
relative to the largest output about 1e-6 at K = 576-4096).

So fastllm's CPU matmuls (fastllm.ops.linear and through it every nn.Linear of a patched model,
the LoRA ops, the fused loss, the CPU attention) take such a route for fp32 on those CPUs;
csrc/cpu/gemm.cpp has the calls.

    FASTLLM_CPU_FP32_MATMUL=auto|aten|onednn|avx2
        auto (default): oneDNN on AMD x86 CPUs with AVX-512, the AVX2 kernel on AMD x86 CPUs
        with AVX2 and no AVX-512 (where each was measured faster), ATen elsewhere; aten: never;
        onednn / avx2: always that route (an error where it does not exist)

The functions below compute what their torch namesakes do, for 2-D operands; they take a route
only for fp32 CPU tensors that autograd does not track (they are called inside fastllm's ops,
below autograd) and call torch otherwise.
"""

import functools
import math

import torch

from fastllm import _backend, _extension

ENV = "FASTLLM_CPU_FP32_MATMUL"
_MODES = ("auto", "aten", "onednn", "avx2")
# route: (the C++ switch's value, the entry, the extension's availability check)
_ROUTES = {"aten": (0, None, None),
           "onednn": (1, "gemm_onednn_cpu", "onednn_gemm_available"),
           "avx2": (2, "sgemm_avx2_cpu", "sgemm_avx2_available")}
_synced = None  # the route last handed to the C++ kernels (csrc/cpu/gemm.cpp)


def _mode():
    return _backend.env_choice(ENV, _MODES)


def _cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def _usable(route="onednn"):
    """Whether the extension has `route` here and it computes a small product right. A fact of
    the process, so the probe is hermetic: real fp32 CPU tensors, no random numbers, whatever
    mode the first call runs under (torch.export's fake tensors, a meta device context, an fp64
    default dtype, vmap, torch.func.grad: each made it fail once, and the cache turned the route
    off for good)."""
    from torch.utils._python_dispatch import _disable_current_modes

    _, entry, available = _ROUTES[route]
    ext = _extension.extension() if _extension.has_cpp() else None
    if ext is None or not hasattr(ext, available) or not getattr(ext, available)():
        return False
    with _disable_current_modes(), torch._C._DisableFuncTorch(), torch.no_grad():
        cpu = {"dtype": torch.float32, "device": "cpu"}
        a = torch.arange(35, **cpu).reshape(7, 5).sin()
        b = torch.arange(45, **cpu).reshape(9, 5).cos().t()  # transposed, as the ops pass them
        out = torch.empty(7, 9, **cpu)
        try:
            getattr(ext, entry)(a, b, out, 0.0, 1.0)
        except RuntimeError:  # (ATen's oneDNN entry refuses CPUs without AVX-512)
            return False
        return torch.allclose(out, a.double().mm(b.double()).float(), rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _auto():
    if _cpu_vendor() != "AuthenticAMD":
        return "aten"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX512_BF16", "AMX"):
        return "onednn" if _usable("onednn") else "aten"
    if capability == "AVX2":
        return "avx2" if _usable("avx2") else "aten"
    return "aten"


def route():
    """The route fp32 CPU matmuls take here ("aten", "onednn" or "avx2";
    FASTLLM_CPU_FP32_MATMUL); keeps the C++ kernels' switch in step."""
    global _synced
    mode = _mode()
    if mode == "auto":
        chosen = _auto()
    elif mode == "aten" or _usable(mode):
        chosen = mode
    else:
        raise RuntimeError(f"fastllm: {ENV}={mode}, but that route does not exist here (onednn: "
                           "a PyTorch without oneDNN or a CPU ATen's oneDNN matmul refuses; "
                           "avx2: a CPU without AVX2 + FMA; either: fastllm._C not built)")
    if chosen != _synced:
        if _extension.has_cpp() and hasattr(_extension.extension(), "set_fp32_gemm_route"):
            _extension.extension().set_fp32_gemm_route(_ROUTES[chosen][0])
        _synced = chosen
    return chosen


@torch.compiler.assume_constant_result  # a setting of the process: torch.compile reads it once
def enabled():
    """Whether fp32 CPU matmuls take one of fastllm's routes here."""
    return route() != "aten"


def routes(device, dtype):
    """Whether fp32 matmuls of `dtype` on `device` are fastllm's here."""
    return dtype == torch.float32 and torch.device(device).type == "cpu" and enabled()


def _take(*tensors):
    t = tensors[0]
    if t.dtype != torch.float32 or t.device.type != "cpu" or not enabled():
        return False
    if torch.compiler.is_compiling():  # traced (a plain autograd.Function's body): torch's GEMM,
        return False                   # which dynamo sees; the extension call it cannot trace
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        return False  # autograd would not see the call
    # (a negated view goes to torch, which resolves it: the GEMM reads raw memory)
    return all(x is None or (x.dtype == torch.float32 and x.layout == torch.strided
                             and not x.is_neg()) for x in tensors)


def _gemm(a, b, out, beta, alpha):
    # (every caller passed _take first, whose enabled() put the C++ switch in step)
    _extension.extension().gemm_routed_cpu(a, b, out, float(beta), float(alpha))
    return out


def _mm(a, b):
    return _gemm(a, b, a.new_empty((a.shape[0], b.shape[1])), 0.0, 1.0)


def _addmm(c, a, b, beta, alpha):
    out = a.new_empty((a.shape[0], b.shape[1]))
    if torch.broadcast_shapes(c.shape, out.shape) != out.shape:  # (torch refuses it, beta 0 too)
        raise RuntimeError(f"addmm: the input of shape {tuple(c.shape)} does not broadcast to "
                           f"the product's {tuple(out.shape)}")
    if beta == 0:
        return _gemm(a, b, out, 0.0, alpha)
    out.copy_(c.expand(out.shape))
    return _gemm(a, b, out, beta, alpha)


def mm(a, b):
    """torch.mm(a, b)."""
    return _mm(a, b) if _take(a, b) else torch.mm(a, b)


def addmm(c, a, b, *, beta=1, alpha=1):
    """torch.addmm(c, a, b, beta=beta, alpha=alpha); c broadcastable to the product's shape."""
    if not _take(a, b, c):
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)
    return _addmm(c, a, b, beta, alpha)


def addmm_(out, a, b, *, beta=1, alpha=1):
    """out.addmm_(a, b, beta=beta, alpha=alpha)."""
    if not (_take(a, b, out) and out.is_contiguous()) or (
            out.is_inference() and not torch.is_inference_mode_enabled()):
        return out.addmm_(a, b, beta=beta, alpha=alpha)  # (torch refuses that write)
    _gemm(a, b, out, beta, alpha)
    if not out.is_inference():  # (inference tensors keep no version counter)
        # the extension writes out's memory below the dispatcher: autograd must still see the
        # in-place write (a backward reading a saved `out` then raises, as after torch's addmm_)
        torch.autograd.graph.increment_version(out)
    return out


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias): x (..., in), weight (out, in)."""
    if not _take(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    y = _mm(x2, weight.t()) if bias is None else _addmm(bias, x2, weight.t(), 1, 1)
    return y.view(*x.shape[:-1], weight.shape[0])
