"""Training state is never silently corrupted by the optimizers of fastllm/optim/adamw.py.

Non-finite grads: without a skip mechanism a nan/inf reaches the moments as it reaches
torch.optim.AdamW's exp_avg; 8-bit moments share one absmax per block, so a block holding a nan
stores absmax nan and the whole block dequantises to nan (adamw8bit_step_ref: torch.amax keeps
nan). Every backend must agree with the reference, a max that drops nan (std::max, fmax,
Triton's tl.max) would leave finite garbage in the state. With a skip mechanism (max_grad_norm,
GradScaler's found_inf) such a step changes nothing, on every backend.

Master weights: a write to a bf16 param outside the optimizer must reach its fp32 master before
the next step, or that step writes the stale master back over it.
"""

import math

import pytest
import torch

import fastllm
from fastllm.ops import adamw8bit as q8
from fastllm.optim import AdamW, AdamW8bit
from conftest import backend_device_params

# the op has no CUDA kernel: its GPU path is Triton
NO_CUDA_KERNEL = backend_device_params(without=("cuda",))

SIGNED, UNSIGNED = q8.dynamic_code(True), q8.dynamic_code(False)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state(n, state_dtype, block):
    """Non-trivial moments: the stored form of random ones (codes and absmaxes, or bf16)."""
    m = torch.randn(n, dtype=torch.float64) * 1e-2
    v = torch.rand(n, dtype=torch.float64) * 1e-4
    if state_dtype == torch.uint8:
        cm, am = q8.quantize_blockwise_ref(m, SIGNED, block)
        cv, av = q8.quantize_blockwise_ref(v, UNSIGNED, block)
        return [cm, cv, am, av]
    return [m.to(torch.bfloat16), v.to(torch.bfloat16)]


def _step(backend, p, g, state, step, block):
    cm, cv, *absmax = state
    with fastllm.use_backend(backend):
        q8.adamw8bit_step([p], [g], [], [cm], [cv], absmax[:1], absmax[1:],
                          [torch.tensor(float(step))], block_size=block, **HYPER)


def _moments(state, block):
    """(m, v) as float64, as the next step reads them."""
    if state[0].dtype != torch.uint8:
        return state[0].double(), state[1].double()
    return (q8.dequantize_blockwise_ref(state[0], state[2], SIGNED, block),
            q8.dequantize_blockwise_ref(state[1], state[3], UNSIGNED, block))


def _assert_matches(got, want, what):
    """Same nan, +inf and -inf elements; the finite ones equal up to fp32 rounding."""
    got, want = got.double().cpu(), want.double().cpu()
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        differ = (kind(got) != kind(want)).nonzero().flatten().tolist()
        assert not differ, f"{what}: {kind.__name__} differs from the reference at {differ[:8]}"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.bfloat16], ids=["q8", "bf16state"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, (-math.inf, math.inf, -math.inf)],
                         ids=["nan", "inf", "-inf", "-inf,+inf"])  # the last: both in block 0
def test_nonfinite_grad_reaches_the_state_as_in_the_reference(backend, device, state_dtype, bad):
    """adamw8bit_step without found_inf: a step with non-finite grad elements, then a clean one,
    each from the backend's own state, against the float64 reference on a copy of it."""
    block, n = 128, 300  # blocks [0, 128), [128, 256) and a ragged [256, 300)
    torch.manual_seed(0)
    p = torch.randn(n)
    state = _state(n, state_dtype, block)
    for step, bad_at in ((1, [3, 127, 299]), (2, [])):  # block 1 stays clean
        g = torch.randn(n)
        if bad_at:
            g[bad_at] = torch.tensor(bad)
        p_ref, state_ref = p.clone(), [t.clone() for t in state]
        _step("ref", p_ref, g.clone(), state_ref, step, block)
        p, g, state = p.to(device), g.to(device), [t.to(device) for t in state]
        _step(backend, p, g, state, step, block)
        p, state = p.cpu(), [t.cpu() for t in state]
        _assert_matches(p, p_ref, f"step {step}: param")
        if state_dtype == torch.uint8:
            _assert_matches(state[2], state_ref[2], f"step {step}: exp_avg absmax")
            _assert_matches(state[3], state_ref[3], f"step {step}: exp_avg_sq absmax")
        for name, got, want in zip(("exp_avg", "exp_avg_sq"), _moments(state, block),
                                   _moments(state_ref, block)):
            _assert_matches(got, want, f"step {step}: {name}")
        if step == 1 and state_dtype == torch.uint8 and bad != bad:  # nan: the reference's
            assert state_ref[2].isnan().tolist() == [True, False, True]  # own contract
        m, v = _moments(state, block)
        assert torch.isfinite(m[128:256]).all() and torch.isfinite(v[128:256]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.bfloat16], ids=["q8", "bf16state"])
def test_nan_in_the_second_moment_reaches_the_param(backend, device, state_dtype):
    """A nan already in exp_avg_sq (a loaded state), finite grads and exp_avg: the update divides
    by sqrt(nan), so the param goes nan, as in torch.optim.AdamW. (The AVX-512 path clamps v
    away from 0 before its sqrt; with the clamp as vmaxps's second operand that turned a nan v
    into a huge finite update.)"""
    block, n = 128, 300
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n)
    state = _state(n, state_dtype, block)
    if state_dtype == torch.uint8:
        state[3][1] = math.nan  # the second block's exp_avg_sq absmax
    else:
        state[1][[5, 200, 299]] = math.nan
    p_ref, state_ref = p.clone(), [t.clone() for t in state]
    _step("ref", p_ref, g.clone(), state_ref, 1, block)
    p, state = p.to(device), [t.to(device) for t in state]
    _step(backend, p, g.to(device), state, 1, block)
    p, state = p.cpu(), [t.cpu() for t in state]
    assert p_ref.isnan().any()
    _assert_matches(p, p_ref, "param")
    for name, got, want in zip(("exp_avg", "exp_avg_sq"), _moments(state, block),
                               _moments(state_ref, block)):
        _assert_matches(got, want, name)


@pytest.mark.parametrize("backend,device",
                         [p for p in NO_CUDA_KERNEL if p.values[0] != "ref"])
@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.bfloat16], ids=["q8", "bf16state"])
def test_second_moment_overflow_leaves_the_param_finite(backend, device, state_dtype):
    """A finite grad above ~6e20 overflows (1 - beta2) * g^2 to inf in fp32: sqrt(v) = inf, so
    that element gets no update but its decay, as in torch.optim.AdamW (the float64 reference
    does not overflow; the other elements still match it). The AVX-512 path took sqrt and 1/x
    from estimates, where inf * 0 made that param nan. bf16 moments keep v = inf, so the next
    step is the same; 8-bit moments cannot: the block's absmax is inf and every other element's
    v dequantises to 0 * inf = nan on the next step, on every backend as in the reference (one
    absmax per block: an outlier that large ruins its block; clip or skip such steps)."""
    block, n, huge = 128, 300, [3, 64, 200, 299]  # unmasked and ragged (masked) lanes
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n)
    g[huge] = torch.tensor([1e21, -3e22, 2e30, 1e21])
    state = _state(n, state_dtype, block)
    p_ref, state_ref = p.clone(), [t.clone() for t in state]
    _step("ref", p_ref, g.clone(), state_ref, 1, block)
    p0, p, state = p.clone(), p.to(device), [t.to(device) for t in state]
    _step(backend, p, g.to(device), state, 1, block)
    decay = 1 - HYPER["lr"] * HYPER["weight_decay"]
    torch.testing.assert_close(p.cpu()[huge], p0[huge] * decay, rtol=1e-6, atol=0)
    rest = torch.ones(n, dtype=torch.bool)
    rest[huge] = False
    _assert_matches(p.cpu()[rest], p_ref[rest], "param")
    if state_dtype == torch.bfloat16:
        p1 = p.cpu().clone()
        _step(backend, p, torch.randn(n).to(device), state, 2, block)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.cpu()[huge], p1[huge] * decay, rtol=1e-6, atol=0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


def _snapshot(model, opt):
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
@pytest.mark.parametrize("make", [
    lambda ps, **kw: AdamW8bit(ps, lr=1e-2, min_8bit_size=0, block_size=64, **kw),
    lambda ps, **kw: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16, **kw),
], ids=["q8", "bf16state"])
@pytest.mark.parametrize("skip", ["max_grad_norm", "grad_scaler"])
def test_nonfinite_step_is_skipped_on_every_backend(backend, device, make, skip):
    """With a skip mechanism a nan grad changes nothing bitwise (params, moments, absmaxes,
    step counts) on every backend, and the next clean step runs."""
    model = _model().to(device)
    scaler = None
    if skip == "max_grad_norm":
        opt = make(model.parameters(), max_grad_norm=1.0)
    else:
        opt = make(model.parameters())
        scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    x = torch.randn(8, 48, device=device)
    with fastllm.use_backend(backend):
        for step in range(3):
            loss = model(x).square().mean()
            (loss if scaler is None else scaler.scale(loss)).backward()
            if step == 1:
                before = _snapshot(model, opt)
                model[0].weight.grad[0, 0] = math.nan
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            if step == 1:
                assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))
                if skip == "max_grad_norm":
                    assert bool(opt.step_skipped)
            opt.zero_grad()
    assert all(torch.isfinite(t).all() for t in _snapshot(model, opt))
    assert all(float(s["step"]) == 2.0 for s in opt.state.values())


def _data_write(p, write):
    """An in-place write through p.data (which does not bump p's version counter)."""
    if write == "copy_":
        p.data.copy_(torch.randn_like(p))
    elif write == "normal_":  # transformers' _init_weights
        p.data.normal_(mean=0.0, std=0.02)
    else:  # peft's merge of a LoRA delta
        p.data += torch.randn_like(p)


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2, master_weights=True),
    lambda ps: AdamW8bit(ps, lr=1e-2, master_weights=True, min_8bit_size=0, block_size=64),
], ids=["adamw", "adamw8bit"])
@pytest.mark.parametrize("write", ["copy_", "normal_", "iadd"])
@pytest.mark.parametrize("bump", [False, True], ids=["alone", "increment_version"])
def test_data_write_reaches_the_master_after_increment_version(make, write, bump):
    """As AdamW's docstring says: a write through p.data is not seen, and the next step writes
    the stale master back over it; torch.autograd.graph.increment_version(p) after the write
    makes the next step re-sync the master from the param instead."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 24).to(torch.bfloat16)
    opt = make(model.parameters())
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    w = model.weight
    stale = opt.state[w]["master_param"].clone()
    _data_write(w, write)
    written = w.detach().clone()
    assert not torch.equal(written, stale.to(torch.bfloat16))
    if bump:
        torch.autograd.graph.increment_version(w)
    for group in opt.param_groups:
        group["lr"] = 0.0  # the step writes back round(master), and changes nothing else
    opt.zero_grad(set_to_none=False)
    opt.step()
    master = opt.state[w]["master_param"]
    if bump:
        assert torch.equal(w.detach(), written) and torch.equal(master, written.float())
    else:
        assert torch.equal(w.detach(), stale.to(torch.bfloat16)) and torch.equal(master, stale)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("change", ["to_bf16", "smaller", "larger", "grad_fp64"])
def test_a_param_or_grad_changed_under_a_cached_plan_is_refused_before_anything_changes(
        backend, device, change):
    """`m.to(torch.bfloat16)`, `p.data = w` of another size or `p.grad.data = g` of another
    dtype keep the tensors' identity: the cached plan (under which the ops skip their own
    checks) was reused, and the Triton kernel read fp32 moments as bf16 or past their end."""
    m = torch.nn.Linear(8, 8, bias=False).to(device)
    opt = AdamW(m.parameters(), lr=0.1)
    with fastllm.use_backend(backend):
        m.weight.grad = torch.randn(8, 8, device=device)
        opt.step()
        w = m.weight
        if change == "to_bf16":
            m.to(torch.bfloat16)
        elif change == "grad_fp64":
            w.grad.data = w.grad.data.double()
        else:
            w.data = torch.randn((4, 4) if change == "smaller" else (64, 8), device=device)
        if change != "grad_fp64":
            w.grad = torch.randn_like(w)
        before = [w.detach().clone()] + [t.clone() for t in opt.state[w].values()]
        with pytest.raises((ValueError, TypeError, RuntimeError), match="param 0 of param group 0"):
            opt.step()
    after = [w.detach()] + list(opt.state[w].values())
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_amsgrad_set_on_a_group_is_refused_where_the_constructor_refuses_it():
    """amsgrad per group (a group dict, add_param_group, a loaded torch state_dict) with master
    weights or low-byte state: those steps ran without it, silently."""
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = AdamW([{"params": [p], "amsgrad": True}], master_weights=True)
    with pytest.raises(ValueError, match="param group 0 has amsgrad=True"):
        opt.step()
    assert not opt.state
    with pytest.raises(ValueError, match="param group 1 has amsgrad=True.*low-byte"):
        AdamW8bit([p]).add_param_group({"params": [q], "amsgrad": True})


def test_bf16_state_converted_from_a_transposed_params_torch_state_steps():
    """torch's moments of a transposed param keep its strides; convert_state to bf16 and a
    load put them in as they were, and every later step refused them as not contiguous. The
    loaded step count is a copy (it was the live torch optimizer's own tensor, which fastllm's
    step advanced too)."""
    from fastllm.optim import convert_state

    p = torch.nn.Parameter(torch.randn(16, 8).t())
    theirs = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(8, 16)
    theirs.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt = AdamW([q], lr=0.1, state_dtype=torch.bfloat16)
    opt.load_state_dict(convert_state(theirs.state_dict(), torch.bfloat16))
    q.grad = p.grad.clone()
    opt.step()
    theirs.step()
    torch.testing.assert_close(q, p, rtol=0, atol=2e-3)


@pytest.mark.parametrize("make", [lambda ps: AdamW8bit(ps, min_8bit_size=1),
                                  lambda ps: AdamW(ps, state_dtype=torch.bfloat16)],
                         ids=["8bit", "bf16_state"])
def test_fp64_param_with_low_byte_state_is_refused_before_anything_changes(make):
    """The low-byte kernels take fp32/bf16/fp16 params; an fp64 one was refused by the op after
    the fp32 param's call had run and every step count had moved."""
    a, b = torch.randn(8, requires_grad=True), torch.randn(8, dtype=torch.float64,
                                                           requires_grad=True)
    opt = make([a, b])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    before = a.detach().clone()
    with pytest.raises(TypeError, match=r"param 1 of param group 0 .* is torch.float64"):
        opt.step()
    assert torch.equal(a, before) and not opt.state


def test_a_call_that_never_ran_gets_its_step_count_back(monkeypatch):
    """An op that raised after an earlier call ran: the flat step counts of the calls after it
    stayed advanced, so their next bias correction was a step ahead."""
    a, b = torch.randn(8, requires_grad=True), torch.randn(8, dtype=torch.float64,
                                                           requires_grad=True)
    opt = AdamW([a, b], lr=0.1)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    from fastllm.optim import _plan

    real, calls = _plan.adamw_step, []

    def fail_second(*args, **kwargs):
        calls.append(args[0][0].dtype)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(_plan, "adamw_step", fail_second)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    assert calls == [torch.float32, torch.float64]
    assert float(opt.state[a]["step"]) == 2.0  # its call ran
    assert float(opt.state[b]["step"]) == 1.0
