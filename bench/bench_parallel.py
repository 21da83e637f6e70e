"""3D-parallel layouts on this CPU: step time, tokens/s and peak memory of a small Llama trained
in each layout by a 4-rank Gloo world (one thread per rank), beside one process, and the
planner's estimate of the same layout on this machine's measured figures, with its split into
compute, host overhead, exposed communication and bubble.

    fastllm bench --ops parallel

The machine is measured first, alone (probes.measure_host: one-thread matmul
FLOP/s at a layer's shape, copy bandwidth, the host cost of an eager op and of a DTensor op; and
one transformers decoder layer's forward + backward, which sets the share of those bare rates a
real layer reaches), then Gloo's latency and bandwidth in the 4-rank world (measure_comm). The
machine is shared with other jobs whose load changes by the minute, so beside every layout (just
before and just after its steps) a short probe measures what the ranks get then: the cores'
share (one decoder layer's forward + backward with every rank busy, against the layer
alone) and the extra wait of a blocking collective when
ranks outnumber cores; the one process gets the same share probe. Nothing is fitted to any
layout's step time, the one process's included. Peak memory: the most bytes of tensor storage
a rank holds at once over two training steps (fastllm.train.memory.PeakMemory, DTensor shards
counted by their local tensors), against the planner's weights + gradients + optimizer state +
activations + pipeline buffers + backward workspace per GPU.
"""

import dataclasses
import statistics

import torch

# Gloo worlds of CPU processes: `fastllm bench --ops all --device cuda` leaves it out
DEVICES = ("cpu",)
WORLD = 4
STEPS = 8          # the first WARMUP are not timed
WARMUP = 3
MODEL = dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=2048)
SEQ, BATCH = 128, 8

# name -> (mesh shape, dim names, train kwargs, planner layout kwargs, copies side by side)
LAYOUTS = {
    "dp4": ((4,), ("dp",), {}, dict(dp=4), 1),
    "tp2 (x2 copies)": ((2, 2), ("rep", "tp"), {}, dict(tp=2), 2),
    "pp2 gpipe mb4 (x2 copies)": ((2, 2), ("rep", "pp"), {"schedule": "gpipe", "n_microbatches": 4},
                                  dict(pp=2, schedule="gpipe", micro_batch=2), 2),
    "pp2 1f1b mb4 (x2 copies)": ((2, 2), ("rep", "pp"), {"schedule": "1f1b", "n_microbatches": 4},
                                 dict(pp=2, schedule="1f1b", micro_batch=2), 2),
    "dp2 x tp2": ((1, 2, 2), ("pp", "dp", "tp"), {}, dict(dp=2, tp=2), 1),
    "pp2 x dp2 1f1b mb2": ((2, 2, 1), ("pp", "dp", "tp"), {"schedule": "1f1b", "n_microbatches": 2},
                           dict(pp=2, dp=2, schedule="1f1b", micro_batch=2), 1),
}


def settings(full=False, device="cpu"):
    """Checked by fastllm bench before any benchmark runs: the device (Gloo worlds of CPU
    processes), and the layouts train with the source tree's examples/parallel_train.py (not in
    a wheel)."""
    from fastllm.bench.harness import example_folder

    if torch.device(device).type not in DEVICES:
        raise SystemExit("fastllm bench --ops parallel: CPU processes in a Gloo world; run it "
                         "with --device cpu")
    example_folder("parallel_train")


def _train(mesh, kwargs, steps):
    from fastllm.bench.harness import example

    train = example("parallel_train").train
    return train(mesh=mesh, steps=steps, global_batch=BATCH, seq_len=SEQ, model_kwargs=MODEL,
                 **kwargs)


def _average(a, b):
    """The mean of two probes of the load ({n: {figure: value}})."""
    return {n: {k: (a[n][k] + b[n][k]) / 2 for k in a[n]} for n in a}


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fastllm.bench.probes import measure_comm, measure_peak_memory

    results = {"comm": measure_comm()}  # one thread per rank: fastllm.distributed.launch
    for name, (shape, names, kwargs, _, _) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        # the load other jobs put on the cores changes by the minute: probe the cores' share
        # and the collectives' wait just before and just after the layout's steps
        before = _probe()
        times = _train(mesh, kwargs, STEPS)["step_times"]
        after = _probe()
        # two steps: the second holds optimizer state, gradients and activations at once
        peak = measure_peak_memory(lambda: _train(mesh, kwargs, 2))
        results[name] = (times, peak, _average(before[0], after[0]),
                         (before[1] + after[1]) / 2)
    return results


def _layer_seconds(reps=10, best=True):
    """Forward + backward of one transformers LlamaDecoderLayer of MODEL at the one-process
    micro-batch (BATCH x SEQ tokens), one thread: the fastest of `reps` alone (best=True: what
    this machine's matmuls, attention and elementwise kernels reach on a real layer), or their
    median (best=False: with other ranks or jobs on the cores, what the rank gets now)."""
    from fastllm.bench.harness import example
    from fastllm.bench.probes import median_time

    tiny_llama = example("parallel_train").tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(**dict(MODEL, layers=1))
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    x = torch.randn(BATCH, SEQ, MODEL["hidden"], requires_grad=True)
    pos = torch.arange(SEQ).unsqueeze(0)
    pe = rotary(x, pos)

    def step():
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)[0].sum().backward()

    return median_time(step, reps=reps, warmup=1, best=best)


def _probe(reps=5):
    """The load now, every rank at once: the collectives' wait (measure_comm) and the seconds
    of one decoder layer's forward + backward (its ratio to the layer alone is the rank's share
    of a core: a layer outlasts the scheduler's time slice, a small matmul does not)."""
    import torch.distributed as dist

    from fastllm.bench.probes import measure_comm

    out = measure_comm(bandwidth=False, reps=15)
    dist.barrier()
    layer = torch.tensor(_layer_seconds(reps, best=False), dtype=torch.float64)
    dist.all_reduce(layer, op=dist.ReduceOp.MAX)
    return out, layer.item()


def layout_of(lo_kw):
    """The planner's Layout of a bench layout: parallelize() shards dp with FSDP2 (ZeRO-3)."""
    from fastllm.parallel.planner import Layout

    zero = 3 if lo_kw.get("dp", 1) > 1 else 0
    return Layout(**{"micro_batch": BATCH // lo_kw.get("dp", 1), "zero": zero, **lo_kw})


def tiny_spec():
    from fastllm.parallel.planner import ModelSpec

    m = MODEL
    return ModelSpec("tiny", m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["ffn"],
                     m["vocab"])


def predict(spec, lo_kw, copies=1, layers=None):
    """The planner's estimate for a bench layout on the measured machine `spec`.

    `copies` identical layouts side by side share the cores: each gets cores / copies."""
    from fastllm.parallel.planner import FASTLLM, estimate

    if copies > 1:
        spec = dataclasses.replace(spec, cores=spec.cores / copies)
    model = tiny_spec()
    if layers:
        model = dataclasses.replace(model, layers=layers)
    return estimate(model, layout_of(lo_kw), SEQ, BATCH, spec, node_size=WORLD,
                    dp_overlap=0.0, runtime=FASTLLM)


def run(device="cpu", full=False, progress=print):
    import os

    from fastllm.distributed.launch import spawn
    from fastllm.bench.probes import machine_spec, measure_host, measure_peak_memory

    settings(full, device)
    progress("parallel: measuring this machine (matmul, copy, op overheads, a layer) alone")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host = measure_host(MODEL["hidden"], MODEL["ffn"], SEQ * BATCH // 2)
        layer_s = _layer_seconds()
        # one process first, alone: inside the world the idle ranks would share its cores
        progress(f"parallel: one process, {STEPS} steps")
        before = _layer_seconds(5, best=False)
        single = _train(None, {}, STEPS)["step_times"]
        single_share = min(1.0, 2 * layer_s / (before + _layer_seconds(5, best=False)))
        single_peak = measure_peak_memory(lambda: _train(None, {}, 2))
    finally:
        torch.set_num_threads(threads)
    progress(f"parallel: {WORLD}-rank Gloo world: collectives, {len(LAYOUTS)} layouts")
    per_rank = spawn(_worker, WORLD, timeout=900)
    comm = per_rank[0]["comm"]
    raw = machine_spec(host, comm, WORLD, cores=WORLD)  # priced for one process only
    # One figure from the layer timed alone: the share of the bare matmul and copy rates that
    # a real decoder layer's forward + backward reaches (smaller and transposed matmuls,
    # attention, rotary, norms), applied to the whole model; the host-op part is priced apart.
    one = predict(raw, {})
    two = predict(raw, {}, layers=MODEL["layers"] + 1)
    planned_layer = (two["time_compute"] - one["time_compute"]) / one["micro_batches"]
    host_layer = (two["time_host"] - one["time_host"]) / one["micro_batches"]
    eff = (planned_layer - host_layer) / max(layer_s - host_layer, 1e-9)
    spec = dataclasses.replace(raw, matmul_efficiency=eff, hbm_bandwidth=raw.hbm_bandwidth * eff)
    cores = len(os.sched_getaffinity(0))
    model = tiny_spec()
    flops = 6 * model.params() * BATCH * SEQ  # per step, for TFLOP/s
    size = (f"Llama {model.params() / 1e6:.1f}M params, batch {BATCH} x {SEQ} tokens, fp32, "
            f"{WORLD} ranks on {cores} cores")
    # each layout priced on the machine as probed beside it: Gloo's bandwidth from the first
    # measurement, the cores' share, latency and collective wait from the probes
    specs = {"1 process": dataclasses.replace(spec, cores=single_share, sync_costs=())}
    for name in LAYOUTS:
        probe, probe_layer_s = per_rank[0][name][2:]
        merged = {n: {**comm[n], **probe[n]} for n in comm}
        share = min(1.0, layer_s / probe_layer_s)
        specs[name] = dataclasses.replace(
            machine_spec(host, merged, WORLD, cores=WORLD * share), matmul_efficiency=eff,
            hbm_bandwidth=raw.hbm_bandwidth * eff)
    rows = []
    cases = [("1 process", single, single_peak, {}, 1)]
    for name, (_, _, _, lo_kw, copies) in LAYOUTS.items():
        # the step is as slow as the slowest rank; memory as high as the highest
        times = [max(r[name][0][i] for r in per_rank) for i in range(STEPS)]
        cases.append((name, times, max(r[name][1] for r in per_rank), lo_kw, copies))
        progress(f"  {name}: peak MiB by rank " + ", ".join(
            f"{r[name][1] / 2**20:.1f}" for r in per_rank))
    for name, times, peak, lo_kw, copies in cases:
        t = statistics.median(times[WARMUP:])
        est = predict(specs[name], lo_kw, copies)
        exposed = (est["time_tp"] + est["time_pp_p2p"] + est["time_dp_exposed"]
                   + est["time_small_collectives"])
        mem = sum(est["memory"].values())
        note = (f"{name}: {BATCH * SEQ / t:,.0f} tokens/s; planner {1e3 * est['step_time']:.1f} ms "
                f"({100 * (est['step_time'] / t - 1):+.0f}%): compute "
                f"{1e3 * est['time_compute']:.1f} (host ops {1e3 * est['time_host']:.1f}), "
                f"exposed comm {1e3 * exposed:.1f}, bubble {1e3 * est['time_bubble']:.1f} ms"
                f"{', cores shared' if est['shared_cores'] else ''}; peak memory "
                f"{peak / 2**20:.1f} MiB, planner {mem / 2**20:.1f} MiB "
                f"({100 * (mem / peak - 1):+.0f}%); probed beside it: {specs[name].cores:.2f} "
                f"cores' worth, collective wait " + (", ".join(
                    f"+{1e6 * c:.0f} us ({n} ranks)" for n, c in specs[name].sync_costs)
                    or "none counted"))
        rows.append({"op": "parallel", "size": size, "provider": name, "time_ms": 1e3 * t,
                     "flops": flops, "baseline": "1 process", "note": note,
                     "tokens_per_s": BATCH * SEQ / t, "planner_ms": 1e3 * est["step_time"],
                     "peak_bytes": peak, "planner_bytes": mem,
                     "cores": specs[name].cores, "sync_costs": specs[name].sync_costs,
                     "planner_split_ms": {k: 1e3 * est[k] for k in (
                         "time_compute", "time_host", "time_tp", "time_pp_p2p",
                         "time_dp_exposed", "time_small_collectives", "time_bubble",
                         "time_optimizer")}})
    rows[0]["note"] += (
        f" | calibration: one decoder layer's forward + backward, timed alone "
        f"({1e3 * layer_s:.1f} ms), reaches {100 * eff:.0f}% of the bare rates"
        f" | measured: matmul {spec.peak_flops / 1e9:.0f} GFLOP/s/thread, copy "
        f"{spec.hbm_bandwidth / 1e9:.1f} GB/s, eager op {1e6 * spec.op_overhead:.1f} us, DTensor "
        f"op +{1e6 * spec.dtensor_overhead:.1f} us, Gloo " + ", ".join(
            f"{n} ranks: {1e6 * c['latency']:.0f} us + {c['bus_bandwidth'] / 1e9:.2f} GB/s bus, "
            f"+{1e6 * c['sync_cost']:.0f} us a collective with cores shared"
            for n, c in sorted(comm.items())))
    return rows
