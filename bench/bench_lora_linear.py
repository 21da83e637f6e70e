"""LoRA linear, forward + backward: fastllm against PEFT and against the frozen linear alone.

One training step of one layer: y = layer(x), then the grads of x and of the LoRA parameters
(the frozen linear: of x only). x: (tokens, in), W: (out, in), r = 16. The ratio column is
against the frozen linear (the floor LoRA can reach); the note gives the ratio to PEFT and the
activation bytes each keeps for the backward (beyond x itself).

    fastllm bench --ops lora_linear
    pytest bench/test_benchmarks.py --benchmark-only -k lora_linear
"""

import copy
import gc

import torch
from torch import nn

import fastllm
from fastllm.bench import harness
from fastllm.lora import inject_lora

# (tokens, in_features, out_features, r, dtype, dropout)
QUICK = [
    (2048, 2048, 2048, 16, torch.float32, 0.0),
    (2048, 2048, 2048, 16, torch.float32, 0.1),
    (2048, 2048, 2048, 16, torch.bfloat16, 0.0),
    (2048, 2048, 2048, 16, torch.bfloat16, 0.1),
]
FULL = QUICK + [
    (4096, 4096, 4096, 16, torch.float32, 0.0),
    (4096, 4096, 4096, 64, torch.bfloat16, 0.1),
]
# Llama-3-8B's q_proj at 8192 tokens (bench/device_check.sh runs these within its budget)
GPU = [
    (8192, 4096, 4096, 16, torch.bfloat16, 0.0),
    (8192, 4096, 4096, 16, torch.bfloat16, 0.1),
]


FP32_ADAPTER = "fastllm, fp32 adapter"  # the layer's name; its provider: "fastllm (backend), ..."
PEFT_FP32_ADAPTER = "peft (fp32 adapter, its default)"


class _Holder(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.q_proj = linear


def _layers(k, n, r, dtype, dropout, device):
    """{provider: layer}: the frozen nn.Linear, fastllm's LoRALinear and PEFT's lora.Linear, all
    with the same W, A and B. fastllm and PEFT twice for bf16/fp16: with the adapter in the base
    dtype, and with an fp32 adapter (PEFT's default, autocast_adapter_dtype=True)."""
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device=device, dtype=dtype).requires_grad_(False)
    ours = inject_lora(_Holder(copy.deepcopy(base)), ["q_proj"], r=r, alpha=2 * r,
                       dropout=dropout).q_proj
    with torch.no_grad():
        ours.lora_B.normal_(0, 0.02)
    layers = {"torch frozen linear": base, "fastllm": ours}
    if dtype != torch.float32:
        wide = inject_lora(_Holder(copy.deepcopy(base)), ["q_proj"], r=r, alpha=2 * r,
                           dropout=dropout, adapter_dtype=torch.float32).q_proj
        with torch.no_grad():
            wide.lora_A.copy_(ours.lora_A)
            wide.lora_B.copy_(ours.lora_B)
        layers[FP32_ADAPTER] = wide
    try:
        import peft
    except ImportError:
        return layers
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"],
                             lora_dropout=dropout)
    variants = {"peft": False}
    if dtype != torch.float32:
        variants[PEFT_FP32_ADAPTER] = True
    for name, autocast_adapter in variants.items():
        wrapped = peft.get_peft_model(_Holder(copy.deepcopy(base)), copy.deepcopy(config),
                                      autocast_adapter_dtype=autocast_adapter)
        theirs = wrapped.base_model.model.q_proj
        with torch.no_grad():
            theirs.lora_A["default"].weight.copy_(ours.lora_A)
            theirs.lora_B["default"].weight.copy_(ours.lora_B)
        layers[name] = theirs
    return layers


def _step(layer, x, g):
    """fn() running forward + backward of `layer` (grads of x and of its trainable params)."""
    wanted = [x] + [p for p in layer.parameters() if p.requires_grad]

    def fn():
        y = layer(x)
        torch.autograd.grad(y, wanted, g)

    return fn


def _saved_bytes(layer, x):
    params = {p.data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr() and t.dim() > 0:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values())


def run(device="cpu", full=False, progress=print):
    dev = torch.device(device).type
    cases = GPU if dev == "cuda" else (FULL if full else QUICK)
    fastllm_name = "fastllm (triton)" if dev == "cuda" else "fastllm (cpp)"
    backend = "triton" if dev == "cuda" else "cpp"
    rows = []
    for m, k, n, r, dtype, p in cases:
        dt = str(dtype).split(".")[-1]
        size = f"x {m}x{k}, W {n}x{k}, r={r}, {dt}, dropout {p:g}"
        layers = _layers(k, n, r, dtype, p, device)
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(m, n, device=device, dtype=dtype)
        # matmul flops: forward x W^T, backward dY W (2 m n k each); LoRA adds O(r) terms
        flops = 4 * m * n * k
        saved, fns = {}, {}
        for name, layer in layers.items():
            provider = name.replace("fastllm", fastllm_name, 1)
            layer.train()
            step = _step(layer, x, g)
            chosen = backend if name.startswith("fastllm") else None

            def run_step(step=step, chosen=chosen):
                with fastllm.use_backend(chosen):
                    step()

            fns[provider] = run_step
            with fastllm.use_backend(chosen):
                saved[provider] = _saved_bytes(layer, x) if name != "torch frozen linear" else 0
        progress(f"lora_linear {size}: {', '.join(fns)} (interleaved)")
        timings = harness.measure_many(fns, device=device, min_reps=5, min_time_s=2.0)
        times = {provider: t.median_ms for provider, t in timings.items()}
        for provider, ms in times.items():
            rows.append(dict(op="lora_linear", size=size, provider=provider, time_ms=ms,
                             flops=flops, baseline="torch frozen linear"))
        for row in rows[-len(layers):]:
            notes = [f"saved activations {saved[row['provider']] / 2**20:.2f} MiB"]
            # each fastllm row against the PEFT layer with its adapter dtype
            peer = PEFT_FP32_ADAPTER if row["provider"].endswith("fp32 adapter") else "peft"
            if peer in times and row["provider"] not in ("peft", PEFT_FP32_ADAPTER):
                notes.append(f"x{times[row['provider']] / times[peer]:.2f} vs {peer}")
            row["note"] = ", ".join(notes)
        del layers, x, g
        gc.collect()
    return rows

