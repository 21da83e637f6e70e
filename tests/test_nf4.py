"""NF4 weights (QLoRA): fastllm::nf4_dequantize on every backend, nf4_quantize against the NF4
definition (and bitsandbytes where it is installed), fastllm.quant.NF4Linear and LoRA over it
against the same maths on the dense dequantised weight, and a tiny Llama fine-tuned on a 4-bit
base whose adapter PEFT reads."""

import copy
import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import fastllm
from conftest import backend_device_params
from fastllm import quant
from fastllm.ops import nf4 as nf4_ops
from fastllm.lora import (LoRALinear, inject_lora, lora_modules, merge_and_unload, merge_lora,
                          save_adapter, unload)
from fastllm.ops import nf4_dequantize, nf4_dequantize_ref, nf4_quantize
from fastllm.ops.linear import linear
from fastllm.ops.lora_linear import lora_linear
from fastllm.ops.lora_linear_multi import lora_linear_multi
from fastllm.ops.nf4 import NF4_CODE
from fastllm.parallel import _torch_support

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODE = torch.tensor(NF4_CODE)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _codes(packed, n):
    return torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n].long()


@pytest.mark.parametrize("shape,blocksize", [((64, 64), 64), ((7, 13), 16), ((3, 33), 64),
                                              ((1, 1), 64), ((300, 7), 256), ((5,), 4096)])
def test_quantize_picks_the_nearest_code_per_block(shape, blocksize):
    w = torch.randn(shape) * 3
    w.view(-1)[0] = 0.0
    packed, absmax = nf4_quantize(w, blocksize)
    n = w.numel()
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 2),)
    assert absmax.dtype == torch.float32 and absmax.shape == (-(-n // blocksize),)
    flat = w.reshape(-1)
    for b in range(absmax.numel()):
        assert absmax[b] == flat[b * blocksize:(b + 1) * blocksize].abs().max()
    scale = absmax.repeat_interleave(blocksize)[:n]
    scaled = torch.where(scale > 0, flat * (1.0 / scale), 0.0)  # (an all-zero block: 0)
    q = _codes(packed, n)
    dist = (scaled[:, None] - CODE[None, :]).abs()
    assert torch.all(dist.gather(1, q[:, None])[:, 0] <= dist.min(1).values + 1e-7)
    assert q[0] == 7  # an exact zero keeps code 0.0
    if n % 2:
        assert packed[-1] & 15 == 7  # the odd element's partner nibble: padding, code 0.0


def test_quantize_layout_and_edges():
    # element 0 in the high nibble (bitsandbytes' order); codes at the table's own values
    w = torch.tensor([-1.0, 1.0] + [0.0] * 62)
    packed, absmax = nf4_quantize(w, 64)
    assert packed[0] == 0x0F and absmax.tolist() == [1.0]
    w = CODE.repeat(4)  # every code, each exactly representable
    assert torch.equal(nf4_dequantize(*nf4_quantize(w, 64), w.shape, 64), w)
    zero = torch.zeros(2, 64)
    zero[1, 5] = -2.0
    packed, absmax = nf4_quantize(zero, 64)
    assert absmax.tolist() == [0.0, 2.0]
    assert torch.equal(nf4_dequantize(packed, absmax, zero.shape, 64), zero)
    with pytest.raises(ValueError, match="inf or nan"):
        nf4_quantize(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="power of two"):
        nf4_quantize(torch.ones(64), 48)
    with pytest.raises(TypeError, match="float64"):
        nf4_quantize(torch.ones(64, dtype=torch.float64))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                    reason="bitsandbytes not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_as_bitsandbytes(dtype):
    import bitsandbytes.functional as bnbf

    for shape in ((96, 70), (5, 99), (3, 5)):  # whole blocks; a short last block; odd numel
        w = (torch.randn(shape) * 0.05).to(dtype)
        w[0, :3] = 0.0
        theirs, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                           compress_statistics=False)
        packed, absmax = nf4_quantize(w, 64)
        assert torch.equal(theirs.reshape(-1), packed), shape
        assert torch.equal(state.absmax.float(), absmax), shape
        want = bnbf.dequantize_4bit(theirs, state, quant_type="nf4").reshape(shape)
        got = nf4_dequantize(packed, absmax, w.shape, 64, dtype)
        assert torch.equal(_bits(got), _bits(want)), shape
    # double quantisation (compress_statistics): the same offset and scales; codes the nearest
    # (bitsandbytes' native CPU kernel takes the farther of two neighbours for a few); its
    # nested absmax, held in fastllm's form, dequantises to its own weights bit for bit
    for shape in ((576, 576), (3, 5), (1000, 333)):
        w = (torch.randn(shape) * 0.05).to(dtype)
        theirs, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                           compress_statistics=True)
        blob = nf4_ops.nf4_double_quantize(nf4_quantize(w, 64)[1])
        n = state.absmax.numel()
        start = 8 + 4 * -(-n // 256)
        floats = blob[4:start].view(torch.float32)
        assert torch.equal(floats[0], state.offset) and torch.equal(floats[1:],
                                                                     state.state2.absmax)
        scale = state.state2.absmax.repeat_interleave(256)[:n]
        scaled = (nf4_quantize(w, 64)[1] - state.offset) / scale.clamp(min=1e-38)  # (0 / 0: 0)
        table = state.state2.code
        ours = blob[start:start + n]
        gaps = [(scaled - table[c.long()]).abs() for c in (ours, state.absmax)]
        # (a block of scale 0 decodes to the offset whatever its code)
        differ = (ours != state.absmax) & (scale > 0)
        assert (gaps[0] <= gaps[1]).all() and differ.float().mean() < 0.01
        held = nf4_ops.pack_nested_absmax(state.absmax, state.offset, state.state2.absmax)
        want = bnbf.dequantize_4bit(theirs, state, quant_type="nf4").reshape(shape)
        got = nf4_dequantize(theirs.reshape(-1), held, shape, 64, dtype)
        assert torch.equal(_bits(got), _bits(want)), shape


@pytest.mark.parametrize("backend,device", backend_device_params(without=("cuda",)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,blocksize", [((0,), 64), ((1,), 64), ((7, 13), 16),
                                              ((33, 129), 64), ((4099,), 2048)])
def test_dequantize_matches_reference_bitwise(backend, device, dtype, shape, blocksize):
    w = (torch.randn(shape) * 10).to(device)
    packed, absmax = nf4_quantize(w, blocksize)
    want = nf4_dequantize_ref(packed, absmax, shape, blocksize, dtype)
    # the reference is the definition: code * absmax in fp32, rounded once
    n = w.numel()
    spelled = (CODE.to(device)[_codes(packed, n)] * absmax.repeat_interleave(blocksize)[:n])
    assert torch.equal(want, spelled.to(dtype).reshape(shape))
    with fastllm.use_backend(backend):
        got = nf4_dequantize(packed, absmax, shape, blocksize, dtype)
    assert got.shape == tuple(shape) and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(want))


def test_dequantize_refuses_bad_input():
    packed, absmax = nf4_quantize(torch.randn(8, 16), 64)
    cases = [
        ((packed.int(), absmax, (8, 16), 64, torch.float32), TypeError, "packed has dtype"),
        ((packed, absmax.double(), (8, 16), 64, torch.float32), TypeError, "absmax has dtype"),
        ((packed, absmax, (8, 17), 64, torch.float32), ValueError, "takes 68 packed bytes"),
        ((packed, absmax, (8, 16), 32, torch.float32), ValueError, "absmax values"),
        ((packed, absmax, (8, 16), 64, torch.int32), TypeError, "dtype torch.int32"),
        ((packed.view(8, 8), absmax, (8, 16), 64, torch.float32), ValueError, "1-d"),
        ((packed, absmax, (8, 16), 24, torch.float32), ValueError, "power of two"),
        ((packed, absmax.to("meta"), (8, 16), 64, torch.float32), ValueError, "absmax is on"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            nf4_dequantize(*args)


def test_dequantize_opcheck_and_compile():
    packed, absmax = nf4_quantize(torch.randn(16, 40), 16)
    torch.library.opcheck(torch.ops.fastllm.nf4_dequantize.default,
                          (packed, absmax, [16, 40], 16, torch.bfloat16))
    fn = torch.compile(lambda p, a: nf4_dequantize(p, a, (16, 40), 16) * 2, fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(packed, absmax), nf4_dequantize(packed, absmax, (16, 40), 16) * 2)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 5204])
def test_double_quantised_absmax_is_its_nearest_8bit_code(n):
    from fastllm.ops.adamw8bit import dynamic_code

    absmax = torch.rand(n) * 0.3 + 0.01
    absmax[n // 2] = 5.0  # (an outlier: its block's scale)
    blob = nf4_ops.nf4_double_quantize(absmax)
    # layout: n (int32), offset and the scales (fp32), the codes padded to 4 bytes
    blocks = -(-n // 256)
    start, pad = 8 + 4 * blocks, -(-n // 4) * 4
    assert blob.dtype == torch.uint8 and blob.numel() == start + pad
    assert blob.numel() == nf4_ops.nested_absmax_bytes(n) and not blob[start + n:].any()
    assert blob[:4].view(torch.int32).item() == n == nf4_ops.nested_absmax_blocks(blob)
    offset, scales = absmax.mean(), torch.zeros(blocks)
    centred = absmax - offset
    for b in range(blocks):
        scales[b] = centred[b * 256:(b + 1) * 256].abs().max()
    floats = blob[4:start].view(torch.float32)
    assert torch.equal(floats[0], offset) and torch.equal(floats[1:], scales)
    scale = scales.repeat_interleave(256)[:n]
    table, codes = dynamic_code(True), blob[start:start + n].long()
    gap = (centred[:, None] / scale.clamp(min=1e-38)[:, None] - table).abs()  # (0 / 0: 0)
    # the nearest code (up to the last bit of x * (1 / scale) against x / scale)
    assert (gap.gather(1, codes[:, None])[:, 0] <= gap.min(dim=1).values + 1e-7).all()
    decoded = nf4_ops.nf4_absmax(blob, n)
    assert torch.equal(decoded, table[codes] * scale + offset)
    shifted = torch.zeros(blob.numel() + 1, dtype=torch.uint8)  # (a view at an odd byte)
    shifted[1:] = blob
    assert torch.equal(nf4_ops.nf4_absmax(shifted[1:], n), decoded)
    assert (decoded - absmax).abs().max() <= scale.max() * 0.01  # (the map's largest gap /2)
    with pytest.raises(TypeError, match="dense 1-d fp32"):
        nf4_ops.nf4_double_quantize(absmax.double())
    with pytest.raises(ValueError, match="inf or nan"):
        nf4_ops.nf4_double_quantize(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match=f"absmax of {n + 4} blocks takes"):
        nf4_ops.nf4_absmax(blob, n + 4)
    if n == 1:  # (1 to 4 blocks take the same bytes: the header tells them apart)
        with pytest.raises(ValueError, match="of 2 blocks takes 16 bytes and says 2; got 16 "
                                             "bytes saying 1"):
            nf4_ops.nf4_absmax(blob, 2)


def test_double_quantised_layers_save_load_and_train_in_either_form():
    # QLoRA's double quantisation in NF4Linear: 0.5159 bytes a weight instead of 0.5625, the
    # weights within the absmax's 8-bit rounding of plain NF4's; a state_dict of either form
    # loads into a layer of either (the layer takes the saved form); double_quantize() in place
    # is from_linear(double_quant=True)
    dense = nn.Linear(160, 96)
    plain = quant.NF4Linear.from_linear(dense)
    double = quant.NF4Linear.from_linear(dense, double_quant=True)
    assert not plain.double_quant and double.double_quant and "double_quant=True" in repr(double)
    assert torch.equal(double.weight_packed, plain.weight_packed)
    weights = 160 * 96
    assert plain.weight_absmax.numel() * 4 == weights // 16
    assert double.weight_absmax.numel() == nf4_ops.nested_absmax_bytes(weights // 64)
    err = [(m.dequantize() - dense.weight).pow(2).mean().sqrt() for m in (plain, double)]
    torch.testing.assert_close(err[1], err[0], rtol=1e-3, atol=0)
    assert torch.equal(copy.deepcopy(plain).double_quantize().weight_absmax, double.weight_absmax)
    for saved, into in ((double, quant.NF4Linear(160, 96)),
                        (plain, quant.NF4Linear(160, 96, double_quant=True)),
                        (double, quant.NF4Linear(160, 96, double_quant=True).shardable())):
        into.load_state_dict(saved.state_dict())
        assert into.double_quant == saved.double_quant
        assert torch.equal(into.dequantize(), saved.dequantize())
    # a checkpoint of another blocksize whose bytes coincide (1 to 4 blocks) is refused
    tiny = quant.NF4Linear.from_linear(nn.Linear(16, 8), blocksize=32, double_quant=True)
    with pytest.raises(ValueError, match="holds 4 double-quantised blocks; this layer has 2"):
        quant.NF4Linear(16, 8, double_quant=True).load_state_dict(tiny.state_dict())
    # a dense weight loads quantised in the layer's form; a bad absmax changes nothing
    into = quant.NF4Linear(160, 96, double_quant=True)
    into.load_state_dict(dense.state_dict())
    assert torch.equal(into.weight_absmax, double.weight_absmax)
    before = into.weight_absmax.clone()
    for bad, error, says in ((double.weight_absmax[:-4], RuntimeError, "size mismatch"),
                             (plain.weight_absmax[:-1], ValueError, "holds 239 torch.float32"),
                             (plain.weight_absmax.double(), TypeError, "is torch.float64")):
        with pytest.raises(error, match=says):
            into.load_state_dict({**double.state_dict(), "weight_absmax": bad})
        assert torch.equal(into.weight_absmax, before)
    # a model quantised so: the bytes, and logits close to plain NF4's
    ids = torch.randint(0, 128, (2, 9))
    models = [quant.quantize_nf4(_tiny_llama(), double_quant=d) for d in (False, True)]
    sizes = [quant.nf4_bytes(m) for m in models]
    assert sizes[1] < 0.925 * sizes[0]
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in models]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=2e-3)


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append((t.numel(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_is_linear_on_the_dequantised_weight(dtype, bias):
    dense = nn.Linear(70, 33, bias=bias).to(dtype)
    layer = quant.NF4Linear.from_linear(dense, blocksize=16)
    layer.bias is None or layer.bias.requires_grad_(True)
    w = layer.dequantize()
    assert w.dtype == dtype and layer.compute_dtype == dtype
    x = torch.randn(3, 5, 70, dtype=dtype, requires_grad=True)
    y, saved = _saved_numels(lambda: layer(x))
    assert not any(n >= w.numel() and d.is_floating_point for n, d in saved)  # no dense W kept
    x2 = x.detach().clone().requires_grad_()
    b2 = None if layer.bias is None else layer.bias.detach().clone().requires_grad_()
    y2 = linear(x2, w, b2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b2.grad, rtol=0, atol=0)
    # and it is nn.Linear's maths within the dtype's rounding
    want = F.linear(x.detach().double(), w.double(), None if b2 is None else b2.detach().double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,adapter_dtype,double_quant", [
    (torch.float32, None, False), (torch.bfloat16, torch.float32, False),
    (torch.float32, None, True), (torch.bfloat16, torch.float32, True)])
def test_lora_over_nf4_is_lora_over_the_dequantised_weight(dtype, adapter_dtype, double_quant):
    dense = nn.Linear(48, 40, bias=True).to(dtype)
    base = quant.NF4Linear.from_linear(dense, blocksize=16, double_quant=double_quant)
    ours = LoRALinear(base, r=4, alpha=8, dropout=0.25, adapter_dtype=adapter_dtype).train()
    with torch.no_grad():
        ours.lora_B.normal_()
    x = torch.randn(2, 7, 48, dtype=dtype, requires_grad=True)
    y, saved = _saved_numels(lambda: ours(x, ))
    assert not any(n >= 48 * 40 and d.is_floating_point for n, d in saved)
    x2 = x.detach().clone().requires_grad_()
    a2, b2 = (ours.lora_A.detach().clone().requires_grad_(),
              ours.lora_B.detach().clone().requires_grad_())
    torch.manual_seed(0)
    y = ours(x)
    torch.manual_seed(0)  # the same dropout seed
    y2 = lora_linear(x2, base.dequantize(), a2, b2, ours.scaling, base.bias, 0.25)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(y, y2)
    for got, want in ((x.grad, x2.grad), (ours.lora_A.grad, a2.grad), (ours.lora_B.grad, b2.grad)):
        assert torch.equal(got, want)
    assert base.bias.grad is None  # frozen, as the base's bias was made


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_lora_compiles_fullgraph(double_quant):
    base = quant.NF4Linear.from_linear(nn.Linear(32, 24), blocksize=16, double_quant=double_quant)
    nf4_ops._DYNAMIC.clear()  # (the code tables' first use inside the trace: no graph break)
    nf4_ops._CODES.clear()
    layer = LoRALinear(base, r=4, alpha=8)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(6, 32, requires_grad=True)
    g = torch.randn(6, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.backward(g)
    got = [t.grad for t in (x, layer.lora_A, layer.lora_B)]
    x.grad = layer.lora_A.grad = layer.lora_B.grad = None
    want = layer(x)
    want.backward(g)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, (x.grad, layer.lora_A.grad, layer.lora_B.grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_fake_trace_leaves_the_eager_path_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = quant.NF4Linear.from_linear(nn.Linear(32, 24), blocksize=16)
    x = torch.randn(3, 32)
    want = layer(x)
    nf4_ops._SCRATCH.buffers.clear()  # (so that a trace would be the first to fill it)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert layer(mode.from_tensor(x)).shape == (3, 24)
    assert type(layer(x)) is torch.Tensor and torch.equal(layer(x), want)


def _projections(dtype):
    """Three NF4 bases (q/k/v-like, biases on two) and one dense nn.Linear over one input, LoRA
    on the first, third and fourth: (bases, lora_as, lora_bs, scalings)."""
    torch.manual_seed(0)
    dense = [nn.Linear(48, out, bias=b).to(dtype)
             for out, b in ((40, True), (24, False), (24, True), (16, True))]
    bases = [quant.NF4Linear.from_linear(layer, blocksize=16, double_quant=i == 1)
             for i, layer in enumerate(dense[:3])] + dense[3:]  # (the second double-quantised)
    ranks = (4, None, 2, 3)
    lora_as = [None if r is None else (torch.randn(r, 48) * 0.3).to(dtype).requires_grad_()
               for r in ranks]
    lora_bs = [None if r is None else (torch.randn(b.out_features, r) * 0.3).to(dtype)
               .requires_grad_() for r, b in zip(ranks, bases)]
    return bases, lora_as, lora_bs, [2.0, 1.0, 0.5, 1.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlora_projections_read_x_once_and_equal_the_dense_ones(dtype):
    # the multi-projection LoRA over NF4 bases is lora_linear_multi over the dequantised weights,
    # bit for bit, forward and every gradient, keeping no dense weight for the backward
    bases, lora_as, lora_bs, scalings = _projections(dtype)
    x = torch.randn(2, 7, 48, dtype=dtype, requires_grad=True)
    ys, saved = _saved_numels(
        lambda: quant.nf4_lora_linear_multi(x, bases, lora_as, lora_bs, scalings))
    assert not any(n >= 24 * 48 and d.is_floating_point for n, d in saved)
    x2 = x.detach().clone().requires_grad_()
    as2, bs2 = ([None if t is None else t.detach().clone().requires_grad_() for t in ts]
                for ts in (lora_as, lora_bs))
    dense = [b.dequantize() if isinstance(b, quant.NF4Linear) else b.weight for b in bases]
    want = lora_linear_multi(x2, dense, as2, bs2, scalings, [b.bias for b in bases])
    gs = [torch.randn_like(y) for y in want]
    torch.autograd.backward(ys, gs)
    torch.autograd.backward(want, gs)
    for y, w in zip(ys, want):
        assert y.dtype == dtype and torch.equal(y, w)
    assert torch.equal(x.grad, x2.grad)
    for got, exp in zip(lora_as + lora_bs, as2 + bs2):
        assert (got is None and exp is None) or torch.equal(got.grad, exp.grad)
    assert torch.equal(bases[3].weight.grad, dense[3].grad)  # the dense layer's weight trains
    # and as separate layers would give it (to rounding: one concatenated product for the As)
    x3 = x.detach().clone().requires_grad_()
    each = [quant.nf4_lora_linear(x3, b.weight_packed, b.weight_absmax, b.weight_shape,
                                  b.blocksize, a, bb, s, b.bias) if a is not None else b(x3)
            for b, a, bb, s in zip(bases[:3], lora_as, lora_bs, scalings)]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for y, e in zip(ys, each):
        torch.testing.assert_close(y, e, **tol)
    compiled = torch.compile(quant.nf4_lora_linear_multi, fullgraph=True, backend="aot_eager")
    for y, c in zip(ys, compiled(x, bases, lora_as, lora_bs, scalings)):
        torch.testing.assert_close(c, y, rtol=1e-6, atol=1e-6)


def test_qlora_projections_refuse_what_they_cannot_run():
    bases, lora_as, lora_bs, scalings = _projections(torch.float32)
    x = torch.randn(3, 48)
    cases = [
        (lambda: (x.bfloat16(), bases, lora_as, lora_bs), TypeError, "base 0 computes in"),
        (lambda: (x, bases[:3] + [LoRALinear(bases[3], r=2)], lora_as, lora_bs), TypeError,
         "base 3 is a LoRALinear"),
        (lambda: (x, [object()] + bases[1:], lora_as, lora_bs), TypeError, "base 0 is a object"),
        (lambda: (x, bases, lora_as[:3], lora_bs), ValueError, "one entry per projection"),
        (lambda: (x, bases, lora_as[:2] + [None, lora_as[3]], lora_bs), ValueError,
         "projection 2 has only one of A, B"),
        (lambda: (x, bases, [None if a is None else a.double() for a in lora_as],
                  [None if b is None else b.double() for b in lora_bs]), TypeError,
         "lora_a has dtype torch.float64"),
        (lambda: (torch.randn(3, 47), bases, lora_as, lora_bs), ValueError, r"\(\.\.\., 48\)"),
    ]
    for make, error, match in cases:
        with pytest.raises(error, match=match):
            quant.nf4_lora_linear_multi(*make(), scalings)
    bf16 = [b.to(torch.bfloat16) for b in _projections(torch.float32)[0]]
    with pytest.raises(TypeError, match="adapters must be in x's dtype"):
        quant.nf4_lora_linear_multi(x.bfloat16(), bf16, lora_as, lora_bs, scalings)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        quant.nf4_lora_linear_multi(x, bases, lora_as, lora_bs, scalings)


@pytest.mark.parametrize("dtype,dropout", [(torch.float32, 0.2), (torch.bfloat16, 0.0)])
def test_qlora_down_proj_over_swiglu_equals_the_dense_one(dtype, dropout):
    from fastllm.ops.swiglu_lora_linear import swiglu_lora_linear

    base = quant.NF4Linear.from_linear(nn.Linear(40, 24, bias=True).to(dtype), blocksize=16,
                                       double_quant=dtype == torch.bfloat16)
    gate, up = (torch.randn(3, 5, 40, dtype=dtype, requires_grad=True) for _ in range(2))
    lora_a = (torch.randn(4, 40) * 0.3).to(dtype).requires_grad_()
    lora_b = (torch.randn(24, 4) * 0.3).to(dtype).requires_grad_()
    y, saved = _saved_numels(lambda: quant.nf4_swiglu_lora_linear(
        gate, up, base, lora_a, lora_b, 1.5, dropout, seed=11))
    assert not any(n >= 24 * 40 and d.is_floating_point for n, d in saved)  # nor the weight
    assert [n for n, _ in saved].count(gate.numel()) == 2  # gate and up, not their product
    g2, u2, a2, b2 = (t.detach().clone().requires_grad_() for t in (gate, up, lora_a, lora_b))
    want = swiglu_lora_linear(g2, u2, base.dequantize(), a2, b2, 1.5, base.bias, dropout,
                              seed=11)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(y, want)
    for got, exp in ((gate, g2), (up, u2), (lora_a, a2), (lora_b, b2)):
        assert torch.equal(got.grad, exp.grad)
    with pytest.raises(TypeError, match="base computes in torch.bfloat16, gate is torch.float32"
                       if dtype == torch.bfloat16 else "computes in torch.float32"):
        quant.nf4_swiglu_lora_linear(gate.detach().to(torch.float32 if dtype == torch.bfloat16
                                                      else torch.bfloat16),
                                     up.detach(), base, lora_a, lora_b, 1.0)
    with pytest.raises(TypeError, match="expected NF4Linear"):
        quant.nf4_swiglu_lora_linear(gate, up, nn.Linear(40, 24), lora_a, lora_b, 1.0)


@pytest.mark.parametrize("dtype,adapter_dtype,dropout,bias,double_quant,hooked", [
    (torch.float32, None, 0.0, True, False, False), (torch.float32, None, 0.2, False, True, False),
    (torch.bfloat16, None, 0.0, False, False, False),
    (torch.bfloat16, torch.float32, 0.0, True, True, False),
    (torch.bfloat16, torch.float32, 0.1, False, False, False),
    (torch.float32, None, 0.2, False, False, True)])
def test_qdora_is_dora_over_the_dequantised_weight(dtype, adapter_dtype, dropout, bias,
                                                   double_quant, hooked):
    # DoRA over an NF4 base (QDoRA): the magnitude, outputs and every grad of DoRA over the
    # dequantised dense weight, bit for bit, in every forward path (fused, dropout, fp32
    # adapters, a base layer with a hook); without dropout no dense weight is kept for the
    # backward. hooked: the path that takes the hooked base's output kept the CPU's reused
    # dequantisation buffer for the backward, which another NF4 layer overwrote before it
    from fastllm.dora import DoRALinear

    torch.manual_seed(0)
    base = quant.NF4Linear.from_linear(nn.Linear(48, 40, bias=bias).to(dtype), blocksize=16,
                                       double_quant=double_quant)
    ours = DoRALinear(base, r=4, alpha=8, dropout=dropout, adapter_dtype=adapter_dtype).train()
    theirs = DoRALinear(base.to_linear(), r=4, alpha=8, dropout=dropout,
                        adapter_dtype=adapter_dtype).train()
    if hooked:  # (e.g. an activation probe)
        for layer in (ours, theirs):
            layer.base_layer.register_forward_hook(lambda module, args, out: None)
    assert torch.equal(ours.lora_magnitude_vector, theirs.lora_magnitude_vector)
    with torch.no_grad():
        ours.lora_B.normal_()
        ours.lora_magnitude_vector.mul_(1.1)
        for name in ("lora_A", "lora_B", "lora_magnitude_vector"):
            getattr(theirs, name).copy_(getattr(ours, name))
    x = torch.randn(2, 7, 48, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    y, saved = _saved_numels(lambda: ours(x))
    if dropout == 0.0:
        assert not any(n >= 48 * 40 and d.is_floating_point for n, d in saved)
    torch.manual_seed(1)  # the same dropout masks
    want = theirs(x2)
    if hooked:  # another NF4 layer's forward before the backward (the next decoder layer's)
        quant.NF4Linear.from_linear(nn.Linear(48, 40).to(dtype), blocksize=16)(x.detach())
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    assert torch.equal(y, want)
    assert torch.equal(x.grad, x2.grad)
    for name in ("lora_A", "lora_B", "lora_magnitude_vector"):
        assert torch.equal(getattr(ours, name).grad, getattr(theirs, name).grad), name
    # merged after dequantize_nf4 (what `fastllm export --merged` does): the layer's outputs
    holder = nn.Sequential(copy.deepcopy(ours)).eval()
    with torch.no_grad():
        before = holder(x)
        merged = merge_and_unload(quant.dequantize_nf4(holder))
        assert type(merged[0]) is nn.Linear
        torch.testing.assert_close(merged(x), before, rtol=2e-2 if dtype == torch.bfloat16
                                   else 1e-5, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager", tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("shardable", [False, True])
def test_module_dtype_moves_keep_the_codes(shardable):
    # (the shardable layer's absmax double-quantised: uint8, kept under casts as the codes)
    layer = quant.NF4Linear.from_linear(nn.Linear(64, 32), double_quant=shardable)
    packed, absmax = layer.weight_packed.clone(), layer.weight_absmax.clone()
    if shardable:  # codes and absmax held as frozen parameters (for FSDP2): the same keys
        keys = list(layer.state_dict())
        x = torch.randn(3, 64)
        before = layer(x)
        assert layer.shardable() is layer and layer.shardable() is layer  # (again: no change)
        assert {n for n, _ in layer.named_buffers()} == set()
        assert {n: p.requires_grad for n, p in layer.named_parameters()} == {
            "weight_packed": False, "weight_absmax": False, "bias": True}  # (as the linear had it)
        assert list(layer.state_dict()) == keys and torch.equal(layer(x), before)
    layer.to(torch.bfloat16)
    assert layer.compute_dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_absmax, absmax)
    layer.type(torch.float16)  # (Module.type casts every tensor, integer ones too)
    assert layer.compute_dtype == torch.float16 and layer.weight_packed.dtype == torch.uint8
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_absmax, absmax)
    layer.to(torch.bfloat16)
    assert layer.dequantize().dtype == torch.bfloat16
    assert isinstance(layer.weight_packed, nn.Parameter) == shardable
    fresh = quant.NF4Linear(64, 32, dtype=torch.bfloat16)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.dequantize(), layer.dequantize()) and fresh.double_quant == shardable
    if shardable and _torch_support.TORCH >= _torch_support.FSDP2_INTEGER_PARAMS:
        from fastllm.train.model import weight_count

        model = nn.Sequential(quant.NF4Linear(64, 32), nn.Linear(32, 2))
        counted = weight_count(model)  # (the 4-bit weight counts as its 64 x 32 parameters)
        assert quant.shardable_nf4(model) == 1 and weight_count(model) == counted == 64 * 32 + (
            32 + 32 * 2 + 2)
        model.load_state_dict({**model.state_dict(), **{"0." + k: v for k, v in
                                                        layer.float().state_dict().items()}})
        assert torch.equal(model[0].weight_packed, packed)
        assert torch.equal(model[0].weight_absmax, absmax)


def test_shardable_nf4_refused_where_fsdp2_cannot_shard_integers(monkeypatch):
    """Below FSDP2_INTEGER_PARAMS (torch 2.11's fully_shard fails on uint8 parameters)
    shardable_nf4, which fastllm.parallel.apply_fsdp calls, refuses a model with NF4 layers,
    naming the release and the way out, before any layer changes; a model without is let be."""
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(_torch_support, "TORCH", TorchVersion("2.11.0"))
    model = nn.Sequential(quant.NF4Linear(64, 32), quant.NF4Linear(32, 16))
    with pytest.raises(RuntimeError, match=r"shardable_nf4: FSDP2 in torch 2\.11\.0 cannot shard "
                                           r".*pytorch/pytorch#177844.*torch >= 2\.12"):
        quant.shardable_nf4(model)
    assert {n for n, _ in model.named_buffers()} == {  # still buffers
        f"{i}.weight_{what}" for i in (0, 1) for what in ("packed", "absmax")}
    assert quant.shardable_nf4(nn.Sequential(nn.Linear(2, 2))) == 0
    # fastllm train refuses the config before it loads a model
    from fastllm.train import TrainConfig
    from fastllm.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"lora.quantize_base=nf4: FSDP2 in torch 2\.11\.0.*"
                                          r"parallel.strategy=ddp, or none"):
        TrainConfig.from_args(["finetune=lora", "lora.quantize_base=nf4",
                               "parallel.strategy=fsdp"])
    TrainConfig.from_args(["finetune=lora", "lora.quantize_base=nf4", "parallel.strategy=ddp"])


def test_qlora_tiny_llama_trains_and_peft_reads_the_adapter(tmp_path):
    import peft

    model = quant.quantize_nf4(_tiny_llama())
    names = [n for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)]
    assert len(names) == 14 and not any("lm_head" in n for n in names)  # 7 per layer, head dense
    assert quant.nf4_bytes(model) < sum(
        m.in_features * m.out_features for n, m in _tiny_llama().named_modules()
        if isinstance(m, nn.Linear) and n != "lm_head") * 0.6  # 0.5625 bytes a weight
    dense = quant.dequantize_nf4(copy.deepcopy(model))  # the same weights, dense
    inject_lora(model, target_modules="all-linear", r=4, alpha=8)
    inject_lora(dense, target_modules="all-linear", r=4, alpha=8)
    assert len(lora_modules(model)) == 14
    with torch.no_grad():
        for (_, a), (_, b) in zip(lora_modules(model), lora_modules(dense)):
            b.lora_A.copy_(a.lora_A)
    patched = fastllm.patch(copy.deepcopy(model))
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(3))
    losses = {}
    for m in (model, dense):
        m.train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses[m] = []
        for _ in range(12):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[m].append(loss.item())
    assert losses[model][-1] < losses[model][0] - 0.3, losses  # a fixed batch: LoRA fits it
    # QLoRA is LoRA on the dequantised weights: the same losses, step by step
    torch.testing.assert_close(losses[model], losses[dense], rtol=1e-5, atol=0)
    model.eval()
    # fastllm.patch gives the same loss on the 4-bit model
    with torch.no_grad():
        for (_, a), (_, b) in zip(lora_modules(patched), lora_modules(model)):
            a.lora_A.copy_(b.lora_A)
            a.lora_B.copy_(b.lora_B)
        torch.testing.assert_close(patched.eval()(input_ids=ids, labels=ids).loss,
                                   model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)
    # the adapter is a PEFT adapter: on the dense dequantised model it gives the same logits
    save_adapter(model, str(tmp_path), task_type="CAUSAL_LM")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4
    plain = quant.dequantize_nf4(unload(copy.deepcopy(model)))
    assert not any(isinstance(m, quant.NF4Linear) for m in plain.modules())
    theirs = peft.PeftModel.from_pretrained(plain, str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, theirs(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    # merging needs dense bases; dequantize_nf4 gives them
    with pytest.raises(ValueError, match="4-bit NF4 base"):
        merge_lora(model)
    assert not any(m.merged for _, m in lora_modules(model))
    merged = merge_and_unload(quant.dequantize_nf4(copy.deepcopy(model)))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_patch_runs_qlora_projections_together(monkeypatch):
    # fastllm.patch sends q/k/v and gate/up of a QLoRA model through nf4_lora_linear_multi and
    # down_proj through nf4_swiglu_lora_linear; the step's loss and adapter grads are those of
    # the unpatched layers
    model = quant.quantize_nf4(_tiny_llama())
    inject_lora(model, target_modules="all-linear", r=4, alpha=8)
    with torch.no_grad():
        for _, layer in lora_modules(model):
            layer.lora_B.normal_(std=0.1)
    patched = fastllm.patch(copy.deepcopy(model))
    calls, real = [], quant.nf4_lora_linear_multi
    monkeypatch.setattr(quant, "nf4_lora_linear_multi",
                        lambda x, bases, *rest: calls.append(len(bases)) or real(x, bases, *rest))
    real_down = quant.nf4_swiglu_lora_linear
    monkeypatch.setattr(quant, "nf4_swiglu_lora_linear",
                        lambda *args, **kw: calls.append("down") or real_down(*args, **kw))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    losses = [m.train()(input_ids=ids, labels=ids).loss for m in (model, patched)]
    for loss in losses:
        loss.backward()
    assert calls == [3, 2, "down"] * 2  # per layer: q/k/v, gate/up, down_proj over swiglu
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), (_, b) in zip(lora_modules(model), lora_modules(patched)):
        for p, q in ((a.lora_A, b.lora_A), (a.lora_B, b.lora_B)):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_quantize_refusals_leave_the_model_unchanged():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="tied weights"):
        quant.quantize_nf4(model, target_modules=["lm_head", "q_proj"])
    assert not any(isinstance(m, quant.NF4Linear) for m in model.modules())
    with pytest.raises(ValueError, match="no nn.Linear"):
        quant.quantize_nf4(model, target_modules=["nope"])
    inject_lora(model, target_modules=["q_proj"])
    for targets in (None, ["q_proj"]):  # (the default would have reached q_proj.base_layer)
        with pytest.raises(ValueError, match="has adapter layers .* quantise the base model"):
            quant.quantize_nf4(model, target_modules=targets)
    assert not any(isinstance(m, quant.NF4Linear) for m in model.modules())


# ----- fastllm train lora.quantize_base=nf4 -----

@pytest.mark.parametrize("overrides,says", [
    (["lora.quantize_base=nf8"], "lora.quantize_base must be none or nf4, got 'nf8'"),
    (["finetune=full", "lora.quantize_base=nf4"], r"is QLoRA \(or QDoRA .*\): finetune=lora with"),
    (["finetune=lora", "backend=torch", "lora.quantize_base=nf4"], "backend=torch"),
    (["finetune=lora", "parallel.strategy=zero2", "lora.quantize_base=nf4"],
     "runs whole on each rank or FSDP2-sharded: .* got strategy=zero2"),
    (["finetune=lora", "parallel.tp=2", "lora.quantize_base=nf4"],
     "runs whole on each rank or FSDP2-sharded: .* tp=2"),
    (["finetune=lora", "lora.double_quant=true"], "lora.double_quant=true double-quantises the "
                                                   "absmax of a 4-bit base: it needs lora.quant"),
])
def test_train_config_refuses_qlora_where_it_cannot_run(overrides, says):
    from fastllm.train import TrainConfig
    from fastllm.train.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        TrainConfig.from_args(overrides)


@pytest.mark.usefixtures("one_thread")
def test_train_qlora_resumes_exactly_and_saves_a_peft_adapter(tmp_path):
    import shutil

    from fastllm.train import TrainConfig, Trainer
    from fastllm.train.metrics import read_metrics

    def run(out, *extra):
        args = ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "lr=1e-2",
                "warmup_steps=1", "threads=1", "log_interval=1000", "track_memory=false",
                f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", "max_steps=2",
                "checkpoint.interval=1", "finetune=lora", *extra]
        trainer = Trainer(TrainConfig.from_args(args), log=lambda text: None)
        summary = trainer.train()
        layers = [m for m in trainer.module.modules() if isinstance(m, quant.NF4Linear)]
        return summary, layers, [r["loss"] for r in read_metrics(
            os.path.join(out, "metrics.jsonl"))]

    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    _, layers, losses = run(ref, "lora.quantize_base=nf4")
    assert len(layers) == 2 * 7  # every linear of the 2 decoder layers; the head stays dense
    _, dense_layers, dense = run(str(tmp_path / "dense"))
    assert not dense_layers and losses != dense  # the base differs by its 4-bit rounding...
    torch.testing.assert_close(losses[0], dense[0], rtol=2e-2, atol=0)  # ...a little
    shutil.copytree(ref, out, ignore=shutil.ignore_patterns(".lock", "checkpoint-2"))
    summary, _, resumed = run(out, "lora.quantize_base=nf4")
    assert summary["resumed_from"].endswith("checkpoint-1") and resumed == losses
    config = json.loads((tmp_path / "ref" / "checkpoint-2" / "adapter" /
                         "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == [
        "q_proj", "v_proj"]


@pytest.mark.usefixtures("one_thread")
def test_train_qdora_saves_a_dora_adapter_that_peft_reads(tmp_path):
    import peft

    from fastllm.dora import DoRALinear
    from fastllm.train import TrainConfig, Trainer

    args = ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "lr=1e-2", "warmup_steps=1",
            "threads=1", "log_interval=1000", "track_memory=false", "max_steps=2",
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}",
            "checkpoint.interval=2", "finetune=lora", "lora.use_dora=true",
            "lora.quantize_base=nf4"]
    trainer = Trainer(TrainConfig.from_args(args), log=lambda text: None)
    trainer.train()
    model = fastllm.unpatch(copy.deepcopy(trainer.module)).eval()
    layers = [m for m in model.modules() if isinstance(m, DoRALinear)]
    assert len(layers) == 2 * 2 and all(isinstance(m.base_layer, quant.NF4Linear)
                                        for m in layers)
    assert any(not torch.equal(m.lora_magnitude_vector, m.weight_norm()) for m in layers)
    adapter = tmp_path / "out" / "checkpoint-2" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    # PEFT's DoRA on the dequantised base reads the adapter and gives the trained model's logits
    plain = quant.dequantize_nf4(unload(copy.deepcopy(model)))
    theirs = peft.PeftModel.from_pretrained(plain, str(adapter)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("one_thread")
def test_export_of_a_qlora_run_is_the_trained_model(tmp_path):
    import peft

    from fastllm.export import export, load_run
    from fastllm.train import TrainConfig, Trainer

    run_dir = str(tmp_path / "run")
    Trainer(TrainConfig.from_args([
        "model=tiny", "data.seq_len=32", "micro_batch_size=4", "lr=1e-2", "warmup_steps=1",
        "threads=1", "log_interval=1000", "track_memory=false", "max_steps=2",
        f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}", "finetune=lora",
        "lora.quantize_base=nf4"]), log=lambda text: None).train()
    model, _, _ = load_run(run_dir)
    assert sum(isinstance(m, quant.NF4Linear) for m in model.modules()) == 14
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            export(run_dir, str(tmp_path / "merged"), merged=True))
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        adapter = export(run_dir, str(tmp_path / "adapter"))
        base = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "adapter" / "base_model"))
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
        torch.testing.assert_close(theirs(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_bench_qlora_runs_on_a_model_folder(tmp_path):
    import subprocess
    import sys

    _tiny_llama().save_pretrained(tmp_path / "model")
    out = subprocess.run(
        [sys.executable, "bench/bench_qlora.py", str(tmp_path / "model"), "--providers",
         "fastllm-lora,fastllm-qlora", "--batch", "1", "--length", "8", "--steps", "1",
         "--threads", "1", "--targets", "all", "--json", str(tmp_path / "rows.json")],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["provider"] for r in rows] == ["fastllm-lora", "fastllm-qlora"]
    dense, nf4 = rows
    assert nf4["base_weights_mib"] < dense["base_weights_mib"] * 0.3
    assert dense["tensor_peak_mib"] > 0 and nf4["losses"][0] != dense["losses"][0]
    # LoRA r=16 on the seven projections: r * (in + out) each, 2 layers of the tiny Llama
    assert dense["targets"] == "all" and dense["trainable"] == nf4["trainable"] == 2 * 16 * (
        4 * (64 + 64) - 2 * (64 - 32) + 3 * (64 + 96))


def test_default_targets_are_exactly_nn_linear_and_compare_hf_refuses_qlora():
    from fastllm.train import TrainConfig
    from fastllm.train.compare_hf import check
    from fastllm.train.config import ConfigError

    class Sub(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(16, 16), Sub(16, 16))
    quant.quantize_nf4(model)
    assert isinstance(model[0], quant.NF4Linear) and type(model[1]) is Sub
    with pytest.raises(ConfigError, match="quantize_base=nf4 has no counterpart"):
        check(TrainConfig.from_args(["finetune=lora", "lora.quantize_base=nf4"]))


# ----- bitsandbytes 4-bit checkpoints, read without bitsandbytes -----

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
BNB_FOLDER = os.path.join(DATA, "bnb_nf4_tiny")  # tests/data/make_bnb_nf4.py made it


def test_from_pretrained_reads_a_bitsandbytes_double_quantised_checkpoint():
    from safetensors.torch import load_file

    expected = load_file(os.path.join(DATA, "bnb_nf4_tiny_expected.safetensors"))
    model = quant.from_pretrained(BNB_FOLDER)
    layers = [m for m in model.modules() if isinstance(m, quant.NF4Linear)]
    assert len(layers) == 14 and type(model.lm_head) is nn.Linear
    assert all(m.double_quant for m in layers)  # (held nested, as saved)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as saved
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        # the nested (8-bit) absmax and the codes give bitsandbytes' own dequantised weight
        assert torch.equal(model.get_submodule(name).dequantize(), expected[name])
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-6, atol=1e-6)
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


def test_nf4_layers_load_dense_weights_and_refuse_other_4bit(tmp_path):
    import shutil

    dense = nn.Linear(40, 24)
    layer = quant.NF4Linear(40, 24, dtype=torch.float32)
    layer.load_state_dict(dense.state_dict())  # a dense weight is quantised as it loads
    assert torch.equal(layer.dequantize(), quant.NF4Linear.from_linear(dense).dequantize())
    with pytest.raises(ValueError, match=r"neither a dense \(24, 40\) weight"):
        layer.load_state_dict({"weight": torch.zeros(24, 41), "bias": dense.bias})
    folder = tmp_path / "fp4"
    shutil.copytree(BNB_FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="4-bit fp4 weights; only NF4"):
        quant.from_pretrained(str(folder))
    assert quant.bnb_4bit_config(str(tmp_path)) is None  # (no config.json: not one)


def test_train_takes_a_4bit_folder_as_qlora_only():
    from fastllm.train import TrainConfig
    from fastllm.train.config import ConfigError
    from fastllm.train.model import build_model, check_model

    with pytest.raises(ConfigError, match="holds bitsandbytes 4-bit NF4 weights: train it with "
                                          "finetune=lora lora.quantize_base=nf4"):
        check_model(TrainConfig.from_args([f"model={BNB_FOLDER}", "finetune=full"]))
    cfg = TrainConfig.from_args([f"model={BNB_FOLDER}", "finetune=lora",
                                 "lora.quantize_base=nf4"])
    check_model(cfg)
    model = build_model(cfg, 128, torch.bfloat16)
    assert sum(isinstance(m, quant.NF4Linear) for m in model.modules()) == 14
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(m.compute_dtype == torch.bfloat16 for m in model.modules()
               if isinstance(m, quant.NF4Linear))


def test_from_pretrained_follows_a_skip_list_a_quantised_head_and_bf16_storage():
    from safetensors.torch import load_file

    folder = BNB_FOLDER + "_skip"  # layer 0 dense, the untied head in 4-bit, codes stored bf16
    expected = load_file(folder + "_expected.safetensors")
    model = quant.from_pretrained(folder)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert isinstance(model.lm_head, quant.NF4Linear)
    assert sum(isinstance(m, quant.NF4Linear) for m in model.modules()) == 8  # layer 1 + head
    # as transformers loads it: parameters in the config's dtype, the 4-bit layers computing
    # in bnb_4bit_compute_dtype
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.compute_dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == [2, 7]  # (generation_config.json read)
    for name in ("model.layers.1.mlp.down_proj", "lm_head"):
        want = expected[name]  # (in the weights' saved dtype, fp32)
        assert torch.equal(model.get_submodule(name).dequantize(want.dtype), want)
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    # bf16 products (equal bits on a Zen 2; 1e-3 leaves room for another CPU's bf16 GEMM, and
    # is below the 2.8e-3 that computing the 4-bit layers in fp32 instead gives)
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-3)


def _bnb_state(w, blocksize):
    """Linear4bit's saved keys for `w` without nested absmax (the codes and absmax being
    nf4_quantize's, which equal bitsandbytes': test_same_bits_as_bitsandbytes)."""
    packed, absmax = nf4_quantize(w, blocksize)
    meta = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32",
            "shape": list(w.shape)}
    return {"weight": packed[:, None], "weight.absmax": absmax,
            "weight.quant_map": torch.tensor(NF4_CODE),
            "weight.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(meta).encode()),
                                                                 dtype=torch.uint8)}


def test_a_checkpoints_blocksize_wins_and_bad_sizes_change_nothing():
    w = torch.randn(24, 40)
    layer = quant.NF4Linear(40, 24, bias=False)  # blocksize 64
    layer.load_state_dict(_bnb_state(w, 128))
    assert layer.blocksize == 128 and layer.weight_absmax.numel() == 8
    assert torch.equal(layer.dequantize(), nf4_dequantize(*nf4_quantize(w, 128), w.shape, 128))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = _bnb_state(w, 128)
    bad["weight.absmax"] = bad["weight.absmax"][:5]
    with pytest.raises(ValueError, match="8 absmax values|and 5 absmax values"):
        layer.load_state_dict(bad)
    del bad["weight.absmax"]
    with pytest.raises(ValueError, match="absmax keys are missing"):
        layer.load_state_dict(bad)
    assert layer.blocksize == 128
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
