"""fastllm::attention: causal self-attention for training, with packed documents and grouped-query
heads, in flash-attention's layout.

q: (B, T, Hq, D); k, v: (B, T, Hkv, D), Hq a multiple of Hkv (grouped-query attention: query
head h reads key/value head h // (Hq // Hkv), as `enable_gqa=True`); one dtype (fp32, bf16, fp16,
fp64). Query t of row b attends keys j with doc_start[b, t] <= j <= t; `doc_start` None is plain
causal attention. Packed rows (several documents per row, position ids restarting) give
doc_start from their position ids (`doc_start_from_position_ids`, transformers' rule), so each
document attends only to itself, as `scaled_dot_product_attention` with the block-diagonal
causal mask transformers builds for them. Returns (B, T, Hq, D), the layout the output projection
reads (no transposes on either side).

Computed in fp32 (fp64 for fp64), rounded once. The forward keeps each row's logsumexp (B, Hq, T)
fp32; the backward recomputes the probabilities from it, so nothing of size T x T is kept.

Ops (schemas in fastllm/_library.py): attention(q, k, v, doc_start, scale) -> (out, lse),
attention_backward(grad_out, q, k, v, out, lse, doc_start, scale) -> (dq, dk, dv). Backends:
cpp (csrc/cpu/attention.cpp: blocks of query positions through fp32 GEMMs, oneDNN's where
fastllm/_gemm.py routes them), ref (plain PyTorch, any device).

There is no GPU kernel of fastllm's own. `attention` on a GPU tensor runs PyTorch's: packed
documents in bf16/fp16 through its variable-length flash attention (`torch.nn.attention.varlen`,
torch >= 2.10, sm80+: each document its own sequence, so no T x T mask is built and no work is
spent on blocks across documents; what torchtitan runs for document masking), anything else
through F.scaled_dot_product_attention (`is_causal`, or the block-diagonal mask for doc_start).
FASTLLM_GPU_ATTENTION=sdpa keeps the latter for packed documents too. The varlen route has not
yet run on a GPU here (no GPU was lent since it was written); tests/test_attention.py checks it
there against the fp64 reference, and on the CPU its plumbing against a stand-in kernel.
"""

import contextlib
import functools
import inspect
import math
import warnings

import torch

from fastllm import _backend, _extension, _gemm, _lowp
from fastllm._library import direct_op, first_order_only, lib, register_autograd

__all__ = ["attention", "attention_ref", "doc_start_from_position_ids", "document_segments",
           "DocumentSegments", "cpu_attention_available", "cpu_attention_enabled", "worth_it",
           "gpu_varlen_applies",
           "gpu_varlen_available"]

_PREFERENCE = {"cpu": ("cpp", "ref")}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
ENV = "FASTLLM_CPU_ATTENTION"
_MODES = ("auto", "fastllm", "torch")
GPU_ENV = "FASTLLM_GPU_ATTENTION"
_GPU_MODES = ("auto", "sdpa")


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def doc_start_from_position_ids(position_ids):
    """(B, T) int64: for each token, the index of the first token of its document, a document
    starting wherever the position ids do not go up by one (transformers' rule for packed rows,
    masking_utils.find_packed_sequence_indices; the first token always starts one)."""
    if position_ids.dim() != 2:
        raise ValueError(f"fastllm.attention: position_ids must be (batch, tokens), got "
                         f"{tuple(position_ids.shape)}")
    steps = torch.diff(position_ids, dim=1) != 1
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, steps], dim=1)
    idx = torch.arange(position_ids.shape[1], device=position_ids.device)
    return torch.where(starts, idx, 0).cummax(dim=1).values.contiguous()


def _mask(doc_start, t, device):
    """(B or 1, 1, T, T) bool: True where query t may attend key j."""
    i = torch.arange(t, device=device)
    causal = i[None, :] <= i[:, None]
    if doc_start is None:
        return causal[None, None]
    return (causal[None] & (i[None, None, :] >= doc_start[:, :, None]))[:, None]


def _without_autocast(device):
    # an enclosing autocast would run the opmath products below in bf16/fp16
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _forward_math(q, k, v, doc_start, scale):
    """(out (B, T, Hq, D) in opmath, lse (B, Hq, T) fp32) by the definition."""
    op = _opmath(q.dtype)
    group = q.shape[2] // k.shape[2]
    with _without_autocast(q.device):
        qh = q.to(op).transpose(1, 2)
        kh = k.to(op).transpose(1, 2).repeat_interleave(group, dim=1)
        vh = v.to(op).transpose(1, 2).repeat_interleave(group, dim=1)
        s = (qh @ kh.transpose(-1, -2)) * scale
        s = s.masked_fill(~_mask(doc_start, q.shape[1], q.device), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = (torch.softmax(s, dim=-1) @ vh).transpose(1, 2)
    return out, lse


def attention_ref(q, k, v, scale=None, doc_start=None):
    """Plain-PyTorch causal attention (q (B, T, Hq, D), k, v (B, T, Hkv, D)) in fp32 (fp64 for
    fp64), rounded once; differentiable by autograd."""
    check_attention_args(q, k, v, doc_start)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _forward_math(q, k, v, doc_start, scale)[0].to(q.dtype)


def check_attention_args(q, k, v, doc_start):
    where = "fastllm.attention"
    if q.dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype {q.dtype} is not supported (fp32, bf16, fp16, fp64)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}, q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device}, q on {q.device}")
    if any(t.layout != torch.strided for t in (q, k, v)):
        raise TypeError(f"{where}: only dense tensors are supported")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: q, k, v must be (batch, tokens, heads, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    b, t, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
        raise ValueError(f"{where}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree (same "
                         f"batch, tokens and head_dim)")
    if d == 0:
        raise ValueError(f"{where}: head_dim must be positive")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"{where}: {hq} query heads are not a multiple of {k.shape[2]} "
                         f"key/value heads")
    if doc_start is not None:
        if doc_start.dtype != torch.int64 or doc_start.shape != (b, t):
            raise ValueError(f"{where}: doc_start must be ({b}, {t}) int64, got "
                             f"{tuple(doc_start.shape)} {doc_start.dtype}")
        if doc_start.device != q.device:
            raise ValueError(f"{where}: doc_start is on {doc_start.device}, q on {q.device}")


def _check_doc_start_values(doc_start):
    if doc_start is None or doc_start.numel() == 0:
        return
    t = torch.arange(doc_start.shape[1], device=doc_start.device)
    ok = (doc_start >= 0) & (doc_start <= t)
    ok[:, 1:] &= doc_start[:, 1:] >= doc_start[:, :-1]
    if not bool(ok.all()):
        b, i = (~ok).nonzero()[0].tolist()
        raise ValueError(f"fastllm.attention: doc_start[{b}, {i}] = {int(doc_start[b, i])} is not "
                         f"a document start (0 <= doc_start[t] <= t, non-decreasing in t)")


def _forward_ref(q, k, v, doc_start, scale):
    _check_doc_start_values(doc_start)  # the cpp kernel checks them itself
    out, lse = _forward_math(q, k, v, doc_start, scale)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def _backward_ref(grad_out, q, k, v, out, lse, doc_start, scale):
    op = _opmath(q.dtype)
    with torch.enable_grad():
        leaves = [t.detach().to(op).requires_grad_() for t in (q, k, v)]
        o, _ = _forward_math(*leaves, doc_start, scale)
        grads = torch.autograd.grad(o, leaves, grad_out.to(op))
    return tuple(g.to(q.dtype) for g in grads)


def _empty(doc_start, device):
    if doc_start is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    return doc_start.contiguous()


def _forward_cpp(q, k, v, doc_start, scale):
    _gemm.enabled()  # the kernel's fp32 GEMMs follow fastllm/_gemm.py's policy (set in C++)
    try:
        out, lse = _extension.extension().attention_cpu(q, k, v, _empty(doc_start, q.device),
                                                        scale)
    except RuntimeError as exc:  # the kernel's doc_start check: the same error as the ref's
        if "is not a document start" in str(exc):
            raise ValueError(str(exc).splitlines()[0]) from None
        raise
    return out, lse


def _backward_cpp(grad_out, q, k, v, out, lse, doc_start, scale):
    _gemm.enabled()
    dq, dk, dv = _extension.extension().attention_backward_cpu(
        grad_out, q, k, v, out, lse, _empty(doc_start, q.device), scale)
    return dq, dk, dv


_FORWARD = {"ref": _forward_ref, "cpp": _forward_cpp}
_BACKWARD = {"ref": _backward_ref, "cpp": _backward_cpp}


def _select(x):
    return _backend.select_kernel("attention", x.device.type, x.dtype, _PREFERENCE, _FORWARD,
                                  cpp_entry="attention_cpu",
                                  kernel_dtypes={"cpp": _backend.KERNEL_DTYPES})


def check_scale(scale):
    if not math.isfinite(scale):
        raise ValueError(f"fastllm.attention: scale must be finite, got {scale}")


def _attention_impl(q, k, v, doc_start, scale):
    check_attention_args(q, k, v, doc_start)
    check_scale(scale)
    with _backend.device_guard(q.device):
        return _FORWARD[_select(q)](q, k, v, doc_start, scale)


def _attention_backward_impl(grad_out, q, k, v, out, lse, doc_start, scale):
    with _backend.device_guard(q.device):
        return _BACKWARD[_select(q)](grad_out, q, k, v, out, lse, doc_start, scale)


for _key in ("CPU", "CUDA"):
    lib.impl("attention", _attention_impl, _key)
    lib.impl("attention_backward", _attention_backward_impl, _key)
_attention_backward = direct_op("attention_backward", _attention_backward_impl)


@torch.library.register_fake("fastllm::attention")
def _attention_fake(q, k, v, doc_start, scale):
    check_attention_args(q, k, v, doc_start)
    b, t, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.register_fake("fastllm::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, doc_start, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, doc_start, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_start)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


@first_order_only("fastllm.attention")
def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, doc_start = ctx.saved_tensors
    dq, dk, dv = _attention_backward(grad_out.contiguous(), q, k, v, out, lse, doc_start,
                                     ctx.scale)
    return dq, dk, dv, None, None


_attention = register_autograd("fastllm::attention", _backward, setup_context=_setup_context,
                               impl=_attention_impl, materialize_grads=False)


def attention(q, k, v, scale=None, doc_start=None, segments=None):
    """Causal attention: q (B, T, Hq, D), k, v (B, T, Hkv, D) -> (B, T, Hq, D).

    scale: multiplies q k^T (default head_dim ** -0.5). doc_start: None, or (B, T) int64, the
    first key each query may attend (packed documents; `doc_start_from_position_ids`).
    segments: optional `document_segments(doc_start)`, for a caller that runs many layers on one
    batch (on a GPU the varlen route reads it; computed here when needed, one host sync).
    Under autocast on q's device type (CPU, CUDA) q, k, v are cast to its dtype first (fp64
    ones are not), as F.scaled_dot_product_attention's are."""
    if _lowp.autocast_enabled(q.device.type):
        q, k, v = _lowp.autocast_args(q.device.type, q, k, v)
    if scale is None:
        scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # head_dim 0: refused below
    if not torch.compiler.is_compiling():  # (traced, maybe symbolic: the op checks it)
        scale = float(scale)
        check_scale(scale)
    if q.device.type != "cpu":
        # no GPU kernel of fastllm's own: PyTorch's fused attention (varlen flash for packed
        # documents, else flash or memory-efficient), not the reference, which would
        # materialise T x T scores per head
        if doc_start is not None and gpu_varlen_applies(q, k, scale):
            out = _varlen_attention(q, k, v, scale, doc_start, segments)
            if out is not None:
                return out
        return _sdpa_attention(q, k, v, scale, doc_start)
    return _attention(q, k, v, doc_start, scale)[0]


class DocumentSegments:
    """The documents of packed rows as one flat sequence: cu_seqlens (N + 1,) int32, the offsets
    of the N documents in the (B * T) tokens, and max_len, the longest (a Python int)."""

    __slots__ = ("cu_seqlens", "max_len")

    def __init__(self, cu_seqlens, max_len):
        self.cu_seqlens = cu_seqlens
        self.max_len = max_len


def document_segments(doc_start):
    """DocumentSegments of doc_start (B, T), or None where doc_start is not made of whole
    documents (each token's value that of the token before it, or its own index: what
    `doc_start_from_position_ids` gives; the op also takes other non-decreasing starts, which
    varlen attention cannot express). A document starts where doc_start[b, t] == t (every row's
    first token starts one, so no document crosses rows). Reads back to the host twice (the
    documents' count, then their longest and the check): compute it once per batch and pass it
    to each layer's `attention`."""
    b, t = doc_start.shape
    idx = torch.arange(t, device=doc_start.device)
    starts = doc_start == idx
    whole = (starts[:, :1].all() & (starts[:, 1:] | (doc_start[:, 1:] == doc_start[:, :-1])).all()
             if t else torch.ones((), dtype=torch.bool, device=doc_start.device))
    flat = starts.reshape(-1).nonzero().reshape(-1)
    end = torch.full((1,), b * t, dtype=flat.dtype, device=flat.device)
    cu = torch.cat([flat, end])
    longest = torch.diff(cu).max() if cu.numel() > 1 else torch.zeros((), dtype=cu.dtype,
                                                                       device=cu.device)
    ok, max_len = torch.stack([whole.to(longest.dtype), longest]).tolist()
    if not ok:
        return None
    return DocumentSegments(cu.to(torch.int32), max_len)


@functools.lru_cache(maxsize=None)
def _varlen_kernel():
    """(varlen_attn, the names of its parameters), or None where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


# (device, dtype, head_dim, grouped) whose varlen call raised: SDPA from then on, one warning
_VARLEN_FAILED = set()


def _varlen_key(q, k):
    return (str(q.device), q.dtype, q.shape[-1], q.shape[2] != k.shape[2])


def gpu_varlen_available():
    """Whether the GPU's varlen route may run at all: a PyTorch with torch.nn.attention.varlen,
    not while torch.compile traces (its max_len is a host value), FASTLLM_GPU_ATTENTION not
    sdpa. gpu_varlen_applies adds what depends on the tensors."""
    return (_varlen_kernel() is not None and not torch.compiler.is_compiling()
            and _backend.env_choice(GPU_ENV, _GPU_MODES) == "auto")


def gpu_varlen_applies(q, k, scale=None):
    """Whether packed documents on this GPU tensor go through PyTorch's varlen flash attention:
    CUDA (not ROCm), sm80+, bf16/fp16, head_dim a multiple of 8 up to 256 (over 192 on sm80 and
    sm90 only: flash's backward refuses it elsewhere), tokens to attend, a PyTorch with
    torch.nn.attention.varlen (>= 2.10; grouped-query heads go to flash as they are, which
    reads each key/value head for its query heads) whose varlen_attn takes the scale asked
    for, not while torch.compile traces (its max_len is a host value), a (device, dtype,
    head_dim, grouping) varlen_attn has not refused before, and FASTLLM_GPU_ATTENTION not sdpa."""
    d = q.shape[-1]
    if (q.device.type != "cuda" or torch.version.hip is not None
            or q.dtype not in (torch.bfloat16, torch.float16)
            or d % 8 or not 0 < d <= 256 or q.shape[0] * q.shape[1] == 0
            or not gpu_varlen_available() or _varlen_key(q, k) in _VARLEN_FAILED):
        return False
    params = _varlen_kernel()[1]
    if scale is not None and "scale" not in params and scale != d ** -0.5:
        return False
    if "window_size" not in params and "is_causal" not in params:
        return False
    major, minor = _capability(q.device.index if q.device.index is not None
                               else torch.cuda.current_device())
    return major >= 8 and (d <= 192 or (major in (8, 9) and minor == 0))


def _varlen_attention(q, k, v, scale, doc_start, segments):
    """attention() through varlen_attn, or None where doc_start is not whole documents or (after
    one warning) where varlen_attn refused the call."""
    check_attention_args(q, k, v, doc_start)
    if segments is None:
        segments = document_segments(doc_start)
        if segments is None:  # not whole documents: SDPA with its mask
            return None
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    fn, params = _varlen_kernel()
    kwargs = {}
    if "window_size" in params:  # torch >= 2.11
        kwargs["window_size"] = (-1, 0)
    else:  # torch 2.10
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    if hq != hkv and "enable_gqa" in params:  # (older ones pass the heads to flash unchecked)
        kwargs["enable_gqa"] = True
    try:
        out = fn(q.reshape(b * t, hq, d), k.reshape(b * t, hkv, d), v.reshape(b * t, hkv, d),
                 segments.cu_seqlens, segments.cu_seqlens, segments.max_len, segments.max_len,
                 **kwargs)
    except torch.OutOfMemoryError:
        raise  # not a refusal: the next step may fit, and the fallback needs more memory
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        # raised by its argument checks (a kernel that does not take these heads, this GPU),
        # before it wrote anything
        _VARLEN_FAILED.add(_varlen_key(q, k))
        warnings.warn(f"fastllm.attention: PyTorch's varlen attention refused {q.dtype}, head_dim "
                      f"{d}, {hq}/{hkv} heads ({exc}); using scaled_dot_product_attention with "
                      f"the document mask for these from now on", RuntimeWarning, stacklevel=3)
        return None
    return out.view(b, t, hq, d)


def _sdpa_attention(q, k, v, scale, doc_start):
    """The op's contract through F.scaled_dot_product_attention: is_causal, or the
    block-diagonal causal mask of doc_start."""
    check_attention_args(q, k, v, doc_start)
    mask = None if doc_start is None else _mask(doc_start, q.shape[1], q.device)
    group = q.shape[2] // k.shape[2]
    if mask is not None and group > 1:
        # a mask with enable_gqa leaves a GPU only SDPA's math kernel (T x T scores in fp32):
        # repeat the key/value heads instead, as transformers does (use_gqa_in_sdpa), for the
        # memory-efficient one
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=doc_start is None, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def _mode():
    return _backend.env_choice(ENV, _MODES)


# bf16/fp16 rows longer than this stay on PyTorch's flash kernel under `auto` where PyTorch has
# native low-precision GEMMs: it multiplies in bf16 (twice the fp32 GEMM rate) and tiles the
# keys, and at 4096 tokens this kernel was no faster (1 x 4096 tokens, 9 / 3 heads of 64, fwd +
# bwd, AMD Zen 5, two runs: 677 and 507 ms against flash's 501 and 509; fp32 547-569 against
# 616-668; at 2048 and below as fast or faster in both dtypes, BENCHMARKS.md). Where bf16 is
# widened (fastllm/_lowp.py) the other side is the fp32 flash kernel, which this one matched or
# beat at every length measured (AMD Zen 3, AVX2, 2026-12-07: 1 x 4096 bf16 631 ms against
# 777), and packed rows' other side is a dense T x T mask, so neither has a cap.
AUTO_MAX_LOWP_TOKENS = 2048


def worth_it(tokens, dtype, packed=False):
    """Whether fastllm.patch gives an attention over rows of `tokens` in `dtype` to this op: where
    the kernel is available (cpu_attention_available), packed rows of several documents always
    (transformers' attention computes them with a dense (T x T) block-diagonal mask, this op one
    causal block per document: fwd + bwd, 8 x 2048 tokens in 35 documents, 9 / 3 heads of 64,
    fp32, AMD Zen 3: 5.2x faster than SDPA with that mask; bf16 1 x 8192 in 16 documents: 297
    ms against 7.6 s, BENCHMARKS.md 2026-12-07); plain rows where cpu_attention_enabled(),
    under `auto` for fp32 at any length and for bf16/fp16 up to AUTO_MAX_LOWP_TOKENS where
    PyTorch multiplies them natively, at any length where they are widened to fp32. Never under
    a forced backend this op has no kernel for (use_backend("triton"), the GPU's path, whose
    attention is PyTorch's): the model keeps its own attention rather than fail."""
    if not cpu_attention_available():
        return False
    if (not torch.compiler.is_compiling()  # (a thread's setting: not read into a graph)
            and _backend.forced_backend() not in (None, *_PREFERENCE["cpu"])):
        return False
    if packed or _mode() == "fastllm":
        return True
    return cpu_attention_enabled() and (
        dtype in (torch.float32, torch.float64) or tokens <= AUTO_MAX_LOWP_TOKENS
        or _lowp.widens("cpu", dtype))


@torch.compiler.assume_constant_result  # a setting of the process: torch.compile reads it once
def cpu_attention_available():
    """Whether this op's CPU kernel is built and FASTLLM_CPU_ATTENTION is not torch."""
    return (_mode() != "torch" and _extension.has_cpp()
            and hasattr(_extension.extension(), "attention_cpu"))


@torch.compiler.assume_constant_result  # a setting of the process: torch.compile reads it once
def cpu_attention_enabled():
    """Whether fastllm.patch runs a CPU model's plain causal attention through this op
    (FASTLLM_CPU_ATTENTION: auto, the default, where fastllm/_gemm.py routes fp32 GEMMs to its
    own kernels (AMD CPUs: oneDNN with AVX-512, fastllm's with AVX2 only), the CPUs it was
    measured faster on than PyTorch's flash attention (fwd + bwd, 9 / 3 heads of 64, AMD Zen 3,
    2026-12-07: 0.71-0.90x its time in fp32, 0.58-0.88x in bf16 against the fp32 flash kernel
    fastllm/_lowp.py widens to, 8 x 512 to 2 x 2048 tokens; not on Intel CPUs, where ATen keeps
    fp32 GEMMs: on a Xeon with AMX, 2026-12-07, fp32 0.76-1.08x either way and PyTorch's bf16
    flash kernel, AMX's, 1.3-1.9x faster); fastllm; torch: PyTorch's own attention)."""
    if not cpu_attention_available():
        return False
    return _mode() == "fastllm" or _gemm.route() in ("onednn", "avx2")
