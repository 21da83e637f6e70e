"""fastllm::adamw8bit_step and the optimizers on it (AdamW8bit, AdamW(state_dtype=bf16)).

Each backend (ref, cpp, triton under the interpreter) is compared step by step with a float64
computation of the same quantised algorithm (dequantise, AdamW, requantise to the nearest code).
"""

import io
import math

import pytest
import torch

import fastllm
from fastllm.ops import adamw8bit as q8
from fastllm.optim import AdamW, AdamW8bit, convert_state
from conftest import BAD_SCALAR_IDS, BAD_SCALARS, backend_device_params

# the op has no CUDA kernel: its GPU path is Triton
NO_CUDA_KERNEL = backend_device_params(without=("cuda",))

SIGNED, UNSIGNED = q8.dynamic_code(True), q8.dynamic_code(False)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _ulp32(x):
    """fp32 ulp at |x| (float64 tensor)."""
    x = x.abs().float().clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.nextafter(x, torch.full_like(x, math.inf)) - x).double()


def _boundary_distance(a, code):
    """For normalised float64 values a: distance to the nearest decision boundary of `code`,
    in fp32 ulps of that boundary."""
    code = code.double()
    boundaries = (code[1:] + code[:-1]) / 2
    i = torch.bucketize(a, boundaries).clamp(1, boundaries.numel() - 1)
    nearest = torch.where((a - boundaries[i - 1]).abs() < (a - boundaries[i]).abs(),
                          boundaries[i - 1], boundaries[i])
    return (a - nearest).abs() / _ulp32(nearest)


def _float64_step(p, g, master, m_state, v_state, absmax_m, absmax_v, step, block, maximize=False):
    """(x, m, v) in float64 from the stored state: the exact maths before any rounding."""
    f64 = torch.float64
    if m_state.dtype == torch.uint8:
        m = q8.dequantize_blockwise_ref(m_state, absmax_m, SIGNED, block)
        v = q8.dequantize_blockwise_ref(v_state, absmax_v, UNSIGNED, block)
    else:
        m, v = m_state.to(f64), v_state.to(f64)
    g = g.to(f64) * (-1.0 if maximize else 1.0)
    x = (master if master is not None else p).to(f64)
    # The size of the terms summed into m: fp32 cancellation errors scale with it, not with m.
    m_terms = m.abs() * HYPER["beta1"] + g.abs() * (1 - HYPER["beta1"])
    x = x * float(torch.tensor(1 - HYPER["lr"] * HYPER["weight_decay"], dtype=torch.float32))
    m = m + (g - m) * (1 - HYPER["beta1"])
    v = v * HYPER["beta2"] + (1 - HYPER["beta2"]) * g * g
    bc1 = 1 - HYPER["beta1"] ** step
    bc2 = math.sqrt(1 - HYPER["beta2"] ** step)
    x = x - HYPER["lr"] / bc1 * m / (v.sqrt() / bc2 + HYPER["eps"])
    return x, m, v, m_terms


def _block_max(t, n_blocks, block):
    t = t.reshape(-1).abs().cpu()
    return torch.nn.functional.pad(t, (0, n_blocks * block - t.numel())).view(-1, block).amax(1)


def _check_codes(codes, ref_values, absmax, code, block, max_ulps=8):
    """codes equal the nearest code to ref_values / block absmax, except where that value lies
    within max_ulps fp32 ulps of a decision boundary (and there they are neighbours)."""
    flat = ref_values.reshape(-1)
    scale = absmax.double().repeat_interleave(block)[: flat.numel()]
    a = torch.where(scale > 0, flat / scale.clamp_min(1e-300), torch.zeros_like(flat))
    expected = torch.bucketize(a.clamp(-1, 1), (code.double()[1:] + code.double()[:-1]) / 2,
                               right=True)
    got = codes.reshape(-1).long()
    differ = got != expected
    if differ.any():
        near = _boundary_distance(a[differ], code) <= max_ulps
        neighbours = (got[differ] - expected[differ]).abs() <= 1
        assert bool((near & neighbours).all()), (
            f"{int(differ.sum())} codes differ, {int((~(near & neighbours)).sum())} of them "
            f"away from a code boundary")
    return int(differ.sum())


def _make_state(n, state_dtype, block, device="cpu"):
    """A non-trivial state: the quantised form of random moments."""
    m0 = torch.randn(n, dtype=torch.float64) * 1e-2
    v0 = torch.rand(n, dtype=torch.float64) * 1e-4
    if state_dtype == torch.uint8:
        cm, am = q8.quantize_blockwise_ref(m0, SIGNED, block)
        cv, av = q8.quantize_blockwise_ref(v0, UNSIGNED, block)
        return cm.to(device), cv.to(device), am.to(device), av.to(device)
    return m0.to(torch.bfloat16).to(device), v0.to(torch.bfloat16).to(device), None, None


@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.bfloat16], ids=["q8", "bf16state"])
@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.bfloat16, True), (torch.float16, True)],
                         ids=["fp32", "bf16", "bf16-master", "fp16-master"])
def test_steps_match_float64_reference(backend, device, state_dtype, param_dtype, master):
    block = 64 if state_dtype == torch.uint8 else 256
    shapes = [(1,), (7,), (123,), (4097,)] if backend != "triton" else [(1,), (7,), (123,), (300,)]
    ps = [torch.randn(s, device=device).to(param_dtype) for s in shapes]
    masters = [p.float() + torch.randn_like(p.float()) * 1e-3 for p in ps] if master else []
    states = [_make_state(p.numel(), state_dtype, block, device) for p in ps]
    ms, vs = [s[0] for s in states], [s[1] for s in states]
    ams = [s[2] for s in states] if state_dtype == torch.uint8 else []
    avs = [s[3] for s in states] if state_dtype == torch.uint8 else []
    qmaps = q8.build_qmaps(device)
    low = param_dtype != torch.float32
    for t in range(1, 4):  # several steps, each against float64 from the kernel's own state
        gs = [torch.randn_like(p.float()).to(param_dtype) for p in ps]
        steps = [torch.tensor(float(t))] * len(ps)
        expected = [_float64_step(p, g, masters[i] if master else None, ms[i], vs[i],
                                  ams[i] if ams else None, avs[i] if avs else None, t, block)
                    for i, (p, g) in enumerate(zip(ps, gs))]
        gs_before = [g.clone() for g in gs]
        x_before = [(masters[i] if master else p).double() for i, p in enumerate(ps)]
        with fastllm.use_backend(backend):
            q8.adamw8bit_step(ps, gs, masters, ms, vs, ams, avs, steps, qmaps, block_size=block,
                              **HYPER)
        for i, (x, m, v, m_terms) in enumerate(expected):
            assert torch.equal(gs[i], gs_before[i]), "grads must not change"
            stored = masters[i] if master else ps[i]
            # One ulp of the stored dtype, plus fp32's error in the update itself.
            tol = _ulp32(x) if not low or master else _ulp32(x) * 2 ** 16
            err = (stored.double().cpu() - x.cpu()).abs()
            bound = tol.cpu() + 1e-5 * (x - x_before[i]).abs().cpu()
            assert (err <= bound).all(), f"worst error / bound {(err / bound).max():.3f}"
            if master:  # the param is the master rounded to nearest
                assert torch.equal(ps[i], masters[i].to(param_dtype))
            if state_dtype == torch.uint8:
                for absmax, values, terms in ((ams[i], m, m_terms), (avs[i], v, v)):
                    ref_absmax = _block_max(values, absmax.numel(), block)
                    ulps = ((absmax.double().cpu() - ref_absmax).abs()
                            / _ulp32(_block_max(terms, absmax.numel(), block)))
                    # The kernels compute m and v in fp32 (dequantise, lerp, fma): ~5 roundings.
                    assert (ulps <= 6).all(), f"absmax off by {ulps.max():.1f} ulps"
                _check_codes(ms[i].cpu(), m.cpu(), ams[i].cpu(), SIGNED, block)
                _check_codes(vs[i].cpu(), v.cpu(), avs[i].cpu(), UNSIGNED, block)
            else:
                for got, want in ((ms[i], m), (vs[i], v)):
                    bf16_ulp = _ulp32(want) * 2 ** 16
                    assert ((got.double() - want).abs() <= bf16_ulp).all()


@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
def test_encode_is_nearest_code(backend, device):
    """beta1 = beta2 = 0, lr = 0: the new moments are g and g^2, so the codes are the encoder's
    output for a dense grid of values, including every code and every boundary's neighbours."""
    block = 256
    for code, signed in ((SIGNED, True), (UNSIGNED, False)):
        c = code.double()
        mids = (c[1:] + c[:-1]) / 2
        probes = torch.cat([c, mids, mids * (1 + 2**-20), mids * (1 - 2**-20),
                            torch.linspace(-1 if signed else 0, 1, 2000, dtype=torch.float64)])
        if not signed:
            probes = probes.abs()
        # One exact 1.0 per block, so absmax is 1 and the values are their own normalised form.
        n_per = block - 1
        chunks = probes.split(n_per)
        g = torch.cat([torch.cat([torch.ones(1, dtype=torch.float64), ch]) for ch in chunks])
        target = g if signed else g.sqrt()  # v = g^2 must equal the probe
        grad = target.float().to(device)
        n = grad.numel()
        nb = q8.n_blocks(n, block)
        p = torch.zeros(n, device=device)
        m = torch.full((n,), 127, dtype=torch.uint8, device=device)
        v = torch.zeros(n, dtype=torch.uint8, device=device)
        am, av = torch.zeros(nb, device=device), torch.zeros(nb, device=device)
        with fastllm.use_backend(backend):
            q8.adamw8bit_step([p], [grad], [], [m], [v], [am], [av], [torch.tensor(1.0)],
                              lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0,
                              block_size=block)
        codes, values = (m, grad.double()) if signed else (v, grad.double() ** 2)
        absmax = am if signed else av
        # Probes at the exact midpoints may go either way; those 8 ulps off must not.
        _check_codes(codes.cpu(), values.cpu(), absmax.cpu(), code, block, max_ulps=2)


def test_quantisation_round_trip_error():
    """|dequant(quant(x)) - x| <= absmax * half the gap between the two codes around x/absmax."""
    torch.manual_seed(1)
    for code, x in ((SIGNED, torch.randn(10000, dtype=torch.float64) * 3),
                    (UNSIGNED, torch.rand(10000, dtype=torch.float64) ** 4)):
        codes, absmax = q8.quantize_blockwise_ref(x, code, 256)
        back = q8.dequantize_blockwise_ref(codes, absmax, code, 256)
        scale = absmax.double().repeat_interleave(256)[: x.numel()]
        a = x / scale
        c = code.double()
        hi = torch.bucketize(a, c).clamp(1, 255)
        gap = c[hi] - c[hi - 1]
        # Below the smallest code (-0.993 of the signed map) the error is the distance to it.
        bound = torch.where(a < c[0], c[0] - a, gap / 2)
        assert ((back - x).abs() <= scale * bound * (1 + 1e-6) + 1e-300).all()
        # Only the top code carries the block maximum exactly; the relative error there is 0.
        assert (back.abs().view(-1) <= scale * 1.0).all()


def test_code_tables():
    assert SIGNED.numel() == 256 and UNSIGNED.numel() == 256
    assert torch.all(SIGNED[1:] > SIGNED[:-1]) and torch.all(UNSIGNED[1:] > UNSIGNED[:-1])
    assert SIGNED[127] == 0 and SIGNED[255] == 1 and UNSIGNED[0] == 0 and UNSIGNED[255] == 1
    assert torch.equal(SIGNED[128:255], -SIGNED[:127].flip(0))


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.Tanh(),
                               torch.nn.Linear(80, 5)).to(dtype)


def _train(opt_fn, steps=3, dtype=torch.float32, scaler=None):
    model = _model(dtype)
    opt = opt_fn(model.parameters())
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 96, dtype=dtype)
        loss = model(x).float().square().mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    return model, opt


def _snapshot(model, opt):
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_optimizer_state_layout_and_threshold():
    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=4096))
    big, bias = model[0].weight, model[0].bias
    state = opt.state[big]
    assert state["exp_avg_codes"].dtype == torch.uint8
    assert state["exp_avg_codes"].shape == big.shape
    assert state["exp_avg_absmax"].shape == (q8.n_blocks(big.numel(), 256),)
    assert opt.state[bias]["exp_avg"].dtype == torch.float32  # below min_8bit_size
    model, opt = _train(lambda ps: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16))
    assert opt.state[model[0].bias]["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.bfloat16], ids=["q8", "bf16state"])
def test_optimizer_equals_op(state_dtype):
    """The optimizer's step is the op on its state (and the step count advances)."""
    make = ((lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=0)) if state_dtype == torch.uint8
            else (lambda ps: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16)))
    model, opt = _train(make, steps=2)
    p = model[0].weight
    state = {k: v.clone() for k, v in opt.state[p].items()}
    before = p.detach().clone()
    g = torch.randn_like(p)
    p.grad = g.clone()
    for q in list(model.parameters())[1:]:
        q.grad = None
    opt.step()
    keys = (["exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"]
            if state_dtype == torch.uint8 else ["exp_avg", "exp_avg_sq"])
    lists = [[state[k]] for k in keys]
    if state_dtype != torch.uint8:
        lists += [[], []]
    ref_p = before.clone()
    q8.adamw8bit_step([ref_p], [g], [], *lists, [state["step"] + 1], lr=1e-2, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=1e-2, block_size=256)
    assert torch.equal(p.detach(), ref_p)
    for k, t in zip(keys, lists):
        assert torch.equal(opt.state[p][k], t[0])
    assert float(opt.state[p]["step"]) == 3.0


def test_triton_without_gather_is_refused_before_anything_changes(monkeypatch):
    """Triton 3.2 (torch 2.6's) has no tl.gather, which the 8-bit kernel's code maps need."""
    import triton.language as tl

    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=0), steps=1)
    model(torch.randn(4, 96)).square().mean().backward()
    before = _snapshot(model, opt)
    monkeypatch.delattr(tl, "gather", raising=False)  # (Triton 3.2 has none)
    with fastllm.use_backend("triton"), pytest.raises(RuntimeError, match=r"Triton >= 3\.3"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))


@pytest.mark.parametrize("opt_fn", [
    lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=0, max_grad_norm=1.0),
    lambda ps: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16, max_grad_norm=1.0),
], ids=["q8", "bf16state"])
def test_nonfinite_step_changes_nothing(opt_fn):
    model, opt = _train(opt_fn, steps=2)
    before = _snapshot(model, opt)
    x = torch.randn(4, 96)
    model(x).square().mean().backward()
    model[0].weight.grad[0, 0] = float("nan")
    opt.step()
    assert bool(opt.step_skipped)
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_grad_scaler_matches_unscaled():
    """GradScaler's fused protocol (grad_scale, found_inf) gives the unscaled run bitwise: the
    scale is a power of two; an overflow step changes nothing."""
    make = lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=0)  # noqa: E731
    m1, o1 = _train(make, steps=3)
    m2, o2 = _train(make, steps=3, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(m1, o1), _snapshot(m2, o2)))


def test_master_weights_and_stochastic_rounding():
    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=0, master_weights=True),
                        dtype=torch.bfloat16)
    w = model[0].weight
    assert opt.state[w]["master_param"].dtype == torch.float32
    assert torch.equal(w.detach(), opt.state[w]["master_param"].to(torch.bfloat16))
    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=0,
                                             stochastic_rounding=True), dtype=torch.bfloat16)
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.parametrize("opt_fn", [
    lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=1000),
    lambda ps: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16),
], ids=["q8", "bf16state"])
def test_state_dict_round_trip(opt_fn):
    model, opt = _train(opt_fn, steps=2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = opt_fn(model2.parameters())
    opt2.load_state_dict(loaded)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), _snapshot(model2, opt2)))
    for m, o in ((model, opt), (model2, opt2)):
        torch.manual_seed(5)
        m(torch.randn(4, 96)).square().mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), _snapshot(model2, opt2)))


def test_convert_state_both_ways():
    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=1000), steps=3)
    sd = opt.state_dict()
    full = convert_state(sd, torch.float32)
    assert "fastllm_lowbyte" not in full and "exp_avg_codes" in sd["state"][0]
    s0 = full["state"][0]
    want = q8.dequantize_blockwise_ref(sd["state"][0]["exp_avg_codes"],
                                       sd["state"][0]["exp_avg_absmax"], SIGNED, 256,
                                       torch.float32)
    assert torch.equal(s0["exp_avg"], want)
    # The fp32 state loads into torch's AdamW and fastllm's AdamW.
    torch.optim.AdamW(model.parameters(), lr=1e-2).load_state_dict(full)
    AdamW(model.parameters(), lr=1e-2).load_state_dict(full)
    # And back. The unsigned map has 1.0, so the second moment's codes come back exactly; the
    # signed map's most negative code is -0.993, so a block whose largest |exp_avg| is negative
    # gets a smaller absmax and may move by one code: compare the values instead.
    back = convert_state(full, torch.uint8, min_8bit_size=1000)
    for pid, state in sd["state"].items():
        if "exp_avg_codes" not in state:
            assert torch.equal(back["state"][pid]["exp_avg"], state["exp_avg"])
            continue
        assert torch.equal(back["state"][pid]["exp_avg_sq_codes"], state["exp_avg_sq_codes"])
        assert torch.equal(back["state"][pid]["exp_avg_sq_absmax"], state["exp_avg_sq_absmax"])
        again = convert_state(back, torch.float32)["state"][pid]["exp_avg"]
        absmax = state["exp_avg_absmax"].repeat_interleave(256)[: again.numel()].view_as(again)
        top_gap = float(SIGNED[255] - SIGNED[254])
        assert ((again - full["state"][pid]["exp_avg"]).abs() <= absmax * top_gap).all()
    opt2 = AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1000)
    opt2.load_state_dict(back)
    bf16 = convert_state(full, torch.bfloat16)
    assert bf16["state"][0]["exp_avg"].dtype == torch.bfloat16
    AdamW(model.parameters(), state_dtype=torch.bfloat16).load_state_dict(bf16)


def test_export_and_import_state_invert_each_other():
    """export_state (fp32 moments, for flat-shard optimizers that gather state per element) and
    import_state (back to the optimizer's layout): exact for the second moment and for every
    first-moment block stored with code 255 (+1.0); a block whose largest |m| is negative moves by
    at most half a code gap of its absmax."""
    from fastllm.optim.adamw8bit import export_state, import_state

    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=1000), steps=3)
    weight = next(model.parameters())  # (80, 96): 30 blocks of 256
    state = opt.state[weight]
    exported = export_state(opt, state)
    assert exported["exp_avg"].dtype == torch.float32 and "exp_avg_codes" in state
    back = import_state(opt, weight, {k: v.clone() for k, v in exported.items()})
    assert sorted(back) == sorted(state)
    for key in ("step", "exp_avg_sq_codes", "exp_avg_sq_absmax"):
        assert torch.equal(back[key], state[key]), key
    blocks, blocks_back = state["exp_avg_codes"].view(-1, 256), back["exp_avg_codes"].view(-1, 256)
    top = (blocks == 255).any(dim=1)
    assert 0 < int(top.sum()) < top.numel()  # both kinds of block occur
    assert torch.equal(blocks_back[top], blocks[top])
    assert torch.equal(back["exp_avg_absmax"][top], state["exp_avg_absmax"][top])
    again = export_state(opt, back)["exp_avg"]
    absmax = state["exp_avg_absmax"].repeat_interleave(256).view_as(again)
    half_gap = float((SIGNED[1:] - SIGNED[:-1]).max()) / 2
    assert ((again - exported["exp_avg"]).abs() <= absmax * half_gap * (1 + 1e-6)).all()
    # bf16 moments: exported as they are, imported from fp32 back to the same bf16 values.
    model, opt = _train(lambda ps: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16))
    weight = next(model.parameters())
    state = opt.state[weight]
    fp32 = {k: v.float() if k.startswith("exp_avg") else v
            for k, v in export_state(opt, state).items()}
    back = import_state(opt, weight, fp32)
    assert back["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(back["exp_avg"], state["exp_avg"])
    assert torch.equal(back["exp_avg_sq"], state["exp_avg_sq"])


def test_mismatched_state_is_refused():
    model, opt = _train(lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=1000), steps=1)
    sd = opt.state_dict()
    plain = AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="convert_state"):
        plain.load_state_dict(sd)
    assert len(plain.state) == 0
    other_block = AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1000, block_size=128)
    with pytest.raises(ValueError, match="block_size"):
        other_block.load_state_dict(sd)
    _, fp32_opt = _train(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=1)
    eight = AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1000)
    with pytest.raises(RuntimeError, match="convert_state"):
        eight.load_state_dict(fp32_opt.state_dict())
    bad = convert_state(sd, torch.uint8, min_8bit_size=1000)
    bad["state"][0]["exp_avg_absmax"] = bad["state"][0]["exp_avg_absmax"][:-1]
    with pytest.raises(RuntimeError, match="exp_avg_absmax"):
        eight.load_state_dict(bad)
    assert len(eight.state) == 0


def test_bad_arguments():
    params = [torch.nn.Parameter(torch.randn(8))]
    with pytest.raises(ValueError, match="block_size"):
        AdamW8bit(params, block_size=100)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW8bit(params, amsgrad=True)
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW(params, state_dtype=torch.int32)
    with pytest.raises(ValueError, match="kahan"):
        AdamW(params, state_dtype=torch.bfloat16, kahan_summation=True)
    p, g = torch.randn(300), torch.randn(300)
    m, v = torch.zeros(300, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)
    am, av = torch.zeros(2), torch.zeros(3)
    before = p.clone()
    with pytest.raises(ValueError, match="exp_avg_sq_absmaxes"):
        q8.adamw8bit_step([p], [g], [], [m], [v], [am], [av], [torch.tensor(1.0)], **HYPER)
    with pytest.raises(TypeError, match="exp_avgs"):
        q8.adamw8bit_step([p], [g], [], [m.float()], [v.float()], [], [], [torch.tensor(1.0)],
                          **HYPER)
    assert torch.equal(p, before)


def test_opcheck():
    n = 300
    args = ([torch.randn(n)], [torch.randn(n)], [], [torch.full((n,), 127, dtype=torch.uint8)],
            [torch.zeros(n, dtype=torch.uint8)], [torch.zeros(2)], [torch.zeros(2)],
            [torch.tensor(1.0)], q8.build_qmaps())
    torch.library.opcheck(torch.ops.fastllm.adamw8bit_step.default, args,
                          dict(HYPER, block_size=256),
                          test_utils=("test_schema", "test_faketensor"))


def _lm_data():
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics.values()).encode()[:200_000]
    return torch.tensor(list(text), dtype=torch.long)


class _TinyLM(torch.nn.Module):
    """Byte-level n-gram language model: the previous CTX bytes, embedded and concatenated,
    through a two-layer MLP to the next byte's logits (~55K params; 3 of its 5 tensors are
    large enough for 8-bit state)."""

    CTX = 8

    def __init__(self, dim=16, hidden=128):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.fc = torch.nn.Linear(self.CTX * dim, hidden)
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, idx):
        return self.head(torch.nn.functional.gelu(self.fc(self.embed(idx).flatten(1))))


def _train_lm(make_opt, steps=300):
    torch.manual_seed(0)
    data = _lm_data()
    model = _TinyLM()
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(0)
    windows = data.unfold(0, _TinyLM.CTX + 1, 1)
    losses = []
    for _ in range(steps):
        batch = windows[torch.randint(0, windows.shape[0], (256,), generator=gen)]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits, batch[:, -1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20  # the mean of the last 20 steps: less batch noise


def test_training_matches_fp32_state():
    """A small LM, 300 steps: 8-bit and bf16 moments end within 1% of fp32 moments' loss."""
    torch.set_num_threads(1)
    hyper = dict(lr=3e-3, weight_decay=0.01)
    fp32 = _train_lm(lambda ps: AdamW(ps, **hyper))
    eight = _train_lm(lambda ps: AdamW8bit(ps, **hyper))
    bf16 = _train_lm(lambda ps: AdamW(ps, state_dtype=torch.bfloat16, **hyper))
    print(f"\nfinal loss (mean of the last 20 of 300 steps): fp32 state {fp32:.4f}, "
          f"8-bit {eight:.4f} ({(eight / fp32 - 1) * 100:+.2f}%), "
          f"bf16 {bf16:.4f} ({(bf16 / fp32 - 1) * 100:+.2f}%)")
    assert abs(eight / fp32 - 1) < 0.01
    assert abs(bf16 / fp32 - 1) < 0.01


@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
def test_a_block_of_subnormal_moments_keeps_its_codes(backend, device):
    """A block whose absmax is below 2^-128 (grads of 1e-38: m ~ 1e-39, subnormal): 1 / absmax
    overflowed fp32, and every code came out the top one (each m dequantised to +-absmax). The
    codes are the reference's; those of fp32 v's few subnormal bits within one code."""
    qmaps = q8.build_qmaps().to(device)
    g = torch.randn(16, generator=torch.Generator().manual_seed(0))
    out = {}
    for name in (backend, "ref"):
        codes = []
        for scale in (1e-38, 1e-20):  # m subnormal; v = 0.001 g^2 subnormal
            m, v = (torch.zeros(16, dtype=torch.uint8, device=device) for _ in range(2))
            am, av = torch.zeros(1, device=device), torch.zeros(1, device=device)
            step = (q8.adamw8bit_step_ref if name == "ref" else q8.adamw8bit_step)
            with fastllm.use_backend(name):
                step([torch.zeros(16, device=device)], [(g * scale).to(device)], [], [m], [v],
                     [am], [av], [torch.tensor(1.0, device=device)], qmaps, lr=1e-3, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, block_size=16)
            codes.append((m.cpu().long(), v.cpu().long()))
        out[name] = codes
    (m_got, _), (_, v_got) = out[backend]
    (m_want, _), (_, v_want) = out["ref"]
    assert torch.equal(m_got, m_want)
    assert (v_got - v_want).abs().max() <= 1 and (v_got == 255).sum() == 1


@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
def test_stochastic_rounding_never_overflows_a_finite_round_to_nearest(backend, device):
    """bf16 masters within half an ulp above bf16's largest value round to it under
    round-to-nearest; stochastic rounding keeps that result (its random bits carried about a
    fifth of them up to inf; the cpp kernel's AVX-512 store had its own copy of the rounding)."""
    n, block = 4096, 256
    info = torch.finfo(torch.bfloat16)
    ulp = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    frac = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.49
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    master = (sign * (info.max + frac.double() * ulp)).float().to(device)
    want = master.cpu().to(torch.bfloat16)
    assert bool(want.isfinite().all())
    m, v, am, av = _make_state(n, torch.uint8, block, device)
    p = torch.zeros(n, dtype=torch.bfloat16, device=device)
    with fastllm.use_backend(backend):
        q8.adamw8bit_step([p], [torch.zeros_like(p)], [master], [m], [v], [am], [av],
                          [torch.tensor(1.0)], block_size=block, **dict(HYPER, lr=0.0),
                          stochastic_rounding=True, seed=5)
    assert torch.equal(p.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
@pytest.mark.parametrize("name,make,error,match", BAD_SCALARS, ids=BAD_SCALAR_IDS)
def test_op_refuses_a_bad_scalar_before_writing(backend, device, name, make, error, match):
    """grad_scale, clip_coef and found_inf hold one floating-point value (found_inf: or bool) on
    the params' device or the CPU: the Triton kernel read the first of a two-element found_inf
    (an overflow flagged in the second was stepped through) and read an empty one out of
    bounds."""
    n, block = 300, 256
    m, v, am, av = _make_state(n, torch.uint8, block, device)
    p, g = torch.randn(n, device=device), torch.randn(n, device=device)
    state = [p, m, v, am, av]
    before = [t.clone() for t in state]
    with fastllm.use_backend(backend), pytest.raises(error, match=match):
        q8.adamw8bit_step([p], [g], [], [m], [v], [am], [av], [torch.tensor(1.0)],
                          block_size=block, **HYPER, **{name: make()})
    for t, b in zip(state, before):
        assert torch.equal(t, b)
