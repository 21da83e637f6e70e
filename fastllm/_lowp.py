"""bf16/fp16 matmuls on CPUs without native low-precision GEMMs: computed in fp32.

PyTorch multiplies bf16 matrices on the CPU through oneDNN when the CPU has AVX-512 (with or
without the bf16 instructions) or AMX; anywhere else (AVX2-only CPUs such as AMD Zen 3) it falls
back to a generic loop. Measured on an AMD EPYC (Zen 3, AVX2) with torch 2.13, 2 threads, at a
(4096 x 576) x (576 x 1536) product: fp32 87-105 GFLOP/s; bf16 x @ W^T 14.7, dY @ W 1.4 and
dY^T @ X 15.7 GFLOP/s (BENCHMARKS.md). The same product with both operands widened to fp32 and
the result rounded to bf16 runs at the fp32 rate: the widening reads each operand once (O(mk +
kn)) against the product's O(mkn). The result is what a native bf16 GEMM computes (fp32
accumulation of exact bf16 x bf16 products, one rounding), up to the order of the sum.

So fastllm's CPU matmuls (fastllm.ops.linear, the LoRA ops, the fused loss and the attention of
fastllm.patch) run in fp32 for bf16/fp16 tensors on such CPUs and keep bf16/fp16 in memory:
activations, saved tensors and outputs stay low precision. Where PyTorch has the native path
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`, `_is_mkldnn_fp16_supported()`) nothing changes.

    FASTLLM_CPU_LOWP_MATMUL=auto|fp32|native    auto (default): as above; fp32: always widen
                                                (tests use it on every CPU); native: never
"""

import functools

import torch
import torch.nn.functional as F

from fastllm._backend import env_choice
from fastllm._library import first_order_only

_LOWP = (torch.bfloat16, torch.float16)
_MODES = ("auto", "fp32", "native")


def _mode():
    """FASTLLM_CPU_LOWP_MATMUL, read at each call in eager code; a torch.compile'd function
    keeps the value it was traced with (a setting of the process, like _native's answer)."""
    return env_choice("FASTLLM_CPU_LOWP_MATMUL", _MODES)


@torch.compiler.assume_constant_result  # a property of the CPU: torch.compile reads it once
def _native(dtype):
    """Whether PyTorch has a fast GEMM for `dtype` on this CPU (oneDNN's low-precision path).
    (dynamo cannot trace the oneDNN query itself: fullgraph failed on a patched bf16 model.)"""
    return _native_query(dtype)


@functools.lru_cache(maxsize=None)
def _native_query(dtype):
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported",
             torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a build without oneDNN has no fast path either
        return False


def widens(device, dtype):
    """Whether matmuls of `dtype` on `device` are computed in fp32 here (CPU bf16/fp16 only)."""
    if torch.device(device).type != "cpu" or dtype not in _LOWP:
        return False
    mode = _mode()
    if mode == "auto":
        return not _native(dtype)
    return mode == "fp32"


def widen(t):
    """Whether a matmul over tensor `t` is computed in fp32 here."""
    return widens(t.device, t.dtype)


def autocast_enabled(device_type):
    """Whether autocast is on for `device_type` ("cpu", "cuda", ...); False for a device type
    autocast does not know (meta), where torch.is_autocast_enabled would raise. Under
    torch.compile the availability check is skipped: dynamo before torch 2.13 cannot trace
    torch._C._is_autocast_available (fullgraph failed on torch 2.11), and a traced tensor's
    device is a real one."""
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def autocast_args(device_type, *tensors):
    """`tensors` as autocast on `device_type` hands them to its lower-precision ops (F.linear,
    F.scaled_dot_product_attention): floating-point ones on that device type other than fp64
    cast to torch.get_autocast_dtype(device_type), the rest (None, fp64, integer, other
    devices) as they are (ATen's is_eligible and is_autocast_eligible in
    aten/src/ATen/autocast_mode.h: autocast never casts fp64)."""
    dtype = torch.get_autocast_dtype(device_type)
    return [t if t is None or not t.is_floating_point() or t.dtype == torch.float64
            or t.device.type != device_type else t.to(dtype) for t in tensors]


def in_fp32(fn, *args):
    """fn(*args) with every bf16/fp16 tensor argument widened to fp32 (lists too) and every fp32
    tensor result rounded back to the arguments' low-precision dtype; None and other values pass
    through; CPU autocast is off inside. For CPU functions made of matmuls and elementwise steps,
    called when widen() says so."""
    dtype = None

    def up(a):
        nonlocal dtype
        if torch.is_tensor(a) and a.dtype in _LOWP:
            dtype = a.dtype
            return a.float()
        if isinstance(a, (list, tuple)):
            return type(a)(up(x) for x in a)
        return a

    widened = [up(a) for a in args]
    with torch.autocast("cpu", enabled=False):  # fp32 products, not autocast's bf16 again
        out = fn(*widened)

    def down(o):
        if torch.is_tensor(o) and o.dtype == torch.float32 and dtype is not None:
            return o.to(dtype)
        if isinstance(o, (list, tuple)):
            return type(o)(down(x) for x in o)
        return o

    return down(out)


def _float_mask(mask, dtype):
    """sdpa's boolean mask (True: attend) as the additive float mask the CPU kernel takes."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


# PyTorch's CPU flash attention reads key/value head h // (Hq // Hkv) for query head h from 2.9
# (pytorch/pytorch#157893). Before, its forward did too but its backward wrote Hq heads of dK and
# dV into Hkv-head buffers: torch 2.6 and 2.7 abort (heap corruption) on GQA. There the key and
# value heads are repeated to Hq and their gradients summed back over each group.
_CPU_FLASH_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _heads_for_flash(t, hq):
    """k or v widened to fp32, its heads repeated to `hq` where the CPU kernel cannot share them."""
    t = t.float()
    if t.shape[1] == hq or _CPU_FLASH_GQA:
        return t
    return t.repeat_interleave(hq // t.shape[1], dim=1)


def _grad_to_heads(g, like):
    """dK or dV (B, Hq, S, D) from the kernel summed back to `like`'s Hkv heads, in its dtype."""
    b, hq, s, d = g.shape
    if hq != like.shape[1]:
        g = g.view(b, like.shape[1], hq // like.shape[1], s, d).sum(2)
    return g.to(like.dtype)


class _WideAttention(torch.autograd.Function):
    """PyTorch's CPU flash attention (forward and backward) on bf16/fp16 q, k, v, computed in
    fp32: saves q, k, v and the output in their own dtype and the fp32 row logsumexp, and widens
    them again in the backward (whose bf16 GEMMs are the slow ones: 1034 ms against fp32's 202 ms
    for forward + backward at 8 x 9 heads x 512 x 64 on the AVX2 machine of BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), _heads_for_flash(k, q.shape[1]), _heads_for_flash(v, q.shape[1]), 0.0,
            is_causal, attn_mask=_float_mask(attn_mask, torch.float32), scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    @first_order_only("fastllm.patch's widened attention")
    def backward(ctx, grad_out):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.float(), q.float(), _heads_for_flash(k, q.shape[1]),
            _heads_for_flash(v, q.shape[1]), out.float(), lse, 0.0, ctx.is_causal,
            attn_mask=_float_mask(attn_mask, torch.float32), scale=ctx.scale)
        return dq.to(q.dtype), _grad_to_heads(dk, k), _grad_to_heads(dv, v), None, None, None


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., scale=...,
    enable_gqa=True) without dropout, for CPU bf16/fp16 tensors that widen() says to compute in
    fp32. q: (B, H, T, D); k, v: (B, H_kv, S, D) with H a multiple of H_kv; attn_mask: None, or
    boolean (True: attend) / additive, broadcastable to (B, H, T, S). An additive mask that
    requires grad (a learned bias) goes to F.scaled_dot_product_attention itself: the widened
    kernel gives the mask no gradient."""
    if (isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad
            and torch.is_grad_enabled()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    return _WideAttention.apply(q, k, v, attn_mask, is_causal, scale)
