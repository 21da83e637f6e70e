"""fastllm::adamw8bit_step: AdamW with low-byte moments (8-bit block-quantised, or bf16).

    adamw8bit_step(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                   exp_avg_sq_absmaxes, steps, qmaps, *, lr, beta1, beta2, eps, weight_decay,
                   block_size=256, maximize=False, stochastic_rounding=False, seed=0,
                   grad_scale=None, clip_coef=None, found_inf=None)

`lr`: a float or a one-element tensor (read on the device by the Triton kernel: the op's
`lr_tensor` argument; fastllm/ops/_lr.py).

Per element, with step t (torch.optim.AdamW's maths, decoupled weight decay):
    g  = grad * clip_coef / grad_scale                  (negated when maximize)
    m  = dequant(exp_avg);  v = dequant(exp_avg_sq)     (bf16 moments: upcast)
    x  = master | param
    x  = x * (1 - lr * weight_decay)
    m  = lerp(m, g, 1 - beta1);   v = beta2 * v + (1 - beta2) * g^2
    x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    master = x;  param = round(x);  exp_avg = quant(m);  exp_avg_sq = quant(v)
The param update uses the new m and v before they are requantised (as bitsandbytes does).

8-bit moments (exp_avgs are uint8): each tensor, flattened, is cut into blocks of `block_size`
elements (the last one may be shorter). A block stores one fp32 absmax (the largest |value|) and
one byte per element, an index into a sorted 256-entry code table: dequant(c) = code[c] * absmax;
quant(x) = the index of the code nearest to x / absmax (ties go to the larger code). The first
moment uses the signed table, the second the unsigned one: bitsandbytes' "dynamic" map
(Dettmers, "8-Bit Approximations for Parallelism in Deep Learning", ICLR 2016; values as built
by bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)):
0, 1.0, and per decade i = 0..6 the midpoints of 2^i (signed, with both signs) or 2^(i+1)
(unsigned) equal bins of [0.1, 1] * 10^(i-6). An all-zero block stores absmax 0.

Non-finite values (no code holds them): a block holding a nan stores absmax nan, so all of it
dequantises to nan (torch.amax's rule; a max that drops nan, as std::max, fmax and tl.max do,
would leave finite garbage where torch.optim.AdamW has nan); an infinite value gives absmax inf
and the top code of its sign, dequantising to itself, and the block's other values to nan
(0 * inf). The fp32 param update uses m and v before quantisation, so only the elements with a
non-finite grad go non-finite in the step itself, the rest of such a block in the next one. Use
max_grad_norm, a loss scaler or GradScaler (found_inf) to skip such steps instead.

Encoding is analytic, not a search, so it vectorises: inside one decade the codes are equally
spaced, so the nearest is floor((a - first_boundary) / spacing); which decade a = |x| / absmax
falls in takes one table lookup indexed by the fp32 exponent of a (each binary octave holds at
most one decade boundary) and one comparison. `qmaps` (2, QMAP_WIDTH) fp32, built once by
`build_qmaps()`, holds per row (0 signed, 1 unsigned): the 256 code values, then that decoding's
per-segment and per-octave constants (layout in build_qmaps).

bf16 moments (exp_avgs are bf16): quant() is round-to-nearest-even, the absmax lists are empty.

Shapes and dtypes: at every index i, params[i] and grads[i] are fp32, bf16 or fp16 (one dtype
per call); masters[i] (empty list, or fp32, one per bf16/fp16 param) share the param's numel;
exp_avgs[i], exp_avg_sqs[i] are uint8 or bf16 with the param's numel; absmaxes[i] are fp32 of
ceil(numel / block_size) elements (8-bit only). Everything dense, contiguous, on one device.
steps[i] is the step count, already incremented. grad_scale, clip_coef and found_inf are
one-element floating-point tensors (found_inf may be bool) on the params' device or the CPU;
nothing changes when found_inf is nonzero. Stochastic rounding applies to
the write-back of bf16/fp16 params.

Backends: cpp (CPU, AVX-512 vectorised), triton (GPU; CPU under TRITON_INTERPRET=1), and
`adamw8bit_step_ref`, plain PyTorch in float64: the test oracle.
"""

import functools
import math

import torch

from fastllm import _backend, _extension
from fastllm._library import lib
from fastllm.ops._overlap import labelled, refuse_overlap
from fastllm.ops._lr import check_lr_tensor, for_backend, ieee_div, split_lr
from fastllm.ops._scalar_args import check_scalar_args
from fastllm.ops.adamw import check_step_values, check_steps
from fastllm.ops.adamw_master import stochastic_round_ref

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}

STATE_DTYPES = (torch.uint8, torch.bfloat16)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)

# qmaps row layout (fp32): [0, 256) code values; then 16-slot segment tables: the index of the
# segment's first code, its last code, and inv_spacing, offset so that for a in the segment
# k = clamp(trunc(a * inv_spacing + offset), 0, last - first) and index = first + k; then per
# binary octave [2^(e-127), 2^(e-126)), e = 96..127 (slot e - 96): the segment of its lower end
# and the one decade boundary inside it (2.0 when there is none), so segment = base + (a >= thr).
QMAP_FIRST, QMAP_LAST, QMAP_INV, QMAP_OFFSET = 256, 272, 288, 304
QMAP_OCT_BASE, QMAP_OCT_THR = 320, 352
QMAP_WIDTH = 384
MIN_BLOCK, MAX_BLOCK = 16, 4096


def dynamic_code(signed):
    """bitsandbytes' dynamic map, (256,) fp32 sorted ascending (see the module docstring).

    Computed as bitsandbytes computes it (fp32 linspace midpoints times 10^(i-6) in fp32), so the
    values are bit for bit those of bitsandbytes.functional.create_dynamic_map(signed)."""
    values = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, n + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist()
        if signed:
            values += (-(10 ** (i - 6)) * means).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def _segments(code, signed):
    """[(first, last)] code indices of the non-negative segments: 0, the 7 decades, 1.0."""
    first = 127 if signed else 0
    sizes = [1] + [2**i if signed else 2 ** (i + 1) for i in range(7)] + [1]
    out = []
    for size in sizes:
        out.append((first, first + size - 1))
        first += size
    assert first == 256 and code[out[0][0]] == 0 and code[255] == 1.0
    return out


@functools.lru_cache(maxsize=None)
def _qmaps_cpu():
    rows = []
    for signed in (True, False):
        code = dynamic_code(signed).double()
        row = torch.zeros(QMAP_WIDTH, dtype=torch.float64)
        row[:256] = code
        segments = _segments(code, signed)
        lower = []  # the decision boundary below each segment's first code
        for j, (f, last) in enumerate(segments):
            lower.append(0.0 if j == 0 else float((code[f - 1] + code[f]) / 2))
            row[QMAP_FIRST + j], row[QMAP_LAST + j] = f, last
            if last > f:
                spacing = float(code[last] - code[f]) / (last - f)
                mid = float(code[f] + code[f + 1]) / 2
                row[QMAP_INV + j] = 1.0 / spacing
                row[QMAP_OFFSET + j] = 1.0 - mid / spacing
        for slot in range(32):
            lo, hi = 2.0 ** (slot - 31), 2.0 ** (slot - 30)
            base = sum(1 for b in lower[1:] if b <= lo)
            inside = [b for b in lower[1:] if lo < b < hi]
            assert len(inside) <= 1, "a binary octave holds two decade boundaries"
            row[QMAP_OCT_BASE + slot] = base
            row[QMAP_OCT_THR + slot] = inside[0] if inside else 2.0
        rows.append(row.float())
    # The encoder works on fp32 thresholds: check they order as the float64 ones do.
    return torch.stack(rows)


def build_qmaps(device="cpu"):
    """(2, QMAP_WIDTH) fp32 on `device`: row 0 the signed map (first moment), row 1 the unsigned
    map (second moment), each the 256 codes and its encoder's constants."""
    return _qmaps_cpu().to(device)


def n_blocks(numel, block_size):
    return -(-numel // block_size)


def quantize_blockwise_ref(x, code, block_size):
    """x (any shape, float) -> (codes uint8 of x's shape, absmax fp32 (n_blocks,)), nearest code
    computed in float64 (ties to the larger code)."""
    flat = x.detach().reshape(-1).double()
    n = flat.numel()
    nb = n_blocks(n, block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float64, device=flat.device)
    padded[:n] = flat
    blocks = padded.view(nb, block_size)
    absmax = blocks.abs().amax(dim=1) if nb else torch.zeros(0, dtype=torch.float64)
    absmax32 = absmax.float()
    scale = absmax32.double()
    # An infinite value normalises to its sign (inf / inf would be nan, and -inf would come
    # back as +inf); a nan absmax (amax keeps nan) makes the whole block dequantise to nan.
    ratio = torch.where(blocks.isinf(), blocks.sign(), blocks / scale[:, None].clamp_min(1e-300))
    normalized = torch.where(scale[:, None] > 0, ratio, torch.zeros_like(blocks))
    normalized = normalized.clamp(-1.0, 1.0).reshape(-1)[:n]
    code64 = code.double().to(flat.device)
    boundaries = (code64[1:] + code64[:-1]) / 2
    idx = torch.bucketize(normalized, boundaries, right=True)
    return idx.to(torch.uint8).view(x.shape), absmax32


def dequantize_blockwise_ref(codes, absmax, code, block_size, dtype=torch.float64):
    """codes uint8 (any shape), absmax (n_blocks,) -> code[codes] * absmax of the block, as dtype
    (float64: the exact product of the fp32 code and fp32 absmax)."""
    flat = codes.reshape(-1).long()
    values = code.to(codes.device).double()[flat]
    scale = absmax.double().repeat_interleave(block_size)[: flat.numel()]
    return (values * scale).view(codes.shape).to(dtype)


def adamw8bit_step_ref(
    params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes, steps,
    qmaps, *, lr, beta1, beta2, eps, weight_decay, block_size=256, maximize=False,
    stochastic_rounding=False, seed=0, grad_scale=None, clip_coef=None, found_inf=None,
):
    """Plain-PyTorch step computed in float64 from the stored values: dequantise, AdamW,
    requantise (nearest code) or round the moments to bf16. The oracle of the kernels. `lr` may
    be a one-element tensor (read here)."""
    if found_inf is not None and bool(found_inf.item()):
        return
    lr = float(lr) if isinstance(lr, torch.Tensor) else lr
    mult = 1.0
    if grad_scale is not None:
        mult = ieee_div(mult, grad_scale)
    if clip_coef is not None:
        mult *= float(clip_coef)
    generator = None
    if stochastic_rounding and params:
        generator = torch.Generator(device=params[0].device)
        generator.manual_seed(seed & ((1 << 63) - 1))
    f64 = torch.float64
    # The kernels' contract: the decay factor is an fp32 scalar (1 - lr * wd, rounded once).
    decay = float(torch.tensor(1.0 - lr * weight_decay, dtype=torch.float32))
    signed_code, unsigned_code = qmaps[0, :256].cpu(), qmaps[1, :256].cpu()
    for i, param in enumerate(params):
        quantized = exp_avgs[i].dtype == torch.uint8
        g = grads[i].to(f64) * float(torch.tensor(mult, dtype=torch.float32))
        if maximize:
            g = -g
        x = masters[i].to(f64) if masters else param.to(f64)
        if quantized:
            m = dequantize_blockwise_ref(exp_avgs[i], exp_avg_absmaxes[i], signed_code,
                                         block_size)
            v = dequantize_blockwise_ref(exp_avg_sqs[i], exp_avg_sq_absmaxes[i], unsigned_code,
                                         block_size)
        else:
            m, v = exp_avgs[i].to(f64), exp_avg_sqs[i].to(f64)
        step = float(steps[i])
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        x = x * decay
        m = m + (g - m) * (1.0 - beta1)
        v = v * beta2 + (1.0 - beta2) * g * g
        x = x - (lr / bias_correction1) * m / (v.sqrt() / bias_correction2_sqrt + eps)
        if quantized:
            codes_m, absmax_m = quantize_blockwise_ref(m, signed_code, block_size)
            codes_v, absmax_v = quantize_blockwise_ref(v, unsigned_code, block_size)
            exp_avgs[i].copy_(codes_m)
            exp_avg_sqs[i].copy_(codes_v)
            exp_avg_absmaxes[i].copy_(absmax_m)
            exp_avg_sq_absmaxes[i].copy_(absmax_v)
        else:
            exp_avgs[i].copy_(m.float())
            exp_avg_sqs[i].copy_(v.float())
        if masters:
            masters[i].copy_(x)
        if stochastic_rounding and param.dtype in LOW_PRECISION:
            param.copy_(stochastic_round_ref(x.float(), param.dtype, generator))
        else:
            param.copy_(x.float())


def _compiled(name):
    def run(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes,
            steps, qmaps, *, lr, beta1, beta2, eps, weight_decay, block_size, maximize,
            stochastic_rounding, seed, grad_scale, clip_coef, found_inf):
        fn = getattr(_extension.extension(), name, None)
        if fn is None:
            raise NotImplementedError(f"fastllm.adamw8bit_step: fastllm._C has no {name}; "
                                      f"rebuild it (pip install --no-build-isolation -e .)")
        fn(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes,
           steps, qmaps, lr, beta1, beta2, eps, weight_decay, block_size, maximize,
           stochastic_rounding, seed, grad_scale, clip_coef, found_inf)

    return run


def _adamw8bit_step_triton(*args, **kwargs):
    from fastllm.kernels.adamw8bit import adamw8bit_step_triton

    adamw8bit_step_triton(*args, **kwargs)


_IMPLS = {
    "ref": adamw8bit_step_ref,
    "cpp": _compiled("adamw8bit_step_cpu"),
    "triton": _adamw8bit_step_triton,
}


_WHERE = "fastllm.adamw8bit_step"


def check_adamw8bit_args(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                         exp_avg_sq_absmaxes, steps, qmaps, *, lr, beta1, beta2, eps,
                         weight_decay, block_size, lr_tensor=None, grad_scale=None,
                         clip_coef=None, found_inf=None):
    """Raise ValueError/TypeError naming the first bad argument; touches nothing. (The step
    counts' own checks, adamw.check_steps, follow it where they are made.)"""
    where = _WHERE
    check_lr_tensor(where, lr_tensor, params[0].device if params else None)
    check_scalar_args(where, params[0].device if params else None, grad_scale=grad_scale,
                      clip_coef=clip_coef, found_inf=found_inf)
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {name} must be finite and >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{where}: {name} must be in [0, 1), got {value}")
    if not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size % 16 == 0):
        raise ValueError(f"{where}: block_size must be a multiple of 16 in [{MIN_BLOCK}, "
                         f"{MAX_BLOCK}], got {block_size}")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if masters:
        lists["masters"] = masters
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{where}: {name} has {len(lst)} tensors, params has {n}")
    if n == 0:
        return
    device, dtype = params[0].device, params[0].dtype
    state_dtype = exp_avgs[0].dtype
    if dtype not in PARAM_DTYPES:
        raise TypeError(f"{where}: params must be float32, bfloat16 or float16, got {dtype}")
    if state_dtype not in STATE_DTYPES:
        raise TypeError(f"{where}: exp_avgs must be uint8 (8-bit codes) or bfloat16, got "
                        f"{state_dtype}")
    if masters and dtype not in LOW_PRECISION:
        raise TypeError(f"{where}: masters are for bfloat16/float16 params, params are {dtype}")
    quantized = state_dtype == torch.uint8
    if quantized:
        for name, lst in (("exp_avg_absmaxes", exp_avg_absmaxes),
                          ("exp_avg_sq_absmaxes", exp_avg_sq_absmaxes)):
            if len(lst) != n:
                raise ValueError(f"{where}: {name} has {len(lst)} tensors, params has {n} "
                                 f"(8-bit moments need one absmax tensor per param)")
        if (qmaps.dtype != torch.float32 or tuple(qmaps.shape) != (2, QMAP_WIDTH)
                or qmaps.device != device or not qmaps.is_contiguous()):
            raise ValueError(f"{where}: qmaps must be a contiguous (2, {QMAP_WIDTH}) float32 "
                             f"tensor on {device} (fastllm.ops.adamw8bit.build_qmaps())")
    elif exp_avg_absmaxes or exp_avg_sq_absmaxes:
        raise ValueError(f"{where}: bf16 moments take no absmax tensors")
    expected = {"params": dtype, "grads": dtype, "masters": torch.float32,
                "exp_avgs": state_dtype, "exp_avg_sqs": state_dtype}
    checked = [("params", params)] + [(k, v) for k, v in lists.items() if k != "steps"]
    for i, p in enumerate(params):
        for name, lst in checked:
            t = lst[i]
            at = f"{where}: {name}[{i}]"
            if t.layout != torch.strided:
                raise TypeError(f"{at} is {t.layout}; only dense tensors are supported")
            if t.dtype != expected[name]:
                raise TypeError(f"{at} has dtype {t.dtype}, expected {expected[name]}")
            if t.device != device:
                raise ValueError(f"{at} is on {t.device}, params[0] on {device}")
            if t.numel() != p.numel():
                raise ValueError(f"{at} has {t.numel()} elements, params[{i}] has {p.numel()}")
            if not t.is_contiguous():
                raise ValueError(f"{at} is not contiguous; call .contiguous() first")
        if quantized:
            nb = n_blocks(p.numel(), block_size)
            for name, lst in (("exp_avg_absmaxes", exp_avg_absmaxes),
                              ("exp_avg_sq_absmaxes", exp_avg_sq_absmaxes)):
                t = lst[i]
                if (t.dtype != torch.float32 or t.numel() != nb or t.device != device
                        or not t.is_contiguous()):
                    raise ValueError(f"{where}: {name}[{i}] must be a contiguous float32 tensor "
                                     f"of {nb} elements (ceil({p.numel()} / {block_size})) on "
                                     f"{device}, got {t.dtype} with {t.numel()} on {t.device}")


def _adamw8bit_step_impl(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                         exp_avg_sq_absmaxes, steps, qmaps, *, lr, beta1, beta2, eps,
                         weight_decay, block_size=256, maximize=False, stochastic_rounding=False,
                         seed=0, grad_scale=None, clip_coef=None, found_inf=None,
                         lr_tensor=None):
    # fastllm.optim's step plan made its scalars itself (one element each, on the device): no
    # per-step host cost re-checking them there.
    scalars = ({} if _backend.prevalidated() else
               dict(grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf))
    check_adamw8bit_args(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                         exp_avg_sq_absmaxes, steps, qmaps, lr=lr, beta1=beta1, beta2=beta2,
                         eps=eps, weight_decay=weight_decay, block_size=block_size,
                         lr_tensor=lr_tensor, **scalars)
    if not params:
        return
    if not _backend.prevalidated():
        # The step counts as adamw_step checks them, and as there not in fastllm.optim's step
        # plan (which made them): no per-tensor host cost in the optimizer's step.
        check_steps(_WHERE, steps, params[0].device)
        check_step_values(_WHERE, steps)
        refuse_overlap(_WHERE, labelled(
            params=params, masters=masters, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
            exp_avg_absmaxes=exp_avg_absmaxes, exp_avg_sq_absmaxes=exp_avg_sq_absmaxes),
            labelled(grads=grads, steps=steps, qmaps=[qmaps]))
    device_type = params[0].device.type
    backend = _backend.select("adamw8bit_step", device_type,
                              _PREFERENCE.get(device_type, ("ref",)))
    if backend == "cuda":
        raise RuntimeError("fastllm.adamw8bit_step: there is no CUDA kernel for this op; its GPU "
                           "path is Triton (FASTLLM_BACKEND=triton)")
    lr, lr_tensor = for_backend(lr, lr_tensor, backend, params[0].device)
    kwargs = {} if lr_tensor is None else {"lr_tensor": lr_tensor}
    with _backend.device_guard(params[0].device):
        _IMPLS[backend](
            params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes,
            steps, qmaps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            block_size=block_size, maximize=maximize, stochastic_rounding=stochastic_rounding,
            seed=seed, grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf, **kwargs,
        )


lib.impl("adamw8bit_step", _adamw8bit_step_impl, "CPU")
lib.impl("adamw8bit_step", _adamw8bit_step_impl, "CUDA")


@torch.library.register_fake("fastllm::adamw8bit_step")
def _adamw8bit_step_fake(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                         exp_avg_sq_absmaxes, steps, qmaps, *, lr, beta1, beta2, eps,
                         weight_decay, block_size=256, maximize=False, stochastic_rounding=False,
                         seed=0, grad_scale=None, clip_coef=None, found_inf=None,
                         lr_tensor=None):
    check_adamw8bit_args(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                         exp_avg_sq_absmaxes, steps, qmaps, lr=lr, beta1=beta1, beta2=beta2,
                         eps=eps, weight_decay=weight_decay, block_size=block_size,
                         lr_tensor=lr_tensor, grad_scale=grad_scale, clip_coef=clip_coef,
                         found_inf=found_inf)
    if params:
        check_steps(_WHERE, steps, params[0].device)


def adamw8bit_step(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes,
                   exp_avg_sq_absmaxes, steps, qmaps=None, *, lr, beta1, beta2, eps,
                   weight_decay, block_size=256, maximize=False, stochastic_rounding=False,
                   seed=0, grad_scale=None, clip_coef=None, found_inf=None):
    """Functional form of the op (see the module docstring); a no-op for empty lists.
    qmaps defaults to build_qmaps() on the params' device; `lr`: a float or a one-element
    tensor."""
    if len(params) == 0:
        return
    lr, lr_tensor = split_lr(lr)
    if qmaps is None:
        qmaps = build_qmaps(params[0].device)
    if _backend.direct(params, grads, masters, exp_avgs, exp_avg_sqs):  # (torch.ops skipped)
        _adamw8bit_step_impl(
            params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes,
            steps, qmaps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            block_size=int(block_size), maximize=maximize,
            stochastic_rounding=stochastic_rounding, seed=int(seed), grad_scale=grad_scale,
            clip_coef=clip_coef, found_inf=found_inf, lr_tensor=lr_tensor,
        )
        torch.autograd.graph.increment_version(params)
        return
    torch.ops.fastllm.adamw8bit_step(
        params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_absmaxes, exp_avg_sq_absmaxes,
        steps, qmaps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        block_size=int(block_size), maximize=maximize, stochastic_rounding=stochastic_rounding,
        seed=int(seed), grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf,
        lr_tensor=lr_tensor,
    )
