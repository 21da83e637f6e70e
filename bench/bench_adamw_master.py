"""Mixed-precision AdamW step: fastllm (fp32 master weights, loss scaling and clipping fused)
against the PyTorch sequence that does the same work.

The PyTorch sequence (the issue's wording): bf16 grads to fp32 (`p.grad.float()`), unscaled,
clip_grad_norm_, AdamW(fused=True) on the fp32 masters, masters copied back into the bf16 params.
"torch sequence, preallocated" is the same with fp32 grad buffers allocated once and foreach
kernels throughout: about 56 bytes per parameter in six passes, which bounds fastllm's advantage
at about 56 / 30 = 1.9x on a machine where every pass runs at full bandwidth.

Bytes per parameter that any implementation must move: read the bf16 grad twice (norm pass and
update, 4), read and write the fp32 master, exp_avg, exp_avg_sq (24), write the bf16 param (2) =
30 for master weights. Pure bf16: grad 4, param read+write 4, moments 16 = 24 (+4 for the Kahan
buffer's read and write). The memory probe streams the master step's 30 B/param in the same
interleaved rounds (harness.memory_probe): the ceiling of "% ceiling".

    fastllm bench --ops adamw_master
    pytest bench/test_benchmarks.py --benchmark-only -k adamw_master
"""

import gc

import torch

import fastllm
from fastllm.amp import LossScaler
from fastllm.bench import harness

# (total params, tensors)
QUICK = [(32 << 20, 16)]
FULL = [(4 << 20, 16), (32 << 20, 16), (32 << 20, 512)]
GPU = [(32 << 20, 16), (256 << 20, 64)]

SCALE = 1024.0
MAX_NORM = 1.0
BYTES_PER_PARAM = {"master": 30, "pure_sr": 24, "pure_kahan": 28}


def _params(total, n_tensors, device, dtype=torch.bfloat16):
    sizes = [total // n_tensors] * n_tensors
    sizes[-1] += total - sum(sizes)
    params = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(device, dtype))
        p.grad = (torch.randn(n, generator=gen) * 1e-3 * SCALE).to(device, dtype)
        params.append(p)
    return params


def _fastllm_step(params, **options):
    # A growth interval no run reaches keeps the scale (and so the work) the same every step.
    opt = fastllm.optim.AdamW(params, lr=1e-4, max_grad_norm=MAX_NORM,
                              loss_scaler=LossScaler(init_scale=SCALE, growth_interval=10**9),
                              **options)
    return opt.step


def torch_sequence_step(params):
    """The PyTorch baseline as usually written: returns step(), one mixed-precision step."""
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def step():
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        torch._foreach_mul_([m.grad for m in masters], 1.0 / SCALE)
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
        opt.step()
        for p, m in zip(params, masters):
            p.data.copy_(m.data)

    return step


def torch_preallocated_step(params):
    """The PyTorch baseline at its most frugal: fp32 grad buffers reused, foreach everywhere."""
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    for m in masters:
        m.grad = torch.empty_like(m)
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)
    grads = [p.grad for p in params]
    master_grads = [m.grad for m in masters]
    model = [p.data for p in params]
    master_data = [m.data for m in masters]

    def step():
        torch._foreach_copy_(master_grads, grads)
        torch._foreach_mul_(master_grads, 1.0 / SCALE)
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM, foreach=True)
        opt.step()
        torch._foreach_copy_(model, master_data)

    return step


def _providers(device):
    on_cpu = torch.device(device).type == "cpu"
    backend = "cpp" if on_cpu else "cuda"
    extra = [] if on_cpu else [("fastllm (triton)", "master", "triton",
                                lambda ps: _fastllm_step(ps, master_weights=True))]
    return [
        (f"fastllm ({backend})", "master", backend,
         lambda ps: _fastllm_step(ps, master_weights=True)),
        *extra,
        ("torch sequence", "master", None, torch_sequence_step),
        ("torch sequence, preallocated", "master", None, torch_preallocated_step),
        (f"fastllm ({backend}) pure bf16 + SR", "pure_sr", backend,
         lambda ps: _fastllm_step(ps, stochastic_rounding=True)),
        (f"fastllm ({backend}) pure bf16 + Kahan", "pure_kahan", backend,
         lambda ps: _fastllm_step(ps, kahan_summation=True)),
    ]


def run(device="cpu", full=False, progress=print):
    cases = GPU if torch.device(device).type == "cuda" else (FULL if full else QUICK)
    rows = []
    for total, n_tensors in cases:
        size = f"{total / 2**20:g}M bf16 params / {n_tensors} tensors, scale+clip"
        fns, kinds = {}, {}
        for name, kind, backend, make in _providers(device):
            params = _params(total, n_tensors, device)  # each provider updates its own copy
            with fastllm.use_backend(backend):
                step = make(params)

            def run_step(step=step, backend=backend):
                with fastllm.use_backend(backend):
                    step()

            fns[name], kinds[name] = run_step, kind
        fns[harness.PROBE], probe_bytes = harness.memory_probe(total * BYTES_PER_PARAM["master"],
                                                               device)
        progress(f"adamw_master {size}: {', '.join(fns)} (interleaved)")
        for name, timing in harness.measure_many(fns, device=device).items():
            if name == harness.PROBE:
                rows.append(dict(op="adamw_master", size=size, provider=name,
                                 time_ms=timing.median_ms, bytes=probe_bytes,
                                 baseline="torch sequence", probe=True))
                continue
            kind = kinds[name]
            note = None if kind == "master" else (
                f"GB/s counts {BYTES_PER_PARAM[kind]} B/param (no fp32 master), not 30")
            rows.append(dict(op="adamw_master", size=size, provider=name,
                             time_ms=timing.median_ms, bytes=total * BYTES_PER_PARAM[kind],
                             baseline="torch sequence", note=note))
        del fns
        gc.collect()
    return rows

