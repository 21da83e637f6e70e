"""LoRA linear in Triton: the frozen base matmul and the rank-r update in the same kernels.

Maths (x: (M, K) rows of the input, W: (N, K), A: (R, K), B: (N, R), s = scaling):
    forward     xd = dropout(x)          xa = xd A^T                  y = x W^T + bias + s xa B^T
    backward    dyb = dY B               dX = dY W + s dropout(dyb A)
                dB = s dY^T xa           dA = s dyb^T xd
The forward kernel computes a (BLOCK_M, BLOCK_N) tile of x W^T and, in the same loop over K,
the (BLOCK_M, R) tile of xd A^T (recomputed by each column block: R is small next to BLOCK_N), then
adds s xa B^T before the one store; the column-0 programs store xa for the backward (r-major,
(R, M), the op's layout). The dX kernel
does the same over N with dY, W and B. dA and dB come from one kernel, C = s P^T Q with P, Q
(M, .), fp32 accumulation over M, M split across programs into fp32 partial sums that are added
in a fixed order (deterministic). Dropout is a hash of (seed, row, column), regenerated wherever
it is needed (fastllm/ops/lora_linear.py `lora_dropout_mask_ref` is the same function), never
stored.

Every tl.dot accumulates in fp32. fp32 operands use IEEE products (no TF32) so fp32 results match
the reference to ~1e-6. Under TRITON_INTERPRET=1 operands are upcast to fp32 first: the
interpreter's bf16 tl.dot is wrong (triton-lang/triton issue 11584).
"""

import math

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting


@triton.jit
def _fmix32(h):
    # MurmurHash3's 32-bit finaliser (github.com/aappleby/smhasher), on uint32 with wraparound.
    h ^= h >> 16
    h = h * 0x85EBCA6B
    h ^= h >> 13
    h = h * 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _keep_mask(seed_key, rows, cols, threshold):
    """Dropout keep mask for the (rows[:, None], cols[None, :]) elements; rows, cols int64."""
    row_key = _fmix32(rows.to(tl.uint32) ^ seed_key.to(tl.uint32))
    h = _fmix32(row_key[:, None] ^ cols.to(tl.uint32)[None, :])
    return (h >> 8) >= threshold


# Sizes and the dropout key vary from call to call and only bound loops and masks: not
# specialising on them (== 1, % 16) saves recompilations. Strides stay specialised (alignment).
_SIZES = ["M", "N", "K", "R", "seed_key", "threshold"]


@triton.jit(do_not_specialize=_SIZES)
def _lora_fwd_kernel(
    x_ptr,  # *T (M, K), the input rows
    w_ptr,  # *T (N, K), frozen weight
    a_ptr,  # *T (R, K), lora_A
    b_ptr,  # *T (N, R), lora_B
    bias_ptr,  # *T (N,), read only when HAS_BIAS
    y_ptr,  # *T (M, N), output
    xa_ptr,  # *T, output xd A^T for the backward: (m, r) at m * stride_xam + r * stride_xar
    M, N, K, R,  # problem sizes
    scaling,  # fp32, the LoRA scale s
    seed_key,  # int32, dropout seed & 0x7fffffff
    threshold,  # int32, keep iff (hash >> 8) >= threshold
    dropout_scale,  # fp32, 1 / (1 - p)
    stride_xm, stride_wn, stride_ar, stride_bn, stride_ym,  # row strides (cols are 1)
    stride_xam, stride_xar,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,  # upcast operands to fp32 before tl.dot (the interpreter needs it)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" for fp32 inputs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= R, a power of two >= 16
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        a = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=mask_r[None, :] & mask_k[:, None], other=0.0)
        if HAS_DROPOUT:
            keep = _keep_mask(seed_key, offs_m, offs_k, threshold)
            xd = tl.where(keep, x.to(tl.float32) * dropout_scale, 0.0)
            if not UPCAST:
                xd = xd.to(x.dtype)
        else:
            xd = x
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            a = a.to(tl.float32)
            xd = xd.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        acc_xa = tl.dot(xd, a, acc_xa, input_precision=PRECISION)
    xa = acc_xa.to(xa_ptr.dtype.element_ty)
    if pid_n == 0:
        tl.store(xa_ptr + offs_m[:, None] * stride_xam + offs_r[None, :] * stride_xar, xa,
                 mask=mask_m[:, None] & mask_r[None, :])
    b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=mask_n[None, :] & mask_r[:, None], other=0.0)
    if UPCAST:
        xa = xa.to(tl.float32)
        b = b.to(tl.float32)
    acc += scaling * tl.dot(xa, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=_SIZES)
def _lora_bwd_dx_kernel(
    dy_ptr,  # *T (M, N), grad of y
    w_ptr,  # *T (N, K), frozen weight
    a_ptr,  # *T (R, K), lora_A
    b_ptr,  # *T (N, R), lora_B
    dx_ptr,  # *T (M, K), output (written only when COMPUTE_DX)
    dyb_ptr,  # *fp32 (M, R), output: dY B, read by the dA kernel (written by column-0 programs)
    M, N, K, R,  # problem sizes
    scaling,  # fp32, the LoRA scale s
    seed_key,  # int32, dropout seed & 0x7fffffff
    threshold,  # int32, keep iff (hash >> 8) >= threshold
    dropout_scale,  # fp32, 1 / (1 - p)
    stride_dym, stride_wn, stride_ar, stride_bn, stride_dxm, stride_dybm,  # row strides
    COMPUTE_DX: tl.constexpr,  # False: only dY B (x needs no grad)
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # reduction block over N
    BLOCK_K: tl.constexpr,  # output columns of dX
    BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_k = offs_k < K
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_dyb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :],
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        if UPCAST:
            dy = dy.to(tl.float32)
            b = b.to(tl.float32)
        if COMPUTE_DX:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            acc = tl.dot(dy, w, acc, input_precision=PRECISION)
        acc_dyb = tl.dot(dy, b, acc_dyb, input_precision=PRECISION)
    if pid_k == 0:
        tl.store(dyb_ptr + offs_m[:, None] * stride_dybm + offs_r[None, :], acc_dyb,
                 mask=mask_m[:, None] & mask_r[None, :])
    if COMPUTE_DX:
        a = tl.load(a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        low_rank = tl.dot(acc_dyb, a.to(tl.float32), input_precision="ieee")
        if HAS_DROPOUT:
            keep = _keep_mask(seed_key, offs_m, offs_k, threshold)
            low_rank = tl.where(keep, low_rank * dropout_scale, 0.0)
        acc += scaling * low_rank
        tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :],
                 acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_k[None, :])


@triton.jit(do_not_specialize=["M", "P", "R", "rows_per_split", "seed_key", "threshold"])
def _lora_bwd_pq_kernel(
    p_ptr,  # *T (M, P): dY for dB, x for dA (dropout applied on the fly when HAS_DROPOUT)
    q_ptr,  # *T or *fp32, (m, r) at m * stride_qm + r * stride_qr: xa for dB, dY B for dA
    c_ptr,  # *fp32 (SPLITS, P, R): partial sums of s P^T Q, one slab per split of M
    M, P, R,  # problem sizes
    rows_per_split,  # rows of M each program reduces (a multiple of BLOCK_M)
    scaling,  # fp32, the LoRA scale s
    seed_key,  # int32, dropout seed & 0x7fffffff
    threshold,  # int32, keep iff (hash >> 8) >= threshold
    dropout_scale,  # fp32, 1 / (1 - p)
    stride_pm, stride_qm, stride_qr, stride_cs, stride_cp,  # c's last dim is contiguous
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # reduction block over rows
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_p = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_r = tl.arange(0, BLOCK_R)
    mask_p = offs_p < P
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    m_begin = pid_s * rows_per_split
    for m0 in range(0, rows_per_split, BLOCK_M):
        offs_m = m_begin + m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        p = tl.load(p_ptr + offs_m[:, None] * stride_pm + offs_p[None, :],
                    mask=mask_m[:, None] & mask_p[None, :], other=0.0)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_r[None, :] * stride_qr,
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        if HAS_DROPOUT:
            keep = _keep_mask(seed_key, offs_m, offs_p, threshold)
            p = tl.where(keep, p.to(tl.float32) * dropout_scale, 0.0)
            if not UPCAST:
                p = p.to(p_ptr.dtype.element_ty)
        if UPCAST:
            p = p.to(tl.float32)
            q = q.to(tl.float32)
        else:
            q = q.to(p.dtype)
        acc = tl.dot(tl.trans(p), q, acc, input_precision=PRECISION)
    tl.store(c_ptr + pid_s * stride_cs + offs_p[:, None] * stride_cp + offs_r[None, :],
             scaling * acc, mask=mask_p[:, None] & mask_r[None, :])


def _weight_grad(p2, q, m, p_cols, r, scaling, dropout, has_dropout, upcast, precision,
                 block_m, block_p, block_r, out_dtype):
    """s P^T Q, (p_cols, r), in out_dtype: fp32 partial sums over splits of M, summed here in a
    fixed order (deterministic, unlike atomics), so a long M still fills the machine."""
    p_blocks = triton.cdiv(p_cols, block_p)
    m_blocks = triton.cdiv(m, block_m)
    # enough programs for a large GPU, few enough that the partial sums stay small
    splits = max(1, min(m_blocks, 512 // p_blocks))
    rows_per_split = triton.cdiv(m_blocks, splits) * block_m
    splits = triton.cdiv(m, rows_per_split)
    partial = torch.empty((splits, p_cols, r), dtype=torch.float32, device=p2.device)
    seed_key, threshold, dropout_scale = dropout
    _lora_bwd_pq_kernel[(p_blocks, splits)](
        p2, q, partial, m, p_cols, r, rows_per_split, float(scaling), seed_key, threshold,
        dropout_scale, p2.stride(0), q.stride(0), q.stride(1), partial.stride(0),
        partial.stride(1),
        HAS_DROPOUT=has_dropout, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_R=block_r,
    )
    return partial.sum(0).to(out_dtype)


def _config(dtype):
    """(forward blocks, dX blocks, weight-grad blocks, UPCAST, PRECISION) for one dtype."""
    interpreting = triton_interpreting()
    # fp32 operands (fp32 inputs, or any inputs upcast for the interpreter) need IEEE products:
    # tl.dot's default for fp32 is TF32, which the interpreter emulates too.
    precision = "ieee" if dtype == torch.float32 or interpreting else None
    if interpreting:
        # Each program instance runs in numpy: few, large blocks are fastest.
        fwd = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64)
        return fwd, fwd, dict(BLOCK_M=32, BLOCK_P=64), True, precision
    # GPU: 128x128 output tiles; 3 stages of x/W/A tiles take ~100 KB of shared memory.
    block_k = 32 if dtype == torch.float32 else 64
    launch = dict(num_warps=8, num_stages=3)
    fwd = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, **launch)
    dx = dict(BLOCK_M=128, BLOCK_N=block_k, BLOCK_K=128, **launch)  # reduction over N here
    return fwd, dx, dict(BLOCK_M=64, BLOCK_P=128), False, precision


def _dropout_args(dropout_p, seed):
    threshold = int(round(dropout_p * (1 << 24)))
    return int(seed) & 0x7FFFFFFF, threshold, 1.0 / (1.0 - dropout_p)


def _store_dtype(dtype):
    # The interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest even): there,
    # bf16 results are stored in fp32 and rounded by torch.
    return torch.float32 if dtype == torch.bfloat16 and triton_interpreting() else dtype


def _block_r(r):
    return max(16, triton.next_power_of_2(r))


def _check_dtype(x):
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"fastllm.lora_linear: the triton backend supports fp32, bf16, fp16; got {x.dtype}"
        )


def lora_linear_fwd_triton(x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed):
    """(y (..., N), xa_t (R, M)): the contract of fastllm::lora_linear."""
    _check_dtype(x)
    n, k = weight.shape
    r = lora_a.shape[0]
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k).contiguous()
    weight, lora_a, lora_b = weight.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    store = _store_dtype(x.dtype)
    y = torch.empty((m, n), dtype=store, device=x.device)
    xa_t = torch.empty((r, m), dtype=store, device=x.device)
    if m == 0:
        return y.to(x.dtype).view(*x.shape[:-1], n), xa_t.to(x.dtype)
    blocks, _, _, upcast, precision = _config(x.dtype)
    seed_key, threshold, dropout_scale = _dropout_args(dropout_p, seed)
    grid = (triton.cdiv(m, blocks["BLOCK_M"]), triton.cdiv(n, blocks["BLOCK_N"]))
    _lora_fwd_kernel[grid](
        x2, weight, lora_a, lora_b, bias.contiguous() if bias is not None else x2, y, xa_t,
        m, n, k, r, float(scaling), seed_key, threshold, dropout_scale,
        x2.stride(0), weight.stride(0), lora_a.stride(0), lora_b.stride(0), y.stride(0),
        xa_t.stride(1), xa_t.stride(0),
        HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0, UPCAST=upcast, PRECISION=precision,
        BLOCK_R=_block_r(r), **blocks,
    )
    return y.to(x.dtype).view(*x.shape[:-1], n), xa_t.to(x.dtype)


def lora_linear_bwd_triton(grad_out, x, weight, lora_a, lora_b, xa_t, scaling, dropout_p, seed,
                           output_mask):
    """(dx, dA, dB), empty where output_mask is False: fastllm::lora_linear_backward's contract."""
    _check_dtype(x)
    need_x, need_a, need_b = output_mask
    n, k = weight.shape
    r = lora_a.shape[0]
    m = xa_t.shape[1]
    dy = grad_out.reshape(m, n).contiguous()
    weight, lora_a, lora_b = weight.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    store = _store_dtype(x.dtype)
    # not-needed outputs are empty, and distinct: outputs never alias
    dx = torch.empty((m, k), dtype=store, device=x.device) if need_x else x.new_empty(0)
    da = torch.zeros_like(lora_a) if need_a else x.new_empty(0)
    db = torch.zeros_like(lora_b) if need_b else x.new_empty(0)
    if m == 0:
        return (dx.to(x.dtype).view(x.shape) if need_x else dx), da, db
    _, blocks, wg_blocks, upcast, precision = _config(x.dtype)
    dropout = _dropout_args(dropout_p, seed)
    seed_key, threshold, dropout_scale = dropout
    block_r = _block_r(r)
    has_dropout = dropout_p > 0.0
    if need_x or need_a:
        dyb = torch.empty((m, r), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, blocks["BLOCK_M"]),
                triton.cdiv(k, blocks["BLOCK_K"]) if need_x else 1)
        _lora_bwd_dx_kernel[grid](
            dy, weight, lora_a, lora_b, dx if need_x else dy, dyb,
            m, n, k, r, float(scaling), seed_key, threshold, dropout_scale,
            dy.stride(0), weight.stride(0), lora_a.stride(0), lora_b.stride(0),
            dx.stride(0) if need_x else 0, dyb.stride(0),
            COMPUTE_DX=need_x, HAS_DROPOUT=has_dropout, UPCAST=upcast, PRECISION=precision,
            BLOCK_R=block_r, **blocks,
        )
    wg = dict(block_m=wg_blocks["BLOCK_M"], block_p=wg_blocks["BLOCK_P"], block_r=block_r,
              upcast=upcast, precision=precision, out_dtype=x.dtype)
    if need_a:
        # dA^T = s xd^T (dY B): dY B is kept in fp32; the product runs in fp32 when x is fp32
        # and in x's dtype otherwise (as cuBLAS would for PyTorch's own backward)
        x2 = x.reshape(m, k).contiguous()
        q = dyb if x.dtype == torch.float32 else dyb.to(x.dtype)
        da = _weight_grad(x2, q, m, k, r, scaling, dropout, has_dropout, **wg).t().contiguous()
    if need_b:
        db = _weight_grad(dy, xa_t.t(), m, n, r, scaling, dropout, False, **wg)
    return (dx.to(x.dtype).view(x.shape) if need_x else dx), da, db
