"""fastllm::fused_linear_cross_entropy: the LM head's matmul and the cross-entropy loss, fused
over chunks of tokens, so that the (tokens x vocab) logits and their grad never exist.

    logits = hidden weight^T + bias                     (fp32 accumulation)
    logits = cap * tanh(logits / cap)                   (logit_softcap, Gemma-2; None: off)
    loss_i = (1 - eps) (lse_i - z_{i,y_i}) + eps (lse_i - mean_j z_ij) + z_loss lse_i^2
    lse_i  = logsumexp_j z_ij, eps = label_smoothing, z_loss: PaLM's auxiliary loss

hidden: (..., H) fp32, bf16 or fp16 (fp64 on the ref backend); weight: (V, H) of hidden's dtype
(tied embeddings: the embedding matrix itself); bias: (V,) or None; labels: (...) int64, already
aligned with hidden (the caller shifts for causal LM), ignore_index where no loss is wanted.
reduction: "mean" over non-ignored tokens (as F.cross_entropy: nan when every label is ignored,
with zero grads), "sum" (0 when every label is ignored) or "none" (per token, labels' shape, 0 at
ignored tokens). The loss is fp32 (fp64 for fp64 inputs), as Hugging Face's loss over
`logits.float()`.

How the grads are produced. For "mean" and "sum" the forward computes the loss AND the grads of
hidden, weight and bias in the same pass over the chunks (Liger-Kernel's scheme): per chunk of
tokens the logits (chunk x V) are computed by one GEMM, turned in place into their grad by one
vectorised pass, and consumed by the two grad GEMMs; the backward only scales the saved grads by
the incoming grad. That is 3 GEMMs per step, the same as F.cross_entropy over materialised logits.
Recomputing the logits in the backward instead (cut cross-entropy's scheme) costs a 4th GEMM, about
+33% on this CPU, where the three GEMMs alone already take as long as the whole materialised loss
(BENCHMARKS.md), to save holding grad_weight (V x H, the size of the weight) from forward to
backward. "none" can for hidden's grad alone (each token's row is scaled by its own incoming
grad; in dW that grad sits inside the sum over tokens): with a frozen weight and bias (LoRA, DPO's
log-probabilities) its forward computes loss and grad_hidden (2 GEMMs, as materialised logits),
else the loss only (1 GEMM) and its backward recomputes (3 GEMMs). fp16 inputs take that route in
every reduction: an fp16 grad made in the forward, before a loss scale reaches it, would lose its
bits to fp16's subnormals (about 1/tokens a token), so the backward computes the grads with the
incoming (scaled) grad applied first, as the unfused loss does. Grads are computed only for
the inputs that require them (a frozen head skips the dW GEMM), and ignored tokens are dropped
before any GEMM, but under CUDA graph capture: finding them (and checking the labels) reads the
GPU back, which a capture refuses, so there the GPU driver keeps every token in place, the
ignored ones with a loss and grad of 0, and checks the labels by a device-side assertion
(`_chunked`'s dense rows; tests/test_cuda_graph_step.py captures a patched step).

Chunk size: CHUNK_BYTES (128 MiB) of logits per chunk (`chunk_rows`), 682 fp32 / 1365 bf16 rows at
V = 49152, on the CPU at least CPU_MIN_CHUNK_ROWS (512) rows, the chunks balanced
(`balanced_rows`: no more chunks than an equal split needs, at most an eighth and a tile over,
and from 128 rows on whole multiples of 16 rows, at which oneDNN's GEMMs keep their speed): the
op's extra memory is one chunk plus the grads, independent of the token count.

Backends: cpp (CPU: csrc/cpu/fused_linear_cross_entropy.cpp, ATen GEMMs + an AVX-512 row pass,
OpenMP over rows), triton (GPU; CPU under TRITON_INTERPRET=1: torch GEMMs and the row pass of
fastllm/kernels/fused_linear_cross_entropy.py), ref (the same chunked algorithm with the row pass in
PyTorch). `fused_linear_cross_entropy_ref` materialises the logits and lets autograd
differentiate: the oracle the tests compare against.
"""

import math

import torch
import torch.nn.functional as F

from fastllm import _backend, _extension, _gemm, _lowp
from fastllm._library import direct_op, first_order_only, lib, register_autograd

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
REDUCTIONS = ("mean", "sum", "none")
_WHERE = "fastllm.fused_linear_cross_entropy"

# Bytes of logits per chunk, by measurement: every chunk re-reads the whole weight in its GEMMs.
# 2048 x 576 x 49152 fp32 (Zen 4): 2 MiB chunks 69.5 s, 8 MiB 25.8 s, 32 MiB 13.8 s, 96 MiB 12.2 s;
# 4096 tokens, frozen head (Zen 3): 64 MiB 4.83 s, 128 MiB 4.17 s, 256 MiB 4.25 s (BENCHMARKS.md).
CHUNK_BYTES = 128 << 20
# and on the CPU at least this many rows (CHUNK_BYTES is 167 at Phi-4-mini's V = 200064): its
# frozen 200064 x 3072 head, 1024 fp32 tokens, fwd + bwd, Zen 3: 176-row chunks 27.5-28.8 s, 512
# rows 23.7 s, 1024 rows 23.1 s, torch over logits 25.4-27.2 s (BENCHMARKS.md 2026-12-07)
CPU_MIN_CHUNK_ROWS = 512


def fused_linear_cross_entropy_ref(hidden, weight, labels, bias=None, ignore_index=-100,
                                   reduction="mean", label_smoothing=0.0, z_loss=0.0,
                                   logit_softcap=None):
    """Plain PyTorch over materialised logits (upcast to fp32, as Hugging Face's loss), autograd
    differentiable: the oracle for every backend. Same arguments as fused_linear_cross_entropy."""
    logits = F.linear(hidden, weight, bias)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    logits = logits.reshape(-1, weight.shape[0])
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    valid = flat != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, -1).square() * valid
    if reduction == "none":
        return loss.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def check_fused_linear_cross_entropy_args(hidden, weight, labels, bias, ignore_index, reduction,
                                          label_smoothing, z_loss, logit_softcap):
    """Raise ValueError/TypeError naming the first bad argument; touches nothing."""
    tensors = {"hidden": hidden, "weight": weight}
    if bias is not None:
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.layout != torch.strided:
            raise TypeError(f"{_WHERE}: {name} is {t.layout}; only dense tensors are supported")
        if t.dtype != hidden.dtype:
            raise TypeError(f"{_WHERE}: {name} has dtype {t.dtype}, hidden has {hidden.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{_WHERE}: {name} is on {t.device}, hidden on {hidden.device}")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"{_WHERE}: dtype {hidden.dtype} is not supported (fp32, bf16, fp16, fp64)")
    if labels.dtype != torch.int64:
        raise TypeError(f"{_WHERE}: labels must be int64, got {labels.dtype}")
    if labels.device != hidden.device:
        raise ValueError(f"{_WHERE}: labels are on {labels.device}, hidden on {hidden.device}")
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{_WHERE}: expected hidden (..., H) and weight (V, H), got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{_WHERE}: labels {tuple(labels.shape)} must have hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])} (shift them for causal LM first)")
    if weight.shape[0] < 1:
        raise ValueError(f"{_WHERE}: the vocabulary (weight.shape[0]) is empty")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_WHERE}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{_WHERE}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{_WHERE}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"{_WHERE}: z_loss must be finite and >= 0, got {z_loss}")
    if logit_softcap is not None and not (math.isfinite(logit_softcap) and logit_softcap > 0):
        raise ValueError(f"{_WHERE}: logit_softcap must be None or > 0, got {logit_softcap}")


def _bad_labels(flat, keep, vocab):  # kept (not ignore_index) but outside [0, vocab)
    return keep & ((flat < 0) | (flat >= vocab))


def _check_labels(flat, ignore_index, vocab, keep=None):
    bad = _bad_labels(flat, flat != ignore_index if keep is None else keep, vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_WHERE}: label {int(flat[i])} at token {i} is outside [0, {vocab}) "
                         f"and is not ignore_index ({ignore_index})")


def chunk_rows(tokens, vocab, elem_size, device_type="cpu"):
    """Rows of the chunk buffer: CHUNK_BYTES of logits in hidden's dtype on every device (Liger's
    smaller GPU chunks made the call host-bound on an H200, 2026-12-04), on the CPU at least
    CPU_MIN_CHUNK_ROWS rows."""
    return balanced_rows(tokens, _budget_rows(vocab, elem_size, device_type))


def _budget_rows(vocab, elem_size, device_type):  # rows of a chunk, before balancing
    rows = max(1, CHUNK_BYTES // max(1, vocab * elem_size))
    return max(rows, CPU_MIN_CHUNK_ROWS) if device_type == "cpu" else rows


# Chunks of at least 8 x ROW_TILE rows are whole multiples of it: oneDNN's GEMMs slow down at
# some row counts (Zen 4, 49152 x 576 bf16: 0.25 TFLOP/s at 1363 rows, 0.40 at 1376; BENCHMARKS.md).
ROW_TILE = 16


def balanced_rows(tokens, most):
    """Rows per chunk for `tokens` rows in chunks of about `most`: as few chunks as an equal
    split of at most an eighth over `most` needs (2048 tokens at 682: 3 chunks, not 3 x 682 + 2),
    rounded up to whole ROW_TILEs from 8 of them on (688, 688, 672; the last takes what is left,
    never an extra chunk). The C++ kernel's chunk_rows_for applies the same rule."""
    if tokens <= most:
        return max(1, tokens)
    chunks = tokens // most
    if -(-tokens // chunks) > most + most // 8:
        chunks += 1
    rows = -(-tokens // chunks)
    if rows >= 8 * ROW_TILE:
        rows = min(tokens, -(-rows // ROW_TILE) * ROW_TILE)
    return rows


def row_pass_ref(z, labels, weights, label_smoothing, z_loss, cap, need_grad):
    """One chunk's rows of logits z (c, V), in place: returns the per-token losses (c,) fp32 and,
    with need_grad, overwrites z with weights[:, None] * dloss/dz. labels (c,) in [0, V), or
    negative for an ignored token (the sync-free driver's rows: loss 0, a grad row of zeros)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    zf = z.to(acc)
    if cap:
        zf = cap * torch.tanh(zf / cap)
    vocab = z.shape[1]
    valid = labels >= 0
    labels = labels.clamp_min(0)
    lse = torch.logsumexp(zf, 1)
    z_y = zf.gather(1, labels[:, None])[:, 0]
    eps = label_smoothing
    loss = lse - (1.0 - eps) * z_y + z_loss * lse * lse
    if eps:  # only then: a -inf logit makes the mean -inf, and 0 * -inf is nan
        loss = loss - eps * zf.mean(1)
    if need_grad:
        w = weights.to(acc)
        g = torch.exp(zf - lse[:, None]) * (w * (1.0 + 2.0 * z_loss * lse))[:, None]
        g.sub_((w * (eps / vocab))[:, None])
        g.scatter_add_(1, labels[:, None], -(w * (1.0 - eps))[:, None])
        if cap:
            g.mul_(1.0 - (zf / cap).square())
        z.copy_(g.masked_fill_(~valid[:, None], 0.0))
    return loss.masked_fill_(~valid, 0.0).to(acc)


# whether torch's CUDA addmm adds a bf16/fp16 product into an fp32 `out` (addmm.dtype_out; some
# releases require the added input in the operands' dtype): probed on the first call. torch < 2.8
# has no out_dtype on mm / addmm at all.
_ADDMM_INTO_FP32 = []
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def _add_mm(acc, a, b):
    """acc += a @ b, acc fp32 (fp64): a chunk's dW product summed over chunks without ever being
    rounded to bf16/fp16 (the products of bf16 values are exact in fp32). The GEMM adds into acc
    itself (beta = 1) where it can: no (V, h) temporary per chunk, whose write and re-read would
    cost about twice the GEMM's own time on a GPU at 49k vocabulary and ~256-row chunks."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _MM_OUT_DTYPE:
        if _ADDMM_INTO_FP32 != [False]:
            try:
                torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
                _ADDMM_INTO_FP32[:] = [True]
                return
            except RuntimeError as exc:  # its argument checks run before any kernel
                if _ADDMM_INTO_FP32 == [True] or "dtype" not in str(exc):  # not a refusal
                    raise
                _ADDMM_INTO_FP32[:] = [False]
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:  # the CPU's reference path, or torch < 2.8
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _capturing(t):
    """Whether t's device is being captured into a CUDA graph (which refuses reads of the GPU)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _chunked(row_pass, hidden2, weight, flat, bias, token_scale, scale, divide_by_valid,
             ignore_index, label_smoothing, z_loss, cap, need_hidden, need_weight, need_bias,
             rows=None, dense=None):
    """The cpp kernel's algorithm with torch GEMMs and `row_pass` (ref or triton): the same
    contract as fastllm._C.fused_linear_cross_entropy_cpu.

    dense (None: while a CUDA graph is captured): no GPU read back (no nonzero, no any()):
    ignored tokens kept with label -1 (loss 0, grad 0), labels checked by device assertion."""
    if dense is None:
        dense = _capturing(hidden2)
    n = hidden2.shape[0]
    vocab = weight.shape[0]
    acc = torch.float64 if hidden2.dtype == torch.float64 else torch.float32
    need_grad = need_hidden or need_weight or need_bias
    keep = flat != ignore_index
    if dense:
        torch._assert_async(~_bad_labels(flat, keep, vocab).any(),
                            f"{_WHERE}: a label is outside [0, {vocab}) and is not ignore_index "
                            f"({ignore_index})")
        valid, m = None, n
        count = keep.sum()
    else:
        _check_labels(flat, ignore_index, vocab, keep)
        valid = keep.nonzero()[:, 0]
        m = valid.numel()
    loss = hidden2.new_zeros(n, dtype=acc)
    empty = hidden2.new_empty(0)
    gh = torch.zeros_like(hidden2) if need_grad and need_hidden else empty
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad and need_weight \
        else None
    gb = torch.zeros(vocab, dtype=acc, device=weight.device) if need_grad and need_bias \
        and bias is not None else None
    if m > 0:
        if rows is None:
            rows = chunk_rows(m, vocab, hidden2.element_size(), hidden2.device.type)
        if dense:  # (count on the device: 1 / count where it is 0 weighs no token)
            w_all = keep * (scale / count.clamp_min(1) if divide_by_valid else scale)
            labels = torch.where(keep, flat, -1)
        else:
            w_all = torch.full((m,), scale / m if divide_by_valid else scale, dtype=acc,
                               device=hidden2.device)
            labels = flat[valid]
        if token_scale is not None:
            w_all = w_all * (token_scale.to(acc) if dense else token_scale.to(acc)[valid])
        w_all = w_all.to(acc)  # (fp64 for fp64 inputs: rounded to fp32, their grads were too)
        for c0 in range(0, m, rows):
            idx = slice(c0, c0 + rows) if dense else valid[c0:c0 + rows]
            x = hidden2[idx]
            z = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
            loss[idx] = row_pass(z, labels[c0:c0 + rows], w_all[c0:c0 + rows], label_smoothing,
                                 z_loss, cap, need_grad)
            if not need_grad:
                continue
            if need_hidden:
                gh[idx] = torch.mm(z, weight)
            if need_weight:
                _add_mm(gw, z.t(), x)
            if gb is not None:
                gb.add_(z.sum(0, dtype=acc))
    gw = empty if gw is None else gw.to(weight.dtype)
    gb = empty if gb is None else gb.to(weight.dtype)
    return loss, gh, gw, gb


def _row_pass_triton(*args):
    from fastllm.kernels.fused_linear_cross_entropy import row_pass_triton

    return row_pass_triton(*args)


def _cpp(hidden2, weight, flat, bias, token_scale, scale, divide_by_valid, ignore_index,
         label_smoothing, z_loss, cap, need_hidden, need_weight, need_bias):
    if _lowp.widen(hidden2):
        # bf16/fp16 on a CPU without native low-precision GEMMs (fastllm/_lowp.py): the fp32
        # kernel on widened copies (the weight once per call, not per chunk), grads rounded once
        loss, gh, gw, gb = _cpp(hidden2.float(), weight.float(), flat,
                                None if bias is None else bias.float(), token_scale, scale,
                                divide_by_valid, ignore_index, label_smoothing, z_loss, cap,
                                need_hidden, need_weight, need_bias)
        return loss, gh.to(hidden2.dtype), gw.to(weight.dtype), gb.to(weight.dtype)
    _gemm.enabled()  # the kernel's fp32 GEMMs follow fastllm/_gemm.py's policy (set in C++)
    try:
        return _extension.extension().fused_linear_cross_entropy_cpu(
            hidden2.contiguous(), weight.contiguous(), flat.contiguous(),
            None if bias is None else bias.contiguous(),
            None if token_scale is None else token_scale.float().contiguous(), scale,
            divide_by_valid, ignore_index, label_smoothing, z_loss, cap, need_hidden,
            need_weight, need_bias,
            # the budget: the kernel balances its chunks over the valid tokens (chunk_rows_for)
            _budget_rows(weight.shape[0], hidden2.element_size(), "cpu"))
    except RuntimeError as exc:  # the kernel's label check: the same error as the other paths
        if "is outside [0," in str(exc):
            raise ValueError(str(exc).splitlines()[0]) from None
        raise


_KERNELS = {
    "ref": lambda *a: _chunked(row_pass_ref, *a),
    "triton": lambda *a: _chunked(_row_pass_triton, *a),
    "cpp": _cpp,
}


def _select(hidden):
    return _backend.select_kernel(
        "fused_linear_cross_entropy", hidden.device.type, hidden.dtype, _PREFERENCE, _KERNELS,
        cpp_entry="fused_linear_cross_entropy_cpu",
        kernel_dtypes={"cpp": _backend.KERNEL_DTYPES, "triton": _backend.KERNEL_DTYPES})


def _run(hidden, weight, labels, bias, token_scale, divide_by_valid, ignore_index,
         label_smoothing, z_loss, cap, grad_mask):
    hidden2 = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # (H may be 0)
    flat = labels.reshape(-1)
    # no autograd graph inside (the op's grads are its own), and out= GEMMs refuse one
    with torch.no_grad(), _backend.device_guard(hidden.device):
        return _KERNELS[_select(hidden)](
            hidden2, weight, flat, bias, token_scale, 1.0, divide_by_valid, ignore_index,
            float(label_smoothing), float(z_loss), float(cap), *grad_mask)


def _reduce(per_token, labels, ignore_index, reduction):
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()  # nan when every label is ignored, as torch


def _fused_impl(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss,
                logit_softcap, grad_mask):
    cap = logit_softcap or None
    check_fused_linear_cross_entropy_args(hidden, weight, labels, bias, ignore_index, reduction,
                                          label_smoothing, z_loss, cap)
    if reduction == "none" and any(grad_mask[1:]):
        raise ValueError(f"{_WHERE}: reduction 'none' computes weight and bias grads backward")
    per_token, gh, gw, gb = _run(hidden, weight, labels, bias, None, reduction == "mean",
                                 ignore_index, label_smoothing, z_loss, logit_softcap,
                                 list(grad_mask))
    loss = _reduce(per_token, labels, ignore_index, reduction)
    return loss, gh.view(hidden.shape) if grad_mask[0] else gh, gw, gb  # (an empty batch too)


def _backward_impl(grad_loss, hidden, weight, labels, bias, ignore_index, reduction,
                   label_smoothing, z_loss, logit_softcap, grad_mask):
    """Grads of hidden, weight, bias for an incoming grad_loss (0-d, or labels' shape for
    'none'), recomputing the logits chunk by chunk."""
    token_scale = grad_loss.to(_loss_dtype(hidden)).expand(labels.shape).reshape(-1)
    _, gh, gw, gb = _run(hidden, weight, labels, bias, token_scale, reduction == "mean",
                         ignore_index, label_smoothing, z_loss, logit_softcap, list(grad_mask))
    return gh.view(hidden.shape) if grad_mask[0] else gh, gw, gb


lib.impl("fused_linear_cross_entropy", _fused_impl, "CPU")
lib.impl("fused_linear_cross_entropy", _fused_impl, "CUDA")
lib.impl("fused_linear_cross_entropy_backward", _backward_impl, "CPU")
lib.impl("fused_linear_cross_entropy_backward", _backward_impl, "CUDA")
_fused_backward_op = direct_op("fused_linear_cross_entropy_backward", _backward_impl)


def _loss_dtype(hidden):
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fastllm::fused_linear_cross_entropy")
def _fused_fake(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss,
                logit_softcap, grad_mask):
    check_fused_linear_cross_entropy_args(hidden, weight, labels, bias, ignore_index, reduction,
                                          label_smoothing, z_loss, logit_softcap or None)
    shape = labels.shape if reduction == "none" else ()
    need_h, need_w, need_b = grad_mask
    return (hidden.new_empty(shape, dtype=_loss_dtype(hidden)),
            hidden.new_empty(hidden.shape) if need_h else hidden.new_empty(0),
            weight.new_empty(weight.shape) if need_w else hidden.new_empty(0),
            weight.new_empty(weight.shape[:1]) if need_b and bias is not None
            else hidden.new_empty(0))


@torch.library.register_fake("fastllm::fused_linear_cross_entropy_backward")
def _backward_fake(grad_loss, hidden, weight, labels, bias, ignore_index, reduction,
                   label_smoothing, z_loss, logit_softcap, grad_mask):
    need_h, need_w, need_b = grad_mask
    return (hidden.new_empty(hidden.shape) if need_h else hidden.new_empty(0),
            weight.new_empty(weight.shape) if need_w else hidden.new_empty(0),
            weight.new_empty(weight.shape[:1]) if need_b and bias is not None
            else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, ignore_index, reduction, eps, z_loss, cap, grad_mask = inputs
    _, gh, gw, gb = output
    ctx.mark_non_differentiable(gh, gw, gb)
    ctx.precomputed = list(grad_mask)
    ctx.args = (ignore_index, reduction, eps, z_loss, cap)
    ctx.has_bias = bias is not None
    ctx.handed_out = False  # a backward returned the saved grads themselves (_fused_backward)
    ctx.save_for_backward(hidden, weight, labels, bias, gh, gw, gb)


def _scaled(grad, grad_loss, in_place=False):
    # grad_loss: 0-d, or per token (grad_hidden under "none"); grad's dtype, fp32 (fp64) math.
    # in_place: grad itself scaled and handed out as .data (a version counter of its own)
    g = grad_loss.to(torch.promote_types(grad.dtype, torch.float32))
    if g.dim():
        g = g.unsqueeze(-1)
    return grad.data.mul_(g) if in_place else (grad * g).to(grad.dtype)


@first_order_only("fastllm.fused_linear_cross_entropy")
def _fused_backward(ctx, grad_loss, *_):
    hidden, weight, labels, bias, gh, gw, gb = ctx.saved_tensors
    wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
              ctx.has_bias and ctx.needs_input_grad[3]]
    grads = [None, None, None]
    # The forward's grads are scaled by grad_loss in place and handed out, as Liger-Kernel's: a
    # scaled copy was a second (V, H) grad_weight, 1-3% of a loss call's time at vocab 49152 on
    # the CPU (BENCHMARKS.md, 2026-12-07, third session). The caller then owns their
    # storage (.grad, or autograd.grad's results) and may change it: they go out as .data (a
    # version counter of their own, so that the saved tensors still unpack), and a second
    # backward through this graph (retain_graph=True) recomputes instead of reading them. Under
    # torch.compile's tracing (ctx's flag is Python state there): scaled copies.
    precomputed = [p and not ctx.handed_out for p in ctx.precomputed]
    in_place = not torch.compiler.is_compiling() and type(grad_loss) is torch.Tensor
    missing = [w and not p for w, p in zip(wanted, precomputed)]
    if any(missing):  # not computed in the forward ("none", or grads it was not asked for)
        recomputed = _fused_backward_op(
            grad_loss, hidden, weight, labels, bias, *ctx.args, missing)
        for i, m in enumerate(missing):
            if m:
                grads[i] = recomputed[i]
    for i, saved in enumerate((gh, gw, gb)):
        if wanted[i] and precomputed[i]:
            grads[i] = _scaled(saved, grad_loss, in_place)
            ctx.handed_out = ctx.handed_out or in_place
    return grads[0], grads[1], None, grads[2], None, None, None, None, None, None


_fused_op = register_autograd("fastllm::fused_linear_cross_entropy", _fused_backward,
                              setup_context=_setup_context, impl=_fused_impl,
                              materialize_grads=False)


def fused_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100,
                               reduction="mean", label_smoothing=0.0, z_loss=0.0,
                               logit_softcap=None):
    """Cross-entropy of `hidden weight^T + bias` against labels without materialising the logits
    (see the module docstring for shapes, dtypes and the maths). Returns the fp32 loss: 0-d for
    "mean"/"sum", labels' shape for "none". Under autocast the inputs are cast as F.linear's."""
    device_type = hidden.device.type
    if _lowp.autocast_enabled(device_type):  # (fp64 stays fp64, as autocast leaves it)
        hidden, weight, bias = _lowp.autocast_args(device_type, hidden, weight, bias)
        with torch.autocast(device_type, enabled=False):
            return fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index,
                                              reduction, label_smoothing, z_loss, logit_softcap)
    if logit_softcap is not None and not torch.compiler.is_compiling() and not (
            math.isfinite(logit_softcap) and logit_softcap > 0):  # (traced: the op checks it)
        raise ValueError(f"{_WHERE}: logit_softcap must be None or > 0, got {logit_softcap}")
    grad_mask = [torch.is_grad_enabled() and t is not None and t.requires_grad
                 for t in (hidden, weight, bias)]
    if reduction == "none":  # grad_hidden alone in the forward, and only if the head is frozen
        grad_mask = [grad_mask[0] and not any(grad_mask[1:]), False, False]
    if hidden.dtype == torch.float16:
        # fp16 (trained under a loss scale): the logits' grad rounded to fp16 in the forward,
        # before the backward's scale reaches it, is about 1/tokens a token and loses its bits to
        # fp16's subnormals (grad_hidden 2.5x torch's error at 2048 tokens, 8.8x at 8192: every
        # grad below the head); the backward computes the grads with the scale applied first, as
        # the unfused loss's matmuls do (one more pass of the head's product)
        grad_mask = [False, False, False]
    cap = 0.0 if logit_softcap is None else float(logit_softcap)
    loss, _, _, _ = _fused_op(
        hidden, weight, labels, bias, int(ignore_index), reduction, float(label_smoothing),
        float(z_loss), cap, grad_mask)
    return loss
