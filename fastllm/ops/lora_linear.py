"""fastllm::lora_linear: a frozen linear layer plus its LoRA update, forward and backward fused.

    y = x W^T + bias + scaling * dropout(x) A^T B^T

x: (..., in_features); weight W: (out_features, in_features), frozen; lora_a A: (r, in_features);
lora_b B: (out_features, r) (PEFT's orientation); bias: (out_features,) or None. x, W and bias
share one dtype (fp32, bf16, fp16; fp64 on the ref and cpp backends), A and B either that dtype
or fp32 under a bf16/fp16 base (fp32 adapters: PEFT's `autocast_adapter_dtype`, what its users
train). One device. Grads flow to x, A, B, bias (and W, if it requires grad) through
`torch.library.register_autograd`.

fp32 adapters on a bf16/fp16 base: x W^T (+ bias) in the base dtype, the low-rank products in fp32
on x cast to fp32, y = x W^T + scaling * (x A^T) B^T summed in fp32 and rounded once to the base
dtype (PEFT adds its fp32 LoRA output to the rounded base output and rounds the sum: the same);
dropout applied to x in fp32, as PEFT does; dX likewise, dA and dB in fp32. cpp and ref run this
case as matmuls; the Triton backend through its kernels, fp32-accurate products on tensor cores,
where the low-rank term is rounded to the base dtype and cuBLAS's GEMM adds x W^T to it (one
rounding more, of the smaller term; fastllm/kernels/lora_linear.py).

Two ops (schemas in fastllm/_library.py):
    lora_linear(...) -> (y, xa_t)            xa_t = A dropout(x)^T, (r, rows): all the backward
                                             keeps besides x; never a dropout mask
                                             (r-major: oneDNN's skinny products run faster so)
    lora_linear_backward(...) -> (dx, dA, dB)
        dX = dY W + scaling * dropout((dY B) A)      (the forward's mask and 1 / (1 - p))
        dB = scaling * dY^T xa_t^T                   dA = scaling * (dY B)^T xd
with xd = dropout(x) regenerated from `seed` in the backward. The dropout mask is a hash of
(seed, row, column) (`lora_dropout_mask_ref`), identical in every backend, so backends agree
exactly and the mask costs no memory. The multi-projection LoRA (q/k/v or gate/up reading one x:
xa for all projections is one [A_q; A_k; A_v] x^T, and dX sums each projection's dX term) is
fastllm/ops/lora_linear_multi.py.

Backends: cpp (CPU: ATen matmuls, the low-rank term (+ bias) written first and the base GEMM
adding to it, addmm with beta=1, plus the C++ dropout kernel of csrc/cpu/lora_linear.cpp), triton
(GPU; CPU under TRITON_INTERPRET=1; fastllm/kernels/lora_linear.py: Triton writes the fused
low-rank part, cuBLAS's base GEMMs add to it), ref (the same maths as cpp in plain PyTorch). A
Triton launch that raises OutOfResources falls back to ref for that dtype and rank, with one
warning.
`lora_linear_ref` is the autograd-through-PyTorch oracle the tests compare against.
"""

import math
import warnings

import torch
import torch.nn.functional as F

from fastllm import _backend, _extension, _gemm, _lowp
from fastllm._library import direct_op, first_order_only, lib, register_autograd

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}

_MASK32 = 0xFFFFFFFF
# MurmurHash3's fmix32 multipliers (Austin Appleby, github.com/aappleby/smhasher).
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35


def dropout_threshold(p):
    """keep iff (hash >> 8) >= threshold: a 24-bit comparison, so p is exact to 2^-24."""
    return int(round(p * (1 << 24)))


def _mul32(h, c):
    # (h * c) mod 2^32 for int64 tensors holding uint32 values, with no int64 overflow.
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def lora_dropout_mask_ref(seed, rows, cols, p, device=None):
    """The keep mask (rows, cols), bool, of every backend's dropout for `seed` and probability p.

    h = fmix32(fmix32(uint32(row) ^ (seed & 0x7fffffff)) ^ uint32(col))
    keep = (h >> 8) >= round(p * 2^24)
    """
    # a seed tensor stays a tensor (a GPU seed is not read back to the host: no sync, and the
    # reference fallback stays capturable in a CUDA graph)
    key = (seed.to(device=device, dtype=torch.int64).reshape(()) & 0x7FFFFFFF
           if torch.is_tensor(seed) else int(seed) & 0x7FFFFFFF)
    r = torch.arange(rows, dtype=torch.int64, device=device) & _MASK32
    c = torch.arange(cols, dtype=torch.int64, device=device) & _MASK32
    h = _fmix32(_fmix32(r ^ key)[:, None] ^ c[None, :])
    return (h >> 8) >= dropout_threshold(p)


def lora_dropout_ref(x2, p, seed):
    """dropout(x) for x2: (rows, cols): x * keep / (1 - p), computed in x's precision."""
    if p == 0.0:
        return x2
    keep = lora_dropout_mask_ref(seed, x2.shape[0], x2.shape[1], p, device=x2.device)
    zero = torch.zeros((), dtype=x2.dtype, device=x2.device)
    return torch.where(keep, x2 * (1.0 / (1.0 - p)), zero)


def lora_linear_ref(x, weight, lora_a, lora_b, scaling, bias=None, dropout_p=0.0, seed=0):
    """Plain-PyTorch LoRA linear, differentiated by autograd: the oracle for every backend.

    fp32 adapters on a bf16/fp16 base (PEFT's autocast_adapter_dtype): x widened to fp32 before
    the dropout (PEFT casts x to the adapter's dtype first), the low-rank term in fp32, added to
    the base output in fp32 and rounded once to x's dtype, as PEFT does."""
    rows = math.prod(x.shape[:-1])
    xd = lora_dropout_ref(x.reshape(rows, x.shape[-1]).to(lora_a.dtype), dropout_p, seed)
    low = F.linear(F.linear(xd.reshape(x.shape), lora_a), lora_b)  # (not -1: 0 rows)
    return (F.linear(x, weight, bias) + scaling * low).to(x.dtype)


def adapter_dtype_ok(base_dtype, adapter_dtype):
    """Whether adapters of adapter_dtype may sit on a base of base_dtype: the same, or fp32 on
    bf16/fp16."""
    return adapter_dtype == base_dtype or (
        adapter_dtype == torch.float32 and base_dtype in (torch.bfloat16, torch.float16))


def mixed(x, lora_a):
    """Whether this is the fp32-adapter / low-precision-base case."""
    return lora_a.dtype != x.dtype


def check_lora_linear_args(x, weight, lora_a, lora_b, scaling, bias, dropout_p):
    """Raise ValueError/TypeError naming the first bad argument; touches nothing."""
    where = "fastllm.lora_linear"
    tensors = {"x": x, "weight": weight, "lora_a": lora_a, "lora_b": lora_b}
    if bias is not None:
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.layout != torch.strided:
            raise TypeError(f"{where}: {name} is {t.layout}; only dense tensors are supported")
        if name in ("lora_a", "lora_b") and adapter_dtype_ok(x.dtype, t.dtype):
            pass
        elif t.dtype != x.dtype:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}, x has {x.dtype}"
                            + (" (adapters may be fp32 on a bf16/fp16 base)"
                               if name in ("lora_a", "lora_b") else ""))
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device}, x on {x.device}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"{where}: dtype {x.dtype} is not supported (fp32, bf16, fp16, fp64)")
    if lora_a.dtype != lora_b.dtype:
        raise TypeError(f"{where}: lora_a has dtype {lora_a.dtype}, lora_b {lora_b.dtype}")
    if x.dim() < 1 or weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError(
            f"{where}: expected x (..., in), weight (out, in), lora_a (r, in), lora_b (out, r); "
            "got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)}"
        )
    out_features, in_features = weight.shape
    r = lora_a.shape[0]
    if x.shape[-1] != in_features or lora_a.shape[1] != in_features:
        raise ValueError(
            f"{where}: in_features disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"lora_a {tuple(lora_a.shape)}"
        )
    if tuple(lora_b.shape) != (out_features, r):
        raise ValueError(
            f"{where}: lora_b must be (out_features, r) = ({out_features}, {r}), "
            f"got {tuple(lora_b.shape)}"
        )
    if r < 1:
        raise ValueError(f"{where}: rank r = lora_a.shape[0] must be >= 1")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"{where}: bias must be ({out_features},), got {tuple(bias.shape)}")
    if not math.isfinite(scaling):
        raise ValueError(f"{where}: scaling must be finite, got {scaling}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {dropout_p}")


def _dropout_add_ref(out2, t2, p, seed, alpha):
    out2.add_(lora_dropout_ref(t2, p, seed), alpha=alpha)


def _dropout_cpp(x2, p, seed):
    if p == 0.0:
        return x2
    return _extension.extension().lora_dropout_cpu(x2.contiguous(), p, int(seed))


def _dropout_add_cpp(out2, t2, p, seed, alpha):
    _extension.extension().lora_dropout_add_cpu(out2, t2.contiguous(), p, int(seed), alpha)


def lora_dropout(x2, p, seed, add_to=None):
    """dropout(x2) for x2 (rows, cols) with lora_linear's mask for (seed, p), by the C++ kernel on
    a CPU that has it, else the reference; add_to: add it to that tensor in place instead (its
    shape). For ops built around lora_linear whose other terms see the same dropped input."""
    cpp = x2.device.type == "cpu" and _select(x2, x2) == "cpp"
    if add_to is None:
        return (_dropout_cpp if cpp else lora_dropout_ref)(x2, p, seed)
    (_dropout_add_cpp if cpp else _dropout_add_ref)(add_to, x2, p, seed, 1.0)
    return add_to


def _base_linear(x2, weight, bias, widen):
    """x2 W^T + bias in the base dtype, rounded once (the base nn.Linear's output); widen: in fp32
    on CPUs without native bf16/fp16 GEMMs (_lowp.py)."""
    if bias is None:
        run = lambda a, w: _gemm.mm(a, w.t())  # noqa: E731
        args = (x2, weight)
    else:
        run = lambda a, w, b: _gemm.addmm(b, a, w.t())  # noqa: E731
        args = (x2, weight, bias)
    return _lowp.in_fp32(run, *args) if widen and _lowp.widen(x2) else run(*args)


def _base_mm(a, b, widen):
    """a @ b in the base dtype, as _base_linear."""
    return _lowp.in_fp32(_gemm.mm, a, b) if widen and _lowp.widen(a) else _gemm.mm(a, b)


# One forward and one backward for both cases: adapters in x's dtype (every cast below returns
# its input), and fp32 adapters on a bf16/fp16 base (see the module docstring: x, dY widened for
# the low-rank products, dropout on the widened x as PEFT, sums in fp32 rounded once). widen: the
# base products widened here (the fp32-adapter case, which _lowp.in_fp32 cannot wrap whole, as it
# would round dA and dB back); the cpp backend wraps the same-dtype case whole instead.
def _forward_torch(dropout, dropout_add, x, weight, lora_a, lora_b, scaling, bias, dropout_p,
                   seed, widen=False):
    in_features = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), in_features)
    # The r-wide products are taken r-major (A x^T, B^T dY^T): measured ~1.5x faster than x A^T
    # for bf16 on oneDNN (AVX-512 BF16, one thread) and no slower for fp32.
    xa_t = _gemm.mm(lora_a, dropout(x2.to(lora_a.dtype), dropout_p, seed).t())
    if widen:  # fp32 adapters: the base output in its dtype, the low-rank term added in fp32
        y = _base_linear(x2, weight, bias, widen).to(lora_a.dtype)
        _gemm.addmm_(y, xa_t.t(), lora_b.t(), alpha=scaling)
        return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0]), xa_t
    # The low-rank term (+ bias) seeds y and the base GEMM adds to it (beta=1, the sum inside the
    # GEMM's store): one pass over y fewer than adding it afterwards (BENCHMARKS.md, issue 18).
    y = low_rank_seed(xa_t.t(), lora_b.t(), scaling, bias)
    _gemm.addmm_(y, x2, weight.t())
    return y.view(*x.shape[:-1], weight.shape[0]), xa_t


def scaled_mm(a, b, scaling):
    """scaling * (a @ b) as one addmm, scaled in the GEMM and rounded once. beta=0: torch.addmm
    ignores its input (nan and inf in it are not propagated), so a row of b stands for it: no
    zeros tensor (on a GPU, an allocation and a fill launch) and no separate scaling pass. A b
    with no rows (an empty batch) has no row to lend: a mm and a scaling pass."""
    if b.shape[0] == 0:
        return _gemm.mm(a, b).mul_(scaling)
    return _gemm.addmm(b[0], a, b, beta=0, alpha=scaling)


def low_rank_seed(lo, up, scaling, bias=None):
    """scaling * lo @ up (+ bias), one addmm: the output a base GEMM then adds to (beta=1)."""
    if bias is None:
        return scaled_mm(lo, up, scaling)
    return _gemm.addmm(bias, lo, up, alpha=scaling)


def _backward_torch(dropout, dropout_add, grad_out, x, weight, lora_a, lora_b, xa_t, scaling,
                    dropout_p, seed, output_mask, widen=False):
    need_x, need_a, need_b = output_mask
    out_features, in_features = weight.shape
    rows = math.prod(x.shape[:-1])
    dy = grad_out.reshape(rows, out_features)
    dy_a = dy.to(lora_a.dtype)
    dx, da, db = x.new_empty(0), x.new_empty(0), x.new_empty(0)  # distinct: outputs never alias
    dyb_t = _gemm.mm(lora_b.t(), dy_a.t()) if (need_x or need_a) else None  # (dY B)^T, (r, rows)
    if need_x and widen:  # fp32 adapters: dY W in the base dtype, the low-rank term in fp32
        dx = _base_mm(dy, weight, widen).to(lora_a.dtype)
        if dropout_p == 0.0:
            _gemm.addmm_(dx, dyb_t.t(), lora_a, alpha=scaling)
        else:  # the low-rank term passed through dropout: its gradient carries the same mask
            dropout_add(dx, _gemm.mm(dyb_t.t(), lora_a), dropout_p, seed, scaling)
        dx = dx.to(x.dtype).view(x.shape)
    elif need_x:  # the low-rank term seeds dX and dY W is added to it by the GEMM, as y above
        dx = low_rank_seed(dyb_t.t(), lora_a, scaling)
        if dropout_p > 0.0:  # it passed through dropout: its gradient carries the same mask
            dx = dropout(dx, dropout_p, seed)
        _gemm.addmm_(dx, dy, weight)
        dx = dx.view(x.shape)
    if need_a:
        xd = dropout(x.reshape(rows, in_features).to(lora_a.dtype), dropout_p, seed)
        da = _gemm.addmm(lora_a, dyb_t, xd, beta=0, alpha=scaling)  # one rounding, not two
    if need_b:
        db = _gemm.addmm(lora_b.t(), xa_t, dy_a, beta=0, alpha=scaling).t().contiguous()
    return dx, da, db


_FORWARD_MIXED = {
    "ref": lambda *a: _forward_torch(lora_dropout_ref, _dropout_add_ref, *a, widen=True),
    "cpp": lambda *a: _forward_torch(_dropout_cpp, _dropout_add_cpp, *a, widen=True),
    "triton": lambda *a: _triton_forward(*a),
}
_BACKWARD_MIXED = {
    "ref": lambda *a: _backward_torch(lora_dropout_ref, _dropout_add_ref, *a, widen=True),
    "cpp": lambda *a: _backward_torch(_dropout_cpp, _dropout_add_cpp, *a, widen=True),
    "triton": lambda *a: _triton_backward(*a),
}
# the Triton backend takes the mixed case itself (its kernels multiply bf16 x by the fp32
# adapters' bf16 terms, an fp16 x widened)


def _triton_forward(*args):
    from fastllm.kernels.lora_linear import lora_linear_fwd_triton

    return lora_linear_fwd_triton(*args)


def _triton_backward(*args):
    from fastllm.kernels.lora_linear import lora_linear_bwd_triton

    return lora_linear_bwd_triton(*args)


def _cpp_forward(*args):  # (x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed)
    run = lambda *a: _forward_torch(_dropout_cpp, _dropout_add_cpp, *a)  # noqa: E731
    # bf16/fp16 on a CPU without native low-precision GEMMs: every product in fp32 (_lowp.py)
    return _lowp.in_fp32(run, *args) if _lowp.widen(args[0]) else run(*args)


def _cpp_backward(*args):  # (grad_out, x, weight, lora_a, lora_b, xa_t, scaling, ...)
    run = lambda *a: _backward_torch(_dropout_cpp, _dropout_add_cpp, *a)  # noqa: E731
    return _lowp.in_fp32(run, *args) if _lowp.widen(args[1]) else run(*args)


_FORWARD = {
    "ref": lambda *a: _forward_torch(lora_dropout_ref, _dropout_add_ref, *a),
    "cpp": _cpp_forward,
    "triton": _triton_forward,
}
_BACKWARD = {
    "ref": lambda *a: _backward_torch(lora_dropout_ref, _dropout_add_ref, *a),
    "cpp": _cpp_backward,
    "triton": _triton_backward,
}


# The Triton kernels keep an r-wide tile per block in shared memory: up to this rank they fit
# on every supported GPU (tests/lora_compile_check.py compiles every rank and dtype sent to them
# for sm_80, sm_86, sm_89 and sm_90); past it, and for fp64, which they do not support, the GPU
# path is the reference (cuBLAS matmuls).
_TRITON_MAX_RANK = 128

# (device, dtype, rank block) whose Triton launch raised OutOfResources (a GPU with less shared
# memory than the compile check assumed): the reference runs those from then on.
_TRITON_OUT_OF_RESOURCES = set()


def _triton_key(x, lora_a):
    from fastllm.kernels.lora_linear import _block_r  # the launch configs depend on these only

    return (str(x.device), x.dtype, lora_a.dtype, _block_r(lora_a.shape[0]))


def _select(x, lora_a):
    # An extension built before lora_dropout_add_cpu runs the reference: same maths, PyTorch
    # dropout. The GPU kernels take fp32/bf16/fp16 and rank <= _TRITON_MAX_RANK (the interpreter
    # runs any).
    on_gpu = x.device.type == "cuda"
    backend = _backend.select_kernel(
        "lora_linear", x.device.type, x.dtype, _PREFERENCE, _FORWARD,
        cpp_entry="lora_dropout_add_cpu",
        kernel_dtypes={"triton": _backend.KERNEL_DTYPES} if on_gpu else None)
    if backend != "triton":
        return backend
    forced = _backend.forced_backend() == "triton"
    if on_gpu and lora_a.shape[0] > _TRITON_MAX_RANK:
        if forced:
            raise RuntimeError(f"fastllm.lora_linear: backend 'triton' was forced but its GPU "
                               f"kernels support rank <= {_TRITON_MAX_RANK}, not "
                               f"{lora_a.shape[0]}")
        return "ref"
    if not forced and _triton_key(x, lora_a) in _TRITON_OUT_OF_RESOURCES:
        return "ref"
    return backend


def _run(table, x, lora_a, *args):
    backend = _select(x, lora_a)
    if backend != "triton":
        return table[backend](*args)
    from triton.runtime.errors import OutOfResources

    try:
        return table["triton"](*args)
    except OutOfResources as exc:  # raised at launch, before the kernel wrote anything
        if _backend.forced_backend() == "triton":
            raise
        _TRITON_OUT_OF_RESOURCES.add(_triton_key(x, lora_a))
        warnings.warn(
            f"fastllm.lora_linear: the Triton kernels do not fit this GPU for {x.dtype}, rank "
            f"{lora_a.shape[0]} ({exc}); using the PyTorch reference for these from now on",
            RuntimeWarning, stacklevel=3)
        return table["ref"](*args)


def _lora_linear_impl(x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed):
    check_lora_linear_args(x, weight, lora_a, lora_b, scaling, bias, dropout_p)
    table = _FORWARD_MIXED if mixed(x, lora_a) else _FORWARD
    with _backend.device_guard(x.device):
        return _run(table, x, lora_a, x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed)


def _lora_linear_backward_impl(grad_out, x, weight, lora_a, lora_b, xa, scaling, dropout_p, seed,
                               output_mask):
    table = _BACKWARD_MIXED if mixed(x, lora_a) else _BACKWARD
    with _backend.device_guard(x.device):
        return _run(table, x, lora_a, grad_out, x, weight, lora_a, lora_b, xa, scaling,
                    dropout_p, seed, list(output_mask))


lib.impl("lora_linear", _lora_linear_impl, "CPU")
lib.impl("lora_linear", _lora_linear_impl, "CUDA")
lib.impl("lora_linear_backward", _lora_linear_backward_impl, "CPU")
lib.impl("lora_linear_backward", _lora_linear_backward_impl, "CUDA")
_lora_backward = direct_op("lora_linear_backward", _lora_linear_backward_impl)


@torch.library.register_fake("fastllm::lora_linear")
def _lora_linear_fake(x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed):
    check_lora_linear_args(x, weight, lora_a, lora_b, scaling, bias, dropout_p)
    rows = math.prod(x.shape[:-1])
    return (x.new_empty((*x.shape[:-1], weight.shape[0])),
            lora_a.new_empty((lora_a.shape[0], rows)))


@torch.library.register_fake("fastllm::lora_linear_backward")
def _lora_linear_backward_fake(grad_out, x, weight, lora_a, lora_b, xa, scaling, dropout_p, seed,
                               output_mask):
    need_x, need_a, need_b = output_mask
    return (
        x.new_empty(x.shape) if need_x else x.new_empty(0),
        lora_a.new_empty(lora_a.shape) if need_a else x.new_empty(0),
        lora_b.new_empty(lora_b.shape) if need_b else x.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, weight, lora_a, lora_b, scaling, bias, dropout_p, seed = inputs
    xa = output[1]
    ctx.save_for_backward(x, weight, lora_a, lora_b, xa, seed)
    ctx.scaling = scaling
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(xa)


@first_order_only("fastllm.lora_linear")
def _lora_linear_backward(ctx, grad_y, grad_xa):
    x, weight, lora_a, lora_b, xa, seed = ctx.saved_tensors
    need_x, need_w, need_a, need_b, _, need_bias, _, _ = ctx.needs_input_grad
    grad_x = grad_w = grad_a = grad_b = grad_bias = None
    if need_x or need_a or need_b:
        dx, da, db = _lora_backward(
            grad_y, x, weight, lora_a, lora_b, xa, ctx.scaling, ctx.dropout_p, seed,
            [need_x, need_a, need_b],
        )
        grad_x = dx if need_x else None
        grad_a = da if need_a else None
        grad_b = db if need_b else None
    out_features, in_features = weight.shape
    rows = math.prod(x.shape[:-1])  # (reshape(-1, 0) cannot infer it: a 0-feature layer)
    dy = grad_y.reshape(rows, out_features)
    if need_w:  # not LoRA's contract (W is frozen), but correct if someone trains W too
        grad_w = _lowp.in_fp32(_gemm.mm, dy.t(), x.reshape(rows, in_features)) \
            if _lowp.widen(x) else _gemm.mm(dy.t(), x.reshape(rows, in_features))
    if need_bias:
        grad_bias = bias_grad(dy)
    return grad_x, grad_w, grad_a, grad_b, None, grad_bias, None, None


def bias_grad(dy):
    """The bias's grad from dy (rows, out_features): summed in fp32 for bf16/fp16 (as PyTorch's
    linear backward), in fp64 for fp64."""
    return dy.sum(0, dtype=torch.promote_types(dy.dtype, torch.float32)).to(dy.dtype)


_lora_linear = register_autograd(
    "fastllm::lora_linear", _lora_linear_backward, setup_context=_setup_context,
    impl=_lora_linear_impl, materialize_grads=False)


def new_dropout_seed(device=None):
    """A fresh dropout seed, an int64 scalar tensor drawn by torch's generator of `device` (the
    CPU's by default): on a GPU the Triton kernels read it there, so under CUDA-graph capture each
    replay draws a new one (PyTorch's CUDA generator is graph-safe) and no step reads it back."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)


def lora_linear(x, weight, lora_a, lora_b, scaling, bias=None, dropout_p=0.0, training=True,
                seed=None):
    """y = x W^T + bias + scaling * dropout(x) A^T B^T (see the module docstring for shapes).

    dropout_p applies only when `training`. seed: int or int64 scalar tensor fixing the dropout
    mask; by default a fresh one is drawn from torch's generator (so torch.manual_seed repeats it),
    on x's GPU for GPU tensors (new_dropout_seed). Activation checkpointing repeats the mask
    when it recomputes the layer because it restores torch's generator first: with
    `torch.utils.checkpoint(..., preserve_rng_state=False)` pass a `seed` drawn outside instead.
    Under autocast every floating input is cast to the autocast dtype, as F.linear's are.
    """
    p = float(dropout_p) if training else 0.0
    device_type = x.device.type
    if _lowp.autocast_enabled(device_type):
        # (as autocast casts F.linear's: not fp64, integer or other devices' tensors)
        x, weight, lora_a, lora_b, bias = _lowp.autocast_args(device_type, x, weight, lora_a,
                                                              lora_b, bias)
        with torch.autocast(device_type, enabled=False):
            return lora_linear(x, weight, lora_a, lora_b, scaling, bias, p, True, seed)
    y, _ = _lora_linear(x, weight, lora_a, lora_b, float(scaling), bias, p,
                        dropout_seed(x, p, seed))
    return y


def dropout_seed(x, p, seed):
    """lora_linear's `seed` argument as the op takes it: an int64 scalar tensor, on x's GPU for
    GPU tensors; None draws a fresh one (a zero where p is 0: no mask to draw)."""
    if seed is None:
        # drawn where the kernels read it: a CUDA seed for CUDA tensors (graph-safe, no sync)
        device = x.device if x.device.type == "cuda" else None
        return (new_dropout_seed(device) if p > 0.0
                else torch.zeros((), dtype=torch.int64, device=device))
    if not isinstance(seed, torch.Tensor):
        # an int: made on x's GPU by a fill (capturable), not copied there at every launch
        device = x.device if x.device.type == "cuda" else None
        return torch.full((), int(seed), dtype=torch.int64, device=device)
    if seed.numel() != 1 or seed.dtype.is_floating_point or seed.is_complex():
        raise ValueError(f"fastllm.lora_linear: seed must be an int or a one-element integer "
                         f"tensor, got {seed.dtype} of shape {tuple(seed.shape)}")
    if x.device.type == "cuda" and seed.device != x.device:
        return torch.full((), int(seed), dtype=torch.int64, device=x.device)  # a CPU seed
    return seed.to(torch.int64).reshape(())
