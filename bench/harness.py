"""Shared benchmark harness: interleaved timing, the memory probe, result rows and the table.

A result row is a dict:
    op        str    the op, e.g. "adamw"
    size      str    the case, human readable, e.g. "64M params / 16 tensors"
    provider  str    who did the work, e.g. "fastllm (cpp)", "torch fused", PROBE
    time_ms   float  median time of one call
    bytes     int    optional: bytes the work must move at least (for GB/s and % of the ceiling)
    flops     int    optional: floating-point operations (for TFLOP/s)
    baseline  str    optional: provider of the same (op, size) to report a time ratio against
    probe     bool   optional: this row is the memory probe, timed in the same interleaved rounds
    note      str    optional: printed below the table, not in it
`annotate` adds gbps, tflops, ratio_to_baseline and, in cases with a probe row, ceiling_gbps,
ceiling_by and pct_ceiling. Timings are medians over repeated calls after warm-up; tests never
assert on them.
"""

import dataclasses
import os
import statistics
import textwrap
import time

import torch

from fastllm import _extension

PROBE = "memory probe"

# What "% ceiling" means, printed under the table by `fastllm bench`.
LEGEND = (
    "% ceiling: GB/s over the fastest GB/s reached in the same interleaved rounds by the memory "
    "probe or by any provider of that case, so it cannot pass 100% when the machine's speed "
    "drifts; a provider at 100% beat the probe. The probe streams the same bytes with an "
    "optimizer step's pattern and no arithmetic (CPU: fastllm._C.stream_probe_cpu, 3 arrays read "
    "and written back + 1 read, parallelised like the fused kernels; GPU or no extension: "
    "torch's x.add_(y)). x base: time over the baseline's time (below 1 is faster)."
)


@dataclasses.dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(fn, *, device="cpu", warmup=2, min_reps=5, max_reps=200, min_time_s=0.4,
            queue_ahead_ms=0.0):
    """Time fn() (which must leave its work finished or queued on `device`'s current stream).

    Runs `warmup` untimed calls, then at least `min_reps` and until `min_time_s` has passed (at
    most `max_reps`). CPU calls are timed with perf_counter, CUDA calls with CUDA events: by
    default from an idle GPU, so the host's launch cost counts (an optimizer step's host cost is
    part of its time); with queue_ahead_ms the GPU first spins that long, the host enqueues fn()
    meanwhile, and the events time the GPU's work alone (a kernel's time, as in a training step
    whose host runs ahead), as long as fn's host part takes less than queue_ahead_ms.
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
            spun = None
            if queue_ahead_ms:
                spun = _gpu_spin(queue_ahead_ms)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
            if spun is not None:
                _spun(*spun, begin)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], len(times))


_SPIN_CYCLES_PER_MS = []


def _gpu_spin(ms):
    """Keep the current CUDA stream busy for about `ms` (torch.cuda._sleep counts clock cycles).
    Returns (start event, cycles) for _spun, which measures the spin and corrects the rate: the
    SM clock rises from idle (345 MHz on the H200) to boost (1980 MHz) under load, so a rate
    measured once on an idle GPU made the spins ~6x shorter than asked (2026-12-04: 3 ms asked,
    ~0.5 ms spun, and every queued-ahead row timed the host instead of the GPU)."""
    if not _SPIN_CYCLES_PER_MS:
        _SPIN_CYCLES_PER_MS.append(2_000_000.0)  # a 2 GHz guess, corrected after each spin
    cycles = int(ms * _SPIN_CYCLES_PER_MS[0])
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    return start, cycles


def _spun(start, cycles, end):
    """After `end` (recorded right after the spin) completed: the rate the spin ran at. The next
    spin takes the highest rate seen (the boost clock; from the 2 GHz guess up), so that it is
    never shorter than asked, only longer while the clock is still rising."""
    rate = cycles / max(start.elapsed_time(end), 1e-3)
    _SPIN_CYCLES_PER_MS[0] = max(_SPIN_CYCLES_PER_MS[0], rate)


def measure_many(fns, *, device="cpu", warmup=2, min_reps=7, max_reps=100, min_time_s=1.0,
                 queue_ahead_ms=0.0):
    """Time several callables in interleaved rounds (a, b, c, a, b, c, ...).

    On a shared or noisy machine the speed of memory drifts over seconds; interleaving exposes
    every provider (and the memory probe) to the same drift, so their ratios stay meaningful.
    Returns {name: Timing}.
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
                                       min_time_s=0.0, queue_ahead_ms=queue_ahead_ms).median_ms)
        reps += 1
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=5) if len(ts) >= 2 else [ts[0]] * 4
        out[name] = Timing(statistics.median(ts), q[0], q[3], len(ts))
    return out


def memory_probe(nbytes, device="cpu"):
    """(fn, moved): fn() streams about `nbytes` through memory with no arithmetic to speak of.

    Put fn among the providers of `measure_many` and add a row with provider=PROBE, probe=True
    and bytes=moved: its GB/s, measured in the same rounds, is the ceiling those providers are
    reported against. On the CPU with fastllm._C it is the C++ stream probe with an optimizer
    step's pattern (3 fp32 arrays read and written back, 1 only read: 28 B/element, one pass,
    parallelised like the fused kernels); elsewhere PyTorch's x.add_(y) (12 B/element). Its
    arrays are allocated here and take about 2/3 of `nbytes` of memory.
    """
    dev = torch.device(device)
    probe = getattr(_extension.extension(), "stream_probe_cpu", None) if dev.type == "cpu" else None
    if probe is not None:
        numel = max(1, nbytes // 28)
        read_write = [torch.rand(numel) for _ in range(3)]
        read_only = [torch.rand(numel)]
        return (lambda: probe(read_write, read_only)), 28 * numel
    numel = max(1, nbytes // 12)
    x = torch.rand(numel, device=dev)
    y = torch.rand(numel, device=dev)
    return (lambda: x.add_(y)), 12 * numel


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


def _cases(rows):
    cases = {}
    for r in rows:
        cases.setdefault((r["op"], r["size"]), []).append(r)
    return cases


def annotate(rows):
    """Add GB/s, TFLOP/s, the ratio to each row's baseline and % of the ceiling (in place).

    The ceiling of a case is the highest GB/s among its rows, the probe's included, all timed in
    the same interleaved rounds: a fraction of it is at most 100% by construction, and it is only
    given in cases that have a probe row (without one it would only rank the providers).
    """
    for case in _cases(rows).values():
        # a row without a time (a provider that failed, a peer not installed) gets nothing
        by_provider = {r["provider"]: r for r in case if r.get("time_ms")}
        for r in case:
            if not r.get("time_ms"):
                continue
            if r.get("bytes"):
                r["gbps"] = r["bytes"] / r["time_ms"] / 1e6
            if r.get("flops"):
                r["tflops"] = r["flops"] / r["time_ms"] / 1e9
            base = by_provider.get(r.get("baseline"))
            if base is not None and not r.get("probe"):
                r["ratio_to_baseline"] = r["time_ms"] / base["time_ms"]
        if not any(r.get("probe") for r in case):
            continue
        measured = [r for r in case if "gbps" in r]
        top = max(measured, key=lambda r: r["gbps"])
        for r in measured:
            r["ceiling_gbps"] = top["gbps"]
            r["ceiling_by"] = top["provider"]
            r["pct_ceiling"] = 100.0 * r["gbps"] / top["gbps"]
    return rows


def format_table(rows, width=120):
    """The rows as text, one block per (op, size): a heading line, one line per provider with
    only the columns that case has (time, GB/s, % ceiling, TFLOP/s, x baseline), then its notes.
    No line is wider than `width` unless a single word is."""
    columns = [  # (header, key, format)
        ("time ms", "time_ms", ".3f"),
        ("GB/s", "gbps", ".1f"),
        ("% ceiling", "pct_ceiling", ".0f"),
        ("TFLOP/s", "tflops", ".2f"),
        ("x base", "ratio_to_baseline", ".2f"),
    ]
    wrap = textwrap.TextWrapper(width=width, subsequent_indent="    ", break_on_hyphens=False)
    out = []
    for (op, size), case in _cases(rows).items():
        if out:
            out.append("")
        baselines = {r["baseline"] for r in case if r.get("ratio_to_baseline") is not None}
        heading = f"{op}: {size}"
        if len(baselines) == 1:
            heading += f" (x base: time over {baselines.pop()}'s)"
        out += wrap.wrap(heading)
        present = [c for c in columns if any(r.get(c[1]) is not None for r in case)]
        name_w = min(max(len("provider"), *(len(r["provider"]) for r in case)),
                     max(16, width - 2 - sum(len(h) + 2 for h, _, _ in present)))
        cells = [[format(r[key], spec) if r.get(key) is not None else "" for _, key, spec in present]
                 for r in case]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(present)]
        out.append(("  " + "provider".ljust(name_w) + "".join(
            "  " + h.rjust(w) for (h, _, _), w in zip(present, widths))).rstrip())
        for r, row in zip(case, cells):
            name = r["provider"] if len(r["provider"]) <= name_w else r["provider"][:name_w - 1] + "~"
            out.append(("  " + name.ljust(name_w) + "".join(
                "  " + c.rjust(w) for c, w in zip(row, widths))).rstrip())
        for r in case:
            if r.get("note"):
                out += textwrap.wrap(f"{r['provider']}: {r['note']}", width=width,
                                     initial_indent="  - ", subsequent_indent="    ",
                                     break_on_hyphens=False)
    return "\n".join(out)


def note(progress, message):
    """Report `message` (a provider skipped, a peer that failed, an op that does not run on this
    device) so that it stays: `fastllm bench`'s progress.note ends the line on a terminal, where
    progress lines are rewritten in place, and lists it under the table; any other progress
    callable (print, a list's append) just gets the message."""
    getattr(progress, "note", progress)(message)


def plot(rows, path, title):
    """A bar chart of time per provider for each (op, size), saved as PNG at `path` (whatever
    its suffix). Rows without a time (a memory figure, a failed provider) are left out, and so
    are cases with none. Returns the number of cases drawn; with none, nothing is written."""
    timed = [r for r in rows if r.get("time_ms") is not None]
    if not timed:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["op"], r["size"]) for r in timed))
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 1.2 + 0.45 * len(timed)), squeeze=False)
    for ax, (op, size) in zip(axes[:, 0], cases):
        sub = [r for r in timed if (r["op"], r["size"]) == (op, size)]
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
    # format given: the file is `path` itself (without it, a name with no suffix gets ".png")
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return len(cases)


def example_folder(name):
    """The source tree's examples/ folder, holding <name>.py; SystemExit when it is not there (a
    wheel install ships no examples/): benchmarks that need one check it in settings(), before
    any benchmark runs."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if not os.path.isfile(os.path.join(folder, f"{name}.py")):
        raise SystemExit(f"fastllm bench: needs examples/{name}.py from fastllm's source tree "
                         f"(an editable install: pip install -e .), not found in {folder}")
    return folder


def example(name):
    """The module examples/<name>.py of the source tree (the benchmarks of training loops run
    the examples' loops); its folder joins sys.path so spawned ranks import it too."""
    import importlib
    import sys

    folder = example_folder(name)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def allocator_peak_bytes(fn):
    """Peak bytes the CPU allocator held during fn() beyond what it held before: every
    allocation, those inside C++ kernels included (which a TorchDispatchMode such as
    fastllm/train/memory.py's PeakMemory does not see), from the torch profiler's allocation
    events and the running total each carries."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            f = node.extra_fields
            allocs.append((node.start_time_ns, f.total_allocated, f.alloc_size))
        stack.extend(node.children)
    if not allocs:
        return 0
    allocs.sort()
    start = allocs[0][1] - allocs[0][2]
    return max(total for _, total, _ in allocs) - start
