"""fastllm.optim.global_grad_norm against torch.nn.utils.get_total_norm of the whole tensors: one
process (dtypes, layouts, devices of one kind, empty lists) and one world-2 Gloo launch (DTensor
Shard/Replicate/Partial, flat shards over a group, pipeline stages summed over a group)."""

import pytest
import torch

from _launches import count_launches
from fastllm.distributed.launch import spawn
from fastllm.optim import AdamW8bit, clip_coefficient, global_grad_norm


def _grads(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * 3).to(dtype)
            for s in [(7,), (123, 5), (1,), (0,), (4097,)]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_matches_torch_total_norm(dtype):
    grads = _grads(dtype)
    norm = global_grad_norm(grads)
    expected = torch.nn.utils.get_total_norm([g.double() for g in grads])
    # fp64 grads give an fp64 norm summed in fp64 (torch's dtype); others fp32.
    assert norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(norm.double(), expected, rtol=rtol, atol=0)


def test_non_contiguous_and_mixed_dtypes():
    base = _grads(torch.float32)
    grads = [base[1].t(),  # dense, permuted: read through a flat view
             torch.randn(9, 8)[::2, 1:],  # gaps: read through a copy
             base[4].double(), base[0].bfloat16()]
    before = [g.clone() for g in grads]
    norm = global_grad_norm(grads)
    expected = torch.nn.utils.get_total_norm([g.double() for g in grads])
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), expected, rtol=1e-6, atol=0)
    for g, b in zip(grads, before):
        assert torch.equal(g, b)


def test_non_finite_and_empty():
    grads = _grads(torch.float32)
    grads[4][17] = float("nan")
    assert torch.isnan(global_grad_norm(grads))
    grads[4][17] = float("inf")
    assert not torch.isfinite(global_grad_norm(grads))
    empty = global_grad_norm([])
    assert empty.shape == () and empty.item() == 0.0
    with pytest.raises(ValueError, match="flat_group"):
        global_grad_norm([], flat_shards=[torch.ones(3)])


def test_clip_coefficient_is_torchs():
    grads = _grads(torch.float32)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    coef = clip_coefficient(global_grad_norm(grads), 1.0)
    for g, p in zip(grads, params):
        torch.testing.assert_close(g * coef, p.grad, rtol=1e-6, atol=0)
    assert clip_coefficient(torch.tensor(0.5), 1.0) == 1.0


def _full(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(9, 5, generator=gen)  # 9 rows: uneven Shard(0) over 2 ranks


def _distributed(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    a, b, c, d = (_full(s) for s in range(4))
    out = {}
    sharded = distribute_tensor(a, mesh, [Shard(0)])
    replicated = distribute_tensor(b, mesh, [Replicate()])
    # A Partial DTensor whose local parts sum to c.
    partial = torch.distributed.tensor.DTensor.from_local(c / world, mesh, [Partial()])
    plain = d  # every rank holds the whole tensor: counted once per rank
    out["dtensors"] = global_grad_norm([sharded, replicated, partial, plain]).item()
    out["dtensors_ref"] = torch.nn.utils.get_total_norm([a, b, c, d]).item()
    # Flat shards: rank r holds the r-th half of the flat concatenation of a and b.
    flat = torch.cat([a.flatten(), b.flatten()])
    half = (flat.numel() + 1) // 2
    mine = flat[rank * half:(rank + 1) * half]
    out["flat"] = global_grad_norm([], flat_shards=[mine], flat_group=dist.group.WORLD).item()
    out["flat_ref"] = flat.norm().item()
    # Pipeline stages: rank r holds a different layer's grads; summed over the stage group.
    stage = [a] if rank == 0 else [b, c]
    out["stages"] = global_grad_norm(stage, groups=[dist.group.WORLD]).item()
    out["stages_ref"] = torch.nn.utils.get_total_norm([a, b, c]).item()
    # A stage with no grads still takes part.
    stage = [a] if rank == 0 else []
    out["empty_stage"] = global_grad_norm(stage, groups=[dist.group.WORLD]).item()
    out["empty_stage_ref"] = a.norm().item()
    # AdamW8bit decides 8-bit state on the whole tensor's 45 elements, not a rank's 20 or 25.
    param = torch.nn.Parameter(distribute_tensor(a.clone(), mesh, [Shard(0)]))
    param.grad = distribute_tensor(b.clone(), mesh, [Shard(0)])
    opt = AdamW8bit([param], lr=1e-2, min_8bit_size=40, block_size=16)
    opt.step()
    out["q8_on_global_numel"] = "exp_avg_codes" in opt.state[param]
    return out


def test_distributed_world2():
    for got in spawn(_distributed, 2, timeout=120):
        for key in ("dtensors", "flat", "stages", "empty_stage"):
            assert got[key] == pytest.approx(got[key + "_ref"], rel=1e-6), key
        assert got["q8_on_global_numel"]


def _mixed_run(fused, monkeypatch):
    """Four mixed-precision steps (bf16 masters and an fp32 param, clipping, a LossScaler that
    grows after two clean steps and backs off at once; the third step's grads overflow) on the
    Triton backend: through the one-launch prologue (fused) or the torch-op path."""
    import fastllm
    import fastllm.optim.adamw as adamw_module
    from fastllm.amp import LossScaler
    from fastllm.kernels import l2norm as kernel

    if not fused:
        monkeypatch.setattr(adamw_module, "grad_norm_step", lambda *args, **kwargs: False)
    norm_launches = count_launches(monkeypatch, kernel, "_sum_squares_kernel")
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n, dtype in
              ((7, torch.bfloat16), (0, torch.bfloat16), (300, torch.bfloat16),
               (33, torch.float32))]
    scaler = LossScaler(init_scale=1024.0, hysteresis=1, growth_interval=2)
    opt = AdamW8bit(params, lr=1e-2, min_8bit_size=100, master_weights=True, max_grad_norm=0.5,
                    loss_scaler=scaler)
    reports = []
    with fastllm.use_backend("triton"):
        for step in range(4):
            scale = scaler.get_scale()
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
            if step == 2:
                params[2].grad[5] = float("inf")
            opt.step()
            reports.append((opt.grad_norm.clone(), bool(opt.step_skipped), int(opt.skipped_steps),
                            scaler.get_scale()))
    state = [t for p in params for t in (p.detach(), *opt.state[p].values())
             if isinstance(t, torch.Tensor)]
    return state, reports, scaler.state_dict(), len(norm_launches)


def test_fused_prologue_matches_the_torch_op_path(monkeypatch):
    """AdamW's one-launch prologue (grad norm, skip flag, clip/unscale multiplier, step counts,
    loss scaler: fastllm.optim.grad_norm.grad_norm_step) against the same step with those
    computed by torch ops: the same bits (the loss scale is a power of two), the same reports
    and scaler state, one norm launch per step."""
    from fastllm import _backend

    if _backend.unavailable_reason("triton", "cpu"):
        pytest.skip("triton is not available")
    fused = _mixed_run(True, monkeypatch)
    monkeypatch.undo()
    eager = _mixed_run(False, monkeypatch)
    assert fused[3] == 4  # one launch per step
    assert all(torch.equal(a, b) for a, b in zip(fused[0], eager[0]))
    for (norm_a, *rest_a), (norm_b, *rest_b) in zip(fused[1], eager[1]):
        assert rest_a == rest_b
        assert torch.equal(norm_a, norm_b) or not (torch.isfinite(norm_a) or
                                                    torch.isfinite(norm_b))
    assert [r[1] for r in fused[1]] == [False, False, True, False]
    assert [r[3] for r in fused[1]] == [1024.0, 2048.0, 1024.0, 1024.0]
    assert fused[2] == eager[2]


def test_fused_prologue_raises_when_the_scale_collapses():
    import fastllm
    from fastllm import _backend
    from fastllm.amp import LossScaleCollapsedError, LossScaler

    if _backend.unavailable_reason("triton", "cpu"):
        pytest.skip("triton is not available")
    p = torch.nn.Parameter(torch.randn(10).bfloat16())
    opt = fastllm.optim.AdamW([p], master_weights=True,
                              loss_scaler=LossScaler(init_scale=4.0, min_scale=1.0, hysteresis=1))
    with fastllm.use_backend("triton"):
        p.grad = torch.full((10,), float("inf")).bfloat16()
        opt.step()
        opt.step()
        assert opt.loss_scaler.get_scale() == 1.0 and int(opt.skipped_steps) == 2
        with pytest.raises(LossScaleCollapsedError, match="min_scale"):
            opt.step()


def test_parallel_clip_of_fp64_grads_is_torchs_in_fp64():
    """fastllm.parallel.clip_grad_norm_ rounded the fp64 norm to fp32 and clipped with it: the
    clipped grads were 3e-8 off torch's, the norm's precision instead of fp64's."""
    from fastllm.parallel import clip_grad_norm_

    ours = [torch.nn.Parameter(torch.randn(7, 5, dtype=torch.float64)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    got, want = clip_grad_norm_(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-14, atol=0)
