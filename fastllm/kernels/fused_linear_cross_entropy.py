"""Fused linear cross-entropy in Triton: torch (cuBLAS) does the chunk GEMMs, Triton the loss.

Maths, per token row z (V logits of one chunk, any float dtype; computed in fp32):
    z      = cap * tanh(z / cap)                              (HAS_CAP: logit_softcap)
    lse    = log sum_j exp(z_j)                               (online max / sum over blocks)
    loss   = lse - (1 - eps) z_y - eps mean_j z_j + z_loss lse^2
    dz_j   = w (p_j (1 + 2 z_loss lse) - eps / V - (1 - eps) [j = y]) (1 - (z_j / cap)^2)
The grad overwrites z in place, so the chunk buffer holds logits, then their grad, and the
(tokens x vocab) matrix never exists; fastllm/ops/fused_linear_cross_entropy.py's `_chunked`
drives the chunks (logits GEMM, this kernel, dX and dW GEMMs), the same algorithm as the C++
kernel. A row whose label is negative is an ignored token kept in place (the driver's sync-free
rows, under CUDA graph capture): its loss and grad are 0. Why only the loss is Triton: the GEMMs
are >85% of the op's FLOP time and cuBLAS is the best there is at them (the lesson of
lora_linear.py); the loss is memory-bound, and doing it in one read and one write of the chunk is
what a kernel can win.

Interpreter-tested (TRITON_INTERPRET=1) at small sizes; ran on an H200 (2026-12-04), its
negative-label rows not yet.
"""

import torch
import triton
import triton.language as tl

from fastllm.kernels import next_power_of_2
from fastllm.kernels.rounding import round_nearest


@triton.jit
def _softcap(z, cap):
    # cap * tanh(z / cap) from exp (tl has no tanh on every backend); saturates to +-cap
    e = tl.exp(2.0 * z / cap)
    return cap * (1.0 - 2.0 / (e + 1.0))


# V stays specialised (one compile per model's vocabulary): Triton then knows a vocabulary that is
# a multiple of 16 (every common one but GPT-2's 50257) keeps the masked block loads 16-byte
# aligned, and compiles them to 128-bit accesses (.ci/kernel_check.py); unspecialised they were
# scalar 2-byte loads and stores.
@triton.jit
def _flce_row_kernel(
    z_ptr,  # *T (rows, V) at row * stride_zm + v: logits in, their grad out (NEED_GRAD)
    labels_ptr,  # *int64 (rows,) in [0, V), or negative: an ignored token (loss 0, grad 0)
    weights_ptr,  # *fp32 (rows,): each token's weight w in the reduced loss
    loss_ptr,  # *fp32 (rows,): per-token loss out
    V,  # vocabulary size
    stride_zm,  # row stride of z
    eps,  # fp32 label_smoothing
    z_loss,  # fp32 z-loss coefficient
    cap,  # fp32 logit_softcap (used when HAS_CAP)
    HAS_CAP: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zm
    y = tl.load(labels_ptr + row)
    # a negative label: a token the sync-free driver keeps in place of dropping it (under CUDA
    # graph capture, where finding the valid tokens would read the GPU): loss 0, grad row 0
    valid = y >= 0
    y = tl.maximum(y, 0)
    w = tl.load(weights_ptr + row)
    m = float("-inf")
    s = 0.0
    sum_z = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            z = _softcap(z, cap)
        sum_z += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # (a block of -inf logits so far, a bias masking vocabulary entries: exp(-inf - -inf)
        # would be nan; shifted by 0 instead, its terms are 0)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_y = tl.load(z_row + y).to(tl.float32)
    if HAS_CAP:
        z_y = _softcap(z_y, cap)
    # the smoothing term only when eps > 0: a -inf logit (a bias masking vocabulary entries)
    # makes sum_z -inf, and 0 * -inf would turn a finite loss into nan
    smooth = tl.where(eps > 0.0, eps * (sum_z / V), 0.0)
    loss = lse - (1.0 - eps) * z_y - smooth + z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if NEED_GRAD:
        coef = w * (1.0 + 2.0 * z_loss * lse)
        offset = w * eps / V
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < V
            z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_CAP:
                z = _softcap(z, cap)
            g = coef * tl.exp(z - lse) - offset
            g = tl.where(offs == y, g - w * (1.0 - eps), g)
            if HAS_CAP:
                t = z / cap
                g = g * (1.0 - t * t)
            g = tl.where(valid, g, 0.0)
            tl.store(z_row + offs, round_nearest(g, z_ptr.dtype.element_ty), mask=mask)


def row_pass_triton(z, labels, weights, label_smoothing, z_loss, cap, need_grad):
    """fastllm/ops/fused_linear_cross_entropy.py's `row_pass_ref` contract: z (c, V) in place,
    returns the per-token losses (c,) fp32."""
    if z.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"fastllm.fused_linear_cross_entropy: the triton backend supports fp32, "
                        f"bf16, fp16; got {z.dtype}")
    rows, vocab = z.shape
    loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows == 0:
        return loss
    if z.stride(1) != 1:
        raise ValueError("fastllm.fused_linear_cross_entropy: the chunk buffer must be row-major")
    block_v = min(next_power_of_2(vocab), 4096 if z.element_size() == 4 else 8192)
    _flce_row_kernel[(rows,)](
        z, labels.contiguous(), weights.float().contiguous(), loss, vocab, z.stride(0),
        float(label_smoothing), float(z_loss), float(cap or 1.0),
        HAS_CAP=bool(cap), NEED_GRAD=bool(need_grad), BLOCK_V=block_v, num_warps=8)
    return loss
