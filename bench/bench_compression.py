"""Low-rank compression and memory-lean optimizers, each against the library a user would
otherwise use, in one run:

    PowerSGD hook, rank 4, on a 4096x4096 gradient + its bias (one DDP bucket), world 2, Gloo,
        one thread per rank: fastllm powersgd_hook vs torch's powerSGD_hook vs the dense
        all-reduce; notes give the elements each rank sends per step. And the whole
        DistributedOptimizer step (ZeRO-2, fastllm AdamW, param all-gather waited for) on that
        layer with grad_compression=PowerSGD against the exact reduce-scatter.
    GaLore on 2048x2048 layers at rank 128: the optimizer step (no refresh) of fastllm
        GaLoreAdamW vs galore-torch's GaLoreAdamW vs dense AdamW, with the optimizer-state
        bytes; and the projection refresh: fastllm's range finder (warm and cold start) vs the
        torch.linalg.svd galore-torch runs.
    BAdam on a model of embedding, 8 layers and head, blocks = the 8 layers: optimizer-state
        bytes of fastllm BAdam vs the badam package's BlockOptimizer vs full AdamW, and the
        time of a whole training step (forward, backward, optimizer).

galore-torch and badam are optional peers (`make bench-deps`); their rows are left out when they
are not installed. Hook times are the slower rank's, one call per provider per round, rounds
interleaved.

    fastllm bench --ops compression
"""

import gc
import importlib.util
import statistics
import sys
import time
import types

import torch

import fastllm
from fastllm.bench import harness
from fastllm.bench.bench_distributed import wire_bytes

HOOK_ROWS, HOOK_COLS, HOOK_RANK, WORLD = 4096, 4096, 4, 2
# One layer: galore-torch's first step is a full SVD (tens of seconds on a busy 2-core machine).
GALORE_WIDTH, GALORE_LAYERS, GALORE_RANK = 2048, 1, 128
# Gloo worlds and the CPU kernels: `fastllm bench --ops all --device cuda` leaves it out
DEVICES = ("cpu",)


# --- PowerSGD -------------------------------------------------------------------------------
class _Bucket:
    """What a comm hook reads from torch.distributed.GradBucket (one bucket: weight, bias)."""

    def __init__(self, buffer, shapes):
        self._buffer, self._grads, offset = buffer, [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            self._grads.append(buffer[offset:offset + n].view(s))
            offset += n

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


def _hook_worker(rank, world, rounds, warmup):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState,
                                                                            powerSGD_hook)

    from fastllm.distributed import PowerSGD, powersgd_hook

    shapes = [(HOOK_ROWS, HOOK_COLS), (HOOK_ROWS,)]
    numel = HOOK_ROWS * HOOK_COLS + HOOK_ROWS
    g = torch.Generator().manual_seed(rank)
    # A gradient-like matrix: a decaying spectrum (rank-64 signal) plus noise.
    signal = torch.randn(HOOK_ROWS, 64, generator=g) @ torch.randn(64, HOOK_COLS, generator=g)
    source = torch.cat([(signal + torch.randn(HOOK_ROWS, HOOK_COLS, generator=g)).flatten(),
                        torch.randn(HOOK_ROWS, generator=g)])
    del signal
    buffer = torch.empty(numel)
    ours = PowerSGD(rank=HOOK_RANK, start_iter=2)
    theirs = PowerSGDState(None, matrix_approximation_rank=HOOK_RANK, start_powerSGD_iter=2)

    def dense(buf):
        buf.div_(world)
        dist.all_reduce(buf)

    providers = {
        "fastllm powersgd_hook": lambda buf: powersgd_hook(ours, _Bucket(buf, shapes)).wait(),
        "torch powerSGD_hook": lambda buf: powerSGD_hook(theirs, _Bucket(buf, shapes)).wait(),
        "dense all-reduce": dense,
    }
    times = {name: [] for name in providers}
    for r in range(warmup + rounds):
        for name, fn in providers.items():
            buffer.copy_(source)
            dist.barrier()
            t0 = time.perf_counter()
            fn(buffer)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's time
            if r >= warmup:
                times[name].append(elapsed.item() * 1e3)
    return dict(times=times, sent=ours.last_numel_sent, numel=numel,
                **_distopt_times(rounds, warmup, source))


def _distopt_times(rounds, warmup, source):
    import torch.distributed as dist

    from fastllm.distributed import DistributedOptimizer, PowerSGD

    weight = source[:HOOK_ROWS * HOOK_COLS].view(HOOK_ROWS, HOOK_COLS)
    bias = source[HOOK_ROWS * HOOK_COLS:]
    comp = PowerSGD(rank=HOOK_RANK, start_iter=0)
    opts = {}
    for name, kwargs in (("fastllm DistributedOptimizer ZeRO-2", {}),
                         ("fastllm DistributedOptimizer ZeRO-2 + PowerSGD",
                          dict(grad_compression=comp))):
        layer = torch.nn.Linear(HOOK_COLS, HOOK_ROWS)
        opts[name] = (layer, DistributedOptimizer(layer, stage=2, overlap_param_gather=False,
                                                  lr=1e-4, **kwargs))
    times = {name: [] for name in opts}
    sent = 0
    for r in range(warmup + rounds):
        for name, (layer, opt) in opts.items():
            opt.zero_grad()
            layer.weight.grad.copy_(weight)
            layer.bias.grad.copy_(bias)
            before = comp.total_numel_after_compression
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - t0])
            if comp.total_numel_after_compression > before:
                # Two buckets here (the weight is over bucket_cap_mb): all they sent this step.
                sent = comp.total_numel_after_compression - before
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[name].append(elapsed.item() * 1e3)
    return dict(distopt_times=times, distopt_sent=sent)


def _powersgd_rows(full, progress):
    from fastllm.distributed.launch import spawn

    rounds = 10 if full else 5
    progress(f"compression: PowerSGD hook, {HOOK_ROWS}x{HOOK_COLS} grad, world {WORLD} Gloo, "
             f"{rounds} interleaved rounds")
    result = spawn(_hook_worker, WORLD, args=(rounds, 2), timeout=900)[0]
    size = (f"PowerSGD rank {HOOK_RANK}: {HOOK_ROWS}x{HOOK_COLS} grad + bias, world {WORLD}, "
            f"gloo")
    rows = []
    dense = result["numel"]
    for name, times in result["times"].items():
        # every hook averages with all-reduces: of the whole grad, or of P, Q and the bias
        sent = dense if name == "dense all-reduce" else result["sent"]
        if name == "dense all-reduce":
            than = "the dense reference"
        elif sent < dense:
            than = f"{dense / sent:.{0 if dense >= 10 * sent else 1}f}x fewer than dense"
        else:
            than = "as much as dense: not compressed"
        kib = wire_bytes("all_reduce", sent * 4, WORLD) / 2**10
        note = f"sends {kib:.0f} KiB/rank/step ({than})"
        rows.append(dict(op="compression", size=size, provider=name,
                         time_ms=statistics.median(times), baseline="torch powerSGD_hook",
                         note=note))
    exact = "fastllm DistributedOptimizer ZeRO-2"
    for name, times in result["distopt_times"].items():
        # exact: one reduce-scatter of the grads; compressed: all-reduces of P, Q and the bias
        wire = (wire_bytes("reduce_scatter", dense * 4, WORLD) if name == exact
                else wire_bytes("all_reduce", result["distopt_sent"] * 4, WORLD))
        rows.append(dict(op="compression", size=f"{size}: whole optimizer step", provider=name,
                         time_ms=statistics.median(times), baseline=exact,
                         note=f"grad reduction sends {wire / 2**10:.0f} KiB/rank/step (ring "
                              f"accounting); the param all-gather is the same"))
    return rows


# --- GaLore ---------------------------------------------------------------------------------
def load_galore_torch():
    """galore-torch's GaLoreAdamW class, or None when it is not installed.

    galore_torch/__init__.py imports its 8-bit optimizer, which needs bitsandbytes (absent on
    most CPU machines); the AdamW module itself does not, so it is loaded without the package's
    __init__."""
    if "galore_torch" not in sys.modules:
        spec = importlib.util.find_spec("galore_torch")
        if spec is None:
            return None
        try:
            import galore_torch  # noqa: F401
        except ImportError:
            pkg = types.ModuleType("galore_torch")
            pkg.__path__ = list(spec.submodule_search_locations)
            sys.modules["galore_torch"] = pkg
    from galore_torch.adamw import AdamW

    return AdamW


def _state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def _projector_bytes(optimizer):
    """galore-torch keeps its projector inside a GaLoreProjector object in the state."""
    total = 0
    for s in optimizer.state.values():
        proj = s.get("projector")
        ortho = getattr(proj, "ortho_matrix", None)
        if isinstance(ortho, torch.Tensor):
            total += ortho.numel() * ortho.element_size()
    return total


def _galore_rows(full, progress):
    from fastllm.optim import GaLoreAdamW
    from fastllm.optim.galore import range_finder

    width, layers, rank = GALORE_WIDTH, GALORE_LAYERS, GALORE_RANK
    size = f"GaLore: {layers} x {width}x{width} fp32, rank {rank}"
    torch.manual_seed(0)
    weights = [torch.randn(width, width) * 0.02 for _ in range(layers)]
    grads = [torch.randn(width, 64) @ torch.randn(64, width) + 0.1 * torch.randn(width, width)
             for _ in range(layers)]
    group = dict(rank=rank, update_proj_gap=10**9, scale=0.25)

    def make(kind):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if kind == "fastllm GaLoreAdamW":
            opt = GaLoreAdamW([dict(params=params, **group)], lr=1e-3)
        elif kind == "galore-torch GaLoreAdamW":
            opt = load_galore_torch()([dict(params=params, proj_type="std", **group)], lr=1e-3)
        elif kind == "fastllm AdamW (dense)":
            opt = fastllm.optim.AdamW(params, lr=1e-3)
        else:
            opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        opt.step()  # the first step builds the state and the projector
        return opt

    kinds = ["fastllm GaLoreAdamW", "galore-torch GaLoreAdamW", "fastllm AdamW (dense)",
             "torch AdamW (fused, dense)"]
    if load_galore_torch() is None:
        kinds.remove("galore-torch GaLoreAdamW")
    opts = {k: make(k) for k in kinds}
    state = {k: _state_bytes(o) + _projector_bytes(o) for k, o in opts.items()}
    progress(f"compression: {size}: optimizer steps (interleaved)")
    timings = harness.measure_many({k: o.step for k, o in opts.items()}, min_reps=5,
                                   min_time_s=2.0)
    dense = state["torch AdamW (fused, dense)"]
    rows = []
    for k in kinds:
        note = (f"optimizer state {state[k] / 2**20:.1f} MiB "
                f"({100 * state[k] / dense:.1f}% of AdamW)")
        rows.append(dict(op="compression", size=f"{size}: step", provider=k,
                         time_ms=timings[k].median_ms, baseline="torch AdamW (fused, dense)",
                         note=note))
    del opts
    gc.collect()

    g = grads[0]
    previous = range_finder(g, rank, generator=torch.Generator().manual_seed(0))
    fns = {
        "fastllm range finder (warm, 2 power iters)": lambda: range_finder(g, rank, previous, 2),
        "fastllm range finder (cold, 3 power iters)": lambda: range_finder(
            g, rank, None, 2, torch.Generator().manual_seed(1)),
        "torch.linalg.svd (galore-torch's refresh)": lambda: torch.linalg.svd(
            g, full_matrices=False),
    }
    progress(f"compression: {size}: projection refresh (interleaved; the SVD takes seconds)")
    reps = 3 if full else 1
    timings = harness.measure_many(fns, warmup=0, min_reps=reps, max_reps=reps, min_time_s=0.0)
    # Quality: the gradient energy the projector keeps, over what the best rank-r subspace (the
    # SVD's) keeps: ||P^T G||^2 / sum of the top-r squared singular values.
    s_top = torch.linalg.svdvals(g.double())[:rank].square().sum().item()
    for k in fns:
        note = ""
        if k.startswith("fastllm"):
            start = None if "cold" in k else previous
            p = range_finder(g, rank, start, 2, torch.Generator().manual_seed(1))
            kept = (p.double().t() @ g.double()).square().sum().item() / s_top
            note = f"keeps {100 * kept:.2f}% of the best rank-{rank} gradient energy"
        rows.append(dict(op="compression", size=f"{size}: projection refresh", provider=k,
                         time_ms=timings[k].median_ms,
                         baseline="torch.linalg.svd (galore-torch's refresh)", note=note))
    return rows


# --- BAdam ----------------------------------------------------------------------------------
class _BlockModel(torch.nn.Module):
    def __init__(self, vocab=4096, width=256, hidden=1024, n_layers=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, width)) for _ in range(n_layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _badam_rows(full, progress):
    from fastllm.optim import BAdam

    size = "BAdam: embedding + 8 layers (256 -> 1024 -> 256) + head, 6.3M fp32 params, batch 4x64"
    tokens = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))

    def make(kind):
        torch.manual_seed(0)
        model = _BlockModel()
        named = list(model.named_parameters())
        layer_blocks = [[f"layers.{i}."] for i in range(8)]
        if kind == "fastllm BAdam":
            opt = BAdam(named, switch_block_every=10**9, blocks=layer_blocks, lr=1e-3)
        elif kind == "badam BlockOptimizer":
            import logging
            import warnings

            from badam import BlockOptimizer
            logging.getLogger("badam").setLevel(logging.ERROR)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = BlockOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), named,
                                     block_prefix_list=layer_blocks,
                                     switch_block_every=10**9, switch_mode="ascending",
                                     verbose=0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        def step():
            # a whole training step: badam's BlockOptimizer consumes (and frees) the grads
            opt.zero_grad()
            model(tokens).logsumexp(-1).mean().backward()
            opt.step()

        step()

        state = opt.base_optimizer if kind == "badam BlockOptimizer" else opt
        return step, _state_bytes(state), model

    kinds = ["fastllm BAdam", "badam BlockOptimizer", "torch AdamW (fused, all params)"]
    if importlib.util.find_spec("badam") is None:
        kinds.remove("badam BlockOptimizer")
    made = {}
    for k in kinds:
        try:
            made[k] = make(k)
        except Exception as exc:  # an optional peer that fails here is reported, not fatal
            harness.note(progress, f"compression: {k} failed ({type(exc).__name__}: {exc}); "
                                   "left out")
    progress(f"compression: {size}: optimizer steps (interleaved)")
    timings = harness.measure_many({k: v[0] for k, v in made.items()}, min_reps=5,
                                   min_time_s=1.0)
    block = sum(p.numel() for p in made[kinds[0]][2].layers[0].parameters()) * 4 * 2
    full_state = made["torch AdamW (fused, all params)"][1]
    rows = []
    for k, (_, state, _) in made.items():
        rows.append(dict(op="compression", size=f"{size}: step", provider=k,
                         time_ms=timings[k].median_ms, baseline="torch AdamW (fused, all params)",
                         note=f"optimizer state {state / 2**20:.2f} MiB ({state / block:.2f} "
                              f"blocks' AdamW state, {100 * state / full_state:.1f}% of full)"))
    return rows


def run(device="cpu", full=False, progress=print):
    if torch.device(device).type != "cpu":
        harness.note(progress, "compression: runs on the CPU (Gloo world 2 and the CPU "
                               f"kernels); skipped on {device}")
        return []
    with fastllm.use_backend("cpp"):
        return _powersgd_rows(full, progress) + _galore_rows(full, progress) + _badam_rows(
            full, progress)
