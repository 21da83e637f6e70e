"""Mixed-precision AdamW: fastllm::adamw_master_step, fastllm.optim.AdamW's master_weights /
stochastic_rounding / kahan_summation / max_grad_norm / loss_scaler options, and
fastllm.amp.LossScaler.

Accuracy contract, on every backend that runs here (cpp, triton through the interpreter, ref):
- each step's fp32 master and moments match a float64 reference step from the same state to
  rtol 1e-5 (atol 1e-7, an fp32 ulp at 1, for values that cancel to near zero);
- the written-back bf16/fp16 param is bitwise the round-to-nearest-even of the fp32 master;
- in pure bf16 mode the param is the correctly rounded updated weight (within half an ulp of the
  float64 step, up to that step's fp32 error), and param + kahan_comp tracks the float64 weight
  to rtol 2e-5 (the buffer keeps ~16 significant bits);
- stochastic rounding is unbiased: over 262144 roundings of values with known fractions the
  mean error is below 0.01 bf16 ulp (the standard error is < 0.001 ulp; round-to-nearest would
  be off by up to 0.5 ulp).
"""

import copy
import math

import pytest
import torch

import fastllm
from conftest import BAD_SCALAR_IDS, BAD_SCALARS
from conftest import backend_device_params as _all_backend_device_params
from fastllm.amp import LossScaleCollapsedError, LossScaler
from fastllm.ops import adamw_master_step, adamw_master_step_ref


def backend_device_params():
    """conftest's (backend, device) pairs. A fastllm._C without this op's kernels fails the
    tests (tests/test_extension.py names the cause) rather than skipping them."""
    return _all_backend_device_params()


RTOL, ATOL = 1e-5, 1e-7
SHAPES = [(0,), (1,), (7,), (123,), (4097,), (3, 5)]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
LOW = [torch.bfloat16, torch.float16]


def bits(t):
    """A view of t's bytes, so that equality is bitwise (nan == nan, -0 != +0)."""
    return t.detach().reshape(-1).view(torch.uint8)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_state(dtype, device, mode, shapes=SHAPES):
    """Op arguments with moments as after a few steps. mode: 'master', 'kahan' or 'pure'."""
    params = [torch.randn(s).to(device=device, dtype=dtype) for s in shapes]
    grads = [(torch.randn(s) * 100).to(device=device, dtype=dtype) for s in shapes]
    masters = [p.float() + torch.randn(p.shape, device=device) * 1e-3 for p in params] \
        if mode == "master" else []
    exp_avgs = [torch.randn(s, device=device) * 10 for s in shapes]
    exp_avg_sqs = [torch.rand(s, device=device) * 1e3 for s in shapes]
    comps = [(torch.randn(s) * 1e-3).to(device=device, dtype=dtype) for s in shapes] \
        if mode == "kahan" else []
    steps = [torch.tensor(4.0) for _ in shapes]
    return [params, grads, masters, exp_avgs, exp_avg_sqs, comps, steps]


def clone_args(args, dtype=None):
    out = []
    for i, lst in enumerate(args):
        # The float64 oracle gets float64 masters and moments; params, grads and comps keep
        # their dtype (what the kernel reads).
        widen = dtype is not None and i in (2, 3, 4)
        out.append([t.to(dtype) if widen else t.clone() for t in lst])
    return out


def assert_close_to(actual, expected, magnitude, what):
    """|actual - expected| <= RTOL * |expected| + 4 fp32 ulps of `magnitude` (the size of the
    operands, elementwise): rtol 1e-5, except where the result cancels to far below its
    operands, where fp32 arithmetic can only be exact to a few ulps of those operands."""
    actual, expected, magnitude = actual.double().cpu(), expected.double().cpu(), magnitude.cpu()
    bound = RTOL * expected.abs() + 4 * 2.0**-24 * magnitude + 1e-30
    err = (actual - expected).abs()
    assert bool((err <= bound).all()), (
        f"{what}: max error {err.max().item():.3g}, worst excess "
        f"{(err / bound).max().item():.3g}x the bound")


def oracle_magnitudes(args, hp, grad_scale, clip_coef, masters_prev):
    """Elementwise operand sizes of the master, exp_avg and exp_avg_sq updates."""
    mult = 1.0 / float(grad_scale) if grad_scale is not None else 1.0
    mult *= float(clip_coef) if clip_coef is not None else 1.0
    out = []
    for i in range(len(args[0])):
        g = args[1][i].double().abs() * mult
        out.append((masters_prev[i].double().abs() + hp["lr"] * 10,
                    args[3][i].double().abs() + g,
                    args[4][i].double().abs() + g * g))
    return out


def bf16_ulp(x):
    """The spacing of bf16 numbers at |x| (2^-133 for zero)."""
    x = x.double().abs().clamp(min=2.0**-126)
    return x.log2().floor().sub(7).exp2()


def scalars(device, scale, clip):
    grad_scale = torch.tensor(1024.0, device=device) if scale else None
    clip_coef = torch.tensor(0.37, device=device) if clip else None
    return grad_scale, clip_coef


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale,clip", [(False, False), (True, False), (False, True),
                                        (True, True)], ids=["plain", "scale", "clip", "both"])
def test_master_step_matches_float64(backend, device, dtype, scale, clip):
    grad_scale, clip_coef = scalars(device, scale, clip)
    args = make_state(dtype, device, "master")
    if scale:  # grads of size ~0.1 as a backward scaled by 1024 produces them (fits in fp16)
        args[1] = [(g.float() * 1.024).to(dtype) for g in args[1]]
    for _ in range(3):
        oracle = clone_args(args, torch.float64)
        adamw_master_step_ref(*oracle, **HP, grad_scale=grad_scale, clip_coef=clip_coef)
        sizes = oracle_magnitudes(args, HP, grad_scale, clip_coef, args[2])
        grads_before = [g.clone() for g in args[1]]
        with fastllm.use_backend(backend):
            adamw_master_step(*args, **HP, grad_scale=grad_scale, clip_coef=clip_coef)
        params, grads, masters, exp_avgs, exp_avg_sqs, _, _ = args
        for i in range(len(params)):
            for j, name in ((2, "master"), (3, "exp_avg"), (4, "exp_avg_sq")):
                assert_close_to(args[j][i], oracle[j][i], sizes[i][j - 2], f"{name} {i}")
            assert same_bits(params[i], masters[i].to(dtype)), f"tensor {i}"
            assert same_bits(grads[i], grads_before[i])
        for s in args[6]:
            s += 1


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("kahan", [True, False], ids=["kahan", "round_nearest"])
def test_pure_bf16_step_matches_float64(backend, device, kahan):
    dtype = torch.bfloat16
    grad_scale, clip_coef = scalars(device, True, True)
    args = make_state(dtype, device, "kahan" if kahan else "pure")
    args[1] = [(g.float() * 1.024).to(dtype) for g in args[1]]
    oracle = clone_args(args, torch.float64)
    # The oracle keeps the exact updated weight: run it as a master step from param + comp.
    oracle[2] = [p.double() + (c.double() if kahan else 0) for p, c in
                 zip(args[0], args[5] if kahan else args[0])]
    oracle[5] = []
    sizes = oracle_magnitudes(args, HP, grad_scale, clip_coef, oracle[2])
    adamw_master_step_ref(*oracle, **HP, grad_scale=grad_scale, clip_coef=clip_coef)
    with fastllm.use_backend(backend):
        adamw_master_step(*args, **HP, grad_scale=grad_scale, clip_coef=clip_coef)
    params, comps = args[0], args[5]
    for i in range(len(params)):
        exact = oracle[2][i]
        assert_close_to(args[3][i], oracle[3][i], sizes[i][1], f"exp_avg {i}")
        assert_close_to(args[4][i], oracle[4][i], sizes[i][2], f"exp_avg_sq {i}")
        # Correctly rounded: within half a bf16 ulp of the exact weight, plus the fp32 error
        # of computing that weight.
        err = (params[i].double() - exact).abs()
        slack = RTOL * exact.abs() + 4 * 2.0**-24 * sizes[i][0]
        assert bool((err <= bf16_ulp(exact) * 0.5 + slack).all()), f"tensor {i}"
        if kahan:
            assert_close_to(params[i].double() + comps[i].double(), exact, sizes[i][0],
                            f"param + kahan_comp {i}")


def rounding_setup(device, mode, n, dtype=torch.bfloat16):
    """Op arguments whose updated fp32 weight x is known exactly, with arbitrary fractions of an
    ulp: master mode with lr = 0 (x = master); pure mode (bf16) with zero moments and grads, so
    x = param * fp32(1 - lr * wd), one correctly rounded fp32 product."""
    args = make_state(dtype, device, mode, shapes=[(n,)])
    if mode == "master":
        exact = 1.0 + torch.rand(n)
        args[2] = [exact.to(device)]
        return args, dict(HP, lr=0.0), exact
    hp = dict(HP, lr=1e-3, weight_decay=0.3, beta1=0.0)
    params = (1.0 + torch.rand(n)).bfloat16()
    args[0] = [params.to(device)]
    args[1] = [torch.zeros(n, dtype=torch.bfloat16, device=device)]
    args[3] = [torch.zeros(n, device=device)]
    args[4] = [torch.zeros(n, device=device)]
    exact = params.float() * torch.tensor(1.0 - hp["lr"] * hp["weight_decay"])
    return args, hp, exact


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("mode,dtype", [("master", torch.bfloat16), ("pure", torch.bfloat16),
                                        ("master", torch.float16)],
                         ids=["master-bf16", "pure-bf16", "master-fp16"])
def test_stochastic_rounding_is_unbiased(backend, device, mode, dtype):
    n, repeats = 8192, 32
    setup, hp, exact = rounding_setup(device, mode, n, dtype)
    ulp = bf16_ulp(exact) if dtype == torch.bfloat16 else bf16_ulp(exact) / 8
    rounded_sum = torch.zeros(n, dtype=torch.float64)
    outputs = []
    for r in range(repeats):
        args = clone_args(setup)
        with fastllm.use_backend(backend):
            adamw_master_step(*args, **hp, stochastic_rounding=True, seed=1000 + r)
        p = args[0][0].double().cpu()
        assert bool(((p - exact.double()).abs() < ulp).all()), "not a neighbour of x"
        rounded_sum += p
        outputs.append(p)
    bias = ((rounded_sum / repeats - exact.double()) / ulp).mean().item()
    assert abs(bias) < 0.01, f"mean rounding error {bias} ulp"
    # Per element too: round-to-nearest is off by min(f, 1 - f) ulp, 0.25 on average over
    # uniform fractions f; the mean of 32 stochastic roundings by ~0.06 (standard error
    # sqrt(f (1 - f) / 32)).
    per_element = ((rounded_sum / repeats - exact.double()) / ulp).abs().mean().item()
    assert per_element < 0.1, per_element
    assert not torch.equal(outputs[0], outputs[1]), "different seeds, different roundings"


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
def test_stochastic_rounding_fraction(backend, device, dtype, sign):
    """Values a quarter ulp above a number round up (in magnitude) a quarter of the time."""
    n = 16384
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    exact = torch.full((n,), sign * (1.0 + ulp * 0.25))
    args = make_state(dtype, device, "master", shapes=[(n,)])
    args[2] = [exact.to(device)]
    with fastllm.use_backend(backend):
        adamw_master_step(*args, **dict(HP, lr=0.0), stochastic_rounding=True, seed=7)
    p = args[0][0].double().cpu() * sign
    assert set(p.unique().tolist()) <= {1.0, 1.0 + ulp}
    up = (p > 1.0).double().mean().item()
    assert abs(up - 0.25) < 0.02  # 6 standard errors
    # Same seed, same bits.
    again = make_state(dtype, device, "master", shapes=[(n,)])
    again[2] = [exact.to(device)]
    with fastllm.use_backend(backend):
        adamw_master_step(*again, **dict(HP, lr=0.0), stochastic_rounding=True, seed=7)
    assert same_bits(again[0][0], args[0][0])


# ----------------------------------------------------------------------------- the optimizer


def make_model_params(dtype, device, shapes=((37, 11), (11,), (4097,), (1,))):
    return [torch.nn.Parameter((torch.randn(s) * 0.5).to(device=device, dtype=dtype))
            for s in shapes]


def set_grads(params, gen, scale=1.0):
    for p in params:
        g = torch.randn(p.shape, generator=gen) * 0.1 * scale
        p.grad = g.to(device=p.device, dtype=p.dtype)


def snapshot(opt, params):
    return copy.deepcopy(([p.detach() for p in params], opt.state_dict()))


def assert_same_snapshot(a, b):
    (pa, sa), (pb, sb) = a, b
    for x, y in zip(pa, pb):
        assert same_bits(x, y)
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()
        for key in sa["state"][k]:
            assert same_bits(sa["state"][k][key], sb["state"][k][key]), (k, key)
    assert sa.get("fastllm") == sb.get("fastllm")


MODES = {
    "master": dict(master_weights=True),
    "master_sr": dict(master_weights=True, stochastic_rounding=True),
    "pure_sr": dict(stochastic_rounding=True),
    "pure_kahan": dict(kahan_summation=True),
}


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaler"])
def test_optimizer_matches_the_pytorch_sequence(backend, device, dtype, clip, scaled):
    """grads to fp32, unscale, clip_grad_norm_, torch AdamW on fp32 masters, copy back."""
    params = make_model_params(dtype, device)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    scaler = LossScaler(init_scale=256.0) if scaled else None
    opt = fastllm.optim.AdamW(params, lr=1e-2, weight_decay=0.1, master_weights=True,
                              max_grad_norm=clip, loss_scaler=scaler)
    torch_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with fastllm.use_backend(backend):
        for _ in range(3):
            set_grads(params, gen, scale=256.0 if scaled else 1.0)
            for p, m in zip(params, masters):
                m.grad = p.grad.float() / (256.0 if scaled else 1.0)
            norm = torch.nn.utils.clip_grad_norm_(masters, clip if clip else float("inf"))
            torch_opt.step()
            opt.step()
            assert not opt.step_skipped
            torch.testing.assert_close(opt.grad_norm.cpu(), norm.float().cpu(), rtol=1e-5,
                                       atol=0)
            for p, m in zip(params, masters):
                state = opt.state[p]
                assert state["master_param"].dtype == torch.float32
                assert state["exp_avg"].dtype == torch.float32
                torch.testing.assert_close(state["master_param"].cpu(), m.detach().cpu(),
                                           rtol=1e-5, atol=1e-6)
                assert same_bits(p, state["master_param"].to(dtype))
    if scaled:
        assert scaler.get_scale() == 256.0


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_fp32_params_are_unaffected_by_master_weights(backend, device):
    """fp32 params in a master-weights optimizer: torch AdamW on the clipped grads."""
    p32 = torch.nn.Parameter(torch.randn(50, device=device))
    pbf = torch.nn.Parameter(torch.randn(30, device=device).bfloat16())
    ref = torch.nn.Parameter(p32.detach().clone())
    opt = fastllm.optim.AdamW([p32, pbf], lr=1e-2, master_weights=True, max_grad_norm=0.1)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    with fastllm.use_backend(backend):
        for _ in range(3):
            set_grads([p32, pbf], gen)
            norm = torch.cat([p32.grad.double(), pbf.grad.double()]).norm()
            ref.grad = p32.grad * min(1.0, 0.1 / (norm.item() + 1e-6))
            opt.step()
            torch_opt.step()
    assert "master_param" not in opt.state[p32]
    assert opt.state[p32]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p32.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_overflow_skips_the_step_bitwise(backend, device, mode, bad):
    dtype = torch.bfloat16
    params = make_model_params(dtype, device)
    scaler = LossScaler(init_scale=1024.0, hysteresis=1)
    opt = fastllm.optim.AdamW(params, lr=1e-2, max_grad_norm=1.0, loss_scaler=scaler,
                              **MODES[mode])
    gen = torch.Generator().manual_seed(2)
    with fastllm.use_backend(backend):
        for _ in range(2):
            set_grads(params, gen, scale=1024.0)
            opt.step()
        before = snapshot(opt, params)
        set_grads(params, gen, scale=1024.0)
        params[2].grad[1234] = bad
        opt.step()
    assert opt.step_skipped and opt.skipped_steps == 1
    assert not torch.isfinite(opt.grad_norm)
    after = snapshot(opt, params)
    # Everything but the scaler (which backed off) and the skip count is bitwise unchanged.
    before[1].pop("fastllm"), after[1].pop("fastllm")
    assert_same_snapshot(before, after)
    assert scaler.get_scale() == 512.0 and scaler.overflows == 1
    for p in params:
        assert bool(torch.isfinite(p).all())


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_overflow_of_scaled_fp16_grads(dtype):
    """A grad that overflows the low-precision format in backward is inf: skipped, backed off."""
    params = make_model_params(dtype, "cpu")
    scaler = LossScaler(init_scale=2.0**16, hysteresis=2)
    opt = fastllm.optim.AdamW(params, lr=1e-2, master_weights=True, loss_scaler=scaler)
    gen = torch.Generator().manual_seed(3)
    set_grads(params, gen)
    params[0].grad[0, 0] = float("inf")
    before = snapshot(opt, params)
    opt.step()  # first overflow: hysteresis absorbs it, the step is still skipped
    assert opt.step_skipped and scaler.get_scale() == 2.0**16
    opt.step()
    assert opt.step_skipped and scaler.get_scale() == 2.0**15
    after = snapshot(opt, params)
    # Params bitwise unchanged; a skipped first step may create the state (as torch's fused
    # AdamW under GradScaler does, deciding on the device), but only as fresh state.
    for x, y in zip(before[0], after[0]):
        assert same_bits(x, y)
    for p in params:
        state = opt.state.get(p, {})
        if state:
            assert state["step"].item() == 0.0
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
            assert same_bits(state["master_param"], p.detach().float())
    set_grads(params, gen)
    opt.step()
    assert not opt.step_skipped and opt.state[params[0]]["step"].item() == 1.0


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("mode,dtype", [(m, torch.bfloat16) for m in MODES]
                         + [("master_sr", torch.float16)],
                         ids=[f"{m}-bf16" for m in MODES] + ["master_sr-fp16"])
def test_state_dict_round_trip_continues_bitwise(backend, device, mode, dtype):
    params = make_model_params(dtype, device)
    opt = fastllm.optim.AdamW(params, lr=1e-2, max_grad_norm=0.5,
                              loss_scaler=LossScaler(init_scale=128.0, growth_interval=2),
                              **MODES[mode])
    gen = torch.Generator().manual_seed(4)
    with fastllm.use_backend(backend):
        for _ in range(3):
            set_grads(params, gen, scale=128.0)
            opt.step()
        saved_params = [p.detach().clone() for p in params]
        saved = copy.deepcopy(opt.state_dict())
        gen_state = gen.get_state()
        for _ in range(3):
            set_grads(params, gen, scale=opt.loss_scaler.get_scale())
            opt.step()
        expected = snapshot(opt, params)

        clones = [torch.nn.Parameter(p.clone()) for p in saved_params]
        opt2 = fastllm.optim.AdamW(clones, lr=1e-2, max_grad_norm=0.5,
                                   loss_scaler=LossScaler(), **MODES[mode])
        opt2.load_state_dict(saved)
        for p in clones:
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in opt2.state[p]:
                    assert opt2.state[p][key].dtype == torch.float32
        gen.set_state(gen_state)
        for _ in range(3):
            set_grads(clones, gen, scale=opt2.loss_scaler.get_scale())
            opt2.step()
    assert_same_snapshot(expected, snapshot(opt2, clones))
    assert opt2.loss_scaler.get_scale() == opt.loss_scaler.get_scale() != 128.0


def test_grad_scaler_works_with_master_weights():
    params = make_model_params(torch.float16, "cpu")
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = fastllm.optim.AdamW(params, lr=1e-2, master_weights=True, max_grad_norm=0.3)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        scaler.scale(torch.tensor(0.0))  # what creates the scaler's scale tensor
        set_grads(params, gen, scale=512.0)
        if step == 1:
            params[1].grad[3] = float("inf")
        for p, r in zip(params, ref):
            r.grad = p.grad.float() / 512.0
        scaler.step(opt)
        scaler.update()
        if step != 1:
            torch.nn.utils.clip_grad_norm_(ref, 0.3)
            torch_opt.step()
        else:
            assert opt.step_skipped
        scaler._scale.fill_(512.0)  # keep the scale fixed so set_grads stays comparable
    for p, r in zip(params, ref):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), rtol=1e-5,
                                   atol=1e-6)


def test_default_options_keep_the_drop_in_state_dict():
    p = torch.nn.Parameter(torch.randn(5).bfloat16())
    opt = fastllm.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(5).bfloat16()
    opt.step()
    sd = opt.state_dict()
    assert "fastllm" not in sd
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert opt.grad_norm is None


# ----------------------------------------------------------------------------- LossScaler


def test_loss_scaler_growth_backoff_and_hysteresis():
    s = LossScaler(init_scale=2.0**16, growth_interval=3, hysteresis=2, backoff_factor=0.5)
    loss = torch.tensor(2.0)
    assert s.scale(loss).item() == 2.0**17
    for _ in range(2):
        s.update(False)
    assert s.get_scale() == 2.0**16
    s.update(False)
    assert s.get_scale() == 2.0**17  # grew after 3 clean steps
    s.update(True)
    assert s.get_scale() == 2.0**17  # hysteresis absorbs the first overflow
    s.update(True)
    assert s.get_scale() == 2.0**16
    s.update(True)
    assert s.get_scale() == 2.0**15  # hysteresis used up: every overflow backs off
    s.update(False), s.update(False)
    s.update(True)  # an overflow resets the growth count
    s.update(False), s.update(False)
    assert s.get_scale() == 2.0**14
    s.update(False)
    assert s.get_scale() == 2.0**15 and s.overflows == 4


def test_loss_scaler_collapse_raises_with_advice():
    s = LossScaler(init_scale=4.0, min_scale=1.0, hysteresis=1)
    s.update(True)
    s.update(True)
    assert s.get_scale() == 1.0
    with pytest.raises(LossScaleCollapsedError, match="min_scale|learning rate"):
        s.update(True)


def test_loss_scaler_state_dict_and_disabled():
    s = LossScaler(init_scale=64.0, growth_interval=5, hysteresis=3)
    s.update(False), s.update(True)
    t = LossScaler()
    t.load_state_dict(copy.deepcopy(s.state_dict()))
    assert t.state_dict() == s.state_dict()
    off = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert off.scale(loss) is loss and off.get_scale() == 1.0
    off.update(True)
    assert off.get_scale() == 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(min_scale=2.0**20), "min_scale"),
])
def test_loss_scaler_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)


# ----------------------------------------------------------------------------- refusals, opcheck


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(master_weights=True, kahan_summation=True), ValueError, "replaces master"),
    (dict(master_weights=True, amsgrad=True), ValueError, "amsgrad"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(loss_scaler=object()), TypeError, "LossScaler"),
])
def test_bad_optimizer_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        fastllm.optim.AdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("kwargs", [dict(stochastic_rounding=True),
                                    dict(kahan_summation=True)])
def test_pure_fp16_is_refused_before_anything_changes(kwargs):
    ok = torch.nn.Parameter(torch.randn(4).bfloat16())
    bad = torch.nn.Parameter(torch.randn(4).half())
    opt = fastllm.optim.AdamW([ok, bad], lr=1e-2, **kwargs)
    ok.grad, bad.grad = torch.randn(4).bfloat16(), torch.randn(4).half()
    before = ok.detach().clone()
    with pytest.raises(NotImplementedError, match="bfloat16"):
        opt.step()
    assert same_bits(ok, before) and len(opt.state) == 0


@pytest.mark.parametrize("case,error,match", [
    ("fp32_params", TypeError, "bfloat16 or float16"),
    ("master_dtype", TypeError, "masters\\[0\\] has dtype"),
    ("both_buffers", ValueError, "not both"),
    ("shape", ValueError, "shape"),
])
def test_op_refuses_bad_arguments_before_writing(case, error, match):
    dtype = torch.bfloat16
    args = make_state(dtype, "cpu", "master", shapes=[(5,)])
    kwargs = dict(HP)
    if case == "fp32_params":
        args[0], args[1] = [args[0][0].float()], [args[1][0].float()]
    elif case == "master_dtype":
        args[2] = [args[2][0].bfloat16()]
    elif case == "both_buffers":
        args[5] = [torch.zeros(5, dtype=dtype)]
    elif case == "shape":
        args[3] = [torch.zeros(6)]
    before = clone_args(args)
    with pytest.raises(error, match=match):
        adamw_master_step(*args, **kwargs)
    for lst, old in zip(args, before):
        for t, o in zip(lst, old):
            assert same_bits(t, o)


@pytest.mark.parametrize("backend", ["ref", "cpp"])
@pytest.mark.parametrize("mode", ["master", "kahan"])
def test_opcheck(backend, mode):
    if fastllm._backend.unavailable_reason(backend, "cpu"):
        pytest.skip("backend unavailable")
    args = make_state(torch.bfloat16, "cpu", mode, shapes=[(5,), (2, 3)])
    kwargs = dict(HP, stochastic_rounding=True, seed=3, grad_scale=torch.tensor(2.0),
                  clip_coef=torch.tensor(0.5))
    with fastllm.use_backend(backend):
        torch.library.opcheck(torch.ops.fastllm.adamw_master_step.default, tuple(args), kwargs)


# ----------------------------------------------------------------------------- pure bf16 training


def train_regression(opt_kwargs, steps=200, lr=1e-2):
    """Linear regression with label noise (loss floor 0.25), bf16 weights around 1.0, where an
    Adam step (~lr) is below half a bf16 ulp (2^-8) of the weights."""
    g = torch.Generator().manual_seed(0)
    n, d = 1024, 64
    x = torch.randn(n, d, generator=g)
    w_true = 1.0 + 0.3 * torch.randn(d, generator=g)
    y = x @ w_true + 0.5 * torch.randn(n, generator=g)
    w = torch.nn.Parameter((1.0 + 0.3 * torch.randn(d, generator=g)).bfloat16())
    b = torch.nn.Parameter(torch.zeros(1).bfloat16())
    opt = fastllm.optim.AdamW([w, b], lr=lr, weight_decay=0.0, **opt_kwargs)
    for _ in range(steps):
        loss = ((x @ w.float() + b.float() - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return ((x @ w.float() + b.float() - y) ** 2).mean().item()


def test_pure_bf16_training_tracks_fp32_master():
    """200 steps: stochastic rounding and Kahan summation end within 1% of the fp32-master loss;
    plain bf16 AdamW (round to nearest) is printed for BENCHMARKS.md (run with -s)."""
    losses = {name: train_regression(kwargs) for name, kwargs in {
        "fp32 master": dict(master_weights=True),
        "bf16 + stochastic rounding": dict(stochastic_rounding=True),
        "bf16 + Kahan summation": dict(kahan_summation=True),
        "bf16 round-to-nearest": dict(),
    }.items()}
    ref = losses["fp32 master"]
    for name, loss in losses.items():
        print(f"{name}: final loss {loss:.5f} ({(loss / ref - 1) * 100:+.2f}% vs fp32 master)")
    assert abs(losses["bf16 + stochastic rounding"] / ref - 1) < 0.01
    assert abs(losses["bf16 + Kahan summation"] / ref - 1) < 0.01
    assert losses["bf16 round-to-nearest"] > ref * 1.05  # the gap the options close


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy
@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_write_back_rounds_every_range_correctly(backend, device, dtype):
    """Subnormals, ties, the largest finite values and overflow to inf round as torch does.
    (Masters that are themselves fp32 subnormals, below 1.2e-38, are left out: the Triton
    interpreter flushes them.)"""
    info = torch.finfo(dtype)
    # (No -0.0: with lr = 0 the update adds a signed zero, which may turn -0 into +0.)
    special = torch.tensor([0.0, info.tiny, info.tiny * 1.5, info.max, info.max * 1.001,
                            -info.max * 1.01, 1.0 + info.eps / 2, 1.0 + info.eps * 1.5,
                            2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14 * 0.75, 2.0**-20 / 3])
    values = torch.cat([special, torch.randn(4000) * torch.logspace(-30, 30, 4000).float()])
    args = make_state(dtype, device, "master", shapes=[values.shape])
    args[2] = [values.to(device)]
    with fastllm.use_backend(backend):
        adamw_master_step(*args, **dict(HP, lr=0.0))
    assert same_bits(args[0][0].cpu(), values.to(dtype))


def test_deepcopy_keeps_the_options():
    p = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt = fastllm.optim.AdamW([p], master_weights=True, stochastic_rounding=True,
                              max_grad_norm=1.0, loss_scaler=LossScaler())
    p.grad = torch.randn(4).bfloat16()
    opt.step()
    twin = copy.deepcopy(opt)
    assert (twin.master_weights, twin.stochastic_rounding, twin.max_grad_norm) == (True, True, 1.0)
    assert twin._sr_seed == opt._sr_seed
    assert twin.loss_scaler.state_dict() == opt.loss_scaler.state_dict()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy
@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_stochastic_rounding_picks_a_neighbour_in_every_range(backend, device, dtype):
    """Each result is round-to-nearest's or the neighbour on x's other side; never nan; exact
    values stay; values that round to inf under round-to-nearest do so here too. (No fp32
    subnormal inputs: the Triton interpreter flushes them.)"""
    info = torch.finfo(dtype)
    values = torch.cat([
        torch.tensor([0.0, 1.0, -2.0, info.tiny, info.tiny * 1.37, -info.tiny * 3.3,
                      info.max, info.max * 1.0001, -info.max * 1.1, 2.0**-24 * 0.6,
                      -(2.0**-24) * 2.3, 1e-30]),
        torch.randn(4000) * torch.logspace(-30, 30, 4000).float()])
    rn = values.to(dtype)
    for seed in (1, 2):
        args = make_state(dtype, device, "master", shapes=[values.shape])
        args[2] = [values.to(device)]
        with fastllm.use_backend(backend):
            adamw_master_step(*args, **dict(HP, lr=0.0), stochastic_rounding=True, seed=seed)
        out = args[0][0].cpu()
        assert not bool(out.isnan().any())
        same = out.view(torch.int16) == rn.view(torch.int16)
        step = (out.view(torch.int16).int() - rn.view(torch.int16).int()).abs() == 1
        between = (out.double() - values.double()) * (rn.double() - values.double()) <= 0
        assert bool((same | (step & between)).all()), values[~(same | (step & between))]
        exact = rn.double() == values.double()
        assert bool(same[exact].all())
        assert bool(same[rn.isinf()].all())


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy
@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_stochastic_rounding_never_overflows_a_finite_round_to_nearest(backend, device, dtype):
    """Masters within half an ulp above the largest finite value round to it under
    round-to-nearest; stochastic rounding keeps that result (bf16's added random bits carried
    about a fifth of them up to inf)."""
    info = torch.finfo(dtype)
    ulp = 2.0 ** math.floor(math.log2(info.max)) * info.eps  # the spacing at the largest value
    frac = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 0.49
    sign = torch.where(torch.arange(4096) % 2 == 0, 1.0, -1.0)
    values = (sign * (info.max + frac.double() * ulp)).float()
    rn = values.to(dtype)
    assert bool(rn.isfinite().all())
    args = make_state(dtype, device, "master", shapes=[values.shape])
    args[2] = [values.to(device)]
    with fastllm.use_backend(backend):
        adamw_master_step(*args, **dict(HP, lr=0.0), stochastic_rounding=True, seed=5)
    assert same_bits(args[0][0].cpu(), rn)




@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("name,make,error,match", BAD_SCALARS, ids=BAD_SCALAR_IDS)
def test_op_refuses_a_bad_scalar_before_writing(backend, device, name, make, error, match):
    """grad_scale, clip_coef and found_inf hold one floating-point value on the params' device or
    the CPU: the Triton kernel read the first of a two-element found_inf (an overflow flagged in
    the second was stepped through) and read an empty one out of bounds."""
    args = make_state(torch.bfloat16, device, "master", shapes=[(33,)])
    before = clone_args(args)
    with fastllm.use_backend(backend), pytest.raises(error, match=match):
        adamw_master_step(*args, **HP, **{name: make()})
    for lst, old in zip(args, before):
        for t, o in zip(lst, old):
            assert same_bits(t, o)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_a_bool_found_inf_skips_the_step(backend, device):
    args = make_state(torch.bfloat16, device, "master", shapes=[(33,)])
    before = clone_args(args)
    with fastllm.use_backend(backend):
        adamw_master_step(*args, **HP, found_inf=torch.tensor(True, device=device))
    for lst, old in zip(args, before):
        for t, o in zip(lst, old):
            assert same_bits(t, o)
