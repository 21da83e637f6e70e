"""fastllm::rotary_embedding: rotary position embedding of q and k in one pass, Hugging Face's
rotate-half convention (LlamaAttention's apply_rotary_pos_emb).

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])

q: (B, S, Hq, D), k: (B, S, Hk, D) with Hk dividing Hq or not (GQA: any Hk), any strides with a
unit last stride (HF's (B, H, S, D) tensors go in as their .transpose(1, 2) views, see
`apply_rotary_pos_emb`). cos, sin: either per position, (B or 1, S, D) as HF's rotary_emb returns
them, or a (max_positions, D) table indexed by position_ids (B or 1, S), int64. q, k, cos, sin
share one dtype (fp32, bf16, fp16, fp64); the products are taken in fp32 (fp64 for fp64) and
rounded once. The backward is the transposed rotation of dq and dk (nothing saved but cos, sin
and position_ids); cos and sin get no gradient from the op (HF computes them from a frozen
buffer): `rotary_embedding` hands cos or sin that require grad to the reference maths.

Ops (schemas in fastllm/_library.py):
    rotary_embedding(q, k, cos, sin, position_ids) -> (q_out, k_out)     out of place, autograd
    rotary_embedding_backward(dq, dk, cos, sin, position_ids) -> (dq_in, dk_in)
    rotary_embedding_(q, k, cos, sin, position_ids) -> ()                in place, no autograd
Out of place costs no memory that lasts: autograd keeps neither q nor its rotation for this op's
backward, so the pre-rotation q (a projection's output nobody else keeps) is freed right away.
Backends: cpp (csrc/cpu/rotary_embedding.cpp), triton (fastllm/kernels/rotary_embedding.py), ref.
"""

import functools

import torch

from fastllm import _backend, _extension
from fastllm._library import direct_op, first_order_only, lib, register_autograd

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rows_of(cos, sin, position_ids):
    """cos, sin as (B or 1, S, 1, D), broadcastable over (B, S, H, D)."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    return cos[:, :, None, :], sin[:, :, None, :]


def rotary_embedding_ref(q, k, cos, sin, position_ids=None):
    """Plain-PyTorch rotary embedding, (B, S, H, D) layout, computed in fp32 (fp64 for fp64)."""
    op = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, s = _rows_of(cos.to(op), sin.to(op), position_ids)
    out = []
    for x in (q, k):
        xf = x.to(op)
        out.append((xf * c + _rotate_half(xf) * s).to(x.dtype))
    return tuple(out)


def check_rotary_embedding_args(q, k, cos, sin, position_ids, values=True):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing. values: also
    check that position_ids index the table (CPU tensors only: no device sync, no fakes)."""
    where = "fastllm.rotary_embedding"
    if q.dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype {q.dtype} is not supported (fp32, bf16, fp16, fp64)")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}, q has {q.dtype}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin), ("position_ids", position_ids)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device}, q on {q.device}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"{where}: q and k must be (B, S, H, D), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    b, s, _, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"{where}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B, S "
                         "and D")
    if d % 2:
        raise ValueError(f"{where}: head dim D = {d} must be even")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{where}: {name} must have a unit last stride")
    if cos.shape != sin.shape:
        raise ValueError(f"{where}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != s or cos.shape[2] != d:
            raise ValueError(f"{where}: without position_ids cos and sin must be (B or 1, S, D) "
                             f"= ({b} or 1, {s}, {d}), got {tuple(cos.shape)}")
    else:
        if position_ids.dtype != torch.int64:
            raise TypeError(f"{where}: position_ids must be int64, got {position_ids.dtype}")
        if (position_ids.dim() != 2 or position_ids.shape[0] not in (1, b)
                or position_ids.shape[1] != s):
            raise ValueError(f"{where}: position_ids must be (B or 1, S) = ({b} or 1, {s}), got "
                             f"{tuple(position_ids.shape)}")
        if cos.dim() != 2 or cos.shape[1] != d:
            raise ValueError(f"{where}: with position_ids cos and sin must be (positions, D), "
                             f"got {tuple(cos.shape)}")
        if values and position_ids.device.type == "cpu" and position_ids.numel():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= cos.shape[0]:
                raise ValueError(f"{where}: position_ids span [{lo}, {hi}] but the cos/sin table "
                                 f"has {cos.shape[0]} positions")


def _ref_into(q, k, cos, sin, position_ids, q_out, k_out, backward):
    op = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, s = _rows_of(cos.to(op), sin.to(op), position_ids)
    half = q.shape[-1] // 2
    for x, out in ((q, q_out), (k, k_out)):
        xf = x.to(op)
        x1, x2 = xf[..., :half], xf[..., half:]
        c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
        if backward:
            o = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)
        else:
            o = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
        out.copy_(o)


def _cpp_into(q, k, cos, sin, position_ids, q_out, k_out, backward):
    pos = position_ids if position_ids is not None else q.new_empty(0, dtype=torch.int64)
    _extension.extension().rotary_embedding_cpu(q, k, cos, sin, pos, q_out, k_out, backward)


def _triton_into(*args):
    from fastllm.kernels.rotary_embedding import rotary_embedding_triton

    rotary_embedding_triton(*args)


_INTO = {"ref": _ref_into, "cpp": _cpp_into, "triton": _triton_into}


def _select(q):
    return _backend.select_kernel("rotary_embedding", q.device.type, q.dtype, _PREFERENCE, _INTO,
                                  cpp_entry="rotary_embedding_cpu",
                                  kernel_dtypes={"triton": _backend.KERNEL_DTYPES})


def _run(q, k, cos, sin, position_ids, q_out, k_out, backward):
    with _backend.device_guard(q.device):
        _INTO[_select(q)](q, k, cos, sin, position_ids, q_out, k_out, backward)


def _rotary_impl(q, k, cos, sin, position_ids=None):
    check_rotary_embedding_args(q, k, cos, sin, position_ids)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _run(q, k, cos, sin, position_ids, q_out, k_out, False)
    return q_out, k_out


def _rotary_backward_impl(grad_q, grad_k, cos, sin, position_ids=None, check=True):
    grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
    grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
    # (the op is public through torch.ops: its arguments are checked as the forward's are; the
    # autograd backward's saved cos, sin and position_ids were checked by its forward)
    if check:
        check_rotary_embedding_args(grad_q, grad_k, cos, sin, position_ids)
    dq, dk = torch.empty_like(grad_q), torch.empty_like(grad_k)
    _run(grad_q, grad_k, cos, sin, position_ids, dq, dk, True)
    return dq, dk


def _rotary_inplace_impl(q, k, cos, sin, position_ids=None):
    check_rotary_embedding_args(q, k, cos, sin, position_ids)
    _check_no_overlap(q, k)
    _run(q, k, cos, sin, position_ids, q, k, False)
    # the kernels write through pointers: record the writes as ATen's in-place ops do, so that
    # autograd refuses a q or k saved before them instead of using the rotated values
    torch.autograd.graph.increment_version((q, k))


def _check_no_overlap(q, k):
    """Refuse in-place outputs whose elements share memory (an expanded head dim, q and k the
    same tensor): each element would be rotated once per alias. The rules of ATen's own in-place
    ops (assert_no_internal_overlap, assert_no_overlap): overlap that is certain is refused."""
    for name, t in (("q", q), ("k", k)):
        if torch._debug_has_internal_overlap(t) == 1:  # 1: MemOverlap::Yes
            raise RuntimeError(f"fastllm.rotary_embedding_: more than one element of {name} "
                               f"refers to a single memory location (an expanded tensor?); "
                               f"clone() it first")
    if q.numel() == 0 or k.numel() == 0 or q.untyped_storage().data_ptr() != \
            k.untyped_storage().data_ptr():
        return
    if q.data_ptr() == k.data_ptr() and q.stride() == k.stride():
        raise RuntimeError("fastllm.rotary_embedding_: q and k are the same memory; rotate "
                           "one of them, or clone() the other first")
    if q.is_contiguous() and k.is_contiguous():
        qs, ks = q.data_ptr(), k.data_ptr()
        qe, ke = qs + q.numel() * q.element_size(), ks + k.numel() * k.element_size()
        if qs < ke and ks < qe:
            raise RuntimeError("fastllm.rotary_embedding_: q and k overlap in memory; clone() "
                               "one of them first")


lib.impl("rotary_embedding", _rotary_impl, "CPU")
lib.impl("rotary_embedding", _rotary_impl, "CUDA")
lib.impl("rotary_embedding_backward", _rotary_backward_impl, "CPU")
lib.impl("rotary_embedding_backward", _rotary_backward_impl, "CUDA")
_rotary_backward = direct_op("rotary_embedding_backward",
                             functools.partial(_rotary_backward_impl, check=False))
lib.impl("rotary_embedding_", _rotary_inplace_impl, "CPU")
lib.impl("rotary_embedding_", _rotary_inplace_impl, "CUDA")


@torch.library.register_fake("fastllm::rotary_embedding")
def _rotary_fake(q, k, cos, sin, position_ids=None):
    check_rotary_embedding_args(q, k, cos, sin, position_ids, values=False)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("fastllm::rotary_embedding_backward")
def _rotary_backward_fake(grad_q, grad_k, cos, sin, position_ids=None):
    grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
    grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


@torch.library.register_fake("fastllm::rotary_embedding_")
def _rotary_inplace_fake(q, k, cos, sin, position_ids=None):
    check_rotary_embedding_args(q, k, cos, sin, position_ids, values=False)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, position_ids = inputs
    ctx.save_for_backward(cos, sin, position_ids)


@first_order_only("fastllm.rotary_embedding")
def _backward(ctx, grad_q, grad_k):
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = _rotary_backward(grad_q, grad_k, cos, sin, position_ids)
    return dq, dk, None, None, None


_rotary = register_autograd("fastllm::rotary_embedding", _backward,
                            setup_context=_setup_context, impl=_rotary_impl)


def rotary_embedding(q, k, cos, sin, position_ids=None, inplace=False):
    """(q_rot, k_rot) for q (B, S, Hq, D), k (B, S, Hk, D); see the module docstring.

    inplace=True rotates q and k in place and returns them (no autograd: for inference, or
    tensors that do not require grad). cos and sin are cast to q's dtype if they differ."""
    if cos.dtype != q.dtype:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise RuntimeError("fastllm.rotary_embedding: inplace=True does not support autograd; "
                               "use the out-of-place form (it keeps no extra memory)")
        # a negated view (x._neg_view()) as its values, written back through the view: the
        # dispatcher's fallback refuses a mutable argument that carries the bit
        qs, ks = q.resolve_neg(), k.resolve_neg()  # (q, k themselves unless negated)
        torch.ops.fastllm.rotary_embedding_(qs, ks, cos, sin, position_ids)
        for view, done in ((q, qs), (k, ks)):
            if done is not view:
                view.copy_(done)
        return q, k
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        # a learned or trained table: the op gives cos and sin no gradient (HF makes them under
        # no_grad), so this call is the reference maths, which autograd differentiates in full
        # (the values' check reads position_ids, which a compiled graph cannot guard on)
        check_rotary_embedding_args(q, k, cos, sin, position_ids,
                                    values=not torch.compiler.is_compiling())
        return rotary_embedding_ref(q, k, cos, sin, position_ids)
    return _rotary(q, k, cos, sin, position_ids)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's apply_rotary_pos_emb on fastllm's op: q (B, Hq, S, D), k (B, Hk, S, D)
    with unsqueeze_dim=1 (or (B, S, H, D) with unsqueeze_dim=2), cos/sin (B or 1, S, D)."""
    if unsqueeze_dim == 1:
        q_rot, k_rot = rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)
    if unsqueeze_dim == 2:
        return rotary_embedding(q, k, cos, sin)
    raise ValueError(f"fastllm.apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got "
                     f"{unsqueeze_dim}")
