"""A learning rate given as a tensor (torch.optim.AdamW's `lr=torch.tensor(...)`).

The AdamW ops take it as `lr_tensor`; the GPU kernels (and the Triton ones here, through the
interpreter) read it on the device, so an LR scheduler's in-place update reaches a compiled or
graph-captured step. It must give exactly the step a float lr of the same value gives, on every
backend and for every optimizer kind (fp32, bf16 with fp32 masters, 8-bit moments).
"""

import pytest
import torch

import fastllm
from conftest import backend_device_params

LRS = (0.01, 0.003, 0.0)  # (0: where a schedule ends)


def _params(kind, device):
    g = torch.Generator().manual_seed(0)
    shapes = [(37,), (5, 67)] if kind != "8bit" else [(300,), (9,)]
    dtype = torch.bfloat16 if kind == "master" else torch.float32
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype))
            for s in shapes]


def _optimizer(kind, params, lr):
    if kind == "8bit":
        return fastllm.optim.AdamW8bit(params, lr=lr, weight_decay=0.1, block_size=64,
                                       min_8bit_size=256)
    return fastllm.optim.AdamW(params, lr=lr, weight_decay=0.1,
                               master_weights=kind == "master", max_grad_norm=1.0)


def _run(kind, backend, device, tensor_lr):
    params = _params(kind, device)
    lr = torch.tensor(LRS[0], device=device) if tensor_lr else float(torch.tensor(LRS[0]))
    opt = _optimizer(kind, params, lr)
    g = torch.Generator().manual_seed(1)
    with fastllm.use_backend(backend):
        for value in LRS:
            # the fp32 value in both runs; in place for the tensor (as torch's schedulers do)
            if tensor_lr:
                lr.fill_(value)
            else:
                opt.param_groups[0]["lr"] = float(torch.tensor(value))
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device=device, dtype=p.dtype)
            opt.step()
    return [p.detach().float().cpu() for p in params]


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("kind", ["fp32", "master", "8bit"])
def test_tensor_lr_steps_like_the_same_float_lr(backend, device, kind):
    """Bitwise: the kernels compute in fp64 from the tensor's value what the host computes from
    the float. A kernel that ignored the tensor (or read it once) would differ at once."""
    if backend == "cuda" and kind == "8bit":
        pytest.skip("8-bit moments have no CUDA kernel (Triton)")
    with_float = _run(kind, backend, device, tensor_lr=False)
    with_tensor = _run(kind, backend, device, tensor_lr=True)
    for a, b in zip(with_float, with_tensor):
        assert torch.equal(a, b), (a - b).abs().max()


def test_matches_torch_with_a_scheduler_filling_the_tensor():
    """torch's LR schedulers write a tensor lr in place; fastllm follows torch.optim.AdamW."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(33)), torch.nn.Parameter(torch.randn(4, 5))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opts = [fastllm.optim.AdamW(ours, lr=torch.tensor(0.1)),
            torch.optim.AdamW(theirs, lr=torch.tensor(0.1), foreach=False)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    for _ in range(5):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
    assert torch.equal(opts[0].param_groups[0]["lr"], opts[1].param_groups[0]["lr"])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_capturable_step_reads_the_current_lr():
    """capturable=True with a tensor lr traces in one graph (no host read of the lr), and the
    compiled step uses the value written after compilation."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 9))
    twin = torch.nn.Parameter(p.detach().clone())
    lr = torch.tensor(0.01)
    opt = fastllm.optim.AdamW([p], lr=lr, capturable=True)
    eager = fastllm.optim.AdamW([twin], lr=0.01)

    @torch.compile(fullgraph=True, backend="eager")
    def step():
        opt.step()

    for value in (0.01, 0.5, 0.02):
        lr.fill_(value)
        eager.param_groups[0]["lr"] = float(lr)
        p.grad = torch.randn(p.shape)
        twin.grad = p.grad.clone()
        step()
        eager.step()
        torch.testing.assert_close(p, twin, rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_graph_replay_reads_the_current_lr(backend):
    """A step captured once in a CUDA graph, replayed with new lr values written in place, steps
    like eager steps at those values (a kernel reading a captured host lr would not)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000, 33, device="cuda"))
    twin = torch.nn.Parameter(p.detach().clone())
    lr = torch.tensor(0.01, device="cuda")
    p.grad = torch.randn_like(p)
    twin.grad = p.grad.clone()
    with fastllm.use_backend(backend):
        opt = fastllm.optim.AdamW([p], lr=lr, capturable=True)
        eager = fastllm.optim.AdamW([twin], lr=float(lr))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up step builds the state and the plan
            opt.step()
            eager.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        for value in (0.5, 0.02):
            lr.fill_(value)
            eager.param_groups[0]["lr"] = float(lr)
            p.grad.normal_()  # in place: the graph reads this memory
            twin.grad.copy_(p.grad)
            graph.replay()
            eager.step()
    torch.cuda.synchronize()
    torch.testing.assert_close(p, twin, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lr,error,match", [
    (torch.tensor([0.1, 0.2]), ValueError, "Tensor lr must be 1-element"),
    (torch.tensor(-0.1), ValueError, "Invalid learning rate"),
    (torch.tensor(float("nan")), ValueError, "Invalid learning rate"),
    (torch.tensor(1), TypeError, "floating-point"),
])
def test_bad_tensor_lr_is_refused(lr, error, match):
    with pytest.raises(error, match=match):
        fastllm.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=lr)


@pytest.mark.parametrize("lr_tensor,error,match", [
    (torch.tensor([0.1, 0.2]), ValueError, "lr_tensor must have one element"),
    (torch.tensor(1), TypeError, "lr_tensor has dtype torch.int64"),
    ("0.1", TypeError, "lr_tensor must be a Tensor"),
])
def test_op_refuses_a_bad_lr_tensor_before_writing(lr_tensor, error, match):
    p, g, m, v = (torch.randn(10) for _ in range(4))
    before = [t.clone() for t in (p, m, v)]
    with pytest.raises(error, match=match):
        fastllm.ops.adamw._adamw_step_impl(
            [p], [g], [m], [v.abs()], [], [torch.tensor(1.0)], lr=0.0, beta1=0.9, beta2=0.99,
            eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, lr_tensor=lr_tensor)
    for t, b in zip((p, m, v), before):
        assert torch.equal(t, b)


def test_opcheck_with_lr_tensor():
    params = [torch.randn(33), torch.randn(7, 3)]
    args = (params, [torch.randn_like(t) for t in params], [torch.randn_like(t) for t in params],
            [torch.rand_like(t) for t in params], [torch.rand_like(t) for t in params],
            [torch.tensor(3.0), torch.tensor(3.0)])
    kwargs = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                  maximize=False, lr_tensor=torch.tensor(1e-2))
    torch.library.opcheck(torch.ops.fastllm.adamw_step.default, args, kwargs)
