"""fastllm::nf4_dequantize: 4-bit NormalFloat (NF4) weights back to fp32/bf16/fp16, and their
quantisation (QLoRA, Dettmers et al. 2023; bitsandbytes' format).

    packed, absmax = nf4_quantize(weight, blocksize=64)      # plain PyTorch, once per weight
    w = nf4_dequantize(packed, absmax, weight.shape, blocksize, torch.bfloat16)
    nf4_dequantize_into(w, packed, absmax, blocksize)       # the same, into an existing tensor

A tensor of n elements is cut, in row-major order, into blocks of `blocksize` (a power of two,
16 to 4096; the last block may be short). Each block keeps its absolute maximum in fp32
(`absmax`, ceil(n / blocksize) values) and each element the index of the NF4 code nearest to
element / absmax (16 codes in [-1, 1], `NF4_CODE`); two indices share a byte, the element of
even index in the high nibble (`packed`, ceil(n / 2) uint8; an odd n pads with code 7, 0.0).
Dequantised, element i is NF4_CODE[q_i] * absmax[i // blocksize], the product in fp32, rounded
to nearest even into the output dtype. Both layouts are bitsandbytes' (its
`quantize_4bit(..., quant_type="nf4")` without nested statistics), so its packed weights and
absmax read here unchanged and the other way (tests/test_nf4.py compares them bitwise).
QLoRA's double quantisation of the absmax (8-bit codes and an fp32 scale per 256 of them:
`nf4_double_quantize`, bitsandbytes' nested statistics) is read wherever an absmax is: the
dequantisation decodes it first (`nf4_absmax`).

Backends of the dequantisation: cpp (CPU, csrc/cpu/nf4.cpp), triton (GPU; CPU under
TRITON_INTERPRET=1; fastllm/kernels/nf4.py), and `nf4_dequantize_ref`; all give the same bits.
"""

import math
import threading

import torch

from fastllm import _backend
from fastllm._library import lib
from fastllm.ops.adamw8bit import dynamic_code

# The NF4 data type: quantiles of N(0, 1) normalised to [-1, 1], with an exact zero (QLoRA,
# appendix E; bitsandbytes' table, to fp32).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("triton", "ref")}
_WHERE = "fastllm.nf4_dequantize"
_CODES = {}  # device -> NF4_CODE as an fp32 tensor there


def nf4_code(device):
    """NF4_CODE as a 16-element fp32 tensor on `device` (made once per device)."""
    return _table(_CODES, NF4_CODE, device)


def check_blocksize(where, blocksize):
    if (not isinstance(blocksize, int) or isinstance(blocksize, bool) or blocksize < 16
            or blocksize > 4096 or blocksize & (blocksize - 1)):
        raise ValueError(f"{where}: blocksize must be a power of two from 16 to 4096, got "
                         f"{blocksize!r}")


def nf4_quantize(weight, blocksize=64):
    """(packed uint8 (ceil(n / 2),), absmax fp32 (ceil(n / blocksize),)) of `weight` (any shape,
    fp32/bf16/fp16, finite): each element's nearest NF4 code after dividing by its block's
    absolute maximum (ties to the lower code; an all-zero block has absmax 0 and codes of 0.0).
    Plain PyTorch, on the weight's device; the weight is read, not modified."""
    where = "fastllm.nf4_quantize"
    check_blocksize(where, blocksize)
    if not isinstance(weight, torch.Tensor) or weight.layout != torch.strided:
        what = str(weight.layout) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"{where}: weight must be a dense tensor, got {what}")
    if weight.dtype not in _SUPPORTED:
        raise TypeError(f"{where}: weight has dtype {weight.dtype}; expected float32, bfloat16 or "
                        f"float16")
    n = weight.numel()
    flat = weight.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError(f"{where}: weight has inf or nan values; they have no NF4 code")
    q, absmax = _blockwise_nearest(flat, blocksize, nf4_code(weight.device))
    q = q.to(torch.uint8)
    if n % 2:  # the odd element's partner: code 7 (0.0), bitsandbytes' padding
        q = torch.cat([q, q.new_full((1,), 7)])
    packed = (q[0::2] << 4) | q[1::2]
    return packed.contiguous(), absmax.contiguous()


def _blockwise_nearest(flat, blocksize, code):
    """(index of each value's nearest entry of the ascending `code`, ties to the lower, after
    dividing by its block's absolute maximum; the blocks' absolute maxima, fp32) of the fp32
    1-d `flat`, cut into blocks of `blocksize` (the last may be short). bitsandbytes' blockwise
    quantisation, for NF4 weights and for the 8-bit codes of a double-quantised absmax."""
    n = flat.numel()
    blocks = -(-n // blocksize)
    padded = torch.zeros(blocks * blocksize, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    rows = padded.view(blocks, blocksize)
    absmax = rows.abs().amax(dim=1)
    # as bitsandbytes scales: whole blocks by x * (1 / absmax), a short last block by x / absmax
    # (the two can differ in the last bit); an all-zero block scales to zeros
    safe = absmax.clamp(min=1e-38)
    scaled = (rows * (1.0 / safe)[:, None]).reshape(-1)
    if n % blocksize:
        tail = (blocks - 1) * blocksize
        scaled[tail:] = padded[tail:] / safe[-1]
    mid = (code[1:] + code[:-1]) * 0.5
    return torch.bucketize(scaled[:n].clamp_(-1.0, 1.0), mid), absmax  # (v <= mid[i]: code i)


# QLoRA's double quantisation of the absmax (bitsandbytes' compress_statistics /
# transformers' bnb_4bit_use_double_quant): the fp32 absmax less its mean, in 8-bit codes of
# bitsandbytes' signed dynamic map, one fp32 scale per NESTED_BLOCKSIZE of them.
NESTED_BLOCKSIZE = 256
_DYNAMIC = {}  # device -> bitsandbytes' signed dynamic map there
# its 256 values as Python floats, made at import: a first nested_code call inside a
# torch.compile trace then makes a constant, not a graph break
_DYNAMIC_VALUES = tuple(dynamic_code(True).tolist())


def nested_code(device):
    """bitsandbytes' signed 8-bit dynamic map (256 fp32, ascending) on `device`: the code table
    of a double-quantised absmax (made once per device)."""
    return _table(_DYNAMIC, _DYNAMIC_VALUES, device)


def _table(cache, values, device):
    """`values` as an fp32 tensor on `device`, cached in `cache` when made eagerly (one made
    inside a torch.compile trace is the graph's constant, not a tensor to keep)."""
    device = torch.device(device)
    code = cache.get(device)
    if code is None:
        code = torch.tensor(values, dtype=torch.float32, device=device)
        if not torch.compiler.is_compiling():
            cache[device] = code
    return code


def _nested_parts(blocks):
    """Byte offsets in a double-quantised absmax of `blocks` values: (the scales, the codes,
    the end)."""
    scales = 8
    codes = scales + 4 * -(-blocks // NESTED_BLOCKSIZE)
    return scales, codes, codes + -(-blocks // 4) * 4


def nested_absmax_bytes(blocks):
    """Bytes of the double-quantised form of `blocks` absmax values (see nf4_double_quantize)."""
    return _nested_parts(blocks)[2]


def nf4_double_quantize(absmax):
    """The fp32 `absmax` of nf4_quantize double-quantised as bitsandbytes' quantize_4bit(...,
    compress_statistics=True) does it: offset = its mean; each value's nearest code in
    bitsandbytes' signed 8-bit dynamic map after dividing (value - offset) by the largest
    |value - offset| of its block of NESTED_BLOCKSIZE (ties to the lower code). Returned as one
    uint8 tensor of nested_absmax_bytes(n), in native byte order: n as int32, the offset and
    each block's scale as fp32, then the n codes (padded with zeros to a multiple of 4 bytes).
    8.1 bits per absmax instead of 32: an NF4 weight at blocksize 64 takes 0.5159 bytes instead
    of 0.5625. nf4_absmax decodes it."""
    where = "fastllm.nf4_double_quantize"
    if (not isinstance(absmax, torch.Tensor) or absmax.layout != torch.strided
            or absmax.dtype != torch.float32 or absmax.dim() != 1):
        what = (f"{absmax.dtype} {tuple(absmax.shape)} {absmax.layout}"
                if isinstance(absmax, torch.Tensor) else type(absmax).__name__)
        raise TypeError(f"{where}: absmax must be a dense 1-d fp32 tensor, got {what}")
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(f"{where}: absmax has inf or nan values")
    offset = absmax.mean() if absmax.numel() else absmax.new_zeros(())
    q, scales = _blockwise_nearest(absmax - offset, NESTED_BLOCKSIZE, nested_code(absmax.device))
    return pack_nested_absmax(q.to(torch.uint8), offset, scales)


def pack_nested_absmax(codes, offset, scales):
    """One uint8 tensor of a double-quantised absmax from its parts (nf4_double_quantize's
    layout): `codes` (n uint8), `offset` (one value) and `scales` (ceil(n / NESTED_BLOCKSIZE)
    values, stored as fp32); how a bitsandbytes nested absmax is held."""
    n = codes.numel()
    if scales.numel() != -(-n // NESTED_BLOCKSIZE):
        raise ValueError(f"fastllm.nf4: {n} nested absmax codes take "
                         f"{-(-n // NESTED_BLOCKSIZE)} scales at {NESTED_BLOCKSIZE} a block; "
                         f"got {scales.numel()}")
    at, start, end = _nested_parts(n)
    out = torch.zeros(end, dtype=torch.uint8, device=codes.device)
    out[:4].view(torch.int32).fill_(n)
    out[4:at].view(torch.float32).copy_(torch.as_tensor(offset, dtype=torch.float32))
    out[at:start].view(torch.float32).copy_(scales.reshape(-1))
    out[start:start + n] = codes.reshape(-1)
    return out


def nested_absmax_blocks(absmax):
    """The block count a double-quantised absmax says it holds (its int32 header; reads the
    tensor: a device sync on a GPU, so checked where a state is loaded, not per forward)."""
    # (copied: a view may start at an offset int32 cannot be read at)
    return int(absmax[:4].to("cpu", copy=True).view(torch.int32)[0]) if absmax.numel() >= 4 else -1


def nf4_absmax(absmax, blocks, where=_WHERE):
    """The fp32 absmax of `blocks` NF4 blocks: `absmax` itself when it is fp32, decoded when it
    is the uint8 of nf4_double_quantize (code[q] * scale, then + offset, in fp32: bitsandbytes'
    dequantisation of a nested absmax, bit for bit)."""
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.uint8:
        return absmax
    if not torch.compiler.is_compiling():  # (checked eagerly: a backward's trace bans .layout)
        if absmax.layout != torch.strided or absmax.dim() != 1 or not absmax.is_contiguous():
            raise ValueError(f"{where}: a double-quantised absmax must be a contiguous 1-d "
                             f"uint8 tensor, got shape {tuple(absmax.shape)}")
        said = nested_absmax_blocks(absmax) if absmax.device.type == "cpu" else blocks
        if absmax.numel() != nested_absmax_bytes(blocks) or said != blocks:
            raise ValueError(f"{where}: a double-quantised absmax of {blocks} blocks takes "
                             f"{nested_absmax_bytes(blocks)} bytes and says {blocks}; got "
                             f"{absmax.numel()} bytes saying {nested_absmax_blocks(absmax)}")
    _, start, _ = _nested_parts(blocks)
    # (copied, a few bytes: a view, e.g. into an all-gather buffer, may start at an offset fp32
    # cannot be read at)
    floats = absmax[4:start].clone().view(torch.float32)
    scale = floats[1:].repeat_interleave(NESTED_BLOCKSIZE)[:blocks]
    codes = absmax[start:start + blocks].long()
    return nested_code(absmax.device)[codes] * scale + floats[0]


def nf4_dequantize_ref(packed, absmax, shape, blocksize, dtype):
    """Plain PyTorch: the oracle and the fallback."""
    n = math.prod(shape)
    q = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n].long()
    scale = absmax.repeat_interleave(blocksize)[:n]
    return (nf4_code(packed.device)[q] * scale).to(dtype).reshape(shape)


def _into_ref(out, packed, absmax, blocksize):
    out.copy_(nf4_dequantize_ref(packed, absmax, out.shape, blocksize, out.dtype))


def _into_cpp(out, packed, absmax, blocksize):
    from fastllm import _extension

    _extension.extension().nf4_dequantize_cpu(packed, absmax, nf4_code(packed.device), out,
                                              blocksize)


def _into_triton(out, packed, absmax, blocksize):
    from fastllm.kernels.nf4 import nf4_dequantize_triton

    nf4_dequantize_triton(packed, absmax, nf4_code(packed.device), out, blocksize)


_IMPLS = {"ref": _into_ref, "cpp": _into_cpp, "triton": _into_triton}


def check_nf4_args(packed, absmax, shape, blocksize, dtype):
    """Raise TypeError/ValueError naming the first bad argument; touches nothing."""
    check_blocksize(_WHERE, blocksize)
    for name, t, want in (("packed", packed, torch.uint8), ("absmax", absmax, torch.float32)):
        if t.layout != torch.strided:
            raise TypeError(f"{_WHERE}: {name} is {t.layout}; only dense tensors are supported")
        if t.dtype != want:
            raise TypeError(f"{_WHERE}: {name} has dtype {t.dtype}; expected {want}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{_WHERE}: {name} must be a contiguous 1-d tensor, got shape "
                             f"{tuple(t.shape)}, strides {t.stride()}")
    if absmax.device != packed.device:
        raise ValueError(f"{_WHERE}: absmax is on {absmax.device}, packed on {packed.device}")
    if dtype not in _SUPPORTED:
        raise TypeError(f"{_WHERE}: dtype {dtype} is not supported; expected float32, bfloat16 "
                        f"or float16")
    if any(s < 0 for s in shape):
        raise ValueError(f"{_WHERE}: shape {tuple(shape)} has a negative size")
    n = math.prod(shape)
    if packed.numel() != -(-n // 2) or absmax.numel() != -(-n // blocksize):
        raise ValueError(f"{_WHERE}: a {tuple(shape)} tensor ({n} elements) takes "
                         f"{-(-n // 2)} packed bytes and {-(-n // blocksize)} absmax values at "
                         f"blocksize {blocksize}; got {packed.numel()} and {absmax.numel()}")


def _select(packed):
    return _backend.select_kernel("nf4_dequantize", packed.device.type, torch.uint8, _PREFERENCE,
                                  _IMPLS, cpp_entry="nf4_dequantize_cpu")


def _check_out(out, packed):
    if out.layout != torch.strided or not out.is_contiguous():
        raise ValueError(f"{_WHERE}: out must be a dense contiguous tensor")
    if out.device != packed.device:
        raise ValueError(f"{_WHERE}: out is on {out.device}, packed on {packed.device}")


def _nf4_dequantize_impl(packed, absmax, shape, blocksize, dtype):
    check_nf4_args(packed, absmax, shape, blocksize, dtype)
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    with _backend.device_guard(packed.device):
        _IMPLS[_select(packed)](out, packed, absmax, blocksize)
    return out


def _nf4_dequantize_into_impl(out, packed, absmax, blocksize):
    check_nf4_args(packed, absmax, out.shape, blocksize, out.dtype)
    _check_out(out, packed)
    with _backend.device_guard(packed.device):
        _IMPLS[_select(packed)](out, packed, absmax, blocksize)


for _device in ("CPU", "CUDA"):
    lib.impl("nf4_dequantize", _nf4_dequantize_impl, _device)
    lib.impl("nf4_dequantize_into", _nf4_dequantize_into_impl, _device)


@torch.library.register_fake("fastllm::nf4_dequantize")
def _nf4_dequantize_fake(packed, absmax, shape, blocksize, dtype):
    check_nf4_args(packed, absmax, shape, blocksize, dtype)
    return packed.new_empty(shape, dtype=dtype)


@torch.library.register_fake("fastllm::nf4_dequantize_into")
def _nf4_dequantize_into_fake(out, packed, absmax, blocksize):
    check_nf4_args(packed, absmax, out.shape, blocksize, out.dtype)
    _check_out(out, packed)


def _decoded(absmax, shape, blocksize):
    if isinstance(absmax, torch.Tensor) and absmax.dtype == torch.uint8:
        check_blocksize(_WHERE, blocksize)
        return nf4_absmax(absmax, -(-math.prod(shape) // blocksize))
    return absmax


def nf4_dequantize(packed, absmax, shape, blocksize=64, dtype=torch.float32):
    """The tensor of `shape` that nf4_quantize stored as (packed, absmax), in `dtype` (see the
    module docstring); a new tensor, not differentiable (the codes are integers). absmax: fp32,
    or double-quantised (uint8, nf4_double_quantize's)."""
    shape = [int(s) for s in shape]
    return torch.ops.fastllm.nf4_dequantize(packed, _decoded(absmax, shape, blocksize), shape,
                                            int(blocksize), dtype)


def nf4_dequantize_into(out, packed, absmax, blocksize=64):
    """nf4_dequantize written into `out` (contiguous; its shape and dtype say what to make):
    what fastllm.quant uses on the CPU to reuse one buffer for every layer's weight."""
    torch.ops.fastllm.nf4_dequantize_into(out, packed, _decoded(absmax, out.shape, blocksize),
                                          int(blocksize))


class _Scratch(threading.local):
    def __init__(self):
        self.buffers = {}  # (dtype, slot) -> a flat CPU tensor, grown to the largest weight seen


_SCRATCH = _Scratch()


def nf4_dense(packed, absmax, shape, blocksize, dtype, slot=0):
    """nf4_dequantize for products that keep nothing of the dense weight (fastllm.quant's
    layers: the backward dequantises again). On the CPU (eager) it is written into a buffer per
    thread, dtype and `slot`, reused by every layer and overwritten by the next call with the
    same slot (weights needed at once, as q/k/v's, take slots 0, 1, 2): a fresh
    megabytes-large tensor per layer and pass fragmented glibc's heap (SmolLM2-135M QLoRA, 2 x 64
    tokens: RSS 1314 MiB after 3 steps against 1055 with the buffer, and 1287 for the dense
    model). GPU tensors come from PyTorch's caching allocator, which reuses them anyway."""
    if (packed.device.type != "cpu" or type(packed) is not torch.Tensor
            or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()):
        # (traced, faked or under a dispatch mode: a plain op call, nothing cached)
        return nf4_dequantize(packed, absmax, shape, blocksize, dtype)
    n = math.prod(shape)
    buffer = _SCRATCH.buffers.get((dtype, slot))
    if buffer is None or buffer.numel() < n:
        buffer = _SCRATCH.buffers[(dtype, slot)] = torch.empty(n, dtype=dtype, device="cpu")
    out = buffer[:n].view(shape)
    nf4_dequantize_into(out, packed, absmax, blocksize)
    return out


def dense_weight(weight, absmax, nf4, dtype, slot=0):
    """`weight` as it is, or, where nf4 = (shape, blocksize), the dense weight of the NF4 codes
    `weight` with `absmax`, by nf4_dense (so not to be kept): how the LoRA ops that take either
    a dense or a 4-bit base (lora_linear_multi, swiglu_lora_linear) read it."""
    if nf4 is None:
        return weight
    return nf4_dense(weight, absmax, nf4[0], nf4[1], dtype, slot)
