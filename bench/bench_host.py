"""Host cost of an optimizer step: fastllm.optim.AdamW.step() against torch's fused AdamW, on
tensors so small (16 elements, CPU, 1 thread) that the time is the Python, dispatch and launch
work per tensor, not the arithmetic. On a GPU this is the part of a step that grows with the
tensor count (issue 18: about 10 us per extra tensor at 1024 tensors).

Two cases, each interleaved with its peer in the same rounds, each twice: with the same grad
tensors every step, and with new grad tensors every step (what zero_grad(set_to_none=True), the
default, gives a training loop; both sides swap between two preallocated sets):
    fp32:          fastllm.optim.AdamW(params)               vs torch.optim.AdamW(fused=True)
    bf16 + clip:   fastllm.optim.AdamW(master_weights=True,  vs torch.optim.AdamW(fused=True)
                   max_grad_norm=1.0) on bf16 params            + torch.nn.utils.clip_grad_norm_
                                                                on the same bf16 params
The peer of the second case does less (no fp32 master copy, no inf/nan skip): the bar to reach.

    fastllm bench --ops host
"""

import torch

import fastllm
from fastllm.bench import harness

NUMEL = 16
QUICK = [64]
FULL = [16, 64, 256]


def _params(n_tensors, dtype):
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(n_tensors):
        p = torch.nn.Parameter((torch.randn(NUMEL, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(NUMEL, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def _swapping(make, params):
    """make(params) wrapped so that every call first gives the params other grad tensors."""
    step = make(params)
    sets = [[p.grad for p in params], [p.grad.clone() for p in params]]
    turn = [0]

    def run():
        turn[0] ^= 1
        for p, g in zip(params, sets[turn[0]]):
            p.grad = g
        step()

    return run


def _providers():
    def fastllm_fp32(ps):
        return fastllm.optim.AdamW(ps, lr=1e-4).step

    def torch_fp32(ps):
        return torch.optim.AdamW(ps, lr=1e-4, fused=True).step

    def fastllm_master(ps):
        return fastllm.optim.AdamW(ps, lr=1e-4, master_weights=True, max_grad_norm=1.0).step

    def torch_clip(ps):
        opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)

        def step():
            torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opt.step()

        return step

    return {
        "fp32": (torch.float32, [("fastllm AdamW", fastllm_fp32),
                                 ("torch fused AdamW", torch_fp32)]),
        "bf16 + master + clip": (torch.bfloat16, [
            ("fastllm AdamW(master_weights, max_grad_norm)", fastllm_master),
            ("torch fused AdamW + clip_grad_norm_", torch_clip)]),
    }


def run(device="cpu", full=False, progress=print):
    if torch.device(device).type != "cpu":
        return []  # a host-cost measurement: CPU tensors by design
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    cases = [(n, case, dtype, providers, new_grads) for n in (FULL if full else QUICK)
             for case, (dtype, providers) in _providers().items() for new_grads in (False, True)]
    try:
        for n_tensors, case, dtype, providers, new_grads in cases:
            size = (f"{case}: {n_tensors} tensors of {NUMEL} elements, 1 thread"
                    + (", new grads each step" if new_grads else ""))
            progress(f"host: {size}")
            fns = {name: (_swapping(make, _params(n_tensors, dtype)) if new_grads
                          else make(_params(n_tensors, dtype))) for name, make in providers}
            times = harness.measure_many(fns, warmup=20, min_reps=50, max_reps=2000,
                                         min_time_s=1.5)
            baseline = providers[1][0]
            for name, _ in providers:
                us = times[name].median_ms * 1e3 / n_tensors
                rows.append({"op": "host", "size": size, "provider": name,
                             "time_ms": times[name].median_ms, "baseline": baseline,
                             "us_per_tensor": us, "note": f"{us:.2f} us per tensor"})
    finally:
        torch.set_num_threads(threads)
    return rows
