"""The single-GPU parts of fastllm.distributed: NCCL at world 1, the DistributedOptimizer's
flat buckets and scaled_copy on CUDA tensors, FSDP2 + fastllm.optim.AdamW on a CUDA mesh.
Skipped without a GPU (bench/device_check.sh runs it on one)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fastllm
from fastllm.distributed import DistributedOptimizer, hooks
from fastllm.distributed.launch import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs a CUDA GPU and NCCL")
STEPS = 5


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 123), nn.Tanh(), nn.Linear(123, 5)).to("cuda", dtype)


def _train(model, opt, dtype):
    for step in range(STEPS):
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(12, 7, device="cuda", generator=g).to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for n, p in model.named_parameters()}


def _reference(dtype, **kwargs):
    model = _model(dtype)
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)
    return _train(model, opt, dtype)


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype)
        opt = DistributedOptimizer(model, stage=2, lr=1e-2, bucket_cap_mb=0.001)
        out[f"zero2_{dtype}"] = _train(model, opt, dtype)
    mesh = init_device_mesh("cuda", (1,))
    model = _model(torch.float32)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1)
    out["fsdp"] = _train(model, opt, torch.float32)
    model = nn.parallel.DistributedDataParallel(_model(torch.float32))
    model.register_comm_hook(None, hooks.bf16_wire_hook)
    model(torch.randn(4, 7, device="cuda")).square().mean().backward()
    out["hook_grad_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return out


def test_world1_nccl():
    got = spawn(_worker, 1, backend="nccl", timeout=300)[0]
    want = _reference(torch.float32)
    for name in want:
        torch.testing.assert_close(got["zero2_torch.float32"][name], want[name], rtol=1e-5,
                                   atol=1e-6)
    # world 1: the same bf16 grads, fp32 masters: the same bf16 params
    want = _reference(torch.bfloat16, master_weights=True)
    for name in want:
        torch.testing.assert_close(got["zero2_torch.bfloat16"][name], want[name], rtol=0,
                                   atol=2.0**-7 * float(want[name].abs().max()))
    want = _reference(torch.float32, max_grad_norm=0.1)
    for name in want:
        torch.testing.assert_close(got["fsdp"][name], want[name], rtol=1e-5, atol=1e-6)
    assert got["hook_grad_finite"]
