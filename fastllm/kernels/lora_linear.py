"""LoRA linear in Triton: PyTorch (cuBLAS) does the frozen base matmul, Triton the low-rank part.

Maths (x: (M, K) rows of the input, W: (N, K), A: (R, K), B: (N, R), s = scaling, d = dropout):
    forward   xa = d(x) A^T               _lora_down_kernel, (M, R), mask regenerated on the fly
              y = bias + s xa B^T         _lora_up_kernel: writes y (reads nothing of its size)
              y += x W^T                  y.addmm_: cuBLAS adds y in its epilogue (beta = 1)
    backward  dyb = dY B                  _lora_down_kernel, in the adapters' dtype
              dX = s d(dyb A)             _lora_up_kernel, with the forward's mask
              dX += dY W                  dX.addmm_ (beta = 1)
              dA = s dyb^T d(x)           _lora_pq_kernel       dB = s dY^T xa     _lora_pq_kernel
The low-rank term seeds the output the base GEMM accumulates into: the GEMM's epilogue reads it
while the GEMM is busy computing, where adding it after the GEMM (the first version of this file)
took a separate pass that read and rewrote the whole output: the memory-bound passes over full-size
(M x N or M x K) tensors outside the GEMMs go from 8 to 6 per forward and backward.
Why the split: the first GPU run (H200, bf16, x 8192x4096, W 4096x4096, r=16) measured a Triton
kernel that did x W^T itself at 5.6 ms against cuBLAS's 0.8 ms. The base GEMM is >98% of the
FLOPs and cuBLAS is the best there is at it; the low-rank work is memory-bound, and fusing it
(no dropout(x) in memory, no full-size temporaries, one write of y) is what a kernel
can win. The down and pq kernels reduce over a long axis split across programs into fp32 partial
sums added in a fixed order (deterministic, and a short M still fills the GPU). Dropout is a hash
of (seed, row, column) (fastllm/ops/lora_linear.py `lora_dropout_mask_ref` is the same function).

Precision: every tl.dot accumulates in fp32 and runs on tensor cores (`make kernel-check`
requires it of every kernel and dtype): bf16/fp16 operands directly, fp32 ones (fp32 models,
fp32 adapters) as three bf16 terms each, which keeps fp32's accuracy (`_dot`). Values
are rounded to the I/O dtype where PyTorch rounds them (d(x), xa, the outputs; the seed the GEMM
adds to is the low-rank term rounded, where PEFT rounds the base product: the smaller of the two
terms carries the extra rounding), to nearest even
with rounding.py, which is exact on the GPU and in the interpreter alike. The one
operation the interpreter gets wrong is a bf16 tl.dot (triton-lang/triton issue 11584): `_mma`
upcasts its operands there, and only there; the GPU runs this same code with INTERPRETED=False.
"""

import math

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting
from fastllm.kernels import cdiv, next_power_of_2
from fastllm.kernels.rounding import round_nearest


@triton.jit
def _split(a):
    """fp32 a as three bf16 terms, a = hi + mid + lo exactly: each conversion truncates (rtz)
    to the next 8 bits of a's 24-bit significand and the differences are exact in fp32. Truncated,
    never rounded: a finite a near fp32's maximum cannot become an infinite hi, and the GPU splits
    as the interpreter does (its casts truncate). A non-finite a gives NaN terms (inf - inf): the
    products are NaN where fp32 ones would be inf or NaN, which a skipped step treats alike."""
    hi = a.to(tl.bfloat16, fp_downcast_rounding="rtz")
    rest = a - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16, fp_downcast_rounding="rtz")
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtz")
    return hi, mid, lo


@triton.jit
def _mma(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b on tensor cores, a and b of one dtype, bf16 or fp16; fp32 accumulation."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            # The interpreter's bf16 tl.dot multiplies bit patterns; exact fp32 products agree
            # with a GPU's bf16 tensor-core products (bf16 x bf16 is exact in fp32).
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    if a.dtype == tl.float32:  # (only in the interpreter)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b in fp32, every product on tensor cores (no fp32 FMA dot). a and b: one
    low-precision dtype (one product), or b fp32 and a bf16 or fp32: each fp32 operand is split
    into three bf16 terms (_split) multiplied term by term. Against bf16 that is 3 products, each
    exact in fp32 (as an fp32 FMA's); fp32 by fp32 takes 8 of the 9 term products (the one left
    out, lo x lo, is below 2^-28 of |a| |b|: under fp32's rounding). The smaller products are summed
    in a tile of their own and added to acc once (one fp32 rounding of the running sum per call,
    as a single product's, not one per term product). The products are small (one side is the
    LoRA rank), so the extra tensor-core work hides under the memory traffic these kernels are
    bound by."""
    if b.dtype == tl.float32:
        bh, bm, bl = _split(b)
        small = tl.zeros(acc.shape, dtype=tl.float32)
        if a.dtype == tl.float32:
            ah, am, al = _split(a)
            small = _mma(am, bl, small, INTERPRETED)
            small = _mma(al, bm, small, INTERPRETED)
            small = _mma(al, bh, small, INTERPRETED)
            small = _mma(ah, bl, small, INTERPRETED)
            small = _mma(am, bm, small, INTERPRETED)
            small = _mma(am, bh, small, INTERPRETED)
            small = _mma(ah, bm, small, INTERPRETED)
            acc = _mma(ah, bh, acc, INTERPRETED) + small
        else:  # a bf16 (the kernels widen fp16 against fp32: _fp32_operand)
            small = _mma(a, bl, small, INTERPRETED)
            small = _mma(a, bm, small, INTERPRETED)
            acc = _mma(a, bh, acc, INTERPRETED) + small
    else:  # one low-precision dtype (an fp32 a with a bf16 b does not occur: it fails to compile)
        acc = _mma(a, b, acc, INTERPRETED)
    return acc


@triton.jit
def _fp32_operand(p, q_ptr):
    """P as _dot takes it against fp32 adapters' Q: bf16 as is, fp16 widened (exact; no mixed
    fp16 x bf16 product), fp32 as is; against adapters of P's dtype, as is."""
    if q_ptr.dtype.element_ty == tl.float32:
        if p.dtype == tl.float16:
            p = p.to(tl.float32)
    return p


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
def _dropout_operand(p, keep, dropout_scale, POST_SCALE: tl.constexpr):
    """d(P) as the down and pq kernels multiply it: masked and scaled, rounded to P's dtype as
    PyTorch's dropout; or (POST_SCALE) masked only, 1 / (1 - p) applied to the kernel's sum."""
    if POST_SCALE:
        p = tl.where(keep, p, tl.zeros_like(p))
    else:
        p = _dropout(p, keep, dropout_scale)
    return p


@triton.jit
def _keep_mask(seed_key, rows, cols, threshold):
    """Dropout keep mask for the (rows[:, None], cols[None, :]) elements; rows, cols int64."""
    row_key = _fmix32(rows.to(tl.uint32) ^ seed_key.to(tl.uint32))
    h = _fmix32(row_key[:, None] ^ cols.to(tl.uint32)[None, :])
    return (h >> 8) >= threshold


@triton.jit
def _dropout(v, keep, dropout_scale):
    """v * keep / (1 - p), rounded to v's dtype as PyTorch rounds dropout(x)."""
    return round_nearest(tl.where(keep, v.to(tl.float32) * dropout_scale, 0.0), v.dtype)


# The dropout threshold varies from layer to layer: not specialising on it saves recompilations.
# The seed is read on the device from seed_ptr (an int64 scalar tensor), so a seed drawn on the GPU
# for each call (fastllm.ops.lora_linear.new_dropout_seed) gives every CUDA-graph replay a new
# mask and costs no host sync. Sizes
# stay specialised (Triton specialises an int only on == 1 and divisibility by 16, so a model
# compiles each kernel a few times at most): without the divisibility hints the masked tile
# loads cannot be proven 16-byte aligned and were compiled to 2-byte accesses on sm_90.
@triton.jit(do_not_specialize=["threshold"])
def _lora_down_kernel(
    p_ptr,  # *T (M, K) at m * stride_pm + k: x (forward) or dY (backward)
    q_ptr,  # (R, K) at r * stride_qr + k * stride_qk: A (forward) or B^T (backward), in the
    # adapters' dtype (T, or fp32 for fp32 adapters: see _fp32_operand)
    out_ptr,  # (SPLITS, M, R) at s * stride_os + m * stride_om + r * stride_or; stored in its dtype
    M, K, R,  # problem sizes
    k_per_split,  # columns of K each split reduces, a multiple of BLOCK_K
    seed_ptr,  # *int64, the dropout seed (its low 31 bits are the mask's key)
    threshold,  # int32, keep iff (hash >> 8) >= threshold
    dropout_scale,  # fp32, 1 / (1 - p)
    stride_pm, stride_qr, stride_qk, stride_os, stride_om, stride_or,
    HAS_DROPOUT: tl.constexpr,  # out = d(P) Q^T, else P Q^T
    POST_SCALE: tl.constexpr,  # dropout as a mask on P and 1 / (1 - p) on the sum (_post_scale)
    INTERPRETED: tl.constexpr,  # running under TRITON_INTERPRET=1 (see _dot)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # reduction block
    BLOCK_R: tl.constexpr,  # >= R, a power of two >= 16
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)
    mask_m = offs_m < M
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if HAS_DROPOUT:
        seed_key = tl.load(seed_ptr) & 0x7FFFFFFF  # once, not per iteration
    k_begin = pid_s * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_begin + k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        mask_k = offs_k < K
        p = tl.load(p_ptr + offs_m[:, None] * stride_pm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        p = _fp32_operand(p, q_ptr)
        if HAS_DROPOUT:
            p = _dropout_operand(p, _keep_mask(seed_key, offs_m, offs_k, threshold),
                                 dropout_scale, POST_SCALE)
        q = tl.load(q_ptr + offs_k[:, None] * stride_qk + offs_r[None, :] * stride_qr,
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = _dot(p, q, acc, INTERPRETED)
    if HAS_DROPOUT:
        if POST_SCALE:
            acc = acc * dropout_scale
    out_offs = pid_s * stride_os + offs_m[:, None] * stride_om + offs_r[None, :] * stride_or
    tl.store(out_ptr + out_offs, round_nearest(acc, out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit(do_not_specialize=["threshold"])
def _lora_up_kernel(
    c_ptr,  # *T (M, N) at m * stride_cm + n, written: y (forward) or dX (backward)
    l_ptr,  # (M, R) at m * stride_lm + r * stride_lr: xa or dY B, in the adapters' dtype
    u_ptr,  # (N, R) at n * stride_un + r * stride_ur: B (forward) or A^T (backward), adapter dtype
    bias_ptr,  # *T (N,): added when HAS_BIAS
    M, N, R,  # problem sizes
    scaling,  # fp32, the LoRA scale s
    seed_ptr,  # *int64, the dropout seed (its low 31 bits are the mask's key)
    threshold,  # int32, keep iff (hash >> 8) >= threshold
    dropout_scale,  # fp32, 1 / (1 - p)
    stride_cm, stride_lm, stride_lr, stride_un, stride_ur,
    HAS_DROPOUT: tl.constexpr,  # C = s d(L U^T) (+ bias), else C = s L U^T (+ bias)
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= R: the whole rank in one tl.dot
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_r = offs_r < R
    lo = tl.load(l_ptr + offs_m[:, None] * stride_lm + offs_r[None, :] * stride_lr,
                 mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    up = tl.load(u_ptr + offs_r[:, None] * stride_ur + offs_n[None, :] * stride_un,
                 mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    # lo and up are both in the adapters' dtype (dY B is stored in it)
    low_rank = _dot(lo, up, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRETED)
    if HAS_DROPOUT:
        keep = _keep_mask(tl.load(seed_ptr) & 0x7FFFFFFF, offs_m, offs_n, threshold)
        low_rank = tl.where(keep, low_rank * dropout_scale, 0.0)
    c = scaling * low_rank
    if HAS_BIAS:
        c += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
             round_nearest(c, c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["threshold"])
def _lora_pq_kernel(
    p_ptr,  # *T (M, P) at m * stride_pm + p: dY for dB, x for dA (dropout applied on the fly)
    q_ptr,  # (M, R) at m * stride_qm + r * stride_qr: xa for dB, dY B (rounded to T; fp32 for
    # fp32 adapters) for dA
    c_ptr,  # *fp32 (SPLITS, P, R) at s * stride_cs + p * stride_cp + r: partial sums of s P^T Q
    M, P, R,  # problem sizes
    rows_per_split,  # rows of M each program reduces, a multiple of BLOCK_M
    scaling,  # fp32, the LoRA scale s
    seed_ptr,  # *int64, the dropout seed (its low 31 bits are the mask's key)
    threshold,  # int32, keep iff (hash >> 8) >= threshold
    dropout_scale,  # fp32, 1 / (1 - p)
    stride_pm, stride_qm, stride_qr, stride_cs, stride_cp,
    HAS_DROPOUT: tl.constexpr,
    POST_SCALE: tl.constexpr,  # as in _lora_down_kernel
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,  # reduction block over rows
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_p = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)
    mask_p = offs_p < P
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    if HAS_DROPOUT:
        seed_key = tl.load(seed_ptr) & 0x7FFFFFFF  # once, not per iteration
    m_begin = pid_s * rows_per_split
    for m0 in range(0, rows_per_split, BLOCK_M):
        offs_m = m_begin + m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask_m = offs_m < M
        p = tl.load(p_ptr + offs_m[:, None] * stride_pm + offs_p[None, :],
                    mask=mask_m[:, None] & mask_p[None, :], other=0.0)
        p = _fp32_operand(p, q_ptr)
        if HAS_DROPOUT:
            p = _dropout_operand(p, _keep_mask(seed_key, offs_m, offs_p, threshold),
                                 dropout_scale, POST_SCALE)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_r[None, :] * stride_qr,
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        acc = _dot(tl.trans(p), q, acc, INTERPRETED)
    if HAS_DROPOUT:
        if POST_SCALE:
            acc = acc * dropout_scale
    tl.store(c_ptr + pid_s * stride_cs + offs_p[:, None] * stride_cp + offs_r[None, :],
             scaling * acc, mask=mask_p[:, None] & mask_r[None, :])


# Launch configurations. Every one must fit the smallest shared memory of the GPUs Triton is sent
# to (sm_86/sm_89: 99 KB per block); tests/lora_compile_check.py compiles each for sm_80, sm_86,
# sm_89 and sm_90 and reports the shared memory it takes.
def _config(dtype, block_r):
    """{"down": ..., "up": ..., "pq": ...}: block sizes and launch options for one dtype and
    BLOCK_R. The interpreter runs the same blocks (few, large programs suit it too)."""
    wide = dtype == torch.float32 or block_r >= 128  # fp32 tiles take twice the bytes
    return {
        # (BLOCK_M x BLOCK_K) of P and (BLOCK_K x BLOCK_R) of Q per stage
        "down": dict(BLOCK_M=64, BLOCK_K=32 if wide else 64, num_warps=4,
                     num_stages=2 if wide else 3),
        # one (BLOCK_M x BLOCK_N) tile of C, one rank-wide tile each of L and U, no loop
        # (fp32 operands at rank 128: the three bf16 terms of each rank-wide tile spilled
        # registers in 64 x 64 tiles of 4 or 8 warps; 128 x 64 in 8 warps takes 171-193, no spill)
        "up": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1)
        if dtype == torch.float32 and block_r >= 128 else
        dict(BLOCK_M=64, BLOCK_N=64 if wide else 128, num_warps=4, num_stages=1),
        "pq": dict(BLOCK_M=32 if wide else 64, BLOCK_P=64 if wide else 128, num_warps=4,
                   num_stages=2 if wide else 3),
    }


# About this many programs fill a large GPU (an H200 has 132 SMs); splitting a reduction further
# only adds partial sums. Tests lower it to 1 to run the unsplit path at small sizes.
_TARGET_PROGRAMS = 256


def _launch(kernel, grid, args, meta):
    """Every launch of this file goes through here (tests/lora_compile_check.py records them)."""
    kernel[grid](*args, **meta)


def _dropout_args(dropout_p, seed, device):
    """(seed tensor on `device`, threshold, 1 / (1 - p)). seed: an int64 scalar tensor, read by
    the kernels where it is (one on another device is copied), or an int."""
    threshold = int(round(dropout_p * (1 << 24)))
    if not torch.is_tensor(seed):
        seed = torch.tensor(int(seed), dtype=torch.int64, device=device)
    elif seed.device != torch.device(device):
        seed = seed.to(device)
    return seed.reshape(()), threshold, 1.0 / (1.0 - dropout_p)


def _post_scale(p2, q):
    """Whether dropout(P) is a mask on P with its 1 / (1 - p) applied to the fp32 sum: a bf16 P
    against fp32 adapters, where PyTorch's dropout runs on P widened to fp32 (no rounding to bf16)
    and the masked bf16 P stays a bf16 operand of _dot."""
    return p2.dtype == torch.bfloat16 and q.dtype == torch.float32


def _block_r(r):
    return max(16, next_power_of_2(r))


def _down(p2, q, q_strides, m, k, r, dropout, has_dropout, out, cfg):
    """out (m, r, any strides) = d(p2) q^T, q: (r, k) at q_strides, stored in out's dtype."""
    meta = dict(cfg["down"])
    m_blocks = cdiv(m, meta["BLOCK_M"])
    k_blocks = cdiv(k, meta["BLOCK_K"])
    splits = max(1, min(k_blocks, _TARGET_PROGRAMS // m_blocks))
    k_per_split = cdiv(k_blocks, splits) * meta["BLOCK_K"]
    splits = cdiv(k, k_per_split)
    if splits == 1:
        target, strides = out, (0, *out.stride())
    else:
        target = torch.empty((splits, m, r), dtype=torch.float32, device=p2.device)
        strides = target.stride()
    seed, threshold, dropout_scale = dropout
    _launch(_lora_down_kernel, (m_blocks, splits), (
        p2, q, target, m, k, r, k_per_split, seed, threshold, dropout_scale,
        p2.stride(0), q_strides[0], q_strides[1], *strides,
    ), dict(HAS_DROPOUT=has_dropout, POST_SCALE=_post_scale(p2, q),
            INTERPRETED=triton_interpreting(), BLOCK_R=_block_r(r), **meta))
    if splits > 1:
        out.copy_(target.sum(0))


def _up(c2, lo, lo_strides, u, u_strides, bias, m, n, r, scaling, dropout, has_dropout, cfg):
    """c2 (m, n) = s d(lo u^T) (+ bias); lo (m, r), u (n, r) at the given strides."""
    meta = dict(cfg["up"])
    grid = (cdiv(m, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]))
    seed, threshold, dropout_scale = dropout
    _launch(_lora_up_kernel, grid, (
        c2, lo, u, c2 if bias is None else bias, m, n, r, float(scaling), seed, threshold,
        dropout_scale, c2.stride(0), lo_strides[0], lo_strides[1], u_strides[0], u_strides[1],
    ), dict(HAS_DROPOUT=has_dropout, HAS_BIAS=bias is not None,
            INTERPRETED=triton_interpreting(), BLOCK_R=_block_r(r), **meta))


def _weight_grad(p2, q, m, p_cols, r, scaling, dropout, has_dropout, out_dtype, cfg):
    """s d(P)^T Q, (p_cols, r), in out_dtype: fp32 partial sums over splits of M, summed here in
    a fixed order (deterministic, unlike atomics), so a long M still fills the machine."""
    meta = dict(cfg["pq"])
    p_blocks = cdiv(p_cols, meta["BLOCK_P"])
    m_blocks = cdiv(m, meta["BLOCK_M"])
    splits = max(1, min(m_blocks, _TARGET_PROGRAMS // p_blocks))
    rows_per_split = cdiv(m_blocks, splits) * meta["BLOCK_M"]
    splits = cdiv(m, rows_per_split)
    partial = torch.empty((splits, p_cols, r), dtype=torch.float32, device=p2.device)
    seed, threshold, dropout_scale = dropout
    _launch(_lora_pq_kernel, (p_blocks, splits), (
        p2, q, partial, m, p_cols, r, rows_per_split, float(scaling), seed, threshold,
        dropout_scale, p2.stride(0), q.stride(0), q.stride(1), partial.stride(0),
        partial.stride(1),
    ), dict(HAS_DROPOUT=has_dropout, POST_SCALE=_post_scale(p2, q),
            INTERPRETED=triton_interpreting(), BLOCK_R=_block_r(r), **meta))
    return partial.sum(0).to(out_dtype)


def _check_dtype(x):
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"fastllm.lora_linear: the triton backend supports fp32, bf16, fp16; got {x.dtype}"
        )


def lora_linear_fwd_triton(x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed):
    """(y (..., N), xa_t (R, M)): the contract of fastllm::lora_linear. fp32 adapters on a bf16/fp16
    x: the low-rank products are fp32-accurate (a bf16 x times the adapters' bf16 terms, an fp16
    one widened; dropout's 1 / (1 - p) in fp32) and xa_t, dA, dB are fp32."""
    _check_dtype(x)
    n, k = weight.shape
    r = lora_a.shape[0]
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k).contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    bias = None if bias is None else bias.contiguous()  # the seed kernel reads it at stride 1
    xa_t = torch.empty((r, m), dtype=lora_a.dtype, device=x.device)  # fp32 for fp32 adapters
    if m == 0 or n == 0 or k == 0:
        y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        return y.view(*x.shape[:-1], n), xa_t.zero_()
    # (fp32 adapters: fp32-sized tiles)
    cfg = _config(torch.promote_types(x.dtype, lora_a.dtype), _block_r(r))
    dropout = _dropout_args(dropout_p, seed, x.device)
    has_dropout = dropout_p > 0.0
    # xa is stored r-major, (R, M), the op's layout: the kernel writes its (M, R) view
    _down(x2, lora_a, (lora_a.stride(0), 1), m, k, r, dropout, has_dropout, xa_t.t(), cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _up(y, xa_t, (1, xa_t.stride(0)), lora_b, (lora_b.stride(0), 1), bias, m, n, r, scaling,
        dropout, False, cfg)
    y.addmm_(x2, weight.t())  # the base GEMM adds to the low-rank seed in its epilogue
    return y.view(*x.shape[:-1], n), xa_t


def lora_linear_bwd_triton(grad_out, x, weight, lora_a, lora_b, xa_t, scaling, dropout_p, seed,
                           output_mask):
    """(dx, dA, dB), empty where output_mask is False: fastllm::lora_linear_backward's contract."""
    _check_dtype(x)
    need_x, need_a, need_b = output_mask
    n, k = weight.shape
    r = lora_a.shape[0]
    m = xa_t.shape[1]
    dy = grad_out.reshape(m, n).contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    # not-needed outputs are empty, and distinct: outputs never alias
    dx = x.new_empty(0)
    da = torch.zeros_like(lora_a) if need_a else x.new_empty(0)
    db = torch.zeros_like(lora_b) if need_b else x.new_empty(0)
    if m == 0 or n == 0 or k == 0:
        dx = torch.mm(dy, weight) if need_x else dx
        return (dx.view(x.shape) if need_x else dx), da, db
    # (fp32 adapters: fp32-sized tiles)
    cfg = _config(torch.promote_types(x.dtype, lora_a.dtype), _block_r(r))
    dropout = _dropout_args(dropout_p, seed, x.device)
    has_dropout = dropout_p > 0.0
    if need_x or need_a:
        # dY B in the adapters' dtype: rounded to bf16/fp16 as PyTorch's backward rounds it, so
        # that the dX and dA products run on tensor cores; fp32 for fp32 adapters
        dyb = torch.empty((m, r), dtype=lora_a.dtype, device=x.device)
        _down(dy, lora_b, (1, lora_b.stride(0)), m, n, r, dropout, False, dyb, cfg)
    if need_x:
        dx = torch.empty((m, k), dtype=x.dtype, device=x.device)
        _up(dx, dyb, dyb.stride(), lora_a, (1, lora_a.stride(0)), None, m, k, r, scaling,
            dropout, has_dropout, cfg)
        dx.addmm_(dy, weight)  # the base GEMM adds to the low-rank seed in its epilogue
    if need_a:
        # dA^T = s d(x)^T (dY B): fp32 products when the adapters are fp32, else in x's dtype (as
        # cuBLAS would run PyTorch's own backward)
        x2 = x.reshape(m, k).contiguous()
        da = _weight_grad(x2, dyb, m, k, r, scaling, dropout, has_dropout, lora_a.dtype, cfg)
        da = da.t().contiguous()
    if need_b:
        db = _weight_grad(dy, xa_t.t(), m, n, r, scaling, dropout, False, lora_b.dtype, cfg)
    return (dx.view(x.shape) if need_x else dx), da, db
