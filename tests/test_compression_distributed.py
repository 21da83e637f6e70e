"""Compression and GaLore under fastllm's sharded data parallelism, in one world-2 Gloo launch:
DistributedOptimizer(grad_compression=PowerSGD) at full rank against the exact
DistributedOptimizer, at rank 4 step by step against DDP + powersgd_hook + the same optimizer, its
state round trip, the refused combinations, one inf/nan on one rank skipping only its step;
GaLoreAdamW under DistributedOptimizer (stage 1 and 2) and under FSDP2 (`fully_shard`) against
one process. Also here, as it shares this launch (tests/test_distributed.py is full):
overlap_param_gather with a param read outside its own module's forward, and DDP +
powersgd_hook keeping each weight's state through DDP's bucket rebuild and a resume. In one
process: the state following each param when a bucket is reordered, the name check of
state_dict(), failure.wait's message and spawn's world_size check.

Tolerances: fp32, 1e-5 relative. Against DDP the same kernels run on the same bucket contents, so
the only differences are the order of a few sums. At full rank P P^T M equals M up to the
rounding of the orthogonalisation (a few 1e-7 relative); the check uses SGD so the param error is
lr times the gradient error. GaLore's distributed paths compute the same projector from the same
averaged gradient, and the projected products through other summation orders.
"""

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fastllm.distributed import DistributedOptimizer, PowerSGD, powersgd_hook
from fastllm.distributed.launch import spawn
from fastllm.optim import AdamW, GaLoreAdamW

STEPS = 6


def _model(out=16, seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, out))


def _batch(step, n=32, out=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 32, generator=g), torch.randn(n, out, generator=g)


def _train(model, opt, rank, world, steps=STEPS, start=0, out=16, n=32):
    """Each rank's half of a fixed batch per step; the loss is the mean, so the average over
    ranks is the full batch's gradient."""
    per = n // world
    for step in range(start, start + steps):
        x, y = _batch(step, n, out)
        half = slice(per * rank, per * rank + per)
        opt.zero_grad()
        (model(x[half]) - y[half]).square().mean().backward()
        opt.step()
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()


def _train_single(model, opt, steps=STEPS, start=0, out=16, n=32, max_grad_norm=None):
    for step in range(start, start + steps):
        x, y = _batch(step, n, out)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()


def _worst(a, b):
    """Largest param difference relative to that param's largest magnitude."""
    return max(((p - q).abs().max() / q.abs().max()).item()
               for p, q in zip(a.parameters(), b.parameters()))


# --- PowerSGD under DistributedOptimizer ------------------------------------------------------
def _full_rank(rank, world):
    out = {}
    for stage in (1, 2):
        exact = _model()
        opt_exact = DistributedOptimizer(exact, torch.optim.SGD, stage=stage, lr=0.1)
        _train(exact, opt_exact, rank, world, n=256)
        compressed = _model()
        state = PowerSGD(rank=64, start_iter=1, min_compression_rate=0)
        opt = DistributedOptimizer(compressed, torch.optim.SGD, stage=stage, lr=0.1,
                                   grad_compression=state)
        _train(compressed, opt, rank, world, n=256)
        # Every matrix was compressed (nothing dense but the biases).
        assert state.total_numel_after_compression > 0
        out[stage] = _worst(compressed, exact)
    return out


def _against_ddp(rank, world):
    out = {}
    for stage in (1, 2):
        ref = _model()
        ddp = nn.parallel.DistributedDataParallel(ref)
        ddp.register_comm_hook(PowerSGD(rank=4, start_iter=2, seed=3), powersgd_hook)
        _train(ddp, AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), rank, world)
        model = _model()
        opt = DistributedOptimizer(model, stage=stage, lr=1e-2, weight_decay=0.1,
                                   grad_compression=PowerSGD(rank=4, start_iter=2, seed=3))
        _train(model, opt, rank, world)
        # Without compression the same run differs well beyond the tolerance: the check can fail.
        dense = _model()
        _train(dense, DistributedOptimizer(dense, stage=stage, lr=1e-2, weight_decay=0.1), rank,
               world)
        out[stage] = (_worst(model, ref), _worst(dense, ref))
    return out


def _round_trip(rank, world):
    def make():
        model = _model()
        state = PowerSGD(rank=4, start_iter=2, seed=5)
        return model, state, DistributedOptimizer(model, stage=2, lr=1e-2,
                                                  grad_compression=state)

    model_a, state_a, opt_a = make()
    _train(model_a, opt_a, rank, world, steps=4)
    blob = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict(),
                "compression": state_a.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    model_b, state_b, opt_b = make()
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    state_b.load_state_dict(saved["compression"])
    _train(model_a, opt_a, rank, world, steps=3, start=4)
    _train(model_b, opt_b, rank, world, steps=3, start=4)
    same = all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    # Without the compression state (fresh errors and Q) the continuation differs.
    model_c, _, opt_c = make()
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    _train(model_c, opt_c, rank, world, steps=3, start=4)
    differs = not all(torch.equal(p, q) for p, q in zip(model_a.parameters(),
                                                          model_c.parameters()))
    return same, differs


def _refusals(rank, world):
    from fastllm.amp import LossScaler

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    messages = []
    cases = [
        (TypeError, dict(grad_compression="powersgd")),
        (NotImplementedError, dict(grad_compression=PowerSGD(), loss_scaler=LossScaler())),
        (ValueError, dict(grad_compression=PowerSGD(process_group=dist.new_group([0, 1])))),
        (ValueError, dict(galore_params=[model[0].weight])),
        (ValueError, dict(optimizer_class=GaLoreAdamW)),  # no rank
        (ValueError, dict(optimizer_class=GaLoreAdamW, rank=4, galore_params=[model[0].bias])),
        (ValueError, dict(optimizer_class=GaLoreAdamW, rank=4, galore_params=[torch.ones(2, 2)])),
    ]
    for error, kwargs in cases:
        try:
            DistributedOptimizer(model, lr=1e-2, **kwargs)
        except error as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return messages, unchanged


def _non_finite_once(rank, world):
    """An inf on rank 1 at step 2 only, PowerSGD with error feedback and warm start (defaults):
    under DistributedOptimizer and DDP + powersgd_hook + AdamW, which both skip non-finite
    steps. Returns per path the skipped steps and whether the params end finite and equal."""
    out = {}
    for path in ("distopt", "ddp"):
        model = _model()
        state = PowerSGD(rank=2, start_iter=0)
        if path == "distopt":
            net = model
            opt = DistributedOptimizer(model, lr=1e-2, max_grad_norm=1.0, grad_compression=state)
        else:
            net = nn.parallel.DistributedDataParallel(model)
            net.register_comm_hook(state, powersgd_hook)
            opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
        skipped = []
        for step in range(5):
            x, y = _batch(step)
            x, y = x[16 * rank:16 * rank + 16].clone(), y[16 * rank:16 * rank + 16]
            if step == 2 and rank == 1:
                x[0, 0] = float("inf")
            opt.zero_grad()
            (net(x) - y).square().mean().backward()
            opt.step()
            skipped.append(bool(opt.step_skipped))
        if path == "distopt":
            opt.finish_param_sync()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        out[path] = (skipped, bool(torch.isfinite(flat).all()) and all(
            torch.equal(gathered[0], g) for g in gathered))
    return out


class _FunctionalInput(nn.Module):
    """Reads inp's params in its own forward without calling inp (a functional or tied layer),
    before any module that owns params runs. `pending` (set by the test) says whether inp's
    all-gather is still in flight at that read: what a stale value would come from."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.inp = nn.Linear(32, 64)
        self.out = nn.Linear(64, 16)
        self.pending = lambda: False
        self.stale_reads = 0

    def forward(self, x):
        self.stale_reads += self.pending()
        return self.out(torch.tanh(F.linear(x, self.inp.weight, self.inp.bias)))


def _overlap_functional_read(rank, world):
    """overlap_param_gather against off: the same losses and params, and no forward reads inp
    while its bucket's all-gather has not been waited for (checked at the read itself, so the
    check does not depend on how fast the other rank is)."""
    runs = []
    for overlap in (False, True):
        model = _FunctionalInput()
        opt = DistributedOptimizer(model, stage=2, lr=1e-2, overlap_param_gather=overlap)
        buckets = {opt._where[id(p)][0].index for p in model.inp.parameters()}
        model.pending = lambda: any(opt.buckets[i].gather_work is not None for i in buckets)
        losses = []
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            loss = (model(x[16 * rank:16 * rank + 16]) - y[16 * rank:16 * rank + 16]).square()
            loss.mean().backward()
            opt.step()
            losses.append(loss.mean().item())
        opt.finish_param_sync()
        runs.append((losses, [p.detach().clone() for p in model.parameters()],
                     model.stale_reads))
    (losses_off, params_off, _), (losses_on, params_on, stale) = runs
    return (stale == 0 and losses_on == losses_off
            and all(map(torch.equal, params_on, params_off)))


# --- GaLore under DistributedOptimizer and FSDP2 ----------------------------------------------
GALORE = dict(rank=8, update_proj_gap=2, scale=0.5, proj_type="std")


def _single_galore(model):
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    return GaLoreAdamW([dict(params=matrices, **GALORE), {"params": others}], lr=1e-2,
                       weight_decay=0.1)


def _galore_distopt(rank, world):
    single = _model()
    opt_single = _single_galore(single)
    _train_single(single, opt_single)
    at_steps = copy.deepcopy(single)
    sd_single = copy.deepcopy(opt_single.state_dict())
    _train_single(single, opt_single, steps=3, start=STEPS)  # the continued reference
    out = {}
    for stage in (1, 2):
        model = _model()
        opt = DistributedOptimizer(model, GaLoreAdamW, stage=stage, lr=1e-2, weight_decay=0.1,
                                   **GALORE)
        _train(model, opt, rank, world)
        worst = _worst(model, at_steps)
        # The consolidated state is single-process GaLoreAdamW's, both ways: each continues
        # like the single-process run (a fresh state, with new projectors, would not).
        single_b = copy.deepcopy(at_steps)
        opt_b = _single_galore(single_b)
        opt_b.load_state_dict(opt.state_dict())
        _train_single(single_b, opt_b, steps=3, start=STEPS)
        fresh = copy.deepcopy(at_steps)
        opt_fresh = DistributedOptimizer(fresh, GaLoreAdamW, stage=stage, lr=1e-2,
                                         weight_decay=0.1, **GALORE)
        opt_fresh.load_state_dict(sd_single)
        _train(fresh, opt_fresh, rank, world, steps=3, start=STEPS)
        out[stage] = (worst, _worst(single_b, single), _worst(fresh, single))
    # With PowerSGD too: every rank projects the same compressed average, so the replicas stay
    # identical, and the run differs from the exact one.
    combined = _model()
    opt = DistributedOptimizer(combined, GaLoreAdamW, stage=2, lr=1e-2, weight_decay=0.1,
                               grad_compression=PowerSGD(rank=2, start_iter=2), **GALORE)
    _train(combined, opt, rank, world)
    flat = torch.cat([p.detach().flatten() for p in combined.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    out["combined"] = (all(torch.equal(gathered[0], g) for g in gathered),
                       _worst(combined, at_steps))
    # Clipping by the global norm: the replicated GaLore buckets count once in it.
    clipped_single = _model()
    _train_single(clipped_single, _single_galore(clipped_single), max_grad_norm=0.05)
    clipped = _model()
    opt = DistributedOptimizer(clipped, GaLoreAdamW, stage=2, lr=1e-2, weight_decay=0.1,
                               max_grad_norm=0.05, **GALORE)
    _train(clipped, opt, rank, world)
    out["clipped"] = (_worst(clipped, clipped_single), _worst(clipped_single, at_steps))
    unloaded = copy.deepcopy(at_steps)
    _train_single(unloaded, _single_galore(unloaded), steps=3, start=STEPS)
    out["unloaded"] = _worst(unloaded, single)
    return out


def _galore_fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out_dim = 15  # 15 rows: uneven shards (8 and 7)
    single = _model(out=out_dim)
    opt_single = _single_galore(single)
    _train_single(single, opt_single, out=out_dim)
    model = _model(out=out_dim)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _single_galore(model)
    _train(model, opt, rank, world, out=out_dim)
    worst = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item()
                for p, q in zip(model.parameters(), single.parameters()))
    lefts = sum(1 for p in model.parameters()
                if p.dim() == 2 and opt.state[p]["exp_avg"].shape[0] == GALORE["rank"])
    # Column-sharded params are refused before anything changes.
    from torch.distributed.tensor import Shard, distribute_tensor

    odd = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    odd.grad = distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)])
    before = odd.full_tensor()
    opt = GaLoreAdamW([{"params": [odd], "rank": 2}])
    try:
        opt.step()
        refused = None
    except NotImplementedError as exc:
        refused = str(exc)
    refused_cleanly = refused is not None and torch.equal(odd.full_tensor(), before)
    return worst, lefts, refused_cleanly, refused


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def _check_ddp_rebuild(rank, world):
    """DDP's one bucket holds [a, b] at the first iteration, [b, a] after its rebuild: error
    feedback must keep each weight's mass, sum_t out_t + mean(error_T) == sum_t mean(grad_t),
    at start_iter 0 and across a resume from state_dict() into a fresh DDP (with module=).
    Worst relative residual over the weights, per case."""
    out = {}
    for case in ("start_iter_0", "resume"):
        torch.manual_seed(0)
        plain = _TwoLayers()
        out_sum = {n: torch.zeros(16, 16) for n in ("a.weight", "b.weight")}
        true_sum = {n: torch.zeros(16, 16) for n in ("a.weight", "b.weight")}
        g, state = torch.Generator().manual_seed(rank), None
        for step in range(5):
            if step == 0 or (case == "resume" and step == 3):
                saved = None if step == 0 else io.BytesIO()
                if saved is not None:
                    torch.save(state.state_dict(), saved)
                    saved.seek(0)
                torch.manual_seed(0)
                model = _TwoLayers()
                if saved is not None:
                    model.load_state_dict(plain.state_dict())
                ddp = nn.parallel.DistributedDataParallel(model)
                state = PowerSGD(rank=1, start_iter=0, module=ddp if case == "resume" else None)
                if saved is not None:
                    state.load_state_dict(torch.load(saved, weights_only=True))
                ddp.register_comm_hook(state, powersgd_hook)
            x = torch.randn(8, 16, generator=g)
            model.zero_grad()
            plain.zero_grad()
            ddp(x).square().sum().backward()
            plain(x).square().sum().backward()
            for (n, p), q in zip(model.named_parameters(), plain.parameters()):
                out_sum[n] += p.grad
                t = q.grad.clone()
                dist.all_reduce(t)
                true_sum[n] += t / world
        err = state.errors[0].clone()
        dist.all_reduce(err)
        order = state._owners[0][0] if case == "resume" else ("b.weight", "a.weight")
        out[case] = max(((out_sum[n] + err[i * 256:(i + 1) * 256].view(16, 16) / world
                          - true_sum[n]).abs().max() / true_sum[n].abs().max()).item()
                        for i, n in enumerate(order))
    return out


def _all_checks(rank, world):
    return {"full_rank": _full_rank(rank, world), "ddp": _against_ddp(rank, world),
            "round_trip": _round_trip(rank, world), "refusals": _refusals(rank, world),
            "galore_distopt": _galore_distopt(rank, world),
            "galore_fsdp2": _galore_fsdp2(rank, world),
            "non_finite_once": _non_finite_once(rank, world),
            "overlap_functional_read": _overlap_functional_read(rank, world),
            "ddp_rebuild": _check_ddp_rebuild(rank, world)}


@pytest.fixture(scope="module")
def world2():
    return spawn(_all_checks, 2, timeout=300)


def test_powersgd_full_rank_reproduces_the_exact_distributed_optimizer(world2):
    for result in world2:
        for stage, worst in result["full_rank"].items():
            assert worst < 1e-5, (stage, worst)


def test_powersgd_matches_ddp_with_powersgd_hook_step_by_step(world2):
    for result in world2:
        for stage, (worst, dense) in result["ddp"].items():
            assert worst < 1e-5, (stage, worst)
            assert dense > 1e-3, (stage, dense)  # compression changed the run


def test_powersgd_state_round_trips_under_distributed_optimizer(world2):
    for same, differs in (r["round_trip"] for r in world2):
        assert same and differs


def test_bad_combinations_are_refused_before_anything_changes(world2):
    expected = ["must be a fastllm.distributed.PowerSGD", "loss_scaler is not supported",
                "process_group is not this optimizer's", "galore_params needs",
                "needs rank=", "projects 2-D params only", "not a trainable parameter"]
    for messages, unchanged in (r["refusals"] for r in world2):
        assert unchanged
        for got, want in zip(messages, expected):
            assert got is not None and want in got, (got, want)


def test_galore_under_distributed_optimizer_matches_one_process(world2):
    for result in world2:
        out = result["galore_distopt"]
        for stage in (1, 2):
            worst, single_loaded, distributed_loaded = out[stage]
            assert worst < 1e-5, (stage, worst)
            assert single_loaded < 1e-5, (stage, single_loaded)
            assert distributed_loaded < 1e-5, (stage, distributed_loaded)
        assert out["unloaded"] > 1e-3  # the state mattered: the check can fail
        clipped, clip_mattered = out["clipped"]
        assert clipped < 1e-5 and clip_mattered > 1e-3, (clipped, clip_mattered)
        replicas_equal, off_exact = out["combined"]
        assert replicas_equal and off_exact > 1e-4


def test_galore_under_fsdp2_matches_one_process(world2):
    for worst, lefts, refused_cleanly, message in (r["galore_fsdp2"] for r in world2):
        assert lefts == 1  # the (15, 64) weight: the all-reduced left projection
        assert worst < 1e-5, worst
        assert refused_cleanly and "sharded on dim 0 over a 1-D mesh" in message, message


def test_powersgd_non_finite_step_on_one_rank_skips_only_that_step(world2):
    for result in world2:
        for path, (skipped, finite_and_equal) in result["non_finite_once"].items():
            assert skipped == [False, False, True, False, False], (path, skipped)
            assert finite_and_equal, path


def test_overlap_param_gather_covers_a_param_read_outside_its_module(world2):
    for result in world2:
        assert result["overlap_functional_read"]


def test_each_weight_keeps_its_own_state_when_ddp_reorders_a_bucket(world2):
    """Before, state went by bucket index and shapes: a.weight's error was added to b.weight's
    gradient after DDP's rebuild (start_iter 0) and after a resume (residuals 0.3-0.4)."""
    for result in world2:
        assert result["ddp_rebuild"]["start_iter_0"] < 1e-5, result["ddp_rebuild"]
        assert result["ddp_rebuild"]["resume"] < 1e-5, result["ddp_rebuild"]



@pytest.mark.parametrize("module", [False, True])
def test_state_follows_each_param_when_a_bucket_is_reordered(module):
    """One process (a world-1 group): the same two params, their order in the bucket swapped
    on alternate steps. Each param's mass is kept: sum_t out_t + error_T == sum_t grad_t."""
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
    params = {n: p for n, p in net.named_parameters()}
    state = PowerSGD(rank=2, start_iter=0, process_group=group,
                     module=net if module else None)
    out_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    true_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    for step in range(6):
        # the two weights hold 2048 elements each, of shapes (64, 32) and (32, 64)
        order = ["0.weight", "1.weight"][::1 if step % 2 == 0 else -1]
        shapes = [tuple(params[n].shape) for n in order]
        buf = torch.randn(4096, generator=torch.Generator().manual_seed(step))
        grads = [buf[:2048].view(shapes[0]), buf[2048:].view(shapes[1])]
        for n, g in zip(order, grads):
            true_sum[n] += g
        state.reduce_(buf, grads, 0, params=[params[n] for n in order])
        for n, g in zip(order, grads):
            out_sum[n] += g
    error = state.errors[0]
    for i, n in enumerate(order):
        e = error[i * 2048:(i + 1) * 2048].view(params[n].shape)
        torch.testing.assert_close(out_sum[n] + e, true_sum[n], rtol=1e-5, atol=1e-5)


def test_state_dict_without_names_is_refused_by_a_state_with_module():
    """Saved without module= (or before names were saved): loadable only by bucket index."""
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    net = nn.Linear(32, 64, bias=False)
    saved = PowerSGD(rank=2, start_iter=0, process_group=group)
    buf = torch.randn(64 * 32, generator=torch.Generator().manual_seed(0))
    saved.reduce_(buf, [buf.view(64, 32)], 0, params=[net.weight])
    sd = saved.state_dict()
    assert sd["params"] is None
    old = {k: v for k, v in sd.items() if k != "params"}  # as saved before 'params' existed
    for state_dict in (sd, old):
        state = PowerSGD(rank=2, start_iter=0, process_group=group, module=net)
        with pytest.raises(ValueError, match="no parameter names"):
            state.load_state_dict(state_dict)
        assert state.iter == 0 and not state.errors
        plain = PowerSGD(rank=2, start_iter=0, process_group=group)
        plain.load_state_dict(state_dict)
        assert torch.equal(plain.errors[0], saved.errors[0])
    named = PowerSGD(rank=2, start_iter=0, process_group=group, module=net)
    named.reduce_(buf, [buf.view(64, 32)], 0, params=[net.weight])
    assert named.state_dict()["params"] == {0: {"names": ["weight"], "offsets": [0]}}


class _FailedWork:
    """An async collective that has already failed."""

    def is_completed(self):
        return True

    def wait(self):
        raise RuntimeError("Connection closed by peer")


def test_a_collective_that_raised_is_not_reported_as_timed_out():
    from fastllm.distributed import failure
    with pytest.raises(failure.DistributedFailure) as info:
        failure.wait(_FailedWork(), "test all-reduce", timeout=30)
    assert "after" not in str(info.value) and "Connection closed" in str(info.value)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True])
def test_spawn_refuses_a_world_size_below_one(world_size):
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        spawn(_model, world_size)
