"""Probes of this machine for the planner's cost model: one thread's matmul rate, copy
bandwidth and per-op dispatch cost (measure_host), Gloo's latency, bus bandwidth and the wait a
collective pays when ranks share cores (measure_comm), the peak memory a function holds
(measure_peak_memory), the eager aten ops a step dispatches (count_ops), and the GPUSpec they
make (machine_spec). Used by bench/bench_parallel.py and the planner's tests, not by the
library."""

from fastllm.parallel.planner import GPUSpec

# --- this machine: measured, not looked up ------------------------------------------------------

def median_time(fn, reps=5, warmup=1, best=False):
    """Median (best=True: the fastest) of `reps` timed calls; the machine's capability is the
    fastest a shared machine allows, a collective's cost the typical one."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def _op_chain(x, n=40):
    """n tiny elementwise ops and their backward: the per-op cost with nothing to compute."""
    import torch

    y = x
    for _ in range(n // 2):
        y = torch.nn.functional.silu(y) * 0.5
    y.sum().backward()


def _linear_chain(x, w, mesh=None, n=8):
    """n tiny linears and their backward; with a mesh, each as ColwiseParallel runs one: the
    input made a Replicate DTensor, multiplied by the sharded weight, the output made local."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    y = x
    for _ in range(n):
        if mesh is not None:
            y = torch.nn.functional.linear(DTensor.from_local(y, mesh, [Replicate()]), w)
            y = y.to_local()
        else:
            y = torch.nn.functional.linear(y, w)
    y.sum().backward()


def count_ops(fn, dtensor_only=False):
    """Aten ops fn dispatches (dtensor_only: those with a DTensor argument)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not dtensor_only or any(isinstance(a, DTensor)
                                       for a in tree_flatten((args, kwargs))[0]):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def measure_host(hidden=256, ffn=688, tokens=512):
    """One process, one thread, alone: matmul FLOP/s at a layer's shape, copy bandwidth, and
    the host cost of an eager op on a plain tensor (tiny elementwise ops and their backward)
    and on a DTensor (tiny column-parallel linears on a world-1 mesh, from_local and to_local
    included, over the ops that see a DTensor).

    Returns a dict of floats (FLOP/s, bytes/s, seconds). Call before starting other ranks.
    """
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(tokens, hidden), torch.randn(hidden, ffn)
        t = median_time(lambda: a @ b, reps=20, warmup=3, best=True)
        flops = 2 * tokens * hidden * ffn / t
        x = torch.empty(16 << 20)
        y = torch.empty_like(x)
        copy = 2 * x.numel() * 4 / median_time(lambda: y.copy_(x), reps=10, best=True)
        del x, y
        leaf = torch.randn(4, 4, requires_grad=True)
        n_ops = count_ops(lambda: _op_chain(leaf))
        op = median_time(lambda: _op_chain(leaf), reps=20, warmup=3, best=True) / n_ops
        own_group = not (dist.is_available() and dist.is_initialized())
        if own_group:
            with tempfile.TemporaryDirectory() as tmp:
                dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                        world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
            w = torch.randn(4, 4, requires_grad=True)
            dw = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
            x = torch.randn(2, 4, requires_grad=True)
            n_dops = count_ops(lambda: _linear_chain(x, dw, mesh), dtensor_only=True)
            t_d = median_time(lambda: _linear_chain(x, dw, mesh), reps=10, warmup=2, best=True)
            t_p = median_time(lambda: _linear_chain(x, w), reps=10, warmup=2, best=True)
            dop = op + (t_d - t_p) / n_dops
        finally:
            if own_group:
                dist.destroy_process_group()
    finally:
        torch.set_num_threads(threads)
    return {"matmul_flops": flops, "copy_bandwidth": copy,
            "op_overhead": op,
            "dtensor_overhead": max(dop - op, 0.0)}


def measure_peak_memory(fn):
    """Run fn() under fastllm.train.memory.PeakMemory; the most bytes of tensor storage held
    at once, tensors made before fn excluded (so build the model inside fn); DTensors count by
    their local shards."""
    from fastllm.train.memory import PeakMemory

    with PeakMemory() as mode:
        fn()
    return mode.peak


_GROUPS = {}  # (world, n) -> this rank's group of n consecutive ranks (None: left over)


def measure_comm(nbytes=4 << 20, work_s=5e-3, reps=10, bandwidth=True):
    """Gloo collectives as the layouts see them; call on every rank of an initialised world.

    For each group size n in (2, world): all groups of n consecutive ranks all-reduce at once
    (as two tp2 or pp2 copies do), timing a 4-byte buffer (the latency a) and an nbytes one
    (the bus bandwidth; skipped when bandwidth=False, for a quick probe of the load). sync_cost:
    how much longer `work, tiny all-reduce` takes in a loop than `work` alone, less a, with
    every rank working at once: on a machine with fewer cores than ranks, a collective waits
    for peers the scheduler has set aside, and the wait grows with the work between
    collectives (up to a scheduler time slice): work_s is about one layer's forward or
    backward of the layouts priced here. On a shared
    machine these move with the other jobs' load: probe again beside each measurement.
    Returns {n: dict}.
    """
    import statistics

    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    rank = dist.get_rank()
    out = {}
    a = torch.randn(256, 256)
    per_mm = median_time(lambda: a @ a, reps=10, warmup=2, best=True)
    work_reps = max(1, round(work_s / per_mm))

    def work():
        for _ in range(work_reps):
            a @ a

    for n in sorted({min(2, world), world}):
        if n < 2:
            continue
        if (world, n) not in _GROUPS:
            groups = [dist.new_group(list(range(i, i + n)))
                      for i in range(0, world - world % n, n)]
            _GROUPS[world, n] = groups[rank // n] if rank < world - world % n else None
        group = _GROUPS[world, n]
        tiny, big = torch.ones(1), torch.ones(nbytes // 4)

        def coll(x, k=1):
            def fn():
                for _ in range(k):
                    if group is not None:
                        dist.all_reduce(x, group=group)
            return fn

        dist.barrier()
        t_tiny = median_time(coll(tiny, 20), reps=reps, warmup=1) / 20
        t_big = 0.0
        if bandwidth:
            dist.barrier()
            t_big = median_time(coll(big), reps=reps, warmup=2)
        def work_and_sync():
            for _ in range(10):
                work()
                coll(tiny)()

        # alternated, so that each pair sees the same load; the median of the pairs' excess
        dist.barrier()
        works, excess = [], []
        for _ in range(max(reps, 5)):
            t_work = median_time(lambda: [work() for _ in range(10)], reps=1, warmup=0)
            t_both = median_time(work_and_sync, reps=1, warmup=0)
            works.append(t_work)
            excess.append(t_both - t_work)
        t_work, t_excess = statistics.median(works), statistics.median(excess)
        vals = torch.tensor([t_tiny, t_big, t_work, t_excess], dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        t_tiny, t_big, t_work, t_excess = vals.tolist()
        out[n] = {"latency": t_tiny,
                  "sync_cost": max(t_excess / 10 - t_tiny, 0.0)}
        if bandwidth:
            out[n]["bus_bandwidth"] = 2 * (n - 1) / n * nbytes / max(t_big - t_tiny, 1e-9)
    return out


def machine_spec(host, comm, ranks, cores, name="this machine"):
    """A GPUSpec for this CPU from measure_host() and measure_comm() (fp32, one thread a rank).

    Gloo's latency per hop and bus bandwidth are averaged over the measured group sizes; the
    sync costs (by group size) were measured with `ranks` ranks at once, and count only when
    the ranks outnumber the cores. cores: the cores' worth the ranks get (bench/bench_parallel.py
    times a decoder layer on every rank at once against the layer alone).
    """
    sizes = sorted(comm)
    hop = sum(comm[n]["latency"] / (2 * (n - 1)) for n in sizes) / len(sizes)
    bus = sum(comm[n]["bus_bandwidth"] for n in sizes) / len(sizes)
    sync = tuple((n, comm[n]["sync_cost"]) for n in sizes) if ranks > cores else ()
    return GPUSpec(name, memory=24e9, peak_flops=host["matmul_flops"],
                   hbm_bandwidth=host["copy_bandwidth"], intra_node_bandwidth=bus,
                   inter_node_bandwidth=bus, matmul_efficiency=1.0, comm_efficiency=1.0,
                   reserved=0, dtype_bytes=4, latency=hop, op_overhead=host["op_overhead"],
                   dtensor_overhead=host["dtensor_overhead"], sync_costs=sync, cores=cores)
