"""fastllm.ops.swiglu and fastllm.ops.geglu on every backend against swiglu_ref / geglu_ref
(fp64) and what Hugging Face's LlamaMLP / GemmaMLP computes (act_fn(gate) * up, act_fn SiLU or
gelu_pytorch_tanh): the output and both gradients, fp32/bf16/fp16, and that the backward keeps
only gate and up."""

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm.ops.swiglu import geglu, geglu_linear, geglu_ref, swiglu, swiglu_linear, swiglu_ref

from _model_ops import check_close, grads
from conftest import backend_device_params

BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1,), (3, 7, 123), (17, 515)]
# activation: (op, its _ref, Hugging Face's act_fn, the op followed by a linear layer, op name)
ACTS = {"silu": (swiglu, swiglu_ref, F.silu, swiglu_linear, "swiglu"),
        "gelu_tanh": (geglu, geglu_ref, lambda t: F.gelu(t, approximate="tanh"), geglu_linear,
                      "geglu")}


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_ref_and_hf(backend, device, dtype, shape, act):
    op, ref, hf_act = ACTS[act][:3]
    gate = (3 * torch.randn(*shape, device=device)).to(dtype).requires_grad_()
    up = torch.randn(*shape, device=device).to(dtype).requires_grad_()
    g = torch.randn(*shape, device=device).to(dtype)
    with fastllm.use_backend(backend):
        got = grads([op(gate, up)], [gate, up], [g])
    gd, ud = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    oracle = grads([ref(gd, ud)], [gd, ud], [g.double()])
    gh, uh = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    theirs = grads([hf_act(gh) * uh], [gh, uh], [g])  # the MLP: act_fn(gate_proj(x)) * up_proj(x)
    for name, a, t, o in zip(("y", "dgate", "dup"), got, theirs, oracle):
        check_close(name, a, t, o, dtype, fp32_rtol=1e-5 if name == "y" else 1e-4)


def test_geglu_ref_backward_is_the_autograd_of_its_forward():
    """geglu's reference backward (aten.gelu_backward, which the kernels' sigmoid form is checked
    against) equals autograd through geglu_ref in fp64, over the tanh's saturation too."""
    gate = torch.linspace(-12, 12, 401, dtype=torch.float64, requires_grad=True)
    up = torch.randn(401, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(401, dtype=torch.float64)
    want = torch.autograd.grad(geglu_ref(gate, up), [gate, up], dy)
    with fastllm.use_backend("ref"):
        dg, du, h = torch.ops.fastllm.geglu_backward(dy, gate.detach(), up.detach(), True)
    torch.testing.assert_close(dg, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(du, want[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, geglu_ref(gate, up).detach())


def test_backward_keeps_only_gate_and_up():
    gate = torch.randn(16, 32, requires_grad=True)
    up = torch.randn(16, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate, up)
    assert len(saved) == 2 and all(t.data_ptr() in (gate.data_ptr(), up.data_ptr())
                                   for t in saved)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_geglu_at_extreme_gates_is_pytorchs(backend, device):
    """Past |gate| = 20 the tanh GELU is gate or 0 and its slope 1 or 0: at 1e19 the kernels'
    a'(gate) overflowed (dgate nan or inf) where PyTorch's is finite. Output and grads finite
    and PyTorch's, fp32."""
    gate = torch.tensor([-1e19, -1e10, -60.0, -20.5, -19.5, 19.5, 20.5, 60.0, 1e10, 1e19],
                        device=device, requires_grad=True)
    up = torch.full_like(gate, 0.75).requires_grad_()
    with fastllm.use_backend(backend):
        got = grads([geglu(gate, up)], [gate, up], [torch.ones_like(gate)])
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    want = grads([F.gelu(g2, approximate="tanh") * u2], [g2, u2], [torch.ones_like(gate)])
    for a, w in zip(got, want):
        assert torch.isfinite(a).all() and torch.isfinite(w).all()
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ACTS)
def test_bad_input_is_refused(act):
    op, name = ACTS[act][0], ACTS[act][4]
    with pytest.raises(ValueError, match=f"fastllm.{name}: .* differ"):
        op(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(TypeError, match="up has dtype"):
        op(torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_product_is_the_forwards(backend, device, dtype, act):
    """swiglu_backward(..., need_h=True) also returns silu(gate) * up (what swiglu_linear's
    weight grad reads instead of a second forward pass): bitwise the forward's output on the same
    backend, and the same dgate and dup as without it; empty without need_h. geglu alike."""
    op, name = ACTS[act][0], ACTS[act][4]
    backward = getattr(torch.ops.fastllm, f"{name}_backward")
    gate = (3 * torch.randn(4, 77, device=device)).to(dtype)
    up, dy = (torch.randn(4, 77, device=device).to(dtype) for _ in range(2))
    with fastllm.use_backend(backend):
        y = op(gate, up)
        dg, du, h = backward(dy, gate, up, True)
        dg0, du0, none = backward(dy, gate, up)
    assert torch.equal(h, y) and torch.equal(dg, dg0) and torch.equal(du, du0)
    assert none.numel() == 0


@pytest.mark.parametrize("act", ACTS)
def test_opcheck_and_compile(act):
    op, name = ACTS[act][0], ACTS[act][4]
    gate = torch.randn(5, 33, requires_grad=True)
    up = torch.randn(5, 33, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.fastllm, name).default, (gate, up))
    for need_h in (False, True):
        torch.library.opcheck(getattr(torch.ops.fastllm, f"{name}_backward").default,
                              (torch.randn(5, 33), gate.detach(), up.detach(), need_h))
    fn = torch.compile(lambda g, u: op(g, u).sum(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(gate, up), op(gate, up).sum())
    fn(gate, up).backward()
    assert gate.grad is not None and up.grad is not None


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("frozen", [False, True])
def test_swiglu_linear_matches_and_keeps_no_product(frozen, act):
    _, act_ref, _, act_linear, _ = ACTS[act]
    gate = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 24, dtype=torch.float64, requires_grad=not frozen)
    b = torch.randn(7, dtype=torch.float64, requires_grad=not frozen)
    wanted = [gate, up] + ([] if frozen else [w, b])
    g = torch.randn(2, 5, 7, dtype=torch.float64)
    got = grads([act_linear(gate, up, w, b)], wanted, [g])
    want = grads([F.linear(act_ref(gate, up), w, b)], wanted, [g])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        act_linear(gate, up, w, b)
    assert {t.data_ptr() for t in saved} <= {gate.data_ptr(), up.data_ptr(), w.data_ptr()}


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("mode", ["native", "fp32"])
@pytest.mark.parametrize("trained", ["all", "weight", "inputs"])
def test_swiglu_linear_both_linear_paths(monkeypatch, backend, device, mode, trained, act):
    """bf16 through F.linear and torch.mm (native: what a GPU runs; the weight grad reads the
    product the SwiGLU / GeGLU backward kernel writes) and through fastllm.linear (fp32: the CPU
    policy that widens bf16 products), on each backend and with the weight or the inputs alone
    trained: against F.linear of the fp64 maths and PyTorch's bf16 F.linear of HF's product,
    forward and every gradient."""
    _, act_ref, hf_act, act_linear, _ = ACTS[act]
    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", mode)
    gen = torch.Generator().manual_seed(0)

    def r(*shape, grad):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device).requires_grad_(
            grad)

    gate, up = (r(3, 9, 40, grad=trained != "weight") for _ in range(2))
    w, b = r(11, 40, grad=trained != "inputs"), r(11, grad=trained != "inputs")
    leaves = [t for t in (gate, up, w, b) if t.requires_grad]
    g = torch.randn(3, 9, 11, generator=gen).to(torch.bfloat16).to(device)
    with fastllm.use_backend(backend):
        out = act_linear(gate, up, w, b)
        assert out.grad_fn.plain == (mode == "native" or device != "cpu")
        got = grads([out], leaves, [g])
    c = [t.detach().clone().requires_grad_(t.requires_grad) for t in (gate, up, w, b)]
    theirs = grads([F.linear(hf_act(c[0]) * c[1], c[2], c[3])],
                   [t for t in c if t.requires_grad], [g])
    d = [t.detach().double().requires_grad_(t.requires_grad) for t in (gate, up, w, b)]
    oracle = grads([F.linear(act_ref(d[0], d[1]), d[2], d[3])],
                   [t for t in d if t.requires_grad], [g.double()])
    names = ["y"] + [n for n, t in zip(("dgate", "dup", "dw", "db"), (gate, up, w, b))
                     if t.requires_grad]
    for name, a, t, o in zip(names, got, theirs, oracle):
        check_close(name, a, t, o, torch.bfloat16)


def test_swiglu_linear_under_autocast_and_bad_bias():
    """fp32 inputs under autocast (bf16): the output and grads of F.linear's autocast behaviour
    would mix dtypes in the backward's products; swiglu_linear keeps fastllm.linear's there
    (fp32, as before), and its backward runs. A bias of another dtype or shape is refused by
    name."""
    gate, up = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True)
    w, b = torch.randn(5, 8, requires_grad=True), torch.randn(5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = swiglu_linear(gate, up, w, b)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (gate, up, w, b))
    with pytest.raises(TypeError, match="bias has dtype"):
        swiglu_linear(gate, up, w, b.double())
    with pytest.raises(ValueError, match="bias must be"):
        swiglu_linear(gate, up, w, b[:1])
