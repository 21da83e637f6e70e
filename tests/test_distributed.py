"""fastllm on torch.distributed (Gloo, CPU): DDP + fastllm.optim.AdamW, the DDP comm hooks,
FSDP2 + fastllm.optim.AdamW (global-norm clipping, DCP resharding), and DistributedOptimizer
stage 1/2, each against single-process fastllm.optim.AdamW on the full batch.

Processes are started three times for the whole module (world 2, then 3, then 1), each running
every check of its world size; the tests below compare what they returned.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fastllm
from fastllm.distributed import DistributedFailure, DistributedOptimizer, hooks
from fastllm.distributed.checkpoint import load, save_atomic
from fastllm.distributed.launch import spawn

STEPS = 20
HALF = 10
BATCH = 12  # divisible by 1, 2, 3, and by 2 micro-batches per rank
LR = 1e-2
SPAWN_TIMEOUT = 240


class Net(nn.Module):
    """Odd sizes: 7 -> 33 -> 5, a one-element gain, and a parameter the forward never uses."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(1234)
        # Registered first, so it lands in the last bucket: the buckets before it are complete
        # during backward and start their reduction there; the last one only at step().
        self.unused = nn.Parameter(torch.randn(3))
        self.fc1 = nn.Linear(7, 33)
        self.fc2 = nn.Linear(33, 5)
        self.gain = nn.Parameter(torch.full((1,), 1.5))
        self.to(dtype)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


def batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 7, generator=g).to(dtype),
            torch.randn(BATCH, 5, generator=g).to(dtype))


def local(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def loss_fn(model, x, y):
    return (model(x).float() - y.float()).square().mean()


NO_DECAY = ["unused", "fc1.bias", "fc2.bias", "gain"]  # Net's 1-D params


def two_groups(model):
    """[matrices, vectors (NO_DECAY) with weight_decay 0], each in model order: the groups of
    fastllm's other strategies, and DistributedOptimizer's with no_decay=NO_DECAY."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n not in NO_DECAY]},
            {"params": [p for n, p in named if n in NO_DECAY], "weight_decay": 0.0}]


def params_of(model, opt=None):
    if opt is not None:
        opt.finish_param_sync()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# --- single-process references ----------------------------------------------------------------
def reference(dtype=torch.float32, steps=STEPS, zero_unused=True, no_decay=False, **kwargs):
    """fastllm.optim.AdamW on the full batch; unused params get zero grads (as data parallel
    gives them); no_decay: two_groups. Returns (params after `steps`, losses per step)."""
    model = Net(dtype)
    opt = fastllm.optim.AdamW(two_groups(model) if no_decay else model.parameters(), lr=LR,
                              weight_decay=0.1, **kwargs)
    losses = []
    for step in range(steps):
        x, y = batch(step, dtype)
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        if zero_unused:
            model.unused.grad = torch.zeros_like(model.unused)
        opt.step()
        losses.append(loss.item())
    return params_of(model), losses


# --- what the ranks run -----------------------------------------------------------------------
def run_ddp(rank, world, dtype, comm_hook=None, optimizer_class=fastllm.optim.AdamW,
            no_decay=False, **kwargs):
    model = Net(dtype)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if comm_hook is not None:
        ddp.register_comm_hook(None, comm_hook)
    opt = optimizer_class(two_groups(model) if no_decay else model.parameters(), lr=LR,
                          weight_decay=0.1, **kwargs)
    for step in range(STEPS):
        x, y = batch(step, dtype)
        opt.zero_grad()
        loss_fn(ddp, local(x, rank, world), local(y, rank, world)).backward()
        if model.unused.grad is None:
            model.unused.grad = torch.zeros_like(model.unused)
        opt.step()
    return params_of(model)


def run_dist_opt(rank, world, dtype, stage, micro=1, steps=STEPS, model=None, opt=None,
                 start=0, **kwargs):
    model = model or Net(dtype)
    opt = opt or DistributedOptimizer(model, stage=stage, bucket_cap_mb=400 * 4 / 2**20,
                                      lr=LR, weight_decay=0.1, timeout=60, **kwargs)
    losses = []
    for step in range(start, steps):
        x, y = batch(step, dtype)
        x, y = local(x, rank, world), local(y, rank, world)
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            n = x.shape[0] // micro
            xs, ys = x[m * n:(m + 1) * n], y[m * n:(m + 1) * n]
            ctx = opt.no_sync() if m < micro - 1 else _null()
            with ctx:
                loss = loss_fn(model, xs, ys) / micro
                loss.backward()
            total += loss.detach()
        opt.step()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return model, opt, losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def grads_with_hook(rank, world, comm_hook, state=None, scale=1.0):
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if comm_hook is not None:
        ddp.register_comm_hook(state, comm_hook)
    x, y = batch(0)
    (loss_fn(ddp, local(x, rank, world), local(y, rank, world)) * scale).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def local_grads(rank, world):
    model = Net()
    x, y = batch(0)
    loss_fn(model, local(x, rank, world), local(y, rank, world)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def fsdp_model(dtype=torch.float32, mp=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Net(dtype)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mp else MixedPrecisionPolicy()
    fully_shard(model.fc1, mp_policy=policy)
    fully_shard(model.fc2, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def run_fsdp(rank, world, model, opt, start, steps, dtype=torch.float32):
    losses = []
    for step in range(start, steps):
        x, y = batch(step, dtype)
        opt.zero_grad()
        loss = loss_fn(model, local(x, rank, world), local(y, rank, world))
        loss.backward()
        if model.unused.grad is None:
            model.unused.grad = torch.zeros_like(model.unused)
        opt.step()
        total = loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def full_params(model):
    out = {}
    for n, p in model.named_parameters():
        out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
    return out


def world2(rank, world, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    r = {}
    r["ddp"] = run_ddp(rank, world, torch.float32)
    r["ddp_bf16_master"] = run_ddp(rank, world, torch.bfloat16, master_weights=True,
                                   max_grad_norm=0.5)
    model, opt, _ = run_dist_opt(rank, world, torch.float32, stage=1, overlap_param_gather=True)
    r["zero1"] = params_of(model, opt)
    r["zero1_shard_numel"] = opt.shard_numel()
    r["zero1_buckets"] = len(opt.buckets)
    # every param and every rank's shard (param, grad, the optimizer's flat shard) 16-byte aligned
    r["zero1_aligned"] = all(
        t.data_ptr() % 16 == 0
        for b in opt.buckets
        for t in [b.param_flat[b.lo:], b.grad_flat[b.lo:], b.shard_param, *b.params,
                  *b.grad_views])
    model, opt, _ = run_dist_opt(rank, world, torch.float32, stage=2, micro=2, max_grad_norm=0.5)
    r["zero2_clip_accum"] = params_of(model, opt)
    r["zero2_norm"] = float(opt.grad_norm)
    model, opt, _ = run_dist_opt(rank, world, torch.bfloat16, stage=2)
    r["zero2_bf16"] = params_of(model, opt)
    model, opt, _ = run_dist_opt(rank, world, torch.float32, stage=1, overlap_grad_reduce=False,
                                 overlap_param_gather=False)
    r["zero1_no_overlap"] = params_of(model, opt)

    # no_decay: the vectors' buckets and group without weight decay, as DDP + torch.optim.AdamW
    # with two_groups; fp32 and bf16 params (fp32 masters), both stages.
    r["ddp_no_decay"] = run_ddp(rank, world, torch.float32, optimizer_class=torch.optim.AdamW,
                                no_decay=True)
    for stage in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            model, opt, _ = run_dist_opt(rank, world, dtype, stage=stage, no_decay=NO_DECAY)
            r[f"no_decay_{stage}_{dtype}"] = params_of(model, opt)
    r["no_decay_groups"] = [g["weight_decay"] for g in opt.param_groups]
    r["no_decay_pure_buckets"] = all(len({n in NO_DECAY for n in b.names}) == 1
                                     for b in opt.buckets)

    # Hooks: one backward, grads compared with the default fp32 all-reduce.
    r["grads_default"] = grads_with_hook(rank, world, None)
    r["grads_local"] = local_grads(rank, world)
    r["grads_bf16"] = grads_with_hook(rank, world, hooks.bf16_wire_hook)
    r["grads_fp16"] = grads_with_hook(rank, world, hooks.fp16_wire_hook)
    scaler = fastllm.amp.LossScaler(init_scale=1024.0)
    r["grads_unscale_bf16"] = grads_with_hook(
        rank, world, hooks.unscale_bf16_wire_hook,
        hooks.LowPrecisionState(loss_scaler=scaler), scale=1024.0)

    # FSDP2: clipping by the global norm, and MixedPrecisionPolicy.
    model = fsdp_model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, max_grad_norm=0.5)
    run_fsdp(rank, world, model, opt, 0, STEPS)
    r["fsdp_clip"] = full_params(model)
    r["fsdp_norm"] = float(opt.grad_norm)
    model = fsdp_model(mp=True)
    opt = fastllm.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    run_fsdp(rank, world, model, opt, 0, STEPS)
    r["fsdp_mp"] = full_params(model)
    model = fsdp_model(torch.bfloat16)  # bf16 shards, fp32 master shards in the optimizer
    opt = fastllm.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, master_weights=True)
    run_fsdp(rank, world, model, opt, 0, STEPS, torch.bfloat16)
    r["fsdp_bf16_master"] = full_params(model)

    # Checkpoints at HALF steps: DistributedOptimizer (consolidated, atomic file) and FSDP2 (DCP).
    model, opt, losses = run_dist_opt(rank, world, torch.float32, stage=2, steps=HALF)
    sd = opt.state_dict()
    if rank == 0:
        save_atomic({"model": model.state_dict(), "optim": sd}, os.path.join(folder, "zero.pt"))
        plain = fastllm.optim.AdamW(Net().parameters(), lr=LR, weight_decay=0.1)
        plain.load_state_dict(sd)
        torch.optim.AdamW(Net().parameters(), lr=LR, weight_decay=0.1).load_state_dict(sd)
        r["zero_sd_step"] = float(plain.state[plain.param_groups[0]["params"][0]]["step"])
    r["zero_losses_first_half"] = losses
    sharded = opt.sharded_state_dict()
    r["zero_shard_state"] = sorted(sharded["state"])
    save_atomic(sharded, os.path.join(folder, f"zero_shard{rank}.pt"))
    # and with no_decay's two groups: torch.optim.AdamW with two_groups loads it
    model, opt, _ = run_dist_opt(rank, world, torch.float32, stage=2, steps=HALF,
                                 no_decay=NO_DECAY)
    sd = opt.state_dict()
    if rank == 0:
        save_atomic({"model": model.state_dict(), "optim": sd},
                    os.path.join(folder, "zero_no_decay.pt"))
        plain = torch.optim.AdamW(two_groups(Net()), lr=LR, weight_decay=0.1)
        plain.load_state_dict(sd)
        r["no_decay_sd"] = ([(g["weight_decay"], g["params"]) for g in sd["param_groups"]],
                            float(plain.state[plain.param_groups[1]["params"][0]]["step"]))
    save_atomic(opt.sharded_state_dict(), os.path.join(folder, f"zero_no_decay{rank}.pt"))
    model = fsdp_model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    run_fsdp(rank, world, model, opt, 0, HALF)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "fsdp_dcp"))

    # An inf/nan on one rank skips the step on every rank (LossScaler backs off everywhere).
    model = Net()
    scaler = fastllm.amp.LossScaler(init_scale=8.0, hysteresis=1)
    opt = DistributedOptimizer(model, stage=2, lr=LR, loss_scaler=scaler, timeout=60,
                               bucket_cap_mb=400 * 4 / 2**20)
    skips = []
    for step in range(2):
        x, y = batch(step)
        x, y = local(x, rank, world).clone(), local(y, rank, world)
        if step == 0 and rank == 1:
            x[0, 0] = float("inf")
        before = params_of(model, opt)
        opt.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        opt.step()
        after = params_of(model, opt)
        skips.append((opt.step_skipped, all(torch.equal(before[n], after[n]) for n in before),
                      scaler.get_scale()))
    r["skips"] = skips

    # A second backward into buckets already being reduced is refused (no silent corruption).
    x, y = batch(0)
    opt.zero_grad()
    loss_fn(model, local(x, rank, world), local(y, rank, world)).backward()
    try:
        loss_fn(model, local(x, rank, world), local(y, rank, world)).backward()
        r["double_backward"] = None
    except RuntimeError as exc:
        r["double_backward"] = str(exc)
    opt.zero_grad()

    # Mismatched models are refused at construction, naming the parameter.
    bad = Net()
    if rank == 1:
        bad.fc2 = nn.Linear(33, 6)
    try:
        DistributedOptimizer(bad, lr=LR)
        r["mismatch"] = None
    except ValueError as exc:
        r["mismatch"] = str(exc)

    # A param that gets no grad after model.zero_grad() (set_to_none: .grad None, the bucket
    # untouched) adds nothing to the next steps, as after opt.zero_grad(): both stages.
    r["zeroing"] = {}
    for stage in (1, 2):
        for via_model in (False, True):
            torch.manual_seed(0)
            m = _Branchy()
            o = DistributedOptimizer(m, stage=stage, lr=1e-2, betas=(0.0, 0.999))
            g = torch.Generator().manual_seed(1)
            for step in range(3):
                x = torch.randn(4, 4, generator=g).chunk(world)[rank]
                m(x, step == 0).square().mean().backward()
                o.step()
                (m.zero_grad if via_model else o.zero_grad)()
            r["zeroing"][stage, via_model] = m.branch.weight.detach().clone()
    r.update(fp64_buffers_and_edits(rank, world))
    return r


class _Buffered(nn.Module):  # buffers drawn at random, as a fixed projection or a mask
    def __init__(self, odd=False):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("proj", torch.randn(4, 3).t())  # not contiguous
        self.register_buffer("mask", torch.rand(5) > 0.5)
        self.register_buffer("count", torch.randint(0, 1000, (2,)))
        self.register_buffer("scratch", torch.randn(4 if odd else 3), persistent=False)


def fp64_buffers_and_edits(rank, world):
    """fp64 training against DDP + torch.optim.AdamW in fp64; buffers broadcast at
    construction; grads clipped after stage 1 launched their all-reduce."""
    r = {"fp64": {}}
    for which in ("ddp", 1, 2):
        model = Net(torch.float64)
        if which == "ddp":
            ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        else:
            ddp = model
            opt = DistributedOptimizer(model, torch.optim.AdamW, stage=which, lr=LR,
                                       weight_decay=0.1, max_grad_norm=0.5, timeout=60,
                                       bucket_cap_mb=400 * 8 / 2**20)
        for step in range(3):
            x, y = batch(step, torch.float64)
            opt.zero_grad()
            loss_fn(ddp, local(x, rank, world), local(y, rank, world)).backward()
            if which == "ddp":
                model.unused.grad = torch.zeros_like(model.unused)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        if which != "ddp":
            opt.finish_param_sync()
        r["fp64"][which] = {n: p.detach().clone() for n, p in model.named_parameters()}
        r["fp64"][which, "dtype"] = {p.dtype for p in model.parameters()}

    torch.manual_seed(rank)  # each rank draws its own
    model = _Buffered()
    DistributedOptimizer(model, lr=LR, timeout=60)
    r["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    try:
        DistributedOptimizer(_Buffered(odd=rank == 1), lr=LR, timeout=60)
        r["buffer_mismatch"] = None
    except ValueError as exc:
        r["buffer_mismatch"] = str(exc)

    # in a 400-element bucket of its own, [gain, fc2, fc1.bias] is reduced during backward
    model = Net()
    opt = DistributedOptimizer(model, stage=1, lr=LR, timeout=60, bucket_cap_mb=400 * 4 / 2**20)
    x, y = batch(0)
    loss_fn(model, local(x, rank, world), local(y, rank, world)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    try:
        opt.step()
        r["stage1_clip"] = None
    except RuntimeError as exc:
        r["stage1_clip"] = str(exc)
    opt.zero_grad()
    return r


class _Branchy(nn.Module):  # its branch is used in the first step only
    def __init__(self):
        super().__init__()
        self.fc, self.branch = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_branch):
        return self.fc(x) + self.branch(x) if use_branch else self.fc(x)


def resume(rank, world, folder):
    """Load both world-2 checkpoints and train the second half here."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    r = {}
    model = Net()
    ckpt = load(os.path.join(folder, "zero.pt"))
    model.load_state_dict(ckpt["model"])
    stage = 1 if world == 3 else 2
    opt = DistributedOptimizer(model, stage=stage, bucket_cap_mb=400 * 4 / 2**20, lr=LR,
                               weight_decay=0.1, timeout=60)
    opt.load_state_dict(ckpt["optim"])
    # The same state from the world-2 ranks' sharded_state_dict()s, resharded here into 100-
    # element buckets: at world 3 some ranks' shards of [unused] and [gain, fc2.bias] are padding.
    other = Net()
    other.load_state_dict(ckpt["model"])
    other_opt = DistributedOptimizer(other, stage=stage, lr=LR, weight_decay=0.1, timeout=60,
                                     bucket_cap_mb=100 * 4 / 2**20)
    other_opt.load_sharded_state_dict(
        [load(os.path.join(folder, f"zero_shard{k}.pt")) for k in range(2)])
    r["sharded_steps"] = [float(other_opt.state.get(b.shard_param, {}).get("step", -1))
                          for b in other_opt.buckets]
    a, b = opt.state_dict()["state"], other_opt.state_dict()["state"]
    r["sharded_equals_consolidated"] = a.keys() == b.keys() and all(
        torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    _, _, r["zero_losses"] = run_dist_opt(rank, world, torch.float32, stage, model=model,
                                          opt=opt, start=HALF)
    r["zero_params"] = params_of(model, opt)
    r["refused"] = refused_states(ckpt["optim"])

    # The no_decay checkpoint (two groups), consolidated and resharded, trains on here.
    model, other = Net(), Net()
    ckpt = load(os.path.join(folder, "zero_no_decay.pt"))
    opts = []
    for m, cap in ((model, 400), (other, 100)):
        m.load_state_dict(ckpt["model"])
        opts.append(DistributedOptimizer(m, stage=stage, bucket_cap_mb=cap * 4 / 2**20, lr=LR,
                                         weight_decay=0.1, timeout=60, no_decay=NO_DECAY))
    opts[0].load_state_dict(ckpt["optim"])
    opts[1].load_sharded_state_dict(
        [load(os.path.join(folder, f"zero_no_decay{k}.pt")) for k in range(2)])
    a, b = opts[0].state_dict(), opts[1].state_dict()
    r["no_decay_sharded_equals_consolidated"] = a["param_groups"] == b["param_groups"] and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    run_dist_opt(rank, world, torch.float32, stage, model=model, opt=opts[0], start=HALF)
    r["no_decay_params"] = params_of(model, opts[0])

    model = fsdp_model() if world > 1 else Net()
    opt = fastllm.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(folder, "fsdp_dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    r["fsdp_losses"] = run_fsdp(rank, world, model, opt, HALF, STEPS)
    r["fsdp_params"] = full_params(model)

    if world == 3:
        r["zero3_stage1"] = params_of(*run_dist_opt(rank, world, torch.float32, stage=1)[:2])
        r["zero3_stage2"] = params_of(*run_dist_opt(rank, world, torch.float32, stage=2)[:2])
        r["failure"] = failing_rank(rank, folder)
    return r


def refused_states(good):
    """Bad states are refused before anything changes; after step() the params are current."""
    import copy

    model = Net()
    opt = DistributedOptimizer(model, stage=2, lr=LR, timeout=60)
    out = {"overlap_default": opt.overlap_param_gather}
    bad = copy.deepcopy(good)
    for entry in bad["state"].values():
        entry.pop("exp_avg_sq")
    before = copy.deepcopy(opt.state_dict())
    for name, call in (("no_exp_avg_sq", lambda: opt.load_state_dict(bad)),
                       ("empty_shards", lambda: opt.load_sharded_state_dict([]))):
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["unchanged"] = repr(opt.state_dict()) == repr(before)
    x, y = batch(0)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, x, y).backward()
    opt.step()
    # no forward since step(): read through model.parameters(), the params are this step's
    out["params_current_after_step"] = all(not torch.equal(a, p) for a, p in
                                           zip(before, model.parameters()))
    return out


def failing_rank(rank, folder):
    """Rank 1 raises (and stays alive); the others must stop with an error naming it."""
    model = Net()
    opt = DistributedOptimizer(model, stage=2, lr=LR, timeout=5)
    flag = os.path.join(folder, "failure_seen")
    if rank == 1:
        try:
            with fastllm.distributed.failure_guard():
                raise ValueError("boom in the data loader")
        except ValueError:
            pass
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(f"{flag}.{r}") for r in (0, 2)):
            time.sleep(0.1)
        return "raised"
    x, y = batch(0)
    t0 = time.monotonic()
    try:
        loss_fn(model, local(x, rank, 3), local(y, rank, 3)).backward()
        opt.step()
        return "no error"
    except DistributedFailure as exc:
        with open(f"{flag}.{rank}", "w"):
            pass
        return (str(exc), time.monotonic() - t0)


# --- the spawns, once per module --------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dist"))
    out = {2: spawn(world2, 2, args=(folder,), timeout=SPAWN_TIMEOUT)}
    out[3] = spawn(resume, 3, args=(folder,), timeout=SPAWN_TIMEOUT)
    out[1] = spawn(resume, 1, args=(folder,), timeout=SPAWN_TIMEOUT)
    return out


def assert_params_close(got, want, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


def assert_bf16_error_within_2x_single_process(got, **kwargs):
    """bf16 training (fp32 masters) drifts from fp32 training by rounding; the distributed run
    may drift at most 2x as far (max abs error per tensor) as single-process bf16 training."""
    exact, _ = reference(torch.float32, **kwargs)
    single, _ = reference(torch.bfloat16, master_weights=True, **kwargs)
    for name in exact:
        own = float((single[name] - exact[name]).abs().max())
        err = float((got[name] - exact[name]).abs().max())
        assert err <= 2 * own + 2.0**-8 * float(exact[name].abs().max()) * 0.5, (
            f"{name}: error {err:.3g} vs single-process bf16 {own:.3g}")


@pytest.mark.parametrize("key", ["ddp", "zero1", "zero1_no_overlap"])
def test_fp32_matches_single_process(runs, key):
    want, _ = reference()
    for rank_result in runs[2]:
        assert_params_close(rank_result[key], want)


def test_world3_stage1_and_stage2_match_single_process(runs):
    want, _ = reference()
    for rank_result in runs[3]:
        assert_params_close(rank_result["zero3_stage1"], want)
        assert_params_close(rank_result["zero3_stage2"], want)


def test_zero2_clipping_and_accumulation(runs):
    want, _ = reference(max_grad_norm=0.5)
    for rank_result in runs[2]:
        assert_params_close(rank_result["zero2_clip_accum"], want)
    # clipping was active: the global norm exceeds max_grad_norm
    assert runs[2][0]["zero2_norm"] > 0.5
    assert runs[2][0]["zero2_norm"] == runs[2][1]["zero2_norm"]


def test_bf16_master_weights_error_as_single_process(runs):
    for rank_result in runs[2]:
        assert_bf16_error_within_2x_single_process(rank_result["zero2_bf16"])
        assert_bf16_error_within_2x_single_process(rank_result["ddp_bf16_master"],
                                                   max_grad_norm=0.5)
        assert_bf16_error_within_2x_single_process(rank_result["fsdp_bf16_master"])


def test_balanced_shards(runs):
    numel = sum(p.numel() for p in Net().parameters())
    shard = [r["zero1_shard_numel"] for r in runs[2]]
    assert shard[0] == shard[1]
    # element-balanced: the pads are under ALIGN elements per param and ALIGN per rank per
    # bucket
    from fastllm.distributed.optimizer import ALIGN

    n_params = len(list(Net().parameters()))
    buckets = runs[2][0]["zero1_buckets"]
    assert numel <= sum(shard) < numel + ALIGN * (n_params + buckets * len(shard))
    assert all(r["zero1_aligned"] for r in runs[2])


def test_hooks_match_default_to_wire_precision(runs):
    world = len(runs[2])
    for rank_result in runs[2]:
        ref = rank_result["grads_default"]
        for key, wire in (("grads_bf16", torch.bfloat16), ("grads_fp16", torch.float16),
                          ("grads_unscale_bf16", torch.bfloat16)):
            got = rank_result[key]
            eps = torch.finfo(wire).eps  # one rounding step is eps / 2 relative
            for name in ref:
                # each rank's share g_r / W is rounded once, each partial sum once, the result
                # once more: |error| <= eps/2 * (sum_r |g_r| / W * W + |mean|), with slack 2x
                shares = sum(r["grads_local"][name].abs() for r in runs[2]) / world
                tol = eps * (world * shares + ref[name].abs()) + 1e-30
                err = (got[name] - ref[name]).abs()
                assert bool((err <= tol).all()), (key, name, float((err / tol).max()))
    # the wire really was low precision: bf16 grads differ from fp32 somewhere
    g = runs[2][0]
    assert any(not torch.equal(g["grads_bf16"][n], g["grads_default"][n])
               for n in g["grads_default"])


def test_fsdp2_clipping_equals_unsharded(runs):
    want, _ = reference(max_grad_norm=0.5)
    for rank_result in runs[2]:
        assert_params_close(rank_result["fsdp_clip"], want)
    assert runs[2][0]["fsdp_norm"] > 0.5


def test_fsdp2_mixed_precision_trains_close_to_fp32(runs):
    want, _ = reference()
    for rank_result in runs[2]:
        for name in want:
            # bf16 compute: the params follow fp32 training to bf16 accuracy (20 steps of lr 1e-2)
            torch.testing.assert_close(rank_result["fsdp_mp"][name], want[name], rtol=0,
                                       atol=0.05, msg=name)


def test_consolidated_state_dict_loads_in_plain_optimizers(runs):
    assert runs[2][0]["zero_sd_step"] == HALF
    keys = [r["zero_shard_state"] for r in runs[2]]
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])


@pytest.mark.parametrize("world", [3, 1])
def test_checkpoint_resumes_at_other_world_size(runs, world):
    want_params, want_losses = reference()
    for rank_result in runs[world]:
        torch.testing.assert_close(torch.tensor(rank_result["zero_losses"]),
                                   torch.tensor(want_losses[HALF:]), rtol=1e-5, atol=1e-7)
        assert_params_close(rank_result["zero_params"], want_params)
        torch.testing.assert_close(torch.tensor(rank_result["fsdp_losses"]),
                                   torch.tensor(want_losses[HALF:]), rtol=1e-5, atol=1e-7)
        assert_params_close(rank_result["fsdp_params"], want_params)


@pytest.mark.parametrize("world", [3, 1])
def test_sharded_state_dict_reshards(runs, world):
    for rank_result in runs[world]:
        assert rank_result["sharded_equals_consolidated"]
        assert rank_result["sharded_steps"] == [HALF] * 5  # padding-only shards have state too


def test_no_decay_matches_ddp_with_two_param_groups(runs):
    """no_decay=NO_DECAY: weight decay on the matrices only, as DDP + torch.optim.AdamW with
    two_groups and one process; bf16 params (fp32 masters) to bf16 training's own error."""
    want, _ = reference(no_decay=True)
    one_group, _ = reference()
    assert not torch.allclose(want["fc1.bias"], one_group["fc1.bias"], rtol=1e-4)
    for rank_result in runs[2]:
        assert_params_close(rank_result["ddp_no_decay"], want)
        for stage in (1, 2):
            assert_params_close(rank_result[f"no_decay_{stage}_{torch.float32}"], want)
            assert_params_close(rank_result[f"no_decay_{stage}_{torch.float32}"],
                                rank_result["ddp_no_decay"])
            assert_bf16_error_within_2x_single_process(
                rank_result[f"no_decay_{stage}_{torch.bfloat16}"], no_decay=True)
        assert rank_result["no_decay_groups"] == [0.1, 0.0]
        assert rank_result["no_decay_pure_buckets"]
    # numbered as torch numbers two groups' params (group order; each group in model order:
    # a module's own params first): fc1.weight, fc2.weight; unused, gain, fc1.bias, fc2.bias
    assert runs[2][0]["no_decay_sd"] == ([(0.1, [0, 1]), (0.0, [2, 3, 4, 5])], HALF)


@pytest.mark.parametrize("world", [3, 1])
def test_no_decay_checkpoint_resumes_at_other_world_size(runs, world):
    want, _ = reference(no_decay=True)
    for rank_result in runs[world]:
        assert rank_result["no_decay_sharded_equals_consolidated"]
        assert_params_close(rank_result["no_decay_params"], want)


def test_first_half_losses_match(runs):
    _, want_losses = reference(steps=HALF)
    torch.testing.assert_close(torch.tensor(runs[2][0]["zero_losses_first_half"]),
                               torch.tensor(want_losses), rtol=1e-5, atol=1e-7)


def test_non_finite_grad_on_one_rank_skips_everywhere(runs):
    for rank_result in runs[2]:
        (skipped0, unchanged0, scale0), (skipped1, unchanged1, scale1) = rank_result["skips"]
        assert skipped0 and unchanged0 and scale0 == 4.0
        assert not skipped1 and not unchanged1 and scale1 == 4.0


def test_second_backward_without_no_sync_is_refused(runs):
    for rank_result in runs[2]:
        assert "no_sync" in (rank_result["double_backward"] or "")


def test_model_zero_grad_leaves_no_stale_grad_in_the_buckets(runs):
    for rank_result in runs[2]:
        for stage in (1, 2):
            z = rank_result["zeroing"]
            assert torch.equal(z[stage, True], z[stage, False]), stage


def test_fp64_matches_ddp_and_torch_adamw(runs):
    """fp64 params were accepted at construction, then step() failed in fastllm.scaled_copy."""
    for rank_result in runs[2]:
        got = rank_result["fp64"]
        for stage in (1, 2):
            assert got[stage, "dtype"] == {torch.float64}
            for name, want in got["ddp"].items():
                torch.testing.assert_close(got[stage][name], want, rtol=1e-12, atol=1e-14,
                                           msg=name)


def test_buffers_are_broadcast_from_rank_0_at_construction(runs):
    """Only the params were broadcast: a buffer drawn at random differed across ranks."""
    torch.manual_seed(0)
    want = dict(_Buffered().named_buffers())
    for rank_result in runs[2]:
        got = rank_result["buffers"]
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
        assert "scratch" in (rank_result["buffer_mismatch"] or "")


def test_stage1_refuses_grads_clipped_after_their_all_reduce_started(runs):
    """Stage 1 recorded no version at launch: the clip raced with the all-reduce."""
    for rank_result in runs[2]:
        assert "max_grad_norm" in (rank_result["stage1_clip"] or ""), rank_result["stage1_clip"]


def test_mismatched_models_name_the_parameter(runs):
    for rank_result in runs[2]:
        assert rank_result["mismatch"] is not None
        assert "fc2.weight" in rank_result["mismatch"]


@pytest.mark.parametrize("world", [3, 1])
def test_bad_states_are_refused_and_params_current_after_step(runs, world):
    for rank_result in runs[world]:
        r = rank_result["refused"]
        assert "lacks ['exp_avg_sq']" in r["no_exp_avg_sq"], r
        assert "no state" in r["empty_shards"], r
        assert r["unchanged"] and r["overlap_default"] is False
        assert r["params_current_after_step"]


def test_checkpoint_load_never_runs_code(tmp_path):
    """fastllm.distributed.checkpoint.load reads with weights_only=True: a pickle whose
    __reduce__ would run code is refused, and the code does not run."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Payload()}, path)
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load(path)
    assert not marker.exists()
    save_atomic({"w": torch.ones(3), "step": 4, "names": ["a"]}, tmp_path / "ok.pt")
    assert load(tmp_path / "ok.pt")["step"] == 4


def test_failing_rank_is_named_within_the_timeout(runs):
    results = [r["failure"] for r in runs[3]]
    assert results[1] == "raised"
    for rank in (0, 2):
        message, seconds = results[rank]
        assert "rank 1" in message and "boom in the data loader" in message, message
        assert seconds < 30


def _returns_a_lambda(rank, world_size):
    return lambda: rank


def test_spawn_reports_a_result_that_cannot_be_returned():
    """A rank whose result does not pickle failed outside the handler that reports errors:
    spawn said only 'exited with code 1 and no result', the PicklingError nowhere."""
    with pytest.raises(RuntimeError, match="rank 0 raised the result of rank 0 cannot be "
                                           "returned: .*pickle"):
        spawn(_returns_a_lambda, 1, timeout=SPAWN_TIMEOUT)
