"""fastllm.optim.AdamW and fastllm::adamw_step against torch.optim.AdamW(foreach=False).

Every backend that can run here (cpp, triton through the interpreter, ref; cuda and triton on a
GPU) is compared with torch's single-tensor AdamW over 100 steps at rtol 1e-5, atol 1e-6.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

import fastllm
from conftest import BAD_SCALAR_IDS, BAD_SCALARS, backend_device_params

RTOL, ATOL = 1e-5, 1e-6
SMALL_SHAPES = [(0,), (1,), (7,), (4097,), (123, 45)]
BIG_SHAPE = (2_000_003,)


def make_params(shapes, device, dtype=torch.float32):
    return [torch.randn(s, device=device, dtype=dtype) for s in shapes]


def clone_params(tensors):
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def groups_of(params, n_groups, group_options):
    if n_groups == 1:
        return params
    return [dict(params=params[i::n_groups], **group_options[i]) for i in range(n_groups)]


def run_both(backend, device, shapes, steps, n_groups=1, group_options=(), **opt_kwargs):
    """Train copies of the same params with torch (foreach=False) and fastllm on `backend`."""
    init = make_params(shapes, device)
    ours, theirs = clone_params(init), clone_params(init)
    torch_opt = torch.optim.AdamW(groups_of(theirs, n_groups, group_options), foreach=False,
                                  **copy.deepcopy(opt_kwargs))
    fast_opt = fastllm.optim.AdamW(groups_of(ours, n_groups, group_options),
                                   **copy.deepcopy(opt_kwargs))
    gen = torch.Generator(device="cpu").manual_seed(1234)
    with fastllm.use_backend(backend):
        for _ in range(steps):
            for a, b in zip(ours, theirs):
                g = torch.randn(a.shape, generator=gen).to(device)
                a.grad, b.grad = g.clone(), g.clone()
            torch_opt.step()
            fast_opt.step()
    return ours, theirs, fast_opt, torch_opt


def assert_states_close(fast_opt, torch_opt, ours, theirs):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        sa, sb = fast_opt.state[a], torch_opt.state[b]
        assert sorted(sa) == sorted(sb)
        for key in sb:
            torch.testing.assert_close(sa[key].cpu(), sb[key].cpu(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"state {key!r}: {m}")


CONFIGS = {
    "default": dict(lr=1e-2),
    "amsgrad": dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    "maximize": dict(lr=3e-3, maximize=True),
    "no_weight_decay": dict(lr=1e-2, weight_decay=0.0, betas=(0.8, 0.95), eps=1e-6),
    "large_beta1": dict(lr=1e-2, betas=(0.6, 0.99)),  # lerp weight > 0.5 takes the other formula
    "tensor_lr": dict(lr=torch.tensor(5e-3), weight_decay=0.05),
}


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_torch_100_steps(backend, device, config):
    ours, theirs, fast_opt, torch_opt = run_both(backend, device, SMALL_SHAPES, 100,
                                                 **CONFIGS[config])
    assert_states_close(fast_opt, torch_opt, ours, theirs)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_param_groups_100_steps(backend, device):
    options = [dict(lr=1e-2, weight_decay=0.0),
               dict(lr=3e-3, betas=(0.85, 0.98), weight_decay=0.2, amsgrad=True)]
    ours, theirs, fast_opt, torch_opt = run_both(backend, device, SMALL_SHAPES, 100, n_groups=2,
                                                 group_options=options)
    assert_states_close(fast_opt, torch_opt, ours, theirs)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_multi_million_elements(backend, device):
    # 100 steps for the compiled kernels; on the CPU, 3 for the interpreter (slow; every program
    # of the grid still runs) and 10 for the reference (plain torch ops: 100 steps on millions of
    # elements add time, not coverage)
    steps = 100
    if device == "cpu" and backend in ("triton", "ref"):
        steps = 3 if backend == "triton" else 10
    ours, theirs, fast_opt, torch_opt = run_both(backend, device, [BIG_SHAPE, (7,)], steps,
                                                 lr=1e-3, weight_decay=0.1)
    assert_states_close(fast_opt, torch_opt, ours, theirs)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_follow_torch_fused_semantics(backend, device, dtype):
    """Non-fp32 params without master weights: states in the param dtype, maths in fp32 (fp64)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernel computes in fp32 and refuses fp64 params")
    init = make_params([(1031,), (5, 7)], device, dtype)
    ours = clone_params(init)
    ref = clone_params(init)
    fast_opt = fastllm.optim.AdamW(ours, lr=1e-2)
    ref_opt = fastllm.optim.AdamW(ref, lr=1e-2)
    for _ in range(20):
        for a, b in zip(ours, ref):
            g = torch.randn(a.shape, device=device, dtype=dtype)
            a.grad, b.grad = g.clone(), g.clone()
        with fastllm.use_backend(backend):
            fast_opt.step()
        with fastllm.use_backend("ref"):
            ref_opt.step()
    # One rounding to the storage dtype per step: equal up to one ulp of that dtype.
    tol = {torch.float64: 1e-12, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("direction", ["torch_to_fastllm", "fastllm_to_torch"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_round_trip(direction, amsgrad):
    init = make_params(SMALL_SHAPES, "cpu")
    first, second = clone_params(init), clone_params(init)
    control = clone_params(init)
    kwargs = dict(lr=1e-2, amsgrad=amsgrad, weight_decay=0.05)
    make_first = (lambda p: torch.optim.AdamW(p, foreach=False, **kwargs)) \
        if direction == "torch_to_fastllm" else (lambda p: fastllm.optim.AdamW(p, **kwargs))
    make_second = (lambda p: fastllm.optim.AdamW(p, **kwargs)) \
        if direction == "torch_to_fastllm" else (lambda p: torch.optim.AdamW(p, foreach=False, **kwargs))
    opt_first, opt_control = make_first(first), make_first(control)
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(p.shape, generator=gen) for p in init] for _ in range(20)]

    def step(params, opt, gs):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()

    for gs in grads[:10]:
        step(first, opt_first, gs)
        step(control, opt_control, gs)
    saved = copy.deepcopy(opt_first.state_dict())
    with torch.no_grad():
        for p, q in zip(second, first):
            p.copy_(q)
    opt_second = make_second(second)
    opt_second.load_state_dict(saved)
    assert opt_second.state_dict()["param_groups"][0]["lr"] == kwargs["lr"]
    for gs in grads[10:]:
        step(second, opt_second, gs)
        step(control, opt_control, gs)
    for a, b in zip(second, control):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert set(opt_second.state_dict()["state"][0]) == set(opt_control.state_dict()["state"][0])


def test_lr_scheduler_unchanged():
    init = make_params([(257,), (3, 3)], "cpu")
    ours, theirs = clone_params(init), clone_params(init)
    fast_opt, torch_opt = fastllm.optim.AdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1,
                                                                                foreach=False)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20) for o in (fast_opt, torch_opt)]
    for _ in range(30):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape)
            a.grad, b.grad = g.clone(), g.clone()
        fast_opt.step()
        torch_opt.step()
        for s in scheds:
            s.step()
    assert fast_opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_grad_scaler_protocol(backend, device):
    """torch.amp.GradScaler: grads unscaled in the kernel; an inf step changes nothing at all."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(device)
    ref_model = copy.deepcopy(model)
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    x = torch.randn(32, 16, device=device)
    with fastllm.use_backend(backend):
        for step in range(6):
            for m, o, s in ((model, opt, scaler), (ref_model, ref_opt, ref_scaler)):
                o.zero_grad()
                s.scale(m(x).square().mean()).backward()
                if step == 3:
                    m.weight.grad[2, 5] = float("inf") if m is model else float("nan")
                    if m is ref_model:
                        m.weight.grad[2, 5] = float("inf")
                if m is model and step == 3:
                    before = [p.detach().clone() for p in m.parameters()]
                    state_before = copy.deepcopy(o.state_dict())
                s.step(o)
                s.update()
                if m is model and step == 3:
                    for p, q in zip(m.parameters(), before):
                        assert torch.equal(p, q), "a skipped step changed a parameter"
                    after = o.state_dict()
                    for k, v in state_before["state"].items():
                        for key, t in v.items():
                            assert torch.equal(after["state"][k][key], t)
    assert scaler.get_scale() == ref_scaler.get_scale() < 2.0 ** 10
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("scalars_on", ["cpu", "param_device"])
def test_op_scalars_found_inf_and_steps(backend, device, scalars_on):
    """The op's own contract (no optimizer in between), with grad_scale, found_inf and steps on
    the CPU or on the params' device: found_inf != 0 writes nothing, found_inf == 0 matches ref."""
    where = "cpu" if scalars_on == "cpu" else device
    p, g, m, v = (torch.randn(1000, device=device) for _ in range(4))
    v = v.abs()
    kwargs = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False,
                  maximize=False, grad_scale=torch.tensor(8.0, device=where))
    steps = [torch.tensor(3.0, device=where)]
    before = [t.clone() for t in (p, m, v)]
    with fastllm.use_backend(backend):
        fastllm.ops.adamw_step([p], [g], [m], [v], [], steps,
                               found_inf=torch.tensor(1.0, device=where), **kwargs)
    for t, b in zip((p, m, v), before):
        assert torch.equal(t, b)
    with fastllm.use_backend(backend):
        fastllm.ops.adamw_step([p], [g], [m], [v], [], steps,
                               found_inf=torch.tensor(0.0, device=where), **kwargs)
    expected = [t.clone() for t in before]
    fastllm.ops.adamw_step_ref([expected[0]], [g], [expected[1]], [expected[2]], [],
                               [torch.tensor(3.0)], **kwargs)
    for t, e in zip((p, m, v), expected):
        torch.testing.assert_close(t, e, rtol=RTOL, atol=ATOL)


def _op_args(n=33):
    params = [torch.randn(n), torch.randn(7, 3)]
    return (
        params, [torch.randn_like(t) for t in params], [torch.randn_like(t) for t in params],
        [torch.rand_like(t) for t in params], [torch.rand_like(t) for t in params],
        [torch.tensor(3.0), torch.tensor(3.0)],
    )


@pytest.mark.parametrize("backend", ["ref", "cpp", "triton"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_opcheck(backend, amsgrad):
    reason = fastllm._backend.unavailable_reason(backend, "cpu")
    if reason:
        pytest.skip(reason)
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=amsgrad,
                  maximize=False, grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
    with fastllm.use_backend(backend):
        torch.library.opcheck(torch.ops.fastllm.adamw_step.default, _op_args(), kwargs)


def test_torch_compile_fullgraph():
    args = _op_args()
    expected = copy.deepcopy(args)

    def step(*a):
        torch.ops.fastllm.adamw_step(*a, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                     weight_decay=0.01, amsgrad=False, maximize=False)

    torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    step(*expected)
    for got, want in zip(args[0] + args[2] + args[3], expected[0] + expected[2] + expected[3]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- bad input: a clear error that names the problem, and nothing modified --------------------

def _opt_with(param, grad):
    p = torch.nn.Parameter(param)
    p.grad = grad
    return p, fastllm.optim.AdamW([p], lr=1e-3)


def _assert_untouched(p, opt, before):
    assert torch.equal(p.detach(), before)
    assert len(opt.state) == 0


@pytest.mark.parametrize("case,match", [
    ("sparse", "sparse"),
    ("complex", "complex"),
])
def test_bad_input_is_refused_before_anything_changes(case, match):
    base = torch.randn(6, 4)
    other = torch.nn.Parameter(torch.randn(5))
    other.grad = torch.randn(5)
    if case == "sparse":
        p, g = base, torch.randn(6, 4).to_sparse()
    elif case == "complex":
        p, g = torch.randn(6, 4, dtype=torch.complex64), torch.randn(6, 4, dtype=torch.complex64)
    elif case == "noncontiguous_grad":
        p, g = base, torch.randn(4, 6).t()
    else:
        p, g = torch.randn(4, 6).t(), torch.randn(4, 6).t()
    bad = torch.nn.Parameter(p)
    bad.grad = g
    before_other = other.detach().clone()
    before_bad = bad.detach().clone()
    opt = fastllm.optim.AdamW([other, bad], lr=1e-2)
    with pytest.raises((RuntimeError, TypeError, ValueError), match=match) as info:
        opt.step()
    assert "param 1 of param group 0" in str(info.value)
    assert torch.equal(other.detach(), before_other)
    assert torch.equal(bad.detach(), before_bad)
    assert len(opt.state) == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=float("nan")), "learning rate"),
    (dict(lr=-1.0), "learning rate"),
    (dict(eps=float("nan")), "epsilon"),
    (dict(betas=(1.0, 0.999)), "beta"),
    (dict(betas=(0.9, float("nan"))), "beta"),
    (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(differentiable=True), "differentiable"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        fastllm.optim.AdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_nan_lr_set_later_is_refused_before_step():
    p, opt = _opt_with(torch.randn(10), torch.randn(10))
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="param group 0: Invalid learning rate: nan"):
        opt.step()
    _assert_untouched(p, opt, before)


def test_nan_filled_into_a_cpu_tensor_lr_is_refused_before_step():
    """A scheduler writes a tensor lr in place (fill_): a CPU one is re-read every step, so nan
    there is refused as a float lr is, even after steps that cached the group's values."""
    p = torch.nn.Parameter(torch.randn(10))
    lr = torch.tensor(0.1)
    opt = fastllm.optim.AdamW([p], lr=lr)
    p.grad = torch.randn(10)
    opt.step()
    lr.fill_(float("nan"))
    before = [p.detach().clone()] + [t.clone() for t in opt.state[p].values()]
    with pytest.raises(ValueError, match="param group 0: Invalid learning rate: nan"):
        opt.step()
    after = [p.detach()] + list(opt.state[p].values())
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_load_state_dict_shape_mismatch_names_the_param():
    a = torch.nn.Parameter(torch.randn(4, 3))
    src = torch.optim.AdamW([a], lr=1e-2)
    a.grad = torch.randn(4, 3)
    src.step()
    sd = src.state_dict()
    b = torch.nn.Parameter(torch.randn(3, 4))
    dst = fastllm.optim.AdamW([b], lr=0.5)
    with pytest.raises(RuntimeError, match=r"exp_avg.*param 0 of param group 0 \(shape \(3, 4\)\)"):
        dst.load_state_dict(sd)
    assert len(dst.state) == 0 and dst.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("case,match", [
    ("mixed_devices", r"params\[1\] is on meta, params\[0\] on cpu"),
    ("grad_on_other_device", r"grads\[0\] is on meta"),
    ("short_list", "grads has 1 tensors, params has 2"),
    ("state_shape", r"exp_avgs\[1\] has shape \(4,\), params\[1\] has \(3,\)"),
    ("grad_dtype", r"grads\[0\] has dtype torch.float64"),
    ("nan_lr", "lr must be finite"),
])
def test_op_refuses_bad_arguments_before_writing(case, match):
    p = [torch.randn(3), torch.randn(3)]
    g = [torch.randn(3), torch.randn(3)]
    m = [torch.zeros(3), torch.zeros(3)]
    v = [torch.zeros(3), torch.zeros(3)]
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    if case == "mixed_devices":
        p[1] = torch.randn(3, device="meta")
    elif case == "grad_on_other_device":
        g[0] = torch.randn(3, device="meta")
    elif case == "short_list":
        g = g[:1]
    elif case == "state_shape":
        m[1] = torch.zeros(4)
    elif case == "grad_dtype":
        g[0] = g[0].double()
    else:
        kwargs["lr"] = float("nan")
    before = [t.clone() for t in p + m + v if t.device.type == "cpu"]
    with pytest.raises((ValueError, TypeError), match=match):
        fastllm.ops.adamw_step(p, g, m, v, [], [torch.tensor(1.0)] * 2, **kwargs)
    after = [t for t in p + m + v if t.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_forced_backend_that_cannot_run_says_why(monkeypatch):
    p, opt = _opt_with(torch.randn(10), torch.randn(10))
    monkeypatch.setenv("FASTLLM_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="backend 'cuda' was forced but the cuda backend runs on "
                                           "CUDA tensors"):
        opt.step()
    monkeypatch.setenv("FASTLLM_BACKEND", "fortran")
    with pytest.raises(ValueError, match="FASTLLM_BACKEND='fortran'"):
        opt.step()


def test_import_without_extension_falls_back_and_warns_once():
    """A checkout without fastllm._C still imports, warns once, and runs the reference."""
    code = (
        "import sys, warnings\n"
        "sys.modules['fastllm._C'] = None\n"  # makes `from fastllm import _C` raise ImportError
        "import torch, fastllm\n"
        "assert not fastllm.has_cpp()\n"
        "p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
        "opt = fastllm.optim.AdamW([p], lr=0.1)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    opt.step(); opt.step()\n"
        "msgs = [str(x.message) for x in w if 'fastllm._C' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert p.detach().lt(1).all()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FASTLLM_BACKEND="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("backend,device", backend_device_params())
def test_zero_grad_scale_is_ieee_on_every_backend(backend, device):
    """grad_scale 0: every backend, the reference included (it raised ZeroDivisionError), takes
    1 / 0 = inf as the C++ and GPU kernels do, so they agree on the non-finite result."""
    kwargs = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False,
                  maximize=False, grad_scale=torch.tensor(0.0))
    g = torch.tensor([1.0, 0.0, -1.0])
    state = [torch.ones(3), torch.zeros(3), torch.zeros(3)]
    want = [t.clone() for t in state]
    fastllm.ops.adamw_step_ref([want[0]], [g], [want[1]], [want[2]], [], [torch.tensor(1.0)],
                               **kwargs)
    assert not want[0].isfinite().any()
    got = [t.to(device) for t in state]
    with fastllm.use_backend(backend):
        fastllm.ops.adamw_step([got[0]], [g.to(device)], [got[1]], [got[2]], [],
                               [torch.tensor(1.0)], **kwargs)
    for t, w in zip(got, want):
        torch.testing.assert_close(t.cpu(), w, rtol=RTOL, atol=ATOL, equal_nan=True)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("name,make,error,match",
                         [c for c in BAD_SCALARS if c[0] != "clip_coef"],
                         ids=[i for i in BAD_SCALAR_IDS if not i.startswith("cc")])
def test_op_refuses_a_bad_scalar_before_writing(backend, device, name, make, error, match):
    """grad_scale and found_inf hold one floating-point value (found_inf: or bool) on the params'
    device or the CPU: the Triton kernel read the first of a two-element found_inf (an overflow
    flagged in the second was stepped through) and read an empty one out of bounds."""
    p, g, m, v = (torch.randn(33, device=device) for _ in range(4))
    v = v.abs()
    before = [t.clone() for t in (p, m, v)]
    with fastllm.use_backend(backend), pytest.raises(error, match=match):
        fastllm.ops.adamw_step([p], [g], [m], [v], [], [torch.tensor(1.0)], lr=0.1, beta1=0.9,
                               beta2=0.999, eps=1e-8, weight_decay=0.1, **{name: make()})
    for t, b in zip((p, m, v), before):
        assert torch.equal(t, b)
