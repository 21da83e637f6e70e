"""GaLore: the fused step against a float64 reference on every backend, the range finder on a
matrix with a known spectrum, the optimizer against a float64 reference of its update rule,
state_dict round trip, gradient accumulation, a small training run against AdamW (and
galore-torch when installed), and DDP world 2 against one process.

Tolerances: fp32 against fp64 1e-5 relative (a handful of fp32 roundings per element); bf16
params within one bf16 spacing per step of the fp64 result rounded the same way.
"""

import copy
import importlib.util
import io
import math

import pytest
import torch
import torch.nn as nn

import fastllm
from conftest import backend_device_params
from fastllm.distributed.launch import spawn
from fastllm.ops import galore_adam_step, galore_adam_step_ref
from fastllm.optim import GaLoreAdamW
from fastllm.optim.galore import range_finder

# the op has no CUDA kernel: its GPU path is Triton
NO_CUDA_KERNEL = backend_device_params(without=("cuda",))

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, scale=0.25)


def _orthonormal(n, r, dtype=torch.float32):
    q, _ = torch.linalg.qr(torch.randn(n, r, dtype=torch.float64))
    return q.to(dtype).contiguous()


# --- the fused step -------------------------------------------------------------------------
@pytest.mark.parametrize("backend,device", NO_CUDA_KERNEL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape,rank,left", [((1, 1), 1, True), ((7, 123), 3, True),
                                             ((123, 7), 4, False), ((33, 4097), 5, True),
                                             ((4097, 2), 1, False)])
def test_step_matches_float64_reference(backend, device, dtype, shape, rank, left):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernel computes in float32")
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    rows, cols = shape
    proj = _orthonormal(rows if left else cols, rank, opmath).to(device)
    low = (rank, cols) if left else (rows, rank)
    param = torch.randn(shape, device=device).to(dtype)
    m, v = torch.zeros(low, dtype=opmath, device=device), torch.zeros(low, dtype=opmath,
                                                                      device=device)
    ref_p, ref_m, ref_v = param.double(), m.double(), v.double()
    steps = 3
    for step in range(1, steps + 1):
        grad = torch.randn(shape, device=device).to(dtype)
        grad_before, proj_before = grad.clone(), proj.clone()
        with fastllm.use_backend(backend):
            galore_adam_step(param, grad, proj, m, v, step=step, left=left, **HYPER)
        assert torch.equal(grad, grad_before) and torch.equal(proj, proj_before)
        galore_adam_step_ref(ref_p, grad.double(), proj.double(), ref_m, ref_v, step=step,
                             left=left, **HYPER)
        if dtype == torch.bfloat16:
            ref_p = ref_p.to(torch.bfloat16).double()  # the param is stored in bf16 each step
    torch.testing.assert_close(m.double(), ref_m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.double(), ref_v, rtol=1e-5, atol=1e-6)
    if dtype == torch.bfloat16:
        spacing = ref_p.abs().clamp_min(1e-3) * 2.0**-8
        assert bool(((param.double() - ref_p).abs() <= steps * spacing).all())
    else:
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(param.double(), ref_p, rtol=tol, atol=tol)


def test_step_refuses_bad_input_before_changing_anything():
    p, g = torch.randn(8, 16), torch.randn(8, 16)
    proj = _orthonormal(8, 2)
    m, v = torch.zeros(2, 16), torch.zeros(2, 16)
    before = p.clone()
    with pytest.raises(ValueError, match="proj has shape"):
        galore_adam_step(p, g, _orthonormal(16, 2), m, v, step=1, left=True, lr=0.1)
    with pytest.raises(ValueError, match="low-rank shape"):
        galore_adam_step(p, g, proj, torch.zeros(3, 16), v, step=1, left=True, lr=0.1)
    with pytest.raises(ValueError, match="step"):
        galore_adam_step(p, g, proj, m, v, step=0, left=True, lr=0.1)
    assert torch.equal(p, before) and not m.any()


def test_step_passes_opcheck():
    p, g = torch.randn(8, 16), torch.randn(8, 16)
    args = (p, g, _orthonormal(8, 2), torch.zeros(2, 16), torch.zeros(2, 16))
    torch.library.opcheck(torch.ops.fastllm.galore_adam_step.default, args,
                          dict(step=1.0, left=True, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.0, scale=1.0))


# --- the range finder -----------------------------------------------------------------------
def _known_spectrum(rows, cols, singular_values):
    u = _orthonormal(rows, len(singular_values), torch.float64)
    v = _orthonormal(cols, len(singular_values), torch.float64)
    return u, (u * torch.tensor(singular_values, dtype=torch.float64)) @ v.t()


def test_range_finder_captures_the_top_singular_directions():
    s = [100.0, 60.0, 30.0, 20.0] + [2.0 * 0.9**i for i in range(60)]
    u, a = _known_spectrum(300, 120, s)
    top = u[:, :4]
    p = range_finder(a.float(), 4, power_iters=2, generator=torch.Generator().manual_seed(0))
    assert p.shape == (300, 4) and p.dtype == torch.float32
    torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)
    # Nothing of the top-4 subspace is left outside span(P): gap 2/20 after 3 passes.
    residual = top - p.double() @ (p.double().t() @ top)
    assert residual.norm() < 1e-4
    # Warm-started from a rotated, slightly perturbed basis, one iteration recovers it.
    previous = (top + 0.05 * torch.randn_like(top)).float()
    p2 = range_finder(a.float(), 4, previous=previous, power_iters=1)
    assert (top - p2.double() @ (p2.double().t() @ top)).norm() < 1e-3


def test_range_finder_on_ill_conditioned_and_bf16_gradients():
    # Rank-deficient (exactly rank 2) and bf16: an SVD-free range finder must not fail.
    a = (torch.randn(64, 2) @ torch.randn(2, 48)).bfloat16()
    p = range_finder(a, 4, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(p).all()
    u, _, _ = torch.linalg.svd(a.double())
    assert (u[:, :2] - p.double() @ (p.double().t() @ u[:, :2])).norm() < 1e-2


# --- the optimizer --------------------------------------------------------------------------
def _reference_run(w0, b0, grads, lr, betas, eps, wd, scale, projectors, left):
    """Float64 GaLore AdamW on (w, b) with the given grads; projectors[step] is P for W."""
    w, b = w0.double(), b0.double()
    r = projectors[0].shape[1]
    m = torch.zeros((r, w.shape[1]) if left else (w.shape[0], r), dtype=torch.float64)
    v = torch.zeros_like(m)
    mb, vb = torch.zeros_like(b), torch.zeros_like(b)
    for t, (gw, gb) in enumerate(grads, start=1):
        p = projectors[t - 1].double()
        galore_adam_step_ref(w, gw.double(), p, m, v, step=t, left=left, lr=lr, beta1=betas[0],
                             beta2=betas[1], eps=eps, weight_decay=wd, scale=scale)
        gb = gb.double()
        b.mul_(1 - lr * wd)
        mb.lerp_(gb, 1 - betas[0])
        vb.mul_(betas[1]).addcmul_(gb, gb, value=1 - betas[1])
        denom = vb.sqrt() / math.sqrt(1 - betas[1]**t) + eps
        b.addcdiv_(mb, denom, value=-lr / (1 - betas[0]**t))
    return w, b


@pytest.mark.parametrize("shape,proj_type,left", [((24, 40), "std", True),
                                                  ((40, 24), "std", False),
                                                  ((24, 40), "reverse_std", False)])
def test_optimizer_matches_float64_reference(shape, proj_type, left):
    w = torch.randn(shape, requires_grad=True)
    b = torch.randn(shape[0], requires_grad=True)
    w0, b0 = w.detach().clone(), b.detach().clone()
    opt = GaLoreAdamW([{"params": [w], "rank": 4, "update_proj_gap": 5, "scale": 0.5,
                        "proj_type": proj_type}, {"params": [b]}], lr=1e-2, betas=(0.9, 0.99),
                      eps=1e-8, weight_decay=0.1)
    grads, projectors = [], []
    base = torch.randn(shape[0], 3) @ torch.randn(3, shape[1])
    for step in range(12):
        gw = base + 0.1 * torch.randn(shape)
        gb = torch.randn(shape[0])
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        grads.append((gw, gb))
        projectors.append(opt.state[w]["projector"].clone())
        if step % 5 != 0:  # refreshed every update_proj_gap steps, kept in between
            assert torch.equal(projectors[-1], projectors[-2])
    assert opt.state[w]["exp_avg"].shape == ((4, shape[1]) if left else (shape[0], 4))
    want_w, want_b = _reference_run(w0, b0, grads, 1e-2, (0.9, 0.99), 1e-8, 0.1, 0.5,
                                    projectors, left)
    torch.testing.assert_close(w.detach().double(), want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.detach().double(), want_b, rtol=1e-5, atol=1e-6)


def _model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 16))


def _galore(model, lr=1e-2, rank=8, gap=50):
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    return GaLoreAdamW([{"params": matrices, "rank": rank, "update_proj_gap": gap, "scale": 1.0},
                        {"params": others}], lr=lr)


def test_state_dict_round_trip_continues_identically():
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    a = _model()
    opt_a = _galore(a, gap=3)
    for _ in range(4):
        opt_a.zero_grad()
        (a(x) - y).square().mean().backward()
        opt_a.step()
    for p in a.parameters():  # an inf step: skipped, and counted
        p.grad = torch.full_like(p, float("inf"))
    opt_a.step()
    assert opt_a.skipped_steps == 1
    blob = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    b = _model(seed=5)
    b.load_state_dict(saved["model"])
    opt_b = _galore(b, gap=3)
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.skipped_steps == 1  # the count goes on from the checkpoint
    for _ in range(5):  # crosses a projector refresh
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def _snapshot(model, opt):
    import copy

    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("when", ["first", "later"])
def test_a_non_finite_grad_changes_nothing(bad, when):
    """One nan/inf element: params, moments, projectors and step counts stay bitwise (as
    fastllm.optim.AdamW's skipped step), even on the first step."""
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    model = _model()
    opt = _galore(model, gap=2)
    for _ in range(0 if when == "first" else 3):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    opt.zero_grad()
    (model(x) - y).square().mean().backward()
    next(model.parameters()).grad[1, 2] = bad
    params, state = _snapshot(model, opt)
    opt.step()
    assert opt.step_skipped and opt.skipped_steps == 1 and not math.isfinite(opt.grad_norm)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    after = opt.state_dict()
    assert after.pop("fastllm") == {"skipped_steps": 1}  # (the count is all that moved)
    state.pop("fastllm")
    assert _same(state, after)


def test_clipping_loss_scaling_and_master_weights_match_their_definitions():
    x, y = torch.randn(16, 32), torch.randn(16, 16)

    def train(clip=None, scale=None, dtype=torch.float32, master=False):
        model = _model().to(dtype)
        matrices = [p for p in model.parameters() if p.dim() == 2]
        others = [p for p in model.parameters() if p.dim() != 2]
        scaler = None if scale is None else fastllm.amp.LossScaler(init_scale=scale)
        kw = dict(max_grad_norm=clip, loss_scaler=scaler, master_weights=master)
        opt = GaLoreAdamW([{"params": matrices, "rank": 8, "update_proj_gap": 2, "scale": 1.0},
                           {"params": others}], lr=1e-2, **kw)
        norms = []
        for _ in range(4):
            opt.zero_grad()
            loss = (model(x.to(dtype)) - y.to(dtype)).float().square().mean()
            (loss * (scale or 1.0)).backward()
            opt.step()
            norms.append(float(opt.grad_norm))
        return model, norms

    plain, norms = train()
    # loss scaling: the grads are divided by the scale inside the step
    scaled, scaled_norms = train(scale=1024.0)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled_norms, norms, rtol=1e-5, atol=0)
    # clipping: equal to pre-clipping the grads with torch.nn.utils.clip_grad_norm_
    clip = 0.5 * min(norms)
    clipped, _ = train(clip=clip)
    model = _model()
    opt = _galore(model, gap=2)
    for _ in range(4):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    for a, b in zip(model.parameters(), clipped.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    # bf16: an update far below half a bf16 spacing is lost without masters, kept in them
    for master in (False, True):
        model = _model().to(torch.bfloat16)
        start = [p.detach().clone() for p in model.parameters()]
        opt = GaLoreAdamW([{"params": [model[0].weight], "rank": 8, "update_proj_gap": 2},
                           {"params": [model[0].bias]}], lr=1e-6, master_weights=master)
        for _ in range(2):
            opt.zero_grad()
            model(x.bfloat16()).float().square().mean().backward()
            opt.step()
        # most bf16 elements cannot move by 1e-6 (only those within ~1e-4 of zero do)
        moved = int((model[0].weight != start[0]).sum())
        assert moved < 0.1 * start[0].numel()
        masters = [opt.state[p].get("master_param") for p in (model[0].weight, model[0].bias)]
        if master:
            assert masters[0].dtype == torch.float32
            assert int((masters[0] != start[0].float()).sum()) > 0.9 * start[0].numel()
        else:
            assert masters == [None, None]


def test_state_of_another_model_and_bad_groups_are_refused_first():
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    a = _model()
    opt_a = _galore(a, gap=3)
    opt_a.zero_grad()
    (a(x) - y).square().mean().backward()
    opt_a.step()
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 64), nn.Tanh(),
                          nn.Linear(64, 16))
    opt_o = _galore(other, gap=3)
    opt_o.zero_grad()
    (other(x) - y).square().mean().backward()
    opt_o.step()
    before = _snapshot(a, opt_a)[1]
    with pytest.raises(ValueError, match="shape"):
        opt_a.load_state_dict(opt_o.state_dict())
    assert _same(before, opt_a.state_dict())
    with pytest.raises(ValueError, match="update_proj_gap"):
        opt_a.add_param_group({"params": [nn.Parameter(torch.ones(3, 3))], "rank": 2,
                               "update_proj_gap": 0})
    with pytest.raises(ValueError, match="without 'rank'"):
        opt_a.add_param_group({"params": [nn.Parameter(torch.ones(3, 3))], "scale": 0.5})
    assert len(opt_a.param_groups) == 2
    opt_a.add_param_group({"params": [nn.Parameter(torch.ones(3, 3))], "rank": 2})
    assert opt_a.param_groups[-1]["update_proj_gap"] == 200


def test_bad_hyperparameters_set_between_steps_change_nothing_and_layouts_are_stepped():
    """A non-finite lr set between steps (a scheduler, a user) is refused before any param,
    moment or step count moves; non-contiguous params (a transposed weight, plain or projected)
    are stepped as their contiguous copies would be."""
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    model = _model()
    opt = _galore(model, gap=2)
    for step in range(2):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    before = _snapshot(model, opt)
    for gi, key, value in ((1, "lr", float("nan")), (0, "betas", (0.9, 1.0)),
                           (1, "weight_decay", -1.0)):
        good = opt.param_groups[gi][key]
        opt.param_groups[gi][key] = value
        with pytest.raises(ValueError, match=f"param group {gi}"):
            opt.step()
        opt.param_groups[gi][key] = good
        assert _same(before[0], _snapshot(model, opt)[0])
        assert _same(before[1], _snapshot(model, opt)[1])

    def train(transposed):
        torch.manual_seed(3)
        w = torch.randn(12, 20)
        v = torch.randn(6)
        w = nn.Parameter(w.t().contiguous().t() if transposed else w)
        v = nn.Parameter(torch.stack([v, v], 1)[:, 0] if transposed else v)
        assert w.is_contiguous() != transposed and v.is_contiguous() != transposed
        opt = GaLoreAdamW([{"params": [w], "rank": 3, "update_proj_gap": 2}, {"params": [v]}],
                          lr=1e-2)
        for step in range(3):
            w.grad = torch.randn(12, 20, generator=torch.Generator().manual_seed(step))
            v.grad = torch.randn(6, generator=torch.Generator().manual_seed(10 + step))
            opt.step()
        return w.detach().clone(), v.detach().clone()

    for a, b in zip(train(True), train(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_master_weights_are_resynced_after_a_write_to_the_param():
    """model.load_state_dict into bf16 params with fp32 masters: the next step starts from the
    loaded values (as fastllm.optim.AdamW), not from the stale masters."""
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    model = _model().to(torch.bfloat16)
    opt = GaLoreAdamW([{"params": [model[0].weight, model[2].weight], "rank": 4},
                       {"params": [model[0].bias]}], lr=1e-8, master_weights=True)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    opt.step()
    for p in (model[0].weight, model[2].weight, model[0].bias):
        assert p.abs().max().item() < 1e-6
        assert opt.state[p]["master_param"].abs().max().item() < 1e-6


def test_gradient_accumulation_equals_the_full_batch():
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    a, b = _model(), _model()
    opt_a, opt_b = _galore(a), _galore(b)
    for _ in range(3):
        opt_a.zero_grad()
        for half in (slice(0, 8), slice(8, 16)):
            ((a(x[half]) - y[half]).square().mean() / 2).backward()
        opt_a.step()
        opt_b.zero_grad()
        (b(x) - y).square().mean().backward()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def train_regression(make_opt, steps=200, seed=1):
    """A small MLP fitted to a fixed teacher; the loss on held-out inputs after `steps`."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16))
    model = _model(seed)
    opt = make_opt(model)
    g = torch.Generator().manual_seed(3)
    x_eval = torch.randn(512, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        y_eval = teacher(x_eval)
    for _ in range(steps):
        x = torch.randn(32, 32, generator=g)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    with torch.no_grad():
        return (model(x_eval) - y_eval).square().mean().item()


def _galore_torch(model, lr=1e-2, rank=8, gap=50):
    from fastllm.bench.bench_compression import load_galore_torch

    PeerGaLore = load_galore_torch()

    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    return PeerGaLore([{"params": matrices, "rank": rank, "update_proj_gap": gap, "scale": 1.0,
                        "proj_type": "std"}, {"params": others}], lr=lr)


def test_training_reaches_a_loss_comparable_to_adamw():
    start = train_regression(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=0)
    adamw = train_regression(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                         weight_decay=0.0))
    galore = train_regression(_galore)
    print(f"\nGaLore training, 200 steps: start {start:.5f}, AdamW {adamw:.5f}, "
          f"fastllm GaLore {galore:.5f}")
    assert galore < 0.2 * start  # it trains
    assert galore < 1.5 * adamw  # rank 8 of 64: close to full-rank AdamW


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None,
                    reason="galore-torch (an optional benchmark peer) is not installed")
def test_training_matches_galore_torch():
    peer = train_regression(_galore_torch)
    ours = train_regression(_galore)
    print(f"\nGaLore training, 200 steps: galore-torch {peer:.5f}, fastllm GaLore {ours:.5f}")
    assert ours < 1.25 * peer


# --- DDP world 2 against one process ------------------------------------------------------
def _ddp_check(rank, world):
    import torch.distributed as dist

    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    single = _model()
    opt_single = _galore(single, gap=2)
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = _galore(model, gap=2)
    half = slice(8 * rank, 8 * rank + 8)
    for _ in range(5):
        opt_single.zero_grad()
        (single(x) - y).square().mean().backward()
        opt_single.step()
        opt.zero_grad()
        (ddp(x[half]) - y[half]).square().mean().backward()
        opt.step()
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(model.parameters(), single.parameters()))

    def replicas_equal(m):
        flat = torch.cat([p.detach().flatten() for p in m.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        return torch.equal(gathered[0], gathered[1])

    # Combined with PowerSGD: the projections come from the same compressed average on every
    # rank, so the replicas stay identical.
    from fastllm.distributed import PowerSGD, powersgd_hook

    combined = _model()
    ddp2 = nn.parallel.DistributedDataParallel(combined)
    ddp2.register_comm_hook(PowerSGD(rank=4, start_iter=2), powersgd_hook)
    opt2 = _galore(combined, gap=2)
    for _ in range(5):
        opt2.zero_grad()
        (ddp2(x[half]) - y[half]).square().mean().backward()
        opt2.step()
    return worst, replicas_equal(model) and replicas_equal(combined)


@pytest.fixture(scope="module")
def ddp_results():
    return spawn(_ddp_check, 2, timeout=180)


def test_ddp_matches_one_process_and_combines_with_powersgd(ddp_results):
    for worst, replicas_equal in ddp_results:
        assert replicas_equal
        assert worst < 1e-5


# --- the projector is orthonormal whatever the gradient's rank, as galore-torch's SVD ---------
@pytest.mark.parametrize("proj_type", ["std", "reverse_std"])
def test_galore_zero_first_gradient_does_not_freeze_the_matrix(proj_type):
    # A zero gradient at the first refresh (a zero-initialised layer downstream, a fully masked
    # first batch): galore-torch's SVD still gives an orthonormal projector and the matrix
    # trains from the next step on; a zero projector would stay zero at every warm start.
    torch.manual_seed(0)
    w = torch.randn(16, 32, requires_grad=True)
    w0 = w.detach().clone()
    opt = GaLoreAdamW([{"params": [w], "rank": 4, "update_proj_gap": 2,
                        "proj_type": proj_type}], lr=0.1)
    for step in range(5):
        w.grad = torch.zeros(16, 32) if step == 0 else torch.randn(16, 32)
        opt.step()
        p = opt.state[w]["projector"]
        torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)
    assert (w.detach() - w0).abs().max() > 1e-2


def test_galore_projector_is_orthonormal_for_a_rank_deficient_gradient():
    # Rank 2 with rank 4 requested: the two extra columns must complete the basis (as the SVD's
    # U[:, :4] does), not repeat the first two, which would double the update along them.
    g = torch.zeros(16, 32)
    g[:2] = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    p = range_finder(g, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)
    u = torch.linalg.svd(g.double()).U[:, :2]
    assert (u - p.double() @ (p.double().t() @ u)).norm() < 1e-5  # the range is still kept

    # The optimizer's projector is the same.
    w = torch.zeros(16, 32, requires_grad=True)
    opt = GaLoreAdamW([{"params": [w], "rank": 4, "scale": 1.0}], lr=0.1)
    w.grad = g.clone()
    opt.step()
    p = opt.state[w]["projector"]
    torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)


def _copied(obj, how):
    if how == "deepcopy":
        import copy

        return copy.deepcopy(obj)
    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("master", [False, True], ids=["plain", "master"])
def test_galore_copy_steps_on_as_the_original(how, master):
    """copy.deepcopy and torch.save/torch.load of the optimizer (with its model) carry its
    options and state: the copy's next steps are the original's, bitwise."""
    dtype = torch.bfloat16 if master else torch.float32
    model = _model().to(dtype)
    opt = GaLoreAdamW([{"params": [model[0].weight], "rank": 2, "update_proj_gap": 2},
                       {"params": [model[0].bias]}], lr=1e-2, master_weights=master,
                      max_grad_norm=1.0)
    x = torch.randn(4, 32, dtype=dtype)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    model2, opt2 = _copied((model, opt), how)
    assert opt2.master_weights == master and opt2.max_grad_norm == 1.0
    for m, o in ((model, opt), (model2, opt2)):
        for _ in range(3):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
    for pa, pb in zip(model.parameters(), model2.parameters()):
        assert torch.equal(pa, pb)


def test_master_weights_switched_on_at_resume_are_created():
    """A bf16 checkpoint saved without master weights resumes with master_weights=True: the
    masters are made from the params (as fastllm.optim.AdamW makes them), and every param steps."""
    model = _model().to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)

    def make(m, master):
        return GaLoreAdamW([{"params": [m[0].weight], "rank": 2}, {"params": [m[0].bias]}],
                           lr=1e-2, master_weights=master)

    opt = make(model, False)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    resumed = make(model, True)
    resumed.load_state_dict(opt.state_dict())
    before = [p.detach().clone() for p in (model[0].weight, model[0].bias)]
    resumed.step()  # the same grads
    for p, b in zip((model[0].weight, model[0].bias), before):
        state = resumed.state[p]
        assert float(state["step"]) == 3 and not torch.equal(p, b)
        assert state["master_param"].dtype == torch.float32
        assert state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["master_param"].bfloat16(), p.detach())


def test_master_weights_switched_off_at_resume_are_dropped():
    """A bf16 checkpoint saved with master weights resumes with master_weights=False: the masters
    are dropped (the param is the weight again, as fastllm.optim.AdamW converts such a state), a
    plain param's moments take its dtype, and the step writes the params themselves."""
    model = _model().to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)

    def make(m, master):
        return GaLoreAdamW([{"params": [m[0].weight], "rank": 2}, {"params": [m[0].bias]}],
                           lr=1e-2, master_weights=master)

    opt = make(model, True)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    resumed = make(model, False)
    resumed.load_state_dict(opt.state_dict())
    for p in (model[0].weight, model[0].bias):
        assert "master_param" not in resumed.state[p]
    assert resumed.state[model[0].bias]["exp_avg"].dtype == torch.bfloat16
    before = [p.detach().clone() for p in (model[0].weight, model[0].bias)]
    resumed.step()  # the same grads
    for p, b in zip((model[0].weight, model[0].bias), before):
        assert float(resumed.state[p]["step"]) == 3 and not torch.equal(p, b)
    assert all("master_param" not in s for s in resumed.state_dict()["state"].values())


def test_fp16_loss_scaled_grads_are_unscaled_in_fp32():
    """fp16 params without masters, a LossScaler: the projected step unscaled the grad in fp16,
    where grads too small for fp16 (what loss scaling is for) became 0 and the update was lost;
    it is now within fp16's rounding of the fp32 run's."""
    from fastllm.amp import LossScaler

    torch.manual_seed(0)
    true_grad, w0 = torch.randn(4, 8, dtype=torch.float64) * 1e-8, torch.randn(4, 8)

    def update(dtype, scaler):
        w = torch.nn.Parameter(w0.to(dtype).clone())
        opt = GaLoreAdamW([{"params": [w], "rank": 2, "scale": 1.0}], lr=1e-2, eps=1e-12,
                          loss_scaler=scaler)
        w.grad = (true_grad * (scaler.get_scale() if scaler else 1.0)).to(dtype)
        opt.step()
        return w.detach().double() - w0.to(dtype).double()

    want, got = update(torch.float32, None), update(torch.float16, LossScaler())
    assert ((got - want).norm() / want.norm()).item() < 0.1


def test_bad_group_keys_are_refused_before_a_step_changes_anything():
    """scale < 0 passed construction, and a key set between steps failed mid-step, after the
    step count (and other groups) had moved."""
    model = _model()
    with pytest.raises(ValueError, match="scale must be a finite number >= 0"):
        GaLoreAdamW([{"params": [model[0].weight], "rank": 2, "scale": -1.0}])
    opt = GaLoreAdamW([{"params": [model[0].weight], "rank": 2},
                       {"params": [model[2].weight], "rank": 2}], lr=1e-2)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    steps = [float(s["step"]) for s in opt.state.values()]
    for key, value in (("scale", float("nan")), ("update_proj_gap", 0), ("proj_type", "bogus")):
        group = opt.param_groups[1]
        old, group[key] = group[key], value
        with pytest.raises(ValueError, match=f"param group 1: {key}"):
            opt.step()
        group[key] = old
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert [float(s["step"]) for s in opt.state.values()] == steps


@pytest.mark.parametrize("key,value", [("proj_type", "reverse_std"), ("rank", 3)])
def test_rank_or_proj_type_changed_after_state_is_refused_before_anything_moves(key, value):
    """A proj_type changed between steps failed inside the first matrix's kernel after its step
    count had moved; a rank changed ran on at the old rank until the next refresh failed."""
    model = _model()
    opt = GaLoreAdamW([{"params": [model[0].weight, model[2].weight], "rank": 2}], lr=1e-2)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    steps = [float(s["step"]) for s in opt.state.values()]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match="cannot change once a param has state"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert [float(s["step"]) for s in opt.state.values()] == steps


def test_a_side_change_of_a_square_full_rank_param_is_refused():
    """8 x 8 at rank 8: both sides' moments are (8, 8), so the shape check let a proj_type
    change through, and the step read the left-projected state as right-projected."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = GaLoreAdamW([{"params": [w], "rank": 8, "proj_type": "left"}], lr=1e-2)
    w.grad = torch.randn(8, 8)
    opt.step()
    before = w.detach().clone()
    opt.param_groups[0]["proj_type"] = "right"
    with pytest.raises(ValueError, match="cannot change once a param has state"):
        opt.step()
    assert torch.equal(w, before)
    opt.param_groups[0]["proj_type"] = "left"
    copy = GaLoreAdamW([{"params": [w], "rank": 8, "proj_type": "right"}], lr=1e-2)
    copy.load_state_dict(opt.state_dict())  # the saved group's side comes with its state
    copy.step()


@pytest.mark.parametrize("change,key,group", [("resize", "exp_avg", 1), ("bf16", "exp_avg", 1),
                                              ("fp64", "exp_avg", 0)])
def test_a_state_that_no_longer_fits_its_param_is_refused_before_anything_moves(change, key,
                                                                                group):
    """A param resized or cast (model.to) after its state was made: the plain step's kernel
    refused it only after the step counts and the projected params had moved."""
    w, b = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(8))
    opt = GaLoreAdamW([{"params": [w], "rank": 2}, {"params": [b]}], lr=1e-2)
    w.grad, b.grad = torch.randn(6, 8), torch.randn(8)
    opt.step()
    if change == "resize":
        b.data = torch.zeros(10)
    elif change == "bf16":
        b.data = b.data.bfloat16()
    else:
        w.data = w.data.double()
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    before = [p.detach().clone() for p in (w, b)]
    with pytest.raises(RuntimeError, match=f"GaLoreAdamW: state '{key}' of param 0 of param "
                                           f"group {group}"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip((w, b), before))
    assert [float(s["step"]) for s in opt.state.values()] == [1.0, 1.0]


def test_plain_moments_loaded_into_bf16_params_take_their_dtype():
    """A state saved in fp32 and loaded into a bf16 model: torch casts a plain param's moments
    to bf16, and GaLoreAdamW put them back in fp32 (its next step then failed mid-step);
    projected params keep their fp32 low-rank state."""
    w, b = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(8))
    opt = GaLoreAdamW([{"params": [w], "rank": 2}, {"params": [b]}], lr=1e-2)
    w.grad, b.grad = torch.randn(6, 8), torch.randn(8)
    opt.step()
    wb, bb = (nn.Parameter(p.detach().bfloat16()) for p in (w, b))
    resumed = GaLoreAdamW([{"params": [wb], "rank": 2}, {"params": [bb]}], lr=1e-2)
    resumed.load_state_dict(opt.state_dict())
    assert resumed.state[bb]["exp_avg"].dtype == torch.bfloat16
    assert resumed.state[bb]["exp_avg_sq"].dtype == torch.bfloat16
    assert resumed.state[wb]["exp_avg"].dtype == torch.float32
    assert resumed.state[wb]["projector"].dtype == torch.float32
    wb.grad, bb.grad = w.grad.bfloat16(), b.grad.bfloat16()
    resumed.step()
    assert [float(s["step"]) for s in resumed.state.values()] == [2.0, 2.0]


@pytest.mark.parametrize("flag", ["maximize", "amsgrad"])
def test_maximize_and_amsgrad_are_refused_before_anything_moves(flag):
    """GaLoreAdamW ignored them (in a group, or loaded from torch.optim.AdamW's state_dict) and
    minimised without amsgrad."""
    w = nn.Parameter(torch.randn(6, 8))
    with pytest.raises(ValueError, match=f"param group 0 sets {flag}=True"):
        GaLoreAdamW([{"params": [w], flag: True}])
    opt = GaLoreAdamW([w], lr=1e-2)
    with pytest.raises(ValueError, match=f"param group 1 sets {flag}=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], flag: True})
    assert len(opt.param_groups) == 1
    w.grad = torch.randn(6, 8)
    opt.step()
    before, steps = w.detach().clone(), float(opt.state[w]["step"])
    opt.param_groups[0][flag] = True
    with pytest.raises(ValueError, match=f"param group 0 sets {flag}=True"):
        opt.step()
    assert torch.equal(w, before) and float(opt.state[w]["step"]) == steps
    opt.param_groups[0][flag] = False
    ref = torch.optim.AdamW([nn.Parameter(w.detach().clone())], **{flag: True})
    ref.param_groups[0]["params"][0].grad = torch.randn(6, 8)
    ref.step()
    with pytest.raises(ValueError, match=f"load_state_dict: the state_dict's param group 0 "
                                         f"sets {flag}=True"):
        opt.load_state_dict(ref.state_dict())
    assert not opt.param_groups[0][flag] and float(opt.state[w]["step"]) == steps


def test_plain_params_continue_torch_adamws_state_of_a_transposed_param():
    """Params outside a rank group step as AdamW; torch.optim.AdamW's (and fastllm AdamW's)
    moments of a non-contiguous param keep its strides, which the plain path's kernels refused
    at every step after a load (step counts already advanced). Now: torch's steps, continued."""
    torch.manual_seed(0)
    start = [torch.randn(3), torch.randn(4, 6).t()]
    grads = [[torch.randn(3), torch.randn(4, 6).t()] for _ in range(3)]
    ref = [torch.nn.Parameter(t.clone().t().contiguous().t() if t.dim() == 2 else t.clone())
           for t in start]
    torch_opt = torch.optim.AdamW(ref, lr=0.01, foreach=False)
    for p, g in zip(ref, grads[0]):
        p.grad = g.clone()
    torch_opt.step()
    params = [torch.nn.Parameter(p.detach().clone().t().contiguous().t() if p.dim() == 2
                                 else p.detach().clone()) for p in ref]
    galore = fastllm.optim.GaLoreAdamW(params, lr=0.01)
    galore.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert not galore.state[params[1]]["exp_avg"].is_contiguous()  # (torch's layout, loaded)
    for step_grads in grads[1:]:
        for opt, ps in ((torch_opt, ref), (galore, params)):
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [float(galore.state[p]["step"]) for p in params] == [3.0, 3.0]
