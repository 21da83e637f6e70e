"""Every GPU measurement issue 18 asks for, in one process, interleaved, into one JSON and one
table (bench/device_check.sh runs it; about two minutes on an H200):

    ceilings   device copy and add GB/s, bf16 GEMM TFLOP/s (8192 x 4096 x 4096)
    adamw      64M fp32 params in 16 and in 1024 tensors: torch fused, fastllm cuda, fastllm
               triton; eager and CUDA-graph replay (capturable=True); kernels per step counted by
               the profiler
    master     32M bf16 params, master weights + clipping: fastllm against the torch sequence
    lowbyte    64M params: AdamW8bit and AdamW(state_dtype=bf16) against torch fused fp32
    lora       x 8192 x 4096, W 4096 x 4096, r = 16, bf16, forward + backward: frozen GEMM,
               PEFT, fastllm, and fastllm's kernels one by one (profiler)
    large      AdamW on one tensor of 2^31 + 1000 elements (int64 indexing): runs, and its last
               elements equal torch's on the same values

    python bench/device_bench.py --json out.json        (--smoke: tiny sizes, any device)
"""

import argparse
import json
import sys

import torch

import fastllm
from fastllm.bench import bench_adamw, bench_adamw_master, bench_lora_linear, harness

M = 1 << 20


def _time(fns, device, seconds=0.3):
    return harness.measure_many(fns, device=device, warmup=3, min_reps=5, max_reps=50,
                                min_time_s=seconds)


def _kernels_per_call(fn, device):
    """How many GPU kernels one call of fn launches (torch.profiler); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _graphed(make_step, device):
    """make_step() -> step; the step captured in a CUDA graph (replay), or None off the GPU."""
    if torch.device(device).type != "cuda":
        return None
    step = make_step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: state created, kernels compiled
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def ceilings(device, scale, rows):
    n = 256 * M // scale
    x, y = torch.empty(n, device=device), torch.rand(n, device=device)
    a = torch.randn(8192 // scale, 4096 // scale, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096 // scale, 4096 // scale, device=device, dtype=torch.bfloat16)
    t = _time({"copy": lambda: x.copy_(y), "add": lambda: x.add_(y), "gemm": lambda: a @ w.t()},
              device)
    rows += [{"op": "ceiling", "size": f"{n // M}M fp32", "provider": "copy_",
              "time_ms": t["copy"].median_ms, "bytes": 8 * n},
             {"op": "ceiling", "size": f"{n // M}M fp32", "provider": "add_",
              "time_ms": t["add"].median_ms, "bytes": 12 * n},
             {"op": "ceiling", "size": f"bf16 {tuple(a.shape)} x {tuple(w.shape)}^T",
              "provider": "matmul", "time_ms": t["gemm"].median_ms,
              "flops": 2 * a.shape[0] * a.shape[1] * w.shape[0]}]


def adamw(device, scale, rows):
    backends = ["cuda", "triton"] if torch.device(device).type == "cuda" else ["cpp"]
    for n_tensors in (16, 1024):
        total = 64 * M // scale
        size = f"{total // M}M fp32 params / {n_tensors} tensors"
        fns, counts = {}, {}
        for capturable in (False, True):
            mode = "graph" if capturable else "eager"

            def torch_step(c=capturable):
                return torch.optim.AdamW(bench_adamw._params(total, n_tensors, device), lr=1e-3,
                                         fused=True, capturable=c).step

            makers = {"torch fused": torch_step}
            for b in backends:
                def ours(b=b, c=capturable):
                    opt = fastllm.optim.AdamW(bench_adamw._params(total, n_tensors, device),
                                              lr=1e-3, capturable=c)

                    def step():
                        with fastllm.use_backend(b):
                            opt.step()

                    return step

                makers[f"fastllm {b}"] = ours
            for name, make in makers.items():
                fn = _graphed(make, device) if capturable else make()
                if fn is None:
                    continue
                fns[f"{name} ({mode})"] = fn
                counts[f"{name} ({mode})"] = _kernels_per_call(fn, device)
        t = _time(fns, device)
        for name, timing in t.items():
            rows.append({"op": "adamw", "size": size, "provider": name,
                         "time_ms": timing.median_ms, "bytes": 28 * total,
                         "baseline": "torch fused (eager)",
                         "note": f"{counts[name]} kernels per step"})


def master(device, scale, rows):
    total = 32 * M // scale
    params = bench_adamw_master._params(total, 16, device)
    fns = {"fastllm master + clip": bench_adamw_master._fastllm_step(params,
                                                                    master_weights=True),
           "torch sequence": bench_adamw_master.torch_sequence_step(
               bench_adamw_master._params(total, 16, device))}
    counts = {k: _kernels_per_call(f, device) for k, f in fns.items()}
    for name, timing in _time(fns, device).items():
        rows.append({"op": "adamw_master", "size": f"{total // M}M bf16 params / 16 tensors",
                     "provider": name, "time_ms": timing.median_ms, "bytes": 30 * total,
                     "baseline": "torch sequence", "note": f"{counts[name]} kernels per step"})


def lowbyte(device, scale, rows):
    total = 64 * M // scale
    fns = {
        "torch fused fp32": torch.optim.AdamW(bench_adamw._params(total, 16, device), lr=1e-3,
                                              fused=True).step,
        "fastllm AdamW8bit": fastllm.optim.AdamW8bit(bench_adamw._params(total, 16, device),
                                                     lr=1e-3).step,
        "fastllm AdamW bf16 state": fastllm.optim.AdamW(
            bench_adamw._params(total, 16, device), lr=1e-3, state_dtype=torch.bfloat16).step,
    }
    counts = {k: _kernels_per_call(f, device) for k, f in fns.items()}
    for name, timing in _time(fns, device).items():
        rows.append({"op": "lowbyte state", "size": f"{total // M}M fp32 params / 16 tensors",
                     "provider": name, "time_ms": timing.median_ms,
                     "baseline": "torch fused fp32", "note": f"{counts[name]} kernels per step"})


def lora(device, scale, rows):
    tokens, k, n, r = 8192 // scale, 4096 // scale, 4096 // scale, 16
    dtype = torch.bfloat16
    layers = bench_lora_linear._layers(k, n, r, dtype, 0.0, device)
    x = torch.randn(tokens, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, n, device=device, dtype=dtype)
    fns = {name: bench_lora_linear._step(layer, x, g) for name, layer in layers.items()}
    size = f"x {tokens}x{k}, W {n}x{k}, r={r}, bf16, fwd+bwd"
    for name, timing in _time(fns, device).items():
        rows.append({"op": "lora_linear", "size": size, "provider": name,
                     "time_ms": timing.median_ms, "flops": 3 * 2 * tokens * k * n,
                     "baseline": "torch frozen linear"})
    if torch.device(device).type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fns["fastllm"]()
            torch.cuda.synchronize()
        per_kernel = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time / 1e3
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]
        rows.append({"op": "lora_linear", "size": size, "provider": "fastllm kernels",
                     "time_ms": sum(per_kernel.values()),
                     "note": "; ".join(f"{name[:60]} {ms:.3f} ms" for name, ms in top)})


def large(device, scale, rows):
    n = (1 << 31) + 1000 if scale == 1 else (1 << 16) + 1000
    p = torch.nn.Parameter(torch.randn(n, device=device) * 0.02)
    p.grad = torch.randn(n, device=device) * 1e-3
    tail = slice(n - 4096, n)
    q = torch.nn.Parameter(p.detach()[tail].clone())
    q.grad = p.grad[tail].clone()
    opt = fastllm.optim.AdamW([p], lr=1e-3)
    ref = torch.optim.AdamW([q], lr=1e-3)
    t = _time({"fastllm": opt.step}, device, seconds=0.0)
    ref.step()
    # fastllm ran warm-up and timed steps: compare with torch after as many steps.
    for _ in range(int(float(opt.state[p]["step"])) - 1):
        ref.step()
    err = (p.detach()[tail] - q.detach()).abs().max().item()
    rows.append({"op": "adamw", "size": f"one tensor of {n} elements (int64 indexing)",
                 "provider": "fastllm", "time_ms": t["fastllm"].median_ms, "bytes": 28 * n,
                 "note": f"last 4096 elements within {err:.2e} of torch.optim.AdamW"})
    if not err < 1e-5:
        raise SystemExit(f"device_bench: the 2^31+ element AdamW is off by {err} at the end")


CASES = {"ceilings": ceilings, "adamw": adamw, "master": master, "lowbyte": lowbyte,
         "lora": lora, "large": large}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU run of the code)")
    parser.add_argument("--cases", default=",".join(CASES))
    opts = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not opts.smoke else "cpu"
    scale = 64 if opts.smoke else 1
    rows, failed = [], []
    for name in opts.cases.split(","):
        print(f"device_bench: {name} ...", file=sys.stderr, flush=True)
        try:
            CASES[name](device, scale, rows)
        except Exception as exc:  # one case failing must not lose the others' numbers
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
        if device == "cuda":
            torch.cuda.empty_cache()
    harness.annotate(rows)
    machine = harness.machine_description(device)
    with open(opts.json, "w") as f:
        json.dump({"device": device, "machine": machine, "rows": rows, "failed": failed}, f,
                  indent=1)
    print(f"{device}: {machine}\n")
    print(harness.format_table(rows))
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
