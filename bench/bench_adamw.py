"""AdamW step: fastllm against torch.optim.AdamW (fused, foreach) and DeepSpeed's CPU Adam.

Bytes per parameter: read param, grad, exp_avg, exp_avg_sq (16) and write param, exp_avg,
exp_avg_sq (12) = 28 for fp32 (36 with amsgrad's max_exp_avg_sq).

    fastllm bench --ops adamw            # the CLI (prints the table)
    pytest bench/bench_adamw.py --benchmark-only
"""

import gc

import pytest
import torch

import fastllm
from fastllm.bench import harness

# (total params, tensors, amsgrad)
QUICK = [(4 << 20, 16, False), (64 << 20, 16, False)]
FULL = QUICK + [(64 << 20, 16, True), (256 << 20, 64, False), (64 << 20, 1024, False)]
PROBE = "memory probe (same access pattern)"
GPU = [(64 << 20, 16, False), (256 << 20, 64, False), (64 << 20, 1024, False)]


def _params(total, n_tensors, device):
    sizes = [total // n_tensors] * n_tensors
    sizes[-1] += total - sum(sizes)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=device) * 0.02)
        p.grad = torch.randn(n, device=device) * 1e-3
        params.append(p)
    return params


def _deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its op cannot be built here
        return None
    return DeepSpeedCPUAdam


def _providers(device, amsgrad):
    dev = torch.device(device).type
    out = []
    if dev == "cpu":
        out.append(("fastllm (cpp)", lambda ps: fastllm.optim.AdamW(ps, amsgrad=amsgrad), "cpp"))
    else:
        out.append(("fastllm (cuda)", lambda ps: fastllm.optim.AdamW(ps, amsgrad=amsgrad), "cuda"))
        out.append(("fastllm (triton)", lambda ps: fastllm.optim.AdamW(ps, amsgrad=amsgrad),
                    "triton"))
    out.append(("torch fused", lambda ps: torch.optim.AdamW(ps, amsgrad=amsgrad, fused=True), None))
    out.append(("torch foreach", lambda ps: torch.optim.AdamW(ps, amsgrad=amsgrad, foreach=True),
                None))
    ds = _deepspeed_adam() if dev == "cpu" and not amsgrad else None
    if ds is not None:
        out.append(("deepspeed cpu_adam",
                    lambda ps: ds(ps, adamw_mode=True, fp32_optimizer_states=True), None))
    return out


def _probe(total, device):
    """The same access pattern without the arithmetic (fastllm._C's stream probe), CPU only."""
    probe = getattr(fastllm._extension.extension(), "stream_probe_cpu", None)
    if probe is None or torch.device(device).type != "cpu":
        return None
    rw = [torch.rand(total) for _ in range(3)]
    ro = [torch.rand(total)]
    return lambda: probe(rw, ro)


def run(device="cpu", full=False, progress=print):
    cases = GPU if torch.device(device).type == "cuda" else (FULL if full else QUICK)
    rows = []
    for total, n_tensors, amsgrad in cases:
        size = f"{total / 2**20:g}M fp32 params / {n_tensors} tensors" + (" amsgrad" if amsgrad else "")
        params = _params(total, n_tensors, device)
        nbytes = total * 4 * (9 if amsgrad else 7)
        fns = {}
        for name, make, backend in _providers(device, amsgrad):
            try:
                opt = make(params)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                progress(f"  skipped {name}: {exc}")
                continue

            def step(opt=opt, backend=backend):
                with fastllm.use_backend(backend):
                    opt.step()

            fns[name] = step
        probe = None if amsgrad else _probe(total, device)
        if probe is not None:
            fns[PROBE] = probe
        progress(f"adamw {size}: {', '.join(fns)} (interleaved)")
        timings = harness.measure_many(fns, device=device)
        for name, timing in timings.items():
            rows.append(dict(op="adamw", size=size, provider=name, time_ms=timing.median_ms,
                             bytes=nbytes, baseline="torch fused"))
        if PROBE in timings:
            for row in rows[-len(timings):]:
                if row["provider"].startswith("fastllm"):
                    share = 100.0 * timings[PROBE].median_ms / row["time_ms"]
                    row["note"] = f"{share:.0f}% of the probe's bandwidth"
        del fns, params
        gc.collect()
    return rows


@pytest.mark.parametrize("provider", ["fastllm", "torch fused", "torch foreach"])
def test_adamw_step(benchmark, provider):
    params = _params(1 << 20, 8, "cpu")
    opt = {
        "fastllm": lambda: fastllm.optim.AdamW(params),
        "torch fused": lambda: torch.optim.AdamW(params, fused=True),
        "torch foreach": lambda: torch.optim.AdamW(params, foreach=True),
    }[provider]()
    benchmark(opt.step)
