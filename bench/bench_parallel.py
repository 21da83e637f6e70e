"""3D-parallel layouts on this CPU: step time and tokens/s of a small Llama trained in each
layout by a 4-rank Gloo world (one thread per rank), beside one process, and the planner's
estimate of the same layout from this machine's measured matmul rate, memory bandwidth and
Gloo all-reduce bandwidth, with its split into compute, exposed communication and bubble.

    fastllm bench --ops parallel
"""

import dataclasses
import os
import pickle
import socket
import statistics
import tempfile
import time

import torch

WORLD = 4
STEPS = 8          # the first WARMUP are not timed
WARMUP = 3
MODEL = dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=2048)
SEQ, BATCH = 128, 8

# name -> (mesh shape, dim names, train kwargs, planner layout kwargs)
LAYOUTS = {
    "dp4": ((4,), ("dp",), {}, dict(dp=4)),
    "tp2 (x2 copies)": ((2, 2), ("rep", "tp"), {}, dict(tp=2)),
    "pp2 gpipe mb4 (x2 copies)": ((2, 2), ("rep", "pp"), {"schedule": "gpipe", "n_microbatches": 4},
                                  dict(pp=2, schedule="gpipe", micro_batch=2)),
    "pp2 1f1b mb4 (x2 copies)": ((2, 2), ("rep", "pp"), {"schedule": "1f1b", "n_microbatches": 4},
                                 dict(pp=2, schedule="1f1b", micro_batch=2)),
    "dp2 x tp2": ((1, 2, 2), ("pp", "dp", "tp"), {}, dict(dp=2, tp=2)),
    "pp2 x dp2 1f1b mb2": ((2, 2, 1), ("pp", "dp", "tp"), {"schedule": "1f1b", "n_microbatches": 2},
                           dict(pp=2, dp=2, schedule="1f1b", micro_batch=2)),
}


def _gloo_bandwidth(group=None, nbytes=8 << 20, reps=5):
    """Bus bandwidth (bytes/s) of a Gloo all-reduce and the latency of a tiny one (s)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    x = torch.ones(nbytes // 4)
    small = torch.ones(1)
    for _ in range(2):
        dist.all_reduce(x, group=group)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x, group=group)
    t_big = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(small, group=group)
    t_small = (time.perf_counter() - t0) / 20
    return 2 * (n - 1) / n * nbytes / t_big, t_small / (2 * (n - 1))


def _worker(rank, port, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fastllm.parallel.run import train

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    try:
        results["gloo"] = _gloo_bandwidth()
        for name, (shape, names, kwargs, _) in LAYOUTS.items():
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            results[name] = train(mesh=mesh, steps=STEPS, global_batch=BATCH, seq_len=SEQ,
                                  model_kwargs=MODEL, **kwargs)["step_times"]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_cpu_spec(latency, bus_bandwidth, ranks_per_core):
    """This machine as a GPUSpec for the planner: fp32 matmul FLOP/s and copy bandwidth of one
    thread, shared by the ranks on a core; Gloo's bus bandwidth and per-hop latency."""
    from fastllm.parallel.planner import GPUSpec

    torch.set_num_threads(1)
    a = torch.randn(SEQ * BATCH // 2, MODEL["hidden"])
    b = torch.randn(MODEL["hidden"], MODEL["ffn"])
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1] * 20 / (time.perf_counter() - t0)
    x = torch.empty(16 << 20)
    y = torch.empty_like(x)
    y.copy_(x)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    copy = 2 * x.numel() * 4 * 5 / (time.perf_counter() - t0)
    return GPUSpec("cpu", 24e9, flops / ranks_per_core, copy / ranks_per_core,
                   bus_bandwidth, bus_bandwidth, matmul_efficiency=1.0, comm_efficiency=1.0,
                   reserved=0, dtype_bytes=4, latency=latency)


def run(device="cpu", full=False, progress=print):
    import torch.multiprocessing as mp

    from fastllm.parallel.planner import Layout, ModelSpec, estimate

    if device != "cpu":
        return []
    from fastllm.parallel.run import train

    # one process first, alone: inside the world the idle ranks would share its cores
    progress(f"parallel: one process, {STEPS} steps")
    torch.set_num_threads(1)
    single = train(steps=STEPS, global_batch=BATCH, seq_len=SEQ, model_kwargs=MODEL)["step_times"]
    progress(f"parallel: {WORLD}-rank Gloo world, {len(LAYOUTS)} layouts")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "bench.pkl")
        mp.start_processes(_worker, args=(_free_port(), out_path), nprocs=WORLD,
                           start_method="spawn")  # joins; raises if a rank failed
        with open(out_path, "rb") as f:
            results = pickle.load(f)
    bus, latency = results.pop("gloo")
    cores = len(os.sched_getaffinity(0))
    m = MODEL
    model = ModelSpec("tiny", m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["ffn"],
                      m["vocab"])
    # One calibration: the compute rate the one-process step reaches over the bare matmul's
    # (Python, elementwise and attention overheads); every layout is then predicted from it.
    raw = measure_cpu_spec(latency, bus, 1)
    t_single = statistics.median(single[WARMUP:])
    pred = estimate(model, Layout(micro_batch=BATCH), SEQ, BATCH, raw, node_size=WORLD)
    eff = pred["step_time"] / t_single
    spec1 = dataclasses.replace(raw, matmul_efficiency=eff, hbm_bandwidth=raw.hbm_bandwidth * eff)
    flops = 6 * model.params() * BATCH * SEQ  # per step, for TFLOP/s
    size = (f"Llama {model.params() / 1e6:.1f}M params, batch {BATCH} x {SEQ} tokens, fp32, "
            f"{WORLD} ranks on {cores} cores")
    rows = []
    for name, times, lo_kw in [("1 process", single, {})] + [
            (k, results[k], LAYOUTS[k][3]) for k in LAYOUTS]:
        t = statistics.median(times[WARMUP:])
        # parallelize() shards over dp with FSDP2: ZeRO-3
        zero = 3 if lo_kw.get("dp", 1) > 1 else 0
        lo = Layout(**{"micro_batch": BATCH // lo_kw.get("dp", 1), "zero": zero, **lo_kw})
        est = estimate(model, lo, SEQ, BATCH, spec1, node_size=WORLD, dp_overlap=0.0)
        # More ranks than cores: a rank waiting in a collective or a bubble leaves its core to
        # another, so the step is the longer of the critical path at a full core's speed and
        # all ranks' compute shared out over the cores.
        n = 1 if name == "1 process" else WORLD
        busy = est["time_compute"] + est["time_optimizer"]
        contended = n * busy / cores + est["time_tp"] + est["time_pp_p2p"] + est["time_dp_exposed"]
        est["step_time"] = max(est["step_time"], contended)
        note = (f"{name}: {BATCH * SEQ / t:,.0f} tokens/s; planner {1e3 * est['step_time']:.1f} ms "
                f"({100 * (est['step_time'] / t - 1):+.0f}%): compute "
                f"{1e3 * est['time_compute']:.1f}, exposed comm "
                f"{1e3 * (est['time_tp'] + est['time_pp_p2p'] + est['time_dp_exposed']):.1f}, "
                f"bubble {1e3 * est['time_bubble']:.1f} ms")
        rows.append({"op": "parallel", "size": size, "provider": name, "time_ms": 1e3 * t,
                     "flops": flops, "baseline": "1 process", "note": note,
                     "tokens_per_s": BATCH * SEQ / t, "planner_ms": 1e3 * est["step_time"],
                     "planner_split_ms": {k: 1e3 * est[k] for k in (
                         "time_compute", "time_tp", "time_pp_p2p", "time_dp_exposed",
                         "time_bubble", "time_optimizer")}})
    rows[0]["note"] += (f" | measured: matmul {raw.peak_flops / 1e9:.0f} GFLOP/s/thread, copy "
                        f"{raw.hbm_bandwidth / 1e9:.1f} GB/s, Gloo bus {bus / 1e9:.2f} GB/s, "
                        f"hop latency {1e6 * latency:.0f} us; the one-process step reaches "
                        f"{100 * eff:.0f}% of the bare matmul rate (the planner's calibration)")
    return rows
