"""Shared benchmark harness: timing, the machine's measured memory bandwidth, result rows.

A result row is a dict:
    op        str    the op, e.g. "adamw"
    size      str    the case, human readable, e.g. "64M params / 16 tensors"
    provider  str    who did the work, e.g. "fastllm (cpp)", "torch fused"
    time_ms   float  median time of one call
    bytes     int    optional: bytes the work must move at least (for GB/s and % of bandwidth)
    flops     int    optional: floating-point operations (for TFLOP/s)
    baseline  str    optional: provider of the same (op, size) to report a time ratio against
    note      str    optional
Timings are medians over repeated calls after warm-up; tests never assert on them.
"""

import dataclasses
import os
import statistics
import time

import torch

from fastllm import _extension


@dataclasses.dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(fn, *, device="cpu", warmup=2, min_reps=5, max_reps=200, min_time_s=0.4):
    """Time fn() (which must leave its work finished or queued on `device`'s current stream).

    Runs `warmup` untimed calls, then at least `min_reps` and until `min_time_s` has passed (at
    most `max_reps`). CPU calls are timed with perf_counter, CUDA calls with CUDA events.
    """
    is_cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time_s):
        if is_cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], len(times))


def measure_many(fns, *, device="cpu", warmup=2, min_reps=7, max_reps=100, min_time_s=1.0):
    """Time several callables in interleaved rounds (a, b, c, a, b, c, ...).

    On a shared or noisy machine the speed of memory drifts over seconds; interleaving exposes
    every provider to the same drift, so their ratios stay meaningful. Returns {name: Timing}.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times = {name: [] for name in fns}
    start = time.perf_counter()
    reps = 0
    while reps < max_reps and (reps < min_reps or time.perf_counter() - start < min_time_s):
        for name, fn in fns.items():
            times[name].append(measure(fn, device=device, warmup=0, min_reps=1, max_reps=1,
                                       min_time_s=0.0).median_ms)
        reps += 1
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=5) if len(ts) >= 2 else [ts[0]] * 4
        out[name] = Timing(statistics.median(ts), q[0], q[3], len(ts))
    return out


_BANDWIDTH = {}


def memory_bandwidth(device="cpu", numel=None):
    """The memory bandwidth this machine reaches with PyTorch's own streaming kernels, in GB/s.

    Returns {"copy": ..., "rmw": ...}: `copy` is dst.copy_(src) counted as 8 bytes per fp32
    element (the usual convention; write-allocate traffic not counted), `rmw` is the best of the
    read-modify-write kernels x.mul_(s) (8 B/elem), x.add_(y) (12 B/elem) and, on the CPU,
    fastllm._C's stream probe with an optimizer step's pattern (3 arrays read and written back, 1
    only read: 28 B/elem, parallelised like the fused kernels). Written tensors are all read
    first, as in an optimizer step. Arrays are far larger than the last-level cache. Measured once
    per process and device.
    """
    key = str(torch.device(device))
    if key in _BANDWIDTH:
        return _BANDWIDTH[key]
    if numel is None:
        numel = (256 << 20) if torch.device(device).type == "cuda" else (64 << 20)
    x = torch.rand(numel, device=device)
    y = torch.rand(numel, device=device)
    nbytes = numel * 4
    copy = measure(lambda: y.copy_(x), device=device)
    mul = measure(lambda: x.mul_(0.999), device=device)
    add = measure(lambda: x.add_(y), device=device)
    rmw = [2 * nbytes / mul.median_ms / 1e6, 3 * nbytes / add.median_ms / 1e6]
    probe = getattr(_extension.extension(), "stream_probe_cpu", None)
    if probe is not None and torch.device(device).type == "cpu":
        z, w = torch.rand(numel), torch.rand(numel)
        timing = measure(lambda: probe([x, z, w], [y]), device=device)
        rmw.append(7 * nbytes / timing.median_ms / 1e6)
        del z, w
    result = {"copy": 2 * nbytes / copy.median_ms / 1e6, "rmw": max(rmw)}
    del x, y
    _BANDWIDTH[key] = result
    return result


def machine_description(device="cpu"):
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, torch {torch.__version__}"


def annotate(rows, bandwidth):
    """Add GB/s, % of measured bandwidth and the ratio to each row's baseline (in place)."""
    by_key = {(r["op"], r["size"], r["provider"]): r for r in rows}
    for r in rows:
        nbytes = r.get("bytes")
        if nbytes:
            gbps = nbytes / r["time_ms"] / 1e6
            r["gbps"] = gbps
            r["pct_copy_bw"] = 100.0 * gbps / bandwidth["copy"]
            r["pct_rmw_bw"] = 100.0 * gbps / bandwidth["rmw"]
        if r.get("flops"):
            r["tflops"] = r["flops"] / r["time_ms"] / 1e9
        base = by_key.get((r["op"], r["size"], r.get("baseline")))
        if base is not None:
            r["ratio_to_baseline"] = r["time_ms"] / base["time_ms"]
    return rows


def format_table(rows):
    headers = ["op", "size", "provider", "time ms", "GB/s", "% copy bw", "% rmw bw",
               "TFLOP/s", "x baseline", "note"]

    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    lines = []
    for r in rows:
        ratio = r.get("ratio_to_baseline")
        lines.append([
            r["op"], r["size"], r["provider"], fmt(r["time_ms"], ".3f"), fmt(r.get("gbps"), ".1f"),
            fmt(r.get("pct_copy_bw"), ".0f"), fmt(r.get("pct_rmw_bw"), ".0f"),
            fmt(r.get("tflops"), ".2f"),
            "" if ratio is None else f"{ratio:.2f} vs {r['baseline']}",
            r.get("note") or "",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(headers)]
    out = [" | ".join(h.ljust(w) for h, w in zip(headers, widths))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def plot(rows, path, title):
    """A bar chart of time per provider for each (op, size), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["op"], r["size"]) for r in rows))
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 1.2 + 0.45 * len(rows)), squeeze=False)
    for ax, (op, size) in zip(axes[:, 0], cases):
        sub = [r for r in rows if (r["op"], r["size"]) == (op, size)]
        labels = [r["provider"] for r in sub]
        times = [r["time_ms"] for r in sub]
        bars = ax.barh(labels, times, color=["tab:green" if l.startswith("fastllm") else "tab:gray"
                                             for l in labels])
        ax.bar_label(bars, [f"{t:.2f} ms" for t in times], fontsize=8)
        ax.set_title(f"{op}: {size}", fontsize=9)
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
        ax.set_xlabel("time per call (ms, lower is better)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
