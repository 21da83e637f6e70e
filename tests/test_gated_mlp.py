"""fastllm.ops.swiglu_mlp / geglu_mlp (a gated MLP of three linear layers as one autograd node) on
every backend against the fp64 maths and Hugging Face's LlamaMLP / GemmaMLP maths in the same
dtype: the output and every gradient; what its backward keeps; its errors; torch.compile and fake
tensors (the op path); and where fastllm.patch takes it."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune  # noqa: F401  (torch.nn.utils.prune below)

import fastllm
from fastllm.ops.gated_mlp import geglu_mlp, geglu_mlp_ref, swiglu_mlp, swiglu_mlp_ref

from _model_ops import check_close, grads
from conftest import backend_device_params

BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]
# activation: (the MLP, its _ref, Hugging Face's act_fn)
ACTS = {"silu": (swiglu_mlp, swiglu_mlp_ref, F.silu),
        "gelu_tanh": (geglu_mlp, geglu_mlp_ref, lambda t: F.gelu(t, approximate="tanh"))}


def _mlp_inputs(dtype, device="cpu", bias=True, trained="all", rows=(3, 5)):
    """x (*rows, 24), gate/up weights (40, 24), down (17, 24 -> 40 -> 17), biases; odd sizes."""
    gen = torch.Generator().manual_seed(0)

    def r(*shape, grad, scale=1.0):
        t = (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)
        return t.requires_grad_(grad)

    x = r(*rows, 24, grad=trained != "weights")
    weights = [r(40, 24, grad=trained != "inputs", scale=0.3),
               r(40, 24, grad=trained != "inputs", scale=0.3),
               r(17, 40, grad=trained != "inputs", scale=0.3)]
    biases = [r(n, grad=trained != "inputs") if bias else None for n in (40, 40, 17)]
    return x, weights, biases


def _hf_maths(act, x, weights, biases):
    """LlamaMLP.forward's: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""
    (wg, wu, wd), (bg, bu, bd) = weights, biases
    return F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_fp64_and_hf(backend, device, dtype, act):
    op, ref, hf_act = ACTS[act]
    x, weights, biases = _mlp_inputs(dtype, device)
    leaves = [x, *weights, *biases]
    g = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    with fastllm.use_backend(backend):
        got = grads([op(x, *weights, *biases)], leaves, [g])
    c = [t.detach().clone().requires_grad_() for t in leaves]
    theirs = grads([_hf_maths(hf_act, c[0], c[1:4], c[4:])], c, [g])
    d = [t.detach().double().requires_grad_() for t in leaves]
    oracle = grads([ref(*d)], d, [g.double()])
    names = ("y", "dx", "dwg", "dwu", "dwd", "dbg", "dbu", "dbd")
    for name, a, t, o in zip(names, got, theirs, oracle):
        check_close(name, a, t, o, dtype, fp32_rtol=1e-5 if name == "y" else 1e-4)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("trained", ["weights", "inputs"])
@pytest.mark.parametrize("rows", [(7,), (0,), (2, 1, 3)])
def test_partial_grads_and_shapes(act, trained, rows):
    """Frozen weights (LoRA elsewhere) or a frozen input, no biases, 1-D to 3-D rows and an
    empty batch: exactly the grads autograd gives through the reference in fp64."""
    op, ref, _ = ACTS[act]
    x, weights, _ = _mlp_inputs(torch.float64, bias=False, trained=trained, rows=rows)
    leaves = [t for t in (x, *weights) if t.requires_grad]
    g = torch.randn(*rows, 17, dtype=torch.float64)
    got = grads([op(x, *weights)], leaves, [g])
    want = grads([ref(x, *weights)], leaves, [g])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wanted", ["down", "biases", "gate", "x"])
def test_one_kind_of_grad(act, wanted):
    """Only down's weight (the product made again from gate and up alone), only the biases, only
    gate's weight, or only x needs a grad: autograd's grads through the reference, fp64."""
    op, ref, _ = ACTS[act]
    x, weights, biases = _mlp_inputs(torch.float64)
    leaves = {"down": [weights[2]], "biases": biases, "gate": [weights[0]], "x": [x]}[wanted]
    for t in (x, *weights, *biases):
        t.requires_grad_(any(t is leaf for leaf in leaves))
    g = torch.randn(3, 5, 17, dtype=torch.float64)
    got = grads([op(x, *weights, *biases)], leaves, [g])
    want = grads([ref(x, *weights, *biases)], leaves, [g])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_forced_backend_holds_for_the_backward(backend, device):
    """use_backend (and FASTLLM_BACKEND) pick the SwiGLU kernels the node runs, forward and
    backward: the backward on another thread keeps the forward's choice."""
    import threading

    x, weights, biases = _mlp_inputs(torch.float32, device)
    with fastllm.use_backend(backend):
        out = swiglu_mlp(x, *weights, *biases)
    assert out.grad_fn.backend == backend
    worker = threading.Thread(target=lambda: out.sum().backward())
    worker.start()
    worker.join()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_under_autocast_the_products_are_cast_as_f_linear_casts():
    """Under CPU autocast (bf16) the inputs are cast as F.linear's are: the output is the
    bf16 node's, and the grads reach the fp32 leaves in fp32."""
    x, weights, biases = _mlp_inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = swiglu_mlp(x, *weights, *biases)
    want = swiglu_mlp(*(t.detach().bfloat16() for t in (x, *weights, *biases)))
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32
               for t in (x, *weights, *biases))


@pytest.mark.parametrize("trained", ["all", "weights", "inputs"])
def test_backward_keeps_gate_up_and_x_where_needed(trained):
    """Saved: the weights, gate(x), up(x) and, where gate's or up's weight needs a grad, x; never
    act(gate) * up (made again in the backward's SwiGLU pass where down's weight grad needs
    it). With frozen weights (LoRA elsewhere) x is not kept, as autograd keeps no input of a
    product whose weight needs no grad."""
    x, weights, biases = _mlp_inputs(torch.float32, trained=trained)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu_mlp(x, *weights, *biases)
    activations = [t for t in saved if t.shape[-1] == 40 and t.dim() == 3]
    keeps_x = trained != "inputs"
    assert len(saved) == 5 + keeps_x and len(activations) == 2, [tuple(t.shape) for t in saved]
    ptrs = {t.data_ptr() for t in saved}
    assert ptrs >= {w.data_ptr() for w in weights} and (x.data_ptr() in ptrs) == keeps_x
    out.sum().backward()
    assert all(t.grad is not None for t in (x, *weights, *biases) if t.requires_grad)


def test_bad_input_is_refused():
    x, (wg, wu, wd), (bg, bu, bd) = _mlp_inputs(torch.float32)
    with pytest.raises(TypeError, match="fastllm.swiglu_mlp: up_weight has dtype"):
        swiglu_mlp(x, wg, wu.double(), wd)
    with pytest.raises(ValueError, match="fastllm.geglu_mlp: expected x"):
        geglu_mlp(x, wg, wu[:-1], wd)
    with pytest.raises(ValueError, match="expected x"):
        swiglu_mlp(x[..., :-1], wg, wu, wd)
    with pytest.raises(ValueError, match="down_bias must be"):
        swiglu_mlp(x, wg, wu, wd, bg, bu, bd[:-1])
    with pytest.raises(TypeError, match="x is torch.sparse_coo"):
        swiglu_mlp(x.detach()[0].to_sparse(), wg, wu, wd)
    with pytest.raises(TypeError, match="dtype torch.int64 is not supported"):
        swiglu_mlp(*(t.detach().long() for t in (x, wg, wu, wd)))


@pytest.mark.parametrize("act", ACTS)
def test_compile_and_fake_tensors_take_the_op_path(act):
    """Traced (torch.compile, fullgraph) or under FakeTensorMode the SwiGLU goes through its
    torch.ops op (no direct kernel call): the compiled forward and grads equal eager's, and
    fake inputs give fake outputs of the right shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = ACTS[act][0]
    x, weights, biases = _mlp_inputs(torch.float32)
    leaves = [x, *weights, *biases]
    eager = grads([op(x, *weights, *biases).sum()], leaves, [torch.tensor(1.0)])
    fn = torch.compile(lambda *a: op(*a).sum(), fullgraph=True, backend="aot_eager")
    compiled = grads([fn(x, *weights, *biases)], leaves, [torch.tensor(1.0)])
    for a, e in zip(compiled, eager):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in leaves]
        out = op(*fake)
    assert out.shape == (3, 5, 17) and type(out).__name__ == "FakeTensor"


@pytest.fixture
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, mlp_bias=True)
    return transformers.LlamaForCausalLM(config)


def test_patch_takes_it_where_linear_is_plain(monkeypatch, tiny_llama):
    """fastllm.patch runs a plain MLP as one node where F.linear is what its layers would run
    (FASTLLM_CPU_FP32_MATMUL=aten here; always on a GPU): the unpatched module's output and
    grads. Not under a CPU matmul policy (fastllm.linear's products), nor with a forward hook on
    a projection (which runs), nor with a LoRA layer in it."""
    monkeypatch.setenv("FASTLLM_CPU_FP32_MATMUL", "aten")
    mlp = tiny_llama.model.layers[0].mlp
    theirs = copy.deepcopy(mlp)
    fastllm.patch(tiny_llama)
    x = torch.randn(2, 3, 24, requires_grad=True)
    out = mlp(x)
    assert type(out.grad_fn).__name__ == "_GatedMLPBackward"
    xt = x.detach().clone().requires_grad_()
    want = theirs(xt)
    params, their_params = list(mlp.parameters()), list(theirs.parameters())
    got = grads([out], [x, *params], [torch.ones_like(out)])
    expected = grads([want], [xt, *their_params], [torch.ones_like(want)])
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)

    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", "fp32")  # bf16 widened: a CPU policy
    assert type(copy.deepcopy(mlp).to(torch.bfloat16)(x.detach().bfloat16()).grad_fn).__name__ \
        != "_GatedMLPBackward"
    seen = []
    handle = mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert type(mlp(x).grad_fn).__name__ != "_GatedMLPBackward" and seen == [(2, 3, 40)]
    handle.remove()
    seen.clear()  # a backward hook fires only where the layer itself is called
    handle = mlp.gate_proj.register_full_backward_hook(lambda m, gi, go: seen.append(1))
    out = mlp(x)
    assert type(out.grad_fn).__name__ != "_GatedMLPBackward"
    out.sum().backward()
    assert seen == [1]
    handle.remove()
    assert type(mlp(x).grad_fn).__name__ == "_GatedMLPBackward"
    pruned = copy.deepcopy(mlp)  # prune takes the weight out of _parameters, into a pre-hook
    torch.nn.utils.prune.l1_unstructured(pruned.up_proj, "weight", amount=0.5)
    assert type(pruned(x).grad_fn).__name__ != "_GatedMLPBackward"
    fastllm.lora.inject_lora(mlp, ["gate_proj"], r=2)
    assert type(mlp(x).grad_fn).__name__ != "_GatedMLPBackward"
