"""fp32 matmuls on the CPU through oneDNN, on CPUs where ATen's fp32 GEMM (MKL's sgemm) is slow.

ATen multiplies fp32 matrices on x86 with MKL, which does not take its AVX-512 code on AMD CPUs.
Measured on an AMD EPYC Zen 5 (AVX-512, 2 threads, torch 2.13; BENCHMARKS.md): MKL ran the
SmolLM2-sized products (4096 x 576) x (576 x 1536) and their backward shapes at 55-67 GFLOP/s and
a LoRA-sized 4096 x 16 x 576 at 16, where oneDNN (PyTorch's own copy, the library its bf16
matmuls go through) ran the same fp32 products at 132-154 and 188 GFLOP/s. Both accumulate in
fp32 and round once; only the order of the sums differs (max error relative to the largest
output about 1e-6 for both at K = 576-4096).

So fastllm's CPU matmuls (fastllm.ops.linear and through it every nn.Linear of a patched model,
the LoRA ops, the fused loss) call oneDNN for fp32 on such CPUs; csrc/cpu/gemm.cpp has the call.

    FASTLLM_CPU_FP32_MATMUL=auto|aten|onednn    auto (default): oneDNN on AMD x86 CPUs with
                                                AVX-512 (where it was measured faster), ATen
                                                elsewhere; aten: never; onednn: always (an
                                                error where this PyTorch has no oneDNN matmul)

The functions below compute what their torch namesakes do, for 2-D operands; they take oneDNN
only for fp32 CPU tensors that autograd does not track (they are called inside fastllm's ops,
below autograd) and call torch otherwise.
"""

import functools
import math

import torch

from fastllm import _backend, _extension

ENV = "FASTLLM_CPU_FP32_MATMUL"
_MODES = ("auto", "aten", "onednn")
_synced = None  # the switch last handed to the C++ kernels (csrc/cpu/gemm.cpp)


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
def _usable():
    """Whether the extension has the oneDNN route and it computes a small product right."""
    ext = _extension.extension() if _extension.has_cpp() else None
    if ext is None or not hasattr(ext, "onednn_gemm_available") or not ext.onednn_gemm_available():
        return False
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=g)
    b = torch.randn(9, 5, generator=g).t()  # a transposed operand, as the ops pass them
    out = torch.empty(7, 9)
    try:
        ext.gemm_onednn_cpu(a, b, out, 0.0, 1.0)
    except RuntimeError:
        return False
    return torch.allclose(out, a.double().mm(b.double()).float(), rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _auto():
    return (_cpu_vendor() == "AuthenticAMD"
            and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX"))


@torch.compiler.assume_constant_result  # a setting of the process: torch.compile reads it once
def enabled():
    """Whether fp32 CPU matmuls take oneDNN here (FASTLLM_CPU_FP32_MATMUL); keeps the C++
    kernels' switch in step."""
    global _synced
    mode = _mode()
    if mode == "aten":
        on = False
    elif mode == "onednn":
        if not _usable():
            raise RuntimeError(f"fastllm: {ENV}=onednn, but this PyTorch has no usable oneDNN "
                               "matmul (a build without oneDNN, or fastllm._C not built)")
        on = True
    else:
        on = _auto() and _usable()
    if on != _synced:
        if _extension.has_cpp() and hasattr(_extension.extension(), "set_onednn_fp32_gemm"):
            _extension.extension().set_onednn_fp32_gemm(on)
        _synced = on
    return on


def routes(device, dtype):
    """Whether fp32 matmuls of `dtype` on `device` are fastllm's (oneDNN) here."""
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
    _extension.extension().gemm_onednn_cpu(a, b, out, float(beta), float(alpha))
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
    if not (_take(a, b, out) and out.is_contiguous()):
        return out.addmm_(a, b, beta=beta, alpha=alpha)
    return _gemm(a, b, out, beta, alpha)


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias): x (..., in), weight (out, in)."""
    if not _take(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    y = _mm(x2, weight.t()) if bias is None else _addmm(bias, x2, weight.t(), 1, 1)
    return y.view(*x.shape[:-1], weight.shape[0])
