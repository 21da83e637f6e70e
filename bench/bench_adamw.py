"""AdamW step: fastllm against torch.optim.AdamW (fused, foreach) and DeepSpeed's CPU Adam.

Bytes per parameter: read param, grad, exp_avg, exp_avg_sq (16) and write param, exp_avg,
exp_avg_sq (12) = 28 for fp32 (36 with amsgrad's max_exp_avg_sq). The memory probe streams the
same bytes in the same interleaved rounds (harness.memory_probe): the ceiling of "% ceiling".

    fastllm bench --ops adamw            # the CLI (prints the table)
    pytest bench/test_benchmarks.py --benchmark-only -k adamw_step
"""

import gc
import importlib.util
import os

import torch

import fastllm
from fastllm.bench import harness

# (total params, tensors, amsgrad)
QUICK = [(4 << 20, 16, False), (64 << 20, 16, False)]
FULL = QUICK + [(64 << 20, 16, True), (256 << 20, 64, False), (64 << 20, 1024, False)]
GPU = [(64 << 20, 16, False), (256 << 20, 64, False), (64 << 20, 1024, False)]

_DEEPSPEED_ANNOUNCED = False
# The decay every provider applies: torch.optim.AdamW's and fastllm.optim.AdamW's default.
WEIGHT_DECAY = 1e-2


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


def _deepspeed_cpu_adam_built():
    """Whether DeepSpeed's cpu_adam op is prebuilt or in torch's JIT cache (so constructing
    DeepSpeedCPUAdam only loads it); False when that cannot be told."""
    try:
        if importlib.util.find_spec("deepspeed.ops.adam.cpu_adam_op") is not None:
            return True
        from torch.utils.cpp_extension import _get_build_directory

        return os.path.exists(os.path.join(_get_build_directory("cpu_adam", False), "cpu_adam.so"))
    except Exception:
        return False


def _make_deepspeed(cls, progress):
    def make(params):
        global _DEEPSPEED_ANNOUNCED
        # The first DeepSpeedCPUAdam of a process JIT-compiles its C++ op (about a minute on two
        # cores) unless it is cached: say so rather than leave the previous line on screen.
        if not _DEEPSPEED_ANNOUNCED:
            _DEEPSPEED_ANNOUNCED = True
            if _deepspeed_cpu_adam_built():
                progress("loading DeepSpeed CPUAdam (built earlier)")
            else:
                progress("building DeepSpeed CPUAdam (first use, ~60 s)")
        # DeepSpeedCPUAdam's own default is weight_decay=0: without this it would skip the decay
        # the other rows of the table do.
        return cls(params, weight_decay=WEIGHT_DECAY, adamw_mode=True,
                   fp32_optimizer_states=True)

    return make


def _providers(device, amsgrad, progress):
    dev = torch.device(device).type
    hyper = dict(amsgrad=amsgrad, weight_decay=WEIGHT_DECAY)
    out = []
    if dev == "cpu":
        out.append(("fastllm (cpp)", lambda ps: fastllm.optim.AdamW(ps, **hyper), "cpp"))
    else:
        out.append(("fastllm (cuda)", lambda ps: fastllm.optim.AdamW(ps, **hyper), "cuda"))
        out.append(("fastllm (triton)", lambda ps: fastllm.optim.AdamW(ps, **hyper), "triton"))
    out.append(("torch fused", lambda ps: torch.optim.AdamW(ps, fused=True, **hyper), None))
    out.append(("torch foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper), None))
    ds = _deepspeed_adam() if dev == "cpu" and not amsgrad else None
    if ds is not None:
        out.append(("deepspeed cpu_adam", _make_deepspeed(ds, progress), None))
    return out


def run(device="cpu", full=False, progress=print):
    cases = GPU if torch.device(device).type == "cuda" else (FULL if full else QUICK)
    rows = []
    for total, n_tensors, amsgrad in cases:
        size = f"{total / 2**20:g}M fp32 params / {n_tensors} tensors" + (
            " amsgrad" if amsgrad else "")
        params = _params(total, n_tensors, device)
        nbytes = total * 4 * (9 if amsgrad else 7)
        fns = {}
        for name, make, backend in _providers(device, amsgrad, progress):
            try:
                opt = make(params)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                harness.note(progress, f"adamw {size}: skipped {name}: {exc}")
                continue

            def step(opt=opt, backend=backend):
                with fastllm.use_backend(backend):
                    opt.step()

            fns[name] = step
        fns[harness.PROBE], probe_bytes = harness.memory_probe(nbytes, device)
        progress(f"adamw {size}: {', '.join(fns)} (interleaved)")
        timings = harness.measure_many(fns, device=device)
        for name, timing in timings.items():
            is_probe = name == harness.PROBE
            rows.append(dict(op="adamw", size=size, provider=name, time_ms=timing.median_ms,
                             bytes=probe_bytes if is_probe else nbytes, baseline="torch fused",
                             probe=is_probe))
        del fns, params
        gc.collect()
    return rows
