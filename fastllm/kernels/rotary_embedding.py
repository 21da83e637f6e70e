"""Rotary embedding of q and k in Triton (fastllm/ops/rotary_embedding.py has the maths).

One program per (batch, position) row: cos and sin of that row are loaded once and applied to
every head of q, then of k, BLOCK_HEADS heads at a time. (Programs per row and block of heads,
q's and k's apart, made 3 programs of one warp per row for SmolLM2's 9 + 3 heads, the second
holding one head of q: 0.066 ms fwd+bwd at 8 x 2048 tokens on an H200, 34% of the copy
bandwidth, Liger-Kernel's one program per row 0.034 ms, 2026-12-04.) Inputs and outputs have
any (B, S, H) strides with a unit last stride, and
so do cos and sin (each with its own row strides); the outputs may be the inputs (in place: each
element is loaded before any is stored).
The one-program-per-row layout (2026-12-04) is interpreter-tested only; the layout before it
passed its GPU tests on an H200.
"""

import triton
import triton.language as tl

from fastllm.kernels import next_power_of_2
from fastllm.kernels.rounding import round_nearest


@triton.jit
def _rotate(x_ptr, o_ptr, stride_xh, stride_oh, heads, head0, c1, c2, s1, s2, half,
            BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    hs = head0 + tl.arange(0, BLOCK_HEADS).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (hs < heads)[:, None] & (cols < half)[None, :]
    offs_x = hs[:, None] * stride_xh + cols[None, :]
    offs_o = hs[:, None] * stride_oh + cols[None, :]
    x1 = tl.load(x_ptr + offs_x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs_x + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(o_ptr + offs_o, round_nearest(o1, o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + offs_o + half, round_nearest(o2, o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr,  # *T (B, S, Hq, D), (B, S, Hk, D)
    qo_ptr, ko_ptr,  # *T outputs, same shapes (may be q_ptr, k_ptr)
    cos_ptr, sin_ptr,  # *T rows of D: (P, D) by position, or (B or 1, S, D)
    pos_ptr,  # *int64 (B or 1, S) when GATHER
    S, Hq, Hk, half,  # sizes; half = D / 2
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_qob, stride_qos, stride_qoh, stride_kob, stride_kos, stride_koh,
    stride_cb, stride_cs,  # cos row strides: (batch, position) or (0, table row) when GATHER
    stride_sb, stride_ss,  # sin row strides, likewise (a slice of another tensor than cos's)
    stride_pb, stride_ps,  # position_ids strides
    GATHER: tl.constexpr,  # cos/sin rows picked by position_ids
    BACKWARD: tl.constexpr,  # the transposed rotation (gradients)
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # >= half
):
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    if GATHER:
        p = tl.load(pos_ptr + b * stride_pb + s * stride_ps)
        c_off = p * stride_cs
        s_off = p * stride_ss
    else:
        c_off = b * stride_cb + s * stride_cs
        s_off = b * stride_sb + s * stride_ss
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < half
    c1 = tl.load(cos_ptr + c_off + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + c_off + half + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + s_off + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + s_off + half + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for head0 in range(0, Hq, BLOCK_HEADS):
        _rotate(q_ptr + b * stride_qb + s * stride_qs, qo_ptr + b * stride_qob + s * stride_qos,
                stride_qh, stride_qoh, Hq, head0, c1, c2, s1, s2, half,
                BACKWARD, BLOCK_HEADS, BLOCK_HALF)
    for head0 in range(0, Hk, BLOCK_HEADS):
        _rotate(k_ptr + b * stride_kb + s * stride_ks, ko_ptr + b * stride_kob + s * stride_kos,
                stride_kh, stride_koh, Hk, head0, c1, c2, s1, s2, half,
                BACKWARD, BLOCK_HEADS, BLOCK_HALF)


def rotary_embedding_triton(q, k, cos, sin, position_ids, q_out, k_out, backward):
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    if B * S == 0:
        return
    half = D // 2
    # all of q's heads in one tile up to 16 (a power of two: 9 heads take 16 rows), more in a loop
    block_heads = min(next_power_of_2(max(Hq, Hk, 1)), 16)
    gather = position_ids is not None
    # cos and sin keep their own strides: the op accepts any row strides for each (a view of
    # one tensor's storage with the other's strides would read the wrong rows, or out of bounds).
    if gather:
        stride_cb, stride_cs = 0, cos.stride(0)
        stride_sb, stride_ss = 0, sin.stride(0)
        stride_pb = 0 if position_ids.shape[0] == 1 else position_ids.stride(0)
        stride_ps = position_ids.stride(1)
        pos = position_ids
    else:
        stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
        stride_sb = 0 if sin.shape[0] == 1 else sin.stride(0)
        stride_cs, stride_ss = cos.stride(1), sin.stride(1)
        stride_pb = stride_ps = 0
        pos = cos  # unused
    block_half = next_power_of_2(max(half, 1))
    # Enough threads for 16 bytes per thread per load (128-bit accesses: .ci/kernel_check.py);
    # with more, a head of 64 in bf16 (8 heads x 32 columns a tile) was split into 8-byte loads.
    tile_bytes = block_heads * block_half * q.element_size()
    num_warps = max(1, min(4, tile_bytes // (16 * 32)))
    _rotary_kernel[(B * S,)](
        q, k, q_out, k_out, cos, sin, pos, S, Hq, Hk, half,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        stride_cb, stride_cs, stride_sb, stride_ss, stride_pb, stride_ps,
        GATHER=gather, BACKWARD=backward, BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half, num_warps=num_warps)
