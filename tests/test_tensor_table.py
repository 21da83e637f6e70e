"""The table-driven Triton optimizer steps (fastllm/kernels/tensor_table.py): many tensors, empty
ones between, chunks split across a tensor and a masked last block, all in one launch, against the
plain-PyTorch references; the table cache; misaligned addresses; the per-tensor fallback.
Triton runs here through the interpreter (tests/conftest.py), with small blocks and chunks so a
few hundred elements span several of each."""

import pytest
import torch

from fastllm import _backend
from _launches import count_launches
from fastllm.ops.adamw import adamw_step_ref
from fastllm.ops.adamw_master import adamw_master_step_ref

pytestmark = pytest.mark.skipif(_backend.unavailable_reason("triton", "cpu") is not None,
                                reason="triton is not available")

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
# 150 tensors: every third one empty, sizes up to 300 (blocks of 64, chunks of 128 below).
SIZES = [0 if i % 3 == 0 else (i * 37) % 300 + 1 for i in range(150)]


@pytest.fixture
def kernels(monkeypatch):
    from fastllm.kernels import adamw, adamw_master

    monkeypatch.setattr(adamw, "_sizes", lambda: (64, 2))
    monkeypatch.setattr(adamw_master, "_sizes", lambda: (64, 2))
    return adamw, adamw_master


def _lists(count, dtype, gen, sizes=SIZES, positive=False):
    out = []
    for _ in range(count):
        ts = [torch.randn(n, generator=gen) for n in sizes]
        out.append([(t.abs() if positive else t).to(dtype) for t in ts])
    return out


def _steps(n):
    return [torch.full((), float(i % 5 + 1)) for i in range(n)]


def _close(out, ref, dtype):
    for a, b in zip(out, ref):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:  # both round the same fp32 value to nearest: at most one ulp apart
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_many_tensors_one_launch(kernels, monkeypatch, dtype, amsgrad):
    adamw, _ = kernels
    gen = torch.Generator().manual_seed(0)
    p, g = _lists(2, dtype, gen)
    m, v, vmax = _lists(3, dtype, gen, positive=True)
    ref = [[t.clone() for t in lst] for lst in (p, g, m, v, vmax)]
    steps = _steps(len(SIZES))
    scale, skip = torch.full((), 4.0), torch.zeros(())
    calls = count_launches(monkeypatch, adamw, "_adamw_kernel")
    adamw.adamw_step_triton(p, g, m, v, vmax, steps, amsgrad=amsgrad, maximize=False,
                            grad_scale=scale, found_inf=skip, **HYPER)
    adamw_step_ref(*ref, steps, amsgrad=amsgrad, maximize=False, grad_scale=scale,
                   found_inf=skip, **HYPER)
    assert len(calls) == 1
    _close(p + m + v + (vmax if amsgrad else []),
           ref[0] + ref[2] + ref[3] + (ref[4] if amsgrad else []), dtype)
    assert all(torch.equal(a, b) for a, b in zip(g, ref[1]))  # grads only read


def test_adamw_found_inf_changes_nothing(kernels):
    adamw, _ = kernels
    gen = torch.Generator().manual_seed(1)
    p, g = _lists(2, torch.float32, gen)
    m, v = _lists(2, torch.float32, gen, positive=True)
    before = [t.clone() for t in p + m + v]
    adamw.adamw_step_triton(p, g, m, v, [], _steps(len(SIZES)), amsgrad=False, maximize=False,
                            found_inf=torch.ones(()), **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, before))


@pytest.mark.parametrize("mode", ["master", "kahan", "pure"])
def test_master_many_tensors_one_launch(kernels, monkeypatch, mode):
    _, master = kernels
    gen = torch.Generator().manual_seed(2)
    p, g = _lists(2, torch.bfloat16, gen)
    m, v = _lists(2, torch.float32, gen, positive=True)
    masters = [t.float() for t in p] if mode == "master" else []
    comps = [torch.zeros_like(t) for t in p] if mode == "kahan" else []
    ref = [[t.clone() for t in lst] for lst in (p, g, masters, m, v, comps)]
    steps = _steps(len(SIZES))
    scalars = dict(grad_scale=torch.full((), 2.0), clip_coef=torch.full((), 0.5),
                   found_inf=torch.zeros(()))
    calls = count_launches(monkeypatch, master, "_adamw_master_kernel")
    master.adamw_master_step_triton(p, g, masters, m, v, comps, steps, maximize=False,
                                    stochastic_rounding=False, seed=0, **scalars, **HYPER)
    adamw_master_step_ref(*ref, steps, **scalars, **HYPER)
    assert len(calls) == 1
    _close(masters + m + v, ref[2] + ref[3] + ref[4], torch.float32)
    _close(p, ref[0], torch.bfloat16)
    # The compensation is a residual: an fp32 ulp of x moves it far relative to itself, so the
    # value it carries (param + compensation) is what must agree.
    _close([a.float() + c.float() for a, c in zip(p, comps)],
           [a.float() + c.float() for a, c in zip(ref[0], ref[5])], torch.float32)


def test_master_stochastic_rounding_picks_a_neighbour(kernels):
    _, master = kernels
    gen = torch.Generator().manual_seed(3)
    p, g = _lists(2, torch.bfloat16, gen)
    m, v = _lists(2, torch.float32, gen, positive=True)
    masters = [t.float() for t in p]
    master.adamw_master_step_triton(p, g, masters, m, v, [], _steps(len(SIZES)), maximize=False,
                                    stochastic_rounding=True, seed=7, grad_scale=None,
                                    clip_coef=None, found_inf=None, **HYPER)
    x = torch.cat(masters)
    got = torch.cat(p).float()
    down = x.to(torch.bfloat16).float()
    ulp = (down.abs() * 2 ** -7).clamp_min(2 ** -133)
    assert ((got - x).abs() <= ulp).all()  # one of the two bf16 neighbours of the master
    assert (got != down).any()  # and not always the nearest


def test_table_cached_until_an_address_changes(kernels):
    from fastllm.kernels import tensor_table

    gen = torch.Generator().manual_seed(4)
    p, g = _lists(2, torch.float32, gen, sizes=[5, 0, 130])
    steps = _steps(3)
    first = tensor_table.table([p, g], steps, 128, p[0].device)
    assert tensor_table.table([p, g], steps, 128, p[0].device) is first
    assert first.n_chunks == 3  # 5 -> 1 chunk, 0 -> none, 130 -> 2
    g[2] = g[2].clone()
    again = tensor_table.table([p, g], steps, 128, p[0].device)
    assert again is not first
    assert again.chunks.view(-1, 2).tolist() == [[0, 0], [2, 0], [2, 128]]


def test_misaligned_and_per_tensor_paths_match(kernels, monkeypatch):
    adamw, _ = kernels
    gen = torch.Generator().manual_seed(5)
    sizes = [7, 0, 123, 200]
    # Views one element into a flat buffer: addresses 4 bytes past a 16-byte boundary.
    flat = [torch.randn(sum(sizes) + 1, generator=gen) for _ in range(4)]
    flat[2].abs_()
    flat[3].abs_()
    lists = [list(f[1:].split(sizes)) for f in flat]
    copies = [[t.clone() for t in lst] for lst in lists]
    steps = _steps(len(sizes))
    found = adamw.table(lists + [None], steps, 128, flat[0].device)
    assert not found.aligned
    adamw.adamw_step_triton(*lists, [], steps, amsgrad=False, maximize=False, **HYPER)
    calls = count_launches(monkeypatch, adamw, "_adamw_tensor_kernel")
    monkeypatch.setattr(adamw, "table", lambda *args: None)
    adamw.adamw_step_triton(*copies, [], steps, amsgrad=False, maximize=False, **HYPER)
    assert len(calls) == 3  # the fallback: one launch per non-empty tensor
    for a, b in zip(lists[0] + lists[2] + lists[3], copies[0] + copies[2] + copies[3]):
        assert torch.equal(a, b)


# 8-bit and bf16 moments: 12 tensors, every third empty, up to 200 elements, quantisation blocks
# of 32 or 48 (BLOCK_P2 64, masked columns), tiles of 2 blocks and chunks of 2 tiles below.
SIZES8 = [0 if i % 3 == 0 else (i * 53) % 200 + 1 for i in range(12)]


@pytest.fixture
def kernels8(monkeypatch):
    import triton

    from fastllm.kernels import adamw8bit

    monkeypatch.setattr(adamw8bit, "_tile",
                        lambda block, q8: (block, triton.next_power_of_2(block), 2, 2, 4))
    return adamw8bit


def _state8(state_dtype, dtype, master, block, gen):
    """(params, grads, masters, exp_avgs, exp_avg_sqs, absmax_m, absmax_v) over SIZES8."""
    from fastllm.ops import adamw8bit as q8

    p, g = _lists(2, dtype, gen, sizes=SIZES8)
    masters = [t.float() for t in p] if master else []
    if state_dtype == torch.bfloat16:
        m, v = _lists(2, torch.bfloat16, gen, sizes=SIZES8, positive=True)
        return p, g, masters, m, v, [], []
    m, v, am, av = [], [], [], []
    for n in SIZES8:
        codes, absmax = q8.quantize_blockwise_ref(torch.randn(n, generator=gen) * 1e-2,
                                                  q8.dynamic_code(True), block)
        m.append(codes)
        am.append(absmax)
        codes, absmax = q8.quantize_blockwise_ref(torch.rand(n, generator=gen) * 1e-4,
                                                  q8.dynamic_code(False), block)
        v.append(codes)
        av.append(absmax)
    return p, g, masters, m, v, am, av


def _flat_steps(n):
    """Step counts as views of one buffer, as fastllm.optim.AdamW keeps them."""
    return list(torch.zeros(n).unbind(0))


@pytest.mark.parametrize("state_dtype,block,dtype,master", [
    (torch.uint8, 32, torch.float32, False), (torch.uint8, 48, torch.bfloat16, True),
    (torch.bfloat16, 32, torch.bfloat16, True)],
    ids=["q8-block32-fp32", "q8-block48-bf16-master", "bf16state-bf16-master"])
def test_adamw8bit_many_tensors_one_launch(kernels8, monkeypatch, state_dtype, block, dtype,
                                           master):
    """Steps in one launch each, bitwise equal to the per-tensor kernel (one launch per
    tensor, the same update) and close to the float64 reference after the first."""
    from fastllm.ops.adamw8bit import adamw8bit_step_ref, build_qmaps

    adamw8bit = kernels8
    gen = torch.Generator().manual_seed(6)
    lists = list(_state8(state_dtype, dtype, master, block, gen))
    copies = [[t.clone() for t in lst] for lst in lists]
    ref = [[t.clone() for t in lst] for lst in lists]
    steps, steps_copy = _flat_steps(len(SIZES8)), _flat_steps(len(SIZES8))
    qmaps = build_qmaps()
    hyper = dict(HYPER, block_size=block, maximize=False, stochastic_rounding=False, seed=0,
                 grad_scale=torch.full((), 4.0), clip_coef=torch.full((), 0.5),
                 found_inf=torch.zeros(()))
    table_calls = count_launches(monkeypatch, adamw8bit, "_adamw8bit_kernel")
    tensor_calls = count_launches(monkeypatch, adamw8bit, "_adamw8bit_tensor_kernel")
    table = adamw8bit.table
    for step in range(2):
        for s, c in zip(steps, steps_copy):
            s.add_(1.0)
            c.add_(1.0)
        grads = [(torch.randn(n, generator=gen) * 3).to(dtype) for n in SIZES8]
        lists[1], copies[1] = grads, [t.clone() for t in grads]
        adamw8bit.adamw8bit_step_triton(*lists, steps, qmaps, **hyper)
        monkeypatch.setattr(adamw8bit, "table", lambda *args: None)
        adamw8bit.adamw8bit_step_triton(*copies, steps_copy, qmaps, **hyper)
        monkeypatch.setattr(adamw8bit, "table", table)
        if step == 0:
            ref[1] = [t.clone() for t in grads]
            adamw8bit_step_ref(*ref, steps, qmaps, **hyper)
            _close(lists[2] or lists[0], ref[2] or ref[0], torch.float32 if master else dtype)
    assert len(table_calls) == 2
    assert len(tensor_calls) == 2 * sum(1 for n in SIZES8 if n)
    for got, want in zip(lists, copies):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_adamw8bit_found_inf_changes_nothing(kernels8):
    from fastllm.ops.adamw8bit import build_qmaps

    gen = torch.Generator().manual_seed(7)
    lists = _state8(torch.uint8, torch.bfloat16, True, 32, gen)
    before = [t.clone() for lst in lists for t in lst]
    kernels8.adamw8bit_step_triton(*lists, _flat_steps(len(SIZES8)), build_qmaps(),
                                   block_size=32, maximize=False, stochastic_rounding=True,
                                   seed=3, grad_scale=None, clip_coef=None,
                                   found_inf=torch.ones(()), **HYPER)
    assert all(torch.equal(a, b) for a, b in zip((t for lst in lists for t in lst), before))


def test_adamw8bit_stochastic_rounding_picks_a_neighbour(kernels8):
    from fastllm.ops.adamw8bit import build_qmaps

    gen = torch.Generator().manual_seed(8)
    lists = _state8(torch.uint8, torch.bfloat16, True, 32, gen)
    steps = _flat_steps(len(SIZES8))
    for s in steps:
        s.add_(1.0)
    kernels8.adamw8bit_step_triton(*lists, steps, build_qmaps(), block_size=32, maximize=False,
                                   stochastic_rounding=True, seed=7, grad_scale=None,
                                   clip_coef=None, found_inf=None, **HYPER)
    x = torch.cat(lists[2])
    got = torch.cat(lists[0]).float()
    down = x.to(torch.bfloat16).float()
    ulp = (down.abs() * 2 ** -7).clamp_min(2 ** -133)
    assert ((got - x).abs() <= ulp).all()
    assert (got != down).any()
