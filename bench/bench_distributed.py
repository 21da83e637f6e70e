"""Data parallel step time at world 2 (Gloo on the CPU, one thread per rank), all in one run:

    DDP + torch.optim.AdamW(fused=True)          the baseline
    DDP + fastllm.optim.AdamW
    DDP + fastllm bf16 / torch fp16 comm hooks   (torch's bf16_compress_hook refuses the CPU)
    DDP + ZeroRedundancyOptimizer(torch AdamW)   torch's ZeRO-1
    fastllm DistributedOptimizer stage 1 and 2 (25 MB buckets as DDP's, and 4 MB)

on an MLP of 50 Linear(640, 640) layers (100 tensors, 20.5M fp32 params), batch 16 per rank.
Configurations are timed in interleaved rounds (one step of each per round; a step's time is
the slowest rank's). Notes give, per provider: the share of the step spent waiting on
communication that backward did not hide (DistributedOptimizer: time blocked waiting for the
grad reductions, and for the param all-gather, which in training overlaps the next forward but
is waited for inside the timed step here), per-rank optimizer-state bytes against the unsharded
optimizer's, and the bytes one rank puts on the wire per step.

    fastllm bench --ops distributed
"""

import statistics
import time

import torch

from fastllm.bench import harness

LAYERS, WIDTH, BATCH, WORLD = 50, 640, 16, 2
BASELINE = "DDP + torch AdamW (fused)"
# a Gloo world on the CPU: `fastllm bench --ops all --device cuda` leaves it out
DEVICES = ("cpu",)


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def _worker(rank, world, rounds, warmup):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastllm
    from fastllm.distributed import DistributedOptimizer, failure, hooks

    waited = {"grad": 0.0, "param": 0.0}
    plain_wait = failure.wait

    def timed_wait(work, what, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return plain_wait(work, what, *args, **kwargs)
        finally:
            waited["param" if "all-gather" in what else "grad"] += time.perf_counter() - t0

    failure.wait = timed_wait

    def ddp_case(make_opt, hook=None):
        model = DDP(_model())
        if hook is not None:
            model.register_comm_hook(None, hook)
        return model, make_opt(model.parameters()), None

    cases = {
        BASELINE: ddp_case(lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
        "DDP + fastllm AdamW": ddp_case(lambda ps: fastllm.optim.AdamW(ps, lr=1e-4)),
        "DDP + fastllm bf16 hook + fastllm AdamW": ddp_case(
            lambda ps: fastllm.optim.AdamW(ps, lr=1e-4), hooks.bf16_wire_hook),
        "DDP + fastllm fp16 hook + fastllm AdamW": ddp_case(
            lambda ps: fastllm.optim.AdamW(ps, lr=1e-4), hooks.fp16_wire_hook),
        "DDP + torch fp16 hook + fastllm AdamW": ddp_case(
            lambda ps: fastllm.optim.AdamW(ps, lr=1e-4), default_hooks.fp16_compress_hook),
        "DDP + ZeroRedundancyOptimizer(torch AdamW)": ddp_case(
            lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=1e-4)),
    }
    for stage, cap in ((1, 25), (2, 25), (2, 4)):
        model = _model()
        cases[f"fastllm DistributedOptimizer stage {stage}, {cap} MB buckets"] = (
            model, DistributedOptimizer(model, stage=stage, bucket_cap_mb=cap, lr=1e-4), "dist")
    numel = sum(p.numel() for p in _model().parameters())
    x = torch.randn(BATCH, WIDTH)
    times = {name: [] for name in cases}
    exposed = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, (model, opt, kind) in cases.items():
            waited["grad"] = waited["param"] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if kind == "dist":
                opt.finish_param_sync()
            elapsed = torch.tensor([time.perf_counter() - t0, waited["grad"], waited["param"]],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[name].append(float(elapsed[0]) * 1e3)
                exposed[name].append((float(elapsed[1]) * 1e3, float(elapsed[2]) * 1e3))
    unsharded = _state_bytes(cases["DDP + fastllm AdamW"][1])
    state = {}
    for name, (_, opt, kind) in cases.items():
        inner = opt.optimizer if kind == "dist" else getattr(opt, "optim", opt)
        mine = torch.tensor(float(_state_bytes(inner)))
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        state[name] = float(mine)
    return dict(times=times, exposed=exposed, state=state, unsharded=unsharded, numel=numel)


# Bytes one rank sends per byte of the buffer with ring algorithms (the standard accounting;
# Gloo's own algorithms differ in detail), world W: an all-reduce is a reduce-scatter and an
# all-gather, each sending (W-1)/W of the buffer.
_RING_SHARE = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def wire_bytes(collective, nbytes, world=WORLD):
    """Bytes one rank sends for one `collective` ("all_reduce", "reduce_scatter", "all_gather")
    of an `nbytes` buffer across `world` ranks, ring accounting: 2 (W-1)/W of the buffer for an
    all-reduce, (W-1)/W for the others."""
    return _RING_SHARE[collective] * (world - 1) / world * nbytes


def _wire_bytes(name, numel):
    """Bytes one rank sends per step for the provider `name` (fp32 grads, numel of them)."""
    if "bf16 hook" in name or "fp16 hook" in name:
        return wire_bytes("all_reduce", numel * 2)
    if "ZeroRedundancy" in name or "stage 1" in name:
        # all-reduce, then broadcast / all-gather of the params
        return wire_bytes("all_reduce", numel * 4) + wire_bytes("all_gather", numel * 4)
    if "stage 2" in name:
        return wire_bytes("reduce_scatter", numel * 4) + wire_bytes("all_gather", numel * 4)
    return wire_bytes("all_reduce", numel * 4)  # DDP


def run(device="cpu", full=False, progress=print):
    from fastllm.distributed.launch import spawn

    if torch.device(device).type != "cpu":
        harness.note(progress, "distributed: the benchmark runs on the CPU with Gloo (world 2); "
                               f"skipped on {device} (bench/device_check.sh runs the single-GPU "
                               "checks)")
        return []
    rounds = 10 if full else 5
    progress(f"distributed: spawning {WORLD} ranks (Gloo, 1 thread each), {len(range(rounds))} "
             f"interleaved rounds")
    result = spawn(_worker, WORLD, args=(rounds, 2), timeout=900)[0]
    numel = result["numel"]
    size = f"world {WORLD}, {2 * LAYERS} tensors, {numel / 1e6:.1f}M params, fp32"
    rows = []
    for name, times in result["times"].items():
        ms = statistics.median(times)
        notes = []
        if "Distributed" in name:
            grad = statistics.median(e[0] / t for e, t in zip(result["exposed"][name], times))
            param = statistics.median(e[1] / t for e, t in zip(result["exposed"][name], times))
            notes.append(f"exposed comm: grad reduction {100 * grad:.0f}% + param all-gather "
                         f"{100 * param:.0f}% of step")
        ratio = result["state"][name] / result["unsharded"]
        notes.append(f"optimizer state/rank {result['state'][name] / 2**20:.0f} MiB "
                     f"({100 * ratio:.1f}% of unsharded)")
        notes.append(f"wire {_wire_bytes(name, numel) / 2**20:.0f} MiB/step/rank")
        rows.append(dict(op="distributed", size=size, provider=name, time_ms=ms,
                         baseline=BASELINE, note=", ".join(notes)))
    return rows
