"""Low-byte optimizer state: fastllm.optim.AdamW8bit and AdamW(state_dtype=bf16) against
torch.optim.AdamW(fused=True) and, where installed, bitsandbytes' and torchao's AdamW8bit.

Bytes per parameter the step must move at least (`_floor`; the grad is read once: no clipping):
    fp32 params, 8-bit moments: param r+w 8, grad 4, codes r+w 2 + 2, absmax 16/block = ~16.06
    fp32 params, bf16 moments:  8 + 4 + 4 + 4 = 20;   fp32 moments (torch): 28
    bf16 params + fp32 master: param w 2, grad 2, master r+w 8, then the moments as above: the
    same ~16.06 (8-bit), 20 (bf16), 28 (fp32)
    bf16 params without masters (the peers in that case, "(no masters)"): param r+w 4, grad 2,
    8-bit moments ~4.06 = ~10.06
The memory probe streams that byte count in the same interleaved rounds (2 fp32 arrays read and
written back, 1 read: the param, the grad, and the codes lumped into one array; 20 B/element, its
length set so the total is the 8-bit step's bytes). "state" in the notes: the optimizer's state
bytes after the step, over the fp32 AdamW state of the same params.

    fastllm bench --ops adamw8bit
"""

import gc

import torch

import fastllm
from fastllm import _extension
from fastllm.bench import harness

# (total params, tensors, param dtype, master weights)
QUICK = [(64 << 20, 16, torch.float32, False), (32 << 20, 16, torch.bfloat16, True)]
FULL = QUICK
GPU = [(64 << 20, 16, torch.float32, False), (32 << 20, 16, torch.bfloat16, True)]


def _params(total, n_tensors, dtype, device):
    sizes = [total // n_tensors] * n_tensors
    sizes[-1] += total - sum(sizes)
    params = []
    for n in sizes:
        p = torch.nn.Parameter((torch.randn(n, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(n, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def _peer(module, attr):
    try:
        mod = __import__(module, fromlist=[attr])
        return getattr(mod, attr)
    except Exception:  # not installed, or cannot run here
        return None


def _state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


# Bytes per param of each kind of moments, read and written: 8-bit is two uint8 codes (4) and, per
# quantisation block of 256 (fastllm's and torchao's default), two fp32 absmax (16 / 256).
MOMENT_BYTES = {"8bit": 4 + 16 / 256, "bf16": 2 * 2 * 2, "fp32": 2 * 4 * 2}


def _floor(param_bytes, master, moments):
    """Bytes per param a step must move at least (the update of fastllm/ops/adamw.py and
    fastllm/ops/adamw8bit.py, where x is the master when there is one, else the param): with a
    master, the param is only written and the fp32 master read and written; without one, the
    param read and written. Plus the grad (of the param's dtype) read once and the moments."""
    weights = param_bytes + 2 * 4 if master else 2 * param_bytes
    return weights + param_bytes + MOMENT_BYTES[moments]


def _providers(device, dtype, master):
    """(name, make, backend, bytes per param) of each provider of the case."""
    dev = torch.device(device).type
    backend = "cpp" if dev == "cpu" else "triton"
    size = dtype.itemsize
    label = f"fastllm AdamW8bit ({backend})"
    out = [(label, lambda ps: fastllm.optim.AdamW8bit(ps, master_weights=master), backend,
            _floor(size, master, "8bit")),
           (f"fastllm AdamW bf16 state ({backend})",
            lambda ps: fastllm.optim.AdamW(ps, state_dtype=torch.bfloat16, master_weights=master),
            backend, _floor(size, master, "bf16"))]
    if master:
        out.append(("fastllm AdamW fp32 state, master", lambda ps: fastllm.optim.AdamW(
            ps, master_weights=True), None, _floor(size, True, "fp32")))
    else:
        out.append(("torch fused", lambda ps: torch.optim.AdamW(ps, fused=True), None,
                    _floor(size, False, "fp32")))
    # The peers step the params they are given and keep no fp32 master: in the master case they
    # do less work than the rows above, so their name says so and they are credited their own
    # bytes, not the master step's.
    suffix = " (no masters)" if master else ""
    for module, name in (("bitsandbytes.optim", "bitsandbytes"), ("torchao.optim", "torchao")):
        cls = _peer(module, "AdamW8bit")
        if cls is not None:
            out.append((f"{name} AdamW8bit{suffix}", lambda ps, cls=cls: cls(ps), None,
                        _floor(size, False, "8bit")))
    return out


def _probe(nbytes, device):
    probe = (getattr(_extension.extension(), "stream_probe_cpu", None)
             if torch.device(device).type == "cpu" else None)
    if probe is None:
        return harness.memory_probe(nbytes, device)
    numel = max(1, nbytes // 20)
    read_write = [torch.rand(numel) for _ in range(2)]
    read_only = [torch.rand(numel)]
    return (lambda: probe(read_write, read_only)), 20 * numel


def run(device="cpu", full=False, progress=print):
    cases = GPU if torch.device(device).type == "cuda" else (FULL if full else QUICK)
    rows = []
    for total, n_tensors, dtype, master in cases:
        kind = "fp32" if dtype == torch.float32 else "bf16"
        size = f"{total / 2**20:g}M {kind} params / {n_tensors} tensors" + (
            ", fp32 master weights" if master else "")
        baseline = "fastllm AdamW fp32 state, master" if master else "torch fused"
        q8_bytes = int(total * _floor(dtype.itemsize, master, "8bit"))
        fp32_state = total * (12 if master else 8)
        fns, opts, per_param = {}, {}, {}
        for name, make, backend, floor in _providers(device, dtype, master):
            params = _params(total, n_tensors, dtype, device)
            try:
                opt = make(params)
                with fastllm.use_backend(backend):
                    opt.step()  # allocates the state (and compiles torchao's step)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                harness.note(progress, f"adamw8bit {size}: skipped {name}: "
                                       f"{type(exc).__name__}: {exc}"[:200])
                continue

            def step(opt=opt, backend=backend):
                with fastllm.use_backend(backend):
                    opt.step()

            fns[name], opts[name], per_param[name] = step, opt, floor
        fns[harness.PROBE], probe_bytes = _probe(q8_bytes, device)
        progress(f"adamw8bit {size}: {', '.join(fns)} (interleaved)")
        timings = harness.measure_many(fns, device=device, min_reps=5, max_reps=30,
                                       min_time_s=3.0)
        for name, timing in timings.items():
            is_probe = name == harness.PROBE
            row = dict(op="adamw8bit", size=size, provider=name, time_ms=timing.median_ms,
                       bytes=probe_bytes if is_probe else int(total * per_param[name]),
                       baseline=baseline, probe=is_probe)
            if not is_probe:
                state = _state_bytes(opts[name])
                row["state_bytes"] = state
                row["note"] = (f"state {state / 2**20:.0f} MiB = {100 * state / fp32_state:.1f}% "
                               f"of fp32 AdamW state; floor {per_param[name]:.2f} B/param")
                if name.startswith("fastllm AdamW8bit"):
                    # The bandwidth target: the probe streams exactly this step's bytes,
                    # so its time over the step's is the step's share of the probe's bandwidth.
                    probe_ms = timings[harness.PROBE].median_ms
                    row["note"] += (f"; {100 * probe_ms / timing.median_ms:.0f}% of the memory "
                                    f"probe's bandwidth for its own bytes")
            rows.append(row)
        del fns, opts
        gc.collect()
    return rows
