"""Regressions from a review of the optimizers: a refused step or load changes nothing
(fastllm.optim.AdamW's hyperparameters, fastllm.ops.adamw_step's step counts, GaLoreAdamW's
projector refresh, BAdam.load_state_dict), zero-size params in GaLore rank groups, and grads
carrying the negative bit (x._neg_view()), which the kernels must not read as if positive.
"""

import pytest
import torch

import fastllm
from fastllm.ops import adamw8bit_step, adamw_master_step, adamw_step
from fastllm.optim import AdamW, AdamW8bit, BAdam, GaLoreAdamW
from fastllm.optim import galore as galore_module

HYPER = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


# --- AdamW: a hyperparameter refused by a cached plan ---------------------------------------
@pytest.mark.parametrize("key,bad", [("lr", -1.0), ("eps", float("nan")), ("betas", (1.0, 0.9)),
                                     ("weight_decay", -0.5)])
def test_adamw_refused_hyperparameter_changes_nothing(key, bad):
    def train(refuse):
        p = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(0))
                               .bfloat16())
        opt = AdamW([p], lr=1e-2, stochastic_rounding=True, max_grad_norm=1.0)
        opt._sr_seed = 1234
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            p.grad = torch.randn(16, generator=g).bfloat16()
            if step == 1:
                p.grad[0] = float("inf")  # a skipped step: the skip count must not move twice
                if refuse:
                    good = opt.param_groups[0][key]
                    opt.param_groups[0][key] = bad
                    with pytest.raises(ValueError):
                        opt.step()
                    assert opt._sr_calls == 1 and int(opt.skipped_steps) == 0
                    opt.param_groups[0][key] = good
            opt.step()
        return p.detach().clone(), int(opt.skipped_steps), opt._sr_calls, opt.state[p]["step"]

    clean, refused = train(False), train(True)
    assert torch.equal(clean[0], refused[0])
    assert clean[1:3] == refused[1:3] == (1, 3)
    assert torch.equal(clean[3], refused[3])


# --- fastllm.ops.adamw_step: the step counts ------------------------------------------------
def _lists():
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(5, generator=g), torch.randn(3, generator=g)]
    gs = [torch.randn(5, generator=g), torch.randn(3, generator=g)]
    return ps, gs, [torch.zeros(5), torch.zeros(3)], [torch.zeros(5), torch.zeros(3)]


BAD_STEPS = [
    ([torch.tensor(1.0), torch.ones(2)], ValueError, r"steps\[1\] must be a dense one-element"),
    ([torch.tensor(1.0), torch.tensor(0.0)], ValueError, r"steps\[1\] is 0.0"),
    ([torch.tensor(-2.0), torch.tensor(1.0)], ValueError, r"steps\[0\] is -2.0"),
    ([torch.tensor(1.0), torch.tensor(1)], TypeError, r"steps\[1\] has dtype torch.int64"),
    ([torch.tensor(1.0), torch.tensor(1.0, device="meta")], ValueError, r"steps\[1\] is on meta"),
]


@pytest.mark.parametrize("backend", ["cpp", "ref"])
@pytest.mark.parametrize("grad_mode", [False, True])  # direct call / through torch.ops
@pytest.mark.parametrize("steps,error,match", BAD_STEPS)
def test_adamw_step_refuses_bad_steps_before_changing_anything(backend, grad_mode, steps, error,
                                                               match):
    ps, gs, ms, vs = _lists()
    before = [t.clone() for t in ps + ms + vs]
    with torch.set_grad_enabled(grad_mode), fastllm.use_backend(backend):
        with pytest.raises(error, match=match):
            adamw_step(ps, gs, ms, vs, [], steps, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(before, ps + ms + vs))


def _master_call(steps):
    """adamw_master_step on bf16 params with fp32 masters: the call, and every tensor it may
    write (params, masters, moments, steps)."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(5, generator=g).bfloat16(), torch.randn(3, generator=g).bfloat16()]
    gs = [torch.randn_like(p, dtype=torch.float32).bfloat16() for p in ps]
    masters = [p.float() for p in ps]
    ms, vs = [torch.full(p.shape, 0.1) for p in ps], [torch.full(p.shape, 0.2) for p in ps]

    def call():
        adamw_master_step(ps, gs, masters, ms, vs, [], steps, **HYPER)

    return call, ps + masters + ms + vs + steps


def _8bit_call(steps):
    """adamw8bit_step on bf16 params, fp32 masters and 8-bit moments: as _master_call."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(5, generator=g).bfloat16(), torch.randn(3, generator=g).bfloat16()]
    gs = [torch.randn_like(p, dtype=torch.float32).bfloat16() for p in ps]
    masters = [p.float() for p in ps]
    ms = [torch.full(p.shape, 140, dtype=torch.uint8) for p in ps]
    vs = [torch.full(p.shape, 30, dtype=torch.uint8) for p in ps]
    ams, avs = [torch.full((1,), 0.5) for _ in ps], [torch.full((1,), 0.25) for _ in ps]

    def call():
        adamw8bit_step(ps, gs, masters, ms, vs, ams, avs, steps, **HYPER)

    return call, ps + masters + ms + vs + ams + avs + steps


def _cpu_backends(*names):
    return [pytest.param(b, marks=pytest.mark.skipif(
        bool(fastllm._backend.unavailable_reason(b, "cpu")), reason=f"no {b} on the CPU"))
        for b in names]


_CALLS = {"adamw_master_step": _master_call, "adamw8bit_step": _8bit_call}


@pytest.mark.parametrize("op", list(_CALLS))
@pytest.mark.parametrize("backend", _cpu_backends("cpp", "ref", "triton"))
@pytest.mark.parametrize("grad_mode", [False, True])  # direct call / through torch.ops
@pytest.mark.parametrize("steps,error,match", BAD_STEPS)
def test_master_and_8bit_steps_refuse_bad_steps_before_changing_anything(
        op, backend, grad_mode, steps, error, match):
    """As adamw_step: a step count < 1 wrote nan (ZeroDivisionError on ref), a two-element one
    was read as its first element (triton), an integer one was taken."""
    call, written = _CALLS[op]([s.clone() for s in steps])
    written = [t for t in written if t.device.type == "cpu"]
    before = [t.clone() for t in written]
    with torch.set_grad_enabled(grad_mode), fastllm.use_backend(backend):
        with pytest.raises(error, match=rf"fastllm\.{op}: {match}"):
            call()
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, written))


@pytest.mark.parametrize("op", ["adamw_step", "adamw_master_step", "adamw8bit_step"])
@pytest.mark.parametrize("backend", _cpu_backends("cpp", "triton"))
def test_moments_that_share_memory_are_refused(op, backend):
    """exp_avgs and exp_avg_sqs the same tensors: the cpp kernels (whose pointers are declared
    unaliased) wrote nan params where the reference did not; torch's in-place ops refuse."""
    p = torch.randn(6, generator=torch.Generator().manual_seed(0))
    g, step = torch.randn(6, generator=torch.Generator().manual_seed(1)), torch.tensor(1.0)
    if op == "adamw_step":
        m = torch.zeros(6)
        call = lambda: adamw_step([p], [g], [m], [m], [], [step], **HYPER)  # noqa: E731
    elif op == "adamw_master_step":
        p, g, m = p.bfloat16(), g.bfloat16(), torch.zeros(6)
        call = lambda: adamw_master_step([p], [g], [p.float()], [m], [m], [],  # noqa: E731
                                         [step], **HYPER)
    else:
        p, g, m = p.bfloat16(), g.bfloat16(), torch.full((6,), 127, dtype=torch.uint8)
        am = torch.zeros(1)
        call = lambda: adamw8bit_step([p], [g], [p.float()], [m], [m], [am], [am],  # noqa: E731
                                      [step], **HYPER)
    before = p.clone()
    with fastllm.use_backend(backend), pytest.raises(ValueError, match="share memory"):
        call()
    assert torch.equal(p, before)


@pytest.mark.parametrize("op", list(_CALLS))
def test_master_and_8bit_step_values_are_not_read_in_the_optimizers_plan(op):
    """As adamw_step's: fastllm.optim's plan made (and advances) its steps; inside it
    (_backend.validated) the ops read none of them, which is no host cost per step."""
    call, written = _CALLS[op]([torch.tensor(1.0), torch.tensor(0.0)])
    with pytest.raises(ValueError, match=r"steps\[1\] is 0.0"):
        call()
    with fastllm._backend.validated(), fastllm.use_backend("cpp"):
        call()  # (not refused: here step 0 writes nan, as the kernels' maths do)
    assert written[1].isnan().all()


# --- GaLoreAdamW: zero-size params and a failing refresh --------------------------------------
def test_galore_zero_size_param_in_rank_group_is_a_no_op():
    def run(with_empty):
        w = torch.nn.Parameter(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)))
        empty = torch.nn.Parameter(torch.randn(0, 6))
        opt = GaLoreAdamW([{"params": [w, empty] if with_empty else [w], "rank": 2}], lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            w.grad, empty.grad = torch.randn(8, 6, generator=g), torch.randn(0, 6)
            opt.step()
        return w.detach(), opt, empty

    w_ref, _, _ = run(False)
    w, opt, empty = run(True)
    assert torch.equal(w, w_ref)
    # as torch.optim.AdamW keeps it: a step count and (empty) full-shape moments, no projector
    t = torch.nn.Parameter(torch.randn(0, 6))
    torch_opt = torch.optim.AdamW([t], lr=0.1)
    for _ in range(2):
        t.grad = torch.randn(0, 6)
        torch_opt.step()
    assert sorted(opt.state[empty]) == sorted(torch_opt.state[t])
    assert torch.equal(opt.state[empty]["step"], torch_opt.state[t]["step"])
    assert opt.state[empty]["exp_avg"].shape == (0, 6)
    opt.load_state_dict(opt.state_dict())  # (its state is not low-rank: loads back)


def test_galore_failing_refresh_changes_nothing(monkeypatch):
    params = [torch.nn.Parameter(torch.randn(8, 6)) for _ in range(2)]
    plain = torch.nn.Parameter(torch.randn(5))
    opt = GaLoreAdamW([{"params": [plain]}, {"params": params, "rank": 2}], lr=0.1)
    for p in params + [plain]:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params + [plain]]
    calls = []
    real = galore_module.range_finder

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("range finder failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(galore_module, "range_finder", failing)
    with pytest.raises(RuntimeError, match="range finder failed"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params + [plain]))
    assert not any(opt.state.get(p) for p in params + [plain])
    assert opt.grad_norm is None and opt.skipped_steps == 0


# --- BAdam: a refused load_state_dict -----------------------------------------------------
def test_badam_refused_load_changes_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    named = list(model.named_parameters())  # 0.weight, 0.bias (no decay), 1.weight

    def make():
        return BAdam(named, lr=0.1, weight_decay=0.5, switch_block_every=100,
                     blocks=[["0"], ["1"]], no_decay=["0.bias"])

    opt = make()
    other = make()
    other._switch()  # on block 1
    model[1].weight.grad = torch.zeros(4, 4)
    other.step()
    sd = other.state_dict()
    k = next(iter(sd["inner"]["state"]))
    sd["inner"]["state"][k]["exp_avg"] = torch.zeros(3)  # refused: the wrong shape
    opt._switch()
    opt._switch()  # back on block 0, with a fresh inner optimizer
    no_decay, inner, groups = set(opt._inner_no_decay), opt.inner, opt.state_dict()
    with pytest.raises(RuntimeError, match="exp_avg"):
        opt.load_state_dict(sd)
    assert opt._inner_no_decay == no_decay == {1} and opt.inner is inner
    assert opt.state_dict()["hyperparameters"] == groups["hyperparameters"]
    bias = model[0].bias
    b0 = bias.detach().clone()
    model[0].weight.grad, bias.grad = torch.zeros(4, 4), torch.zeros(4)
    opt.step()  # zero grads: only weight decay could move the no-decay bias
    assert [g["weight_decay"] for g in opt.inner.param_groups] == [0.5, 0.0]
    assert torch.equal(bias.detach(), b0)


# --- grads carrying the negative bit ------------------------------------------------------
OPTIMIZERS = {
    "plain": (lambda ps: AdamW(ps, lr=0.1), torch.float32),
    "amsgrad": (lambda ps: AdamW(ps, lr=0.1, amsgrad=True), torch.float32),
    "clipped": (lambda ps: AdamW(ps, lr=0.1, max_grad_norm=1.0), torch.float32),
    "master": (lambda ps: AdamW(ps, lr=0.1, master_weights=True), torch.bfloat16),
    "kahan": (lambda ps: AdamW(ps, lr=0.1, kahan_summation=True), torch.bfloat16),
    "8bit": (lambda ps: AdamW8bit(ps, lr=0.1, block_size=64, min_8bit_size=64), torch.float32),
    "8bit_master": (lambda ps: AdamW8bit(ps, lr=0.1, block_size=64, min_8bit_size=64,
                                         master_weights=True), torch.bfloat16),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("negative_steps", [(0, 1, 2), (1,), (0, 2)])
def test_optimizer_reads_negative_bit_grads_by_value(name, negative_steps):
    make, dtype = OPTIMIZERS[name]

    def train(negative):
        p = torch.nn.Parameter(torch.randn(123, generator=torch.Generator().manual_seed(0))
                               .to(dtype))
        opt = make([p])
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            grad = torch.randn(123, generator=g).to(dtype)
            p.grad = (-grad)._neg_view() if negative and step in negative_steps else grad
            opt.step()
        return p.detach().clone(), opt.state[p]

    (p_ref, s_ref), (p_neg, s_neg) = train(False), train(True)
    assert torch.equal(p_ref, p_neg)
    assert all(torch.equal(s_ref[k], s_neg[k]) for k in s_ref)


def test_adamw_negative_bit_grad_matches_torch():
    g = torch.randn(6)
    p = torch.nn.Parameter(torch.randn(6))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad, q.grad = g._neg_view(), g._neg_view()
    AdamW([p], lr=0.1).step()
    torch.optim.AdamW([q], lr=0.1).step()
    torch.testing.assert_close(p, q)


def test_adamw_negative_bit_param_and_loaded_state():
    p = torch.nn.Parameter(torch.randn(6)._neg_view())
    p.grad = torch.randn(6)
    with pytest.raises(RuntimeError, match="negative bit"):
        AdamW([p], lr=0.1).step()
    # a loaded state keeps a tensor's bit (torch.optim does too): resolved on load
    p, q = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))
    opt, ref = AdamW([p], lr=0.1), AdamW([q], lr=0.1)
    m, v = torch.randn(6), torch.rand(6)
    sd = ref.state_dict()
    sd["state"] = {0: {"step": torch.tensor(2.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}}
    ref.load_state_dict(sd)
    sd["state"] = {0: {"step": torch.tensor(-2.0)._neg_view(), "exp_avg": (-m)._neg_view(),
                       "exp_avg_sq": v.clone()}}
    opt.load_state_dict(sd)
    q.data.copy_(p.detach())
    p.grad = q.grad = torch.randn(6)
    opt.step()
    ref.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("backend", ["cpp", "ref"])
@pytest.mark.parametrize("grad_mode", [False, True])
def test_adamw_step_reads_negative_bit_grads_and_steps_by_value(backend, grad_mode):
    ps, gs, ms, vs = _lists()
    ps2, gs2, ms2, vs2 = (list(map(torch.clone, lst)) for lst in (ps, gs, ms, vs))
    neg_gs = [(-g)._neg_view() for g in gs]
    with torch.set_grad_enabled(grad_mode), fastllm.use_backend(backend):
        adamw_step(ps, neg_gs, ms, vs, [], [torch.tensor(-3.0)._neg_view()] * 2, **HYPER)
        adamw_step(ps2, gs2, ms2, vs2, [], [torch.tensor(3.0)] * 2, **HYPER)
        assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs, ps2 + ms2 + vs2))
        with pytest.raises((ValueError, RuntimeError), match="negative bit|negation"):
            adamw_step([ps[0]._neg_view()], gs[:1], ms[:1], vs[:1], [], [torch.tensor(1.0)],
                       **HYPER)
