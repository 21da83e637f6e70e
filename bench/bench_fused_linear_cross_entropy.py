"""Fused linear cross-entropy, forward + backward (grads of hidden and weight, the head matmul
included): fastllm against F.cross_entropy over materialised logits (Hugging Face's loss: fp32
logits, then the loss) and torch.compile of the same maths, at SmolLM2-135M's head (hidden 576,
vocab 49152, tied embeddings). Also timed: torch.mm's three GEMMs alone at full size (logits,
dX, dW), the floor of the materialised methods (fastllm's chunked GEMMs can run faster: bf16 on
an AMX CPU, 2026-12-07). Each row's note gives the peak memory the step
allocates (the CPU allocator's, measured with the torch profiler, inputs excluded).

    fastllm bench --ops fused_linear_cross_entropy [--full]
"""

import gc

import torch
import torch.nn.functional as F

import fastllm
from fastllm.bench import harness
from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

# (tokens, hidden, vocab, dtype)
QUICK = [(2048, 576, 49152, torch.float32), (2048, 576, 49152, torch.bfloat16)]
FULL = QUICK + [(4096, 576, 49152, torch.float32), (4096, 576, 49152, torch.bfloat16)]
GPU = [(8192, 4096, 128256, torch.bfloat16)]  # Llama-3-8B's head


def _materialised(hidden, weight, labels):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _step(loss_fn, hidden, weight, labels):
    def fn():
        loss = loss_fn(hidden, weight, labels)
        torch.autograd.grad(loss, [hidden, weight])
    return fn


def _gemms(hidden, weight):
    """The three GEMMs of any method, at full size, on preallocated operands."""
    grad_logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    grad_logits.normal_()

    def fn():
        torch.mm(hidden, weight.t())
        torch.mm(grad_logits, weight)
        torch.mm(grad_logits.t(), hidden)
    return fn


def run(device="cpu", full=False, progress=print, compile_peer=True):
    dev = torch.device(device).type
    cases = GPU if dev == "cuda" else (FULL if full else QUICK)
    backend = "triton" if dev == "cuda" else "cpp"
    fastllm_name = f"fastllm ({backend})"
    rows = []
    for tokens, h, v, dtype in cases:
        dt = str(dtype).split(".")[-1]
        size = f"{tokens} tokens, hidden {h}, vocab {v}, {dt}"
        torch.manual_seed(0)
        hidden = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(v, h, device=device) * 0.02).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (tokens,), device=device)

        def ours():
            with fastllm.use_backend(backend):
                return fused_linear_cross_entropy(hidden, weight, labels)

        fns = {
            "torch F.cross_entropy (materialised)": _step(_materialised, hidden, weight, labels),
            fastllm_name: _step(lambda *_: ours(), hidden, weight, labels),
        }
        if compile_peer:
            progress(f"fused_linear_cross_entropy {size}: compiling the torch.compile peer")
            compiled = torch.compile(_materialised)
            try:
                _step(compiled, hidden, weight, labels)()
                fns["torch.compile (materialised)"] = _step(compiled, hidden, weight, labels)
            except Exception as exc:  # a CPU without a working C++ toolchain for inductor
                harness.note(progress, f"fused_linear_cross_entropy {size}: torch.compile peer "
                                       f"skipped: {type(exc).__name__}: {exc}")
        fns["torch.mm's 3 GEMMs alone"] = _gemms(hidden.detach(), weight.detach())
        peaks = {name: harness.allocator_peak_bytes(fn) if dev == "cpu" else None
                 for name, fn in fns.items()}
        progress(f"fused_linear_cross_entropy {size}: {', '.join(fns)} (interleaved)")
        timings = harness.measure_many(fns, device=device, warmup=1, min_reps=3, max_reps=5,
                                       min_time_s=0.0)
        flops = 3 * 2 * tokens * h * v
        for name, t in timings.items():
            row = dict(op="fused_linear_cross_entropy", size=size, provider=name,
                       time_ms=t.median_ms, flops=flops,
                       baseline="torch F.cross_entropy (materialised)")
            if peaks[name] is not None:
                row["note"] = f"peak allocated {peaks[name] / 2**20:.0f} MiB"
            rows.append(row)
        del hidden, weight, labels, fns
        gc.collect()
    return rows
