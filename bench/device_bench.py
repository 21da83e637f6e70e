"""Every GPU measurement issues 18 and 19 ask for, in one process, interleaved, into one JSON and
one table (bench/device_check.sh runs it; about three minutes on an H200):

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
    model      issue 19 at SmolLM2-135M's sizes, 8 x 2048 tokens, bf16: rms_norm, rotary_embedding,
               swiglu forward + backward (GB/s, % of the copy_ ceiling timed in the same rounds)
               and fused_linear_cross_entropy (TFLOP/s, against its three GEMMs alone), each
               against torch eager and Liger-Kernel, and DPO's per-token log-probabilities
               (fastllm.preference.token_logps, frozen head: against its two GEMMs alone and
               log_softmax over materialised logits); then a whole training step of a 30-layer
               SmolLM2-135M-shaped LlamaForCausalLM, full and LoRA: HF (+ PEFT), HF + Liger-Kernel
               (+ PEFT), fastllm (patch + lora + optim.AdamW): tokens/s, peak memory, kernels
    qlora      NF4 (fastllm.quant): dequantising a 4096 x 4096 weight to bf16 (GB/s, against a
               bf16 copy_ of the same output), and LoRA forward + backward over the NF4 weight at
               the lora case's sizes: frozen GEMM, LoRA on the dense weight, PEFT, QLoRA
    packed     causal attention over packed documents (SFT rows), SmolLM2-135M's heads, 8 x 2048
               tokens of 64-1024-token documents, bf16, forward + backward: SDPA with the
               (B, 1, T, T) document mask and the key/value heads repeated, as transformers
               runs it, fastllm.ops.attention (PyTorch's
               varlen flash attention on a GPU), and plain causal SDPA over whole rows (the same
               tokens without document boundaries: more work, no mask) for scale

    python bench/device_bench.py --json out.json        (--smoke: tiny sizes, any device)

The JSON is rewritten after every case (and between the model case's ops and its two training
steps), so a run cut short by its time limit keeps what it measured.
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import time
import traceback
import types

import torch
import torch.nn.functional as F

import fastllm
from fastllm.bench import (bench_adamw, bench_adamw_master, bench_lora_linear, bench_model,
                           harness)

M = 1 << 20

# Rewrites the JSON with the rows so far (main sets it): the model case calls it between its
# parts, so a run cut by its time limit keeps the ops when the training steps are cut.
_checkpoint = None


def _time(fns, device, seconds=0.3, queue_ahead_ms=0.0):
    return harness.measure_many(fns, device=device, warmup=3, min_reps=5, max_reps=50,
                                min_time_s=seconds, queue_ahead_ms=queue_ahead_ms)


# Kernel rows (LoRA, the model ops) time the GPU's work: the GPU is kept busy this long before each
# timed call, so the host's launch cost (Python, autograd, Triton's launcher: hundreds of us for a
# small op's forward and backward) overlaps it, as in a training step that runs ahead.
KERNEL_QUEUE_AHEAD_MS = 3.0


def _failure(name, exc, device, peers):
    """The note of a FAILED row for a provider whose first call raised. Off the GPU (CI's smoke
    run) fastllm's own failures raise; on the GPU every provider's is recorded, so that one
    failure loses no other numbers (main then exits non-zero)."""
    if name not in peers and torch.device(device).type != "cuda":
        raise exc
    traceback.print_exc()
    return f"FAILED: {type(exc).__name__}: {str(exc)[:200]}"


def _kernel_profile(fn, device):
    """(kernels one call of fn launches, {kernel name: GPU ms summed over the call}), by
    torch.profiler after a warm-up call; (None, {}) on the CPU, and a count of None where the
    profiler saw no kernel (CUPTI under graphs), not a kernel-less step."""
    if torch.device(device).type != "cuda":
        return None, {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    count, per_kernel = 0, {}
    for e in prof.events():
        if _is_kernel(e):
            count += 1
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time / 1e3
    return count or None, per_kernel


def _kernels_per_call(fn, device):
    """How many GPU kernels one call of fn launches; None on the CPU."""
    return _kernel_profile(fn, device)[0]


def _top_kernels(per_kernel, n):
    """The n kernels that took the most GPU time, as a note."""
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:n]
    return "; ".join(f"{name[:60]} {ms:.3f} ms" for name, ms in top)


def _kernel_note(count):
    return None if count is None else f"{count} kernels per step"


def _is_kernel(event):
    """A kernel among a profile's GPU events (not a memcpy or memset)."""
    return (event.device_type == torch.autograd.DeviceType.CUDA
            and not event.name.startswith(("Memcpy", "Memset")))


def _graphed(make_step, device):
    """make_step() -> step; the step captured in a CUDA graph (replay, which returns what the
    captured call returned, rewritten by each replay), or None off the GPU."""
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
        out = step()

    def replay(step=step):  # holds the step (its optimizer, params, state): the graph does not
        graph.replay()
        return out

    return replay


def _copy_buffers(device, scale):
    """(x, y) for the copy ceiling x.copy_(y): 8 bytes moved per element."""
    n = 256 * M // scale
    return torch.empty(n, device=device), torch.rand(n, device=device)


def ceilings(device, scale, rows):
    x, y = _copy_buffers(device, scale)
    n = x.numel()
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
                         "note": _kernel_note(counts[name])})


def master(device, scale, rows):
    total = 32 * M // scale
    params = bench_adamw_master._params(total, 16, device)
    fns = {"fastllm master + clip": bench_adamw_master._fastllm_step(params,
                                                                    master_weights=True),
           "torch sequence": bench_adamw_master.torch_sequence_step(
               bench_adamw_master._params(total, 16, device))}
    counts = {k: _kernels_per_call(f, device) for k, f in fns.items()}
    for name, timing in _time(fns, device).items():
        rows.append({"op": "adamw_master", "size": f"{total / M:g}M bf16 params / 16 tensors",
                     "provider": name, "time_ms": timing.median_ms, "bytes": 30 * total,
                     "baseline": "torch sequence", "note": _kernel_note(counts[name])})


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
                     "baseline": "torch fused fp32", "note": _kernel_note(counts[name])})


def _lora_rows(op, layers, profiled, tokens, k, n, r, device, rows):
    """Forward + backward of each layer on one bf16 x (tokens, k): a row per provider, rated
    against the frozen linear's two GEMMs, and the kernels of `profiled`'s call."""
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    fns = {name: bench_lora_linear._step(layer, x, g) for name, layer in layers.items()}
    size = f"x {tokens}x{k}, W {n}x{k}, r={r}, bf16, fwd+bwd"
    # frozen W: y = xW^T and dX = dY W, no dW (the rank-r products are noise at r=16)
    for name, timing in _time(fns, device, queue_ahead_ms=KERNEL_QUEUE_AHEAD_MS).items():
        rows.append({"op": op, "size": size, "provider": name, "time_ms": timing.median_ms,
                     "flops": 2 * 2 * tokens * k * n, "baseline": "torch frozen linear"})
    _, per_kernel = _kernel_profile(fns[profiled], device)
    if per_kernel:
        rows.append({"op": op, "size": size, "provider": f"{profiled} kernels",
                     "time_ms": sum(per_kernel.values()), "note": _top_kernels(per_kernel, 8)})


def lora(device, scale, rows):
    tokens, k, n, r = 8192 // scale, 4096 // scale, 4096 // scale, 16
    layers = bench_lora_linear._layers(k, n, r, torch.bfloat16, 0.0, device)
    _lora_rows("lora_linear", layers, "fastllm", tokens, k, n, r, device, rows)


def qlora(device, scale, rows):
    """NF4 (fastllm.quant): the dequantisation of a 4096 x 4096 weight to bf16 (Triton on a GPU)
    against a bf16 copy of the same output, and LoRA forward + backward over the NF4 weight at
    the lora case's sizes against the frozen bf16 GEMM and LoRA over the dense weight."""
    from fastllm import quant
    from fastllm.ops.nf4 import nf4_dequantize_into, nf4_quantize

    k = n = 4096 // scale
    w = torch.randn(n, k, device=device) * 0.02
    packed, absmax = nf4_quantize(w, 64)
    out = torch.empty(n, k, device=device, dtype=torch.bfloat16)
    src = torch.empty_like(out).normal_()
    timing = _time({"fastllm": lambda: nf4_dequantize_into(out, packed, absmax, 64),
                    "copy_ (bf16, same output)": lambda: out.copy_(src)}, device)
    size = f"{n}x{k} NF4 -> bf16, blocksize 64"
    # bytes the op must move: 0.5 (codes) + 4 / 64 (absmax) read and 2 written per weight
    need = {"fastllm": n * k * (0.5 + 4 / 64 + 2), "copy_ (bf16, same output)": n * k * 4}
    for name, t in timing.items():
        rows.append({"op": "nf4_dequantize", "size": size, "provider": name,
                     "time_ms": t.median_ms, "bytes": need[name],
                     "baseline": "copy_ (bf16, same output)"})
    tokens, r = 8192 // scale, 16
    layers = bench_lora_linear._layers(k, n, r, torch.bfloat16, 0.0, device)
    dense = layers["fastllm"]
    nf4 = copy.deepcopy(dense)
    nf4.base_layer = quant.NF4Linear.from_linear(dense.base_layer)
    providers = {"torch frozen linear": layers["torch frozen linear"],
                 "fastllm LoRA (dense bf16 base)": dense, "fastllm QLoRA (NF4 base)": nf4}
    if "peft" in layers:
        providers["peft (dense bf16 base)"] = layers["peft"]
    _lora_rows("qlora_linear", providers, "fastllm QLoRA (NF4 base)", tokens, k, n, r, device,
               rows)


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
        raise RuntimeError(f"the 2^31+ element AdamW is off by {err} at the end")


# --- model: issue 19's ops and training step ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    layers: int

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @property
    def tokens(self):
        return self.batch * self.seq


def _model_shape(scale):
    """SmolLM2-135M (bench_model's constants: hidden 576, 9 / 3 heads of 64, ffn 1536, vocab
    49152, 30 layers) at 8 x 2048 tokens; a toy of the same form for --smoke."""
    if scale == 1:
        return _Shape(8, 2048, bench_model.HIDDEN, bench_model.HEADS, bench_model.KV_HEADS,
                      bench_model.FFN, bench_model.VOCAB, 30)
    return _Shape(2, 64, 64, 4, 2, 128, 512, 2)


# Warm-up steps (the first compiles the Triton kernels and allocates the optimizer state) and
# timed interleaved rounds of the training step; a 135M step at 16k tokens takes a fraction of a
# second on an H200, so these add seconds, not minutes.
STEP_WARMUP, STEP_ROUNDS = 2, 5
# Input sets an op rotates through so that its data is not in the L2 cache from the call before
# (60 MB on an H200): enough sets to touch this many bytes between two uses of one set.
ROTATE_BYTES = 256 * M
LIGER = "liger-kernel"
# the model step's fastllm provider with each decoder layer compiled (full fine-tuning, a part
# of its own after the others; FASTLLM_DEVICE_COMPILE=0 leaves it out)
COMPILED = "fastllm + torch.compile"
# suffix of the providers whose step (forward, backward, AdamW) is captured whole in one CUDA
# graph and replayed: the step without its host work (fastllm's and Hugging Face's; Liger-Kernel's
# loss reads the GPU back, which a capture refuses)
GRAPH = ", CUDA graph"
LIGER_STEP = "HF + Liger-Kernel"


def _liger_pieces():
    """(Liger-Kernel's pieces, None), or (None, why it is left out)."""
    try:
        from importlib.metadata import version

        from liger_kernel.ops import LigerSiLUMulFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.transformers import (LigerFusedLinearCrossEntropyLoss, LigerRMSNorm,
                                               apply_liger_kernel_to_llama, liger_rotary_pos_emb)
    except ModuleNotFoundError as exc:
        return None, f"not installed ({exc})"
    except Exception as exc:  # installed but broken here (e.g. a transformers it refuses)
        return None, f"not importable: {type(exc).__name__}: {exc}"
    return types.SimpleNamespace(
        version=version("liger-kernel"), RMSNorm=LigerRMSNorm, rotary_pos_emb=liger_rotary_pos_emb,
        silu_mul=LigerSiLUMulFunction.apply, gelu_mul=LigerGELUMulFunction.apply,
        FusedLinearCrossEntropyLoss=(
            LigerFusedLinearCrossEntropyLoss), apply_to_llama=apply_liger_kernel_to_llama), None


def _liger(device):
    """_liger_pieces() on a GPU; elsewhere (None, why): imported (so a CPU run checks the names
    this file uses) but not run."""
    liger, why = _liger_pieces()
    if liger is not None and torch.device(device).type != "cuda":
        return None, (f"{liger.version} imports; not run off a GPU (its RMSNorm and SwiGLU "
                      "kernels fail in Triton's interpreter)")
    return liger, why


def _peak_mib(fn, device):
    """Peak device memory fn() allocates beyond what was allocated before it (MiB); None off
    the GPU."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / M


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _input_sets(make_set, device):
    """[make_set() ...]: enough sets (2 to 8) to touch ROTATE_BYTES between two uses of one on
    the GPU, 2 elsewhere. make_set() -> (grad_inputs, others, grad_outputs). A tensor every set
    shares (a weight, a rope table) is not rotated: only a set's own tensors count."""
    sets = [make_set(), make_set()]
    if torch.device(device).type == "cuda":
        shared = {id(t) for part in sets[1] for t in part}
        per_set = _nbytes([t for part in sets[0] for t in part if id(t) not in shared])
        count = min(8, max(2, math.ceil(ROTATE_BYTES / max(per_set, 1))))
        sets += [make_set() for _ in range(count - 2)]
    return sets


def _fwd_bwd(fn, sets):
    """step(): fn(*grad_inputs, *others) forward and backward on the next input set."""
    cycle = itertools.cycle(sets)

    def step():
        grad_inputs, others, grad_outputs = next(cycle)
        outs = fn(*grad_inputs, *others)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        torch.autograd.grad(outs, grad_inputs, grad_outputs)

    return step


def _model_op_cases(shape, device, liger):
    """[(op, size, {provider: fn}, make_set, work)]: fn(*grad_inputs, *others) -> outputs;
    work is {"bytes": the op must move at least, forward + backward} or {"flops": ...}."""
    dt, es, eps = torch.bfloat16, 2, 1e-5
    t, h, ffn = shape.tokens, shape.hidden, shape.ffn
    b, s, d = shape.batch, shape.seq, shape.head_dim

    def rnd(*size, grad=False):
        return torch.randn(*size, device=device, dtype=dt, requires_grad=grad)

    ours = f"fastllm ({'triton' if torch.device(device).type == 'cuda' else 'cpp'})"
    cases = []

    norm_w = torch.nn.Parameter((1 + 0.1 * torch.randn(h, device=device)).to(dt))
    fns = {ours: lambda x, w: fastllm.ops.rms_norm(x, w, eps),
           "torch eager": bench_model._rms_norm_torch}
    if liger:
        # as apply_liger_kernel_to_llama sets it up: casting_mode "llama", dx written into dy
        norm = liger.RMSNorm(h, eps=eps).to(device=device, dtype=dt)
        norm.weight = norm_w
        fns[LIGER] = lambda x, w: norm(x)
    cases.append(("rms_norm", f"x {t}x{h}, bf16", fns,
                  lambda: ([rnd(t, h, grad=True), norm_w], [], [rnd(t, h)]),
                  dict(bytes=5 * t * h * es)))  # fwd: x in, y out; bwd: x, dy in, dx out

    # cos, sin as one (1, S, D) table for the batch: the op's unavoidable bytes are q and k's
    inv = 1.0 / 100000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    fns = {ours: lambda q, k, c, s_: fastllm.ops.rotary_embedding(q, k, c, s_),
           "torch eager": bench_model._rotary_torch}
    if liger:
        # HF's layout: (B, H, S, D) views of the projections' (B, S, H, D); back to the latter
        fns[LIGER] = lambda q, k, c, s_: tuple(o.transpose(1, 2) for o in liger.rotary_pos_emb(
            q.transpose(1, 2), k.transpose(1, 2), c, s_))
    cases.append(("rotary_embedding",
                  f"q {b}x{s}x{shape.heads}x{d}, k {shape.kv_heads} heads, cos/sin (1, {s}, {d}), "
                  "bf16", fns,
                  lambda: ([rnd(b, s, shape.heads, d, grad=True),
                            rnd(b, s, shape.kv_heads, d, grad=True)], [cos, sin],
                           [rnd(b, s, shape.heads, d), rnd(b, s, shape.kv_heads, d)]),
                  dict(bytes=4 * b * s * (shape.heads + shape.kv_heads) * d * es)))

    # the gated MLP activations: SwiGLU (Llama) and GeGLU (Gemma)
    for op, torch_fn, liger_fn in (("swiglu", bench_model._swiglu_torch, "silu_mul"),
                                   ("geglu", bench_model._geglu_torch, "gelu_mul")):
        fns = {ours: getattr(fastllm.ops, op), "torch eager": torch_fn}
        if liger:
            fns[LIGER] = getattr(liger, liger_fn)
        cases.append((op, f"gate, up {t}x{ffn}, bf16", fns,
                      lambda: ([rnd(t, ffn, grad=True), rnd(t, ffn, grad=True)], [],
                               [rnd(t, ffn)]),
                      dict(bytes=8 * t * ffn * es)))  # fwd: 2 in 1 out; bwd: 3 in 2 out

    head_w = torch.nn.Parameter(0.02 * torch.randn(shape.vocab, h, device=device).to(dt))
    fns = {ours: fastllm.ops.fused_linear_cross_entropy,
           "torch eager": lambda x, w, y: F.cross_entropy(F.linear(x, w).float(), y)}  # HF's
    if liger:
        loss = liger.FusedLinearCrossEntropyLoss()
        fns[LIGER] = lambda x, w, y: loss(w, x, y)
    one = torch.ones((), device=device)
    cases.append(("fused_linear_cross_entropy",
                  f"hidden {t}x{h}, tied head {shape.vocab}x{h}, bf16, mean", fns,
                  lambda: ([rnd(t, h, grad=True), head_w],
                           [torch.randint(0, shape.vocab, (t,), device=device)], [one]),
                  dict(flops=3 * 2 * t * h * shape.vocab)))  # logits, dX, dW

    # DPO's log-probabilities of the labels under a frozen (LoRA) head, a grad per token
    fns = {ours: fastllm.preference.token_logps,
           "torch eager": fastllm.preference.token_logps_ref}  # logits, log_softmax, gather
    cases.append(("token_logps", f"hidden {t}x{h}, frozen head {shape.vocab}x{h}, bf16", fns,
                  lambda: ([rnd(t, h, grad=True)],
                           [head_w.detach(), torch.randint(0, shape.vocab, (t,), device=device)],
                           [torch.randn(t, device=device)]),
                  dict(flops=2 * 2 * t * h * shape.vocab, gemms=2)))  # logits, dX
    return cases


def _gemm_floor(shape, device, gemms=3):
    """The loss's three GEMMs alone (logits, dX, dW into preallocated outputs, bf16; gemms=2: a
    frozen head's logits and dX): what no fused loss can beat."""
    dt = torch.bfloat16
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dt)
    w = torch.randn(shape.vocab, shape.hidden, device=device, dtype=dt)
    z = torch.empty(shape.tokens, shape.vocab, device=device, dtype=dt)
    gx, gw = torch.empty_like(x), torch.empty_like(w)

    def step():
        torch.mm(x, w.t(), out=z)
        torch.mm(z, w, out=gx)
        if gemms == 3:
            torch.mm(z.t(), x, out=gw)

    return step


def _model_ops(shape, device, scale, liger, why, rows):
    smoke = scale != 1
    x_copy, y_copy = _copy_buffers(device, 4096 if smoke else 1)
    for op, size, fns, make_set, work in _model_op_cases(shape, device, liger):
        size = f"{size}, fwd+bwd"
        gemms = work.pop("gemms", 3)
        sets = _input_sets(make_set, device)
        steps, failed = {}, {}
        for name, fn in fns.items():
            step = _fwd_bwd(fn, sets)
            try:
                step()  # compiles the Triton kernels; a provider that fails here is reported
            except Exception as exc:
                failed[name] = _failure(name, exc, device, (LIGER,))
                continue
            steps[name] = step
        if "bytes" in work:
            steps["copy_ (ceiling)"] = lambda: x_copy.copy_(y_copy)
        else:
            steps[f"its {gemms} GEMMs alone (torch.mm)"] = _gemm_floor(shape, device, gemms)
        if smoke:  # each step ran once above: one more round checks the rest of the code
            timings = harness.measure_many(steps, device=device, warmup=0, min_reps=1,
                                           max_reps=1, min_time_s=0.0)
        else:
            timings = _time(steps, device, queue_ahead_ms=KERNEL_QUEUE_AHEAD_MS)
        for name, timing in timings.items():
            if name == "copy_ (ceiling)":
                rows.append({"op": f"model/{op}", "size": size, "provider": name,
                             "time_ms": timing.median_ms, "bytes": 8 * x_copy.numel(),
                             "probe": True, "note": "the ceilings case's copy, timed in these "
                             "rounds"})
                continue
            kernels, per_kernel = _kernel_profile(steps[name], device)
            peak = _peak_mib(steps[name], device)
            notes = [f"{kernels} kernels per call" if kernels is not None else None,
                     f"peak +{peak:.0f} MiB" if peak is not None else None]
            if name.startswith("fastllm") and per_kernel:  # where its GPU time goes
                notes.append(f"GPU {sum(per_kernel.values()):.3f} ms: "
                             f"{_top_kernels(per_kernel, 5)}")
            rows.append({"op": f"model/{op}", "size": size, "provider": name,
                         "time_ms": timing.median_ms, **work, "baseline": "torch eager",
                         "peak_mib": peak, "note": ", ".join(n for n in notes if n) or None})
        for name, note in failed.items():
            rows.append({"op": f"model/{op}", "size": size, "provider": name, "time_ms": None,
                         "note": note})
        if not liger:
            rows.append({"op": f"model/{op}", "size": size, "provider": LIGER, "time_ms": None,
                         "note": why})
        del sets, steps
    del x_copy, y_copy


_MISSING = object()


def _module_state(module, classes=None):
    """What apply_liger_kernel_to_llama may rebind process-wide in transformers' modeling_llama:
    its globals (apply_rotary_pos_emb, LlamaRMSNorm, LlamaMLP) and the attributes of the classes
    it defines (LlamaForCausalLM.forward without model=)."""
    names = dict(vars(module))
    if classes is None:
        classes = [v for v in names.values()
                   if isinstance(v, type) and v.__module__ == module.__name__]
    return names, {cls: dict(vars(cls)) for cls in classes}


def _set_module_state(module, state):
    names, classes = state
    now = vars(module)
    for key in [k for k in now if k not in names]:
        delattr(module, key)
    for key, value in names.items():
        if now.get(key, _MISSING) is not value:
            setattr(module, key, value)
    for cls, attrs in classes.items():
        now = vars(cls)
        for key in [k for k in now if k not in attrs]:
            delattr(cls, key)
        for key, value in attrs.items():
            if key not in ("__dict__", "__weakref__") and now.get(key, _MISSING) is not value:
                setattr(cls, key, value)


@contextlib.contextmanager
def _in_state(module, state, restore):
    _set_module_state(module, state)
    try:
        yield
    finally:
        _set_module_state(module, restore)


def _llama(shape, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=max(2048, shape.seq), rms_norm_eps=1e-5,
                         tie_word_embeddings=True, rope_theta=100000.0,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _model_step_case(base, ids, finetune, shape, device, liger, why, rows, rounds, warmup,
                     compiled=False):
    """One (finetune) case: every provider's model built from `base`'s weights (LoRA: the same
    adapter everywhere), its warm-up steps, its peak memory, then `rounds` interleaved timed
    steps and a profiled one. compiled: fastllm's model with each decoder layer compiled beside
    fastllm eager, HF and Liger-Kernel, in place of the CUDA-graph rows (a part of its own, after
    the others: a compile that overruns the budget loses only this part)."""
    import peft
    from transformers.models.llama import modeling_llama

    cuda = torch.device(device).type == "cuda"
    hf_state = _module_state(modeling_llama)
    targets = ["q_proj", "v_proj"]

    def allocated():
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return 0

    def peft_model(model, ours):
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0),
            autocast_adapter_dtype=False)
        with torch.no_grad():
            for name, layer in fastllm.lora.lora_modules(ours):
                theirs = model.base_model.model.get_submodule(name)
                theirs.lora_A["default"].weight.copy_(layer.lora_A)
                theirs.lora_B["default"].weight.copy_(layer.lora_B)
        return model

    def fastllm_setup():
        model = copy.deepcopy(base)
        if finetune == "lora":
            fastllm.lora.inject_lora(model, targets, r=16, alpha=32)
            torch.manual_seed(1)  # B starts at zero, as PEFT's: make the adapter do something
            with torch.no_grad():
                for _, layer in fastllm.lora.lora_modules(model):
                    layer.lora_B.normal_(0, 0.02)
        fastllm.patch(model)
        return model, fastllm.optim.AdamW(_trainable(model), lr=1e-5), None

    def hf_setup():
        model = copy.deepcopy(base)
        if finetune == "lora":
            model = peft_model(model, setups[ours][0])
        return model, torch.optim.AdamW(_trainable(model), lr=1e-5, fused=True), None

    def liger_setup():
        model = copy.deepcopy(base)
        try:
            liger.apply_to_llama(model=model)
            # its rotary is a global of modeling_llama: Liger's only inside this model's forward
            state = _module_state(modeling_llama, list(hf_state[1]))
        finally:
            _set_module_state(modeling_llama, hf_state)
        if finetune == "lora":
            model = peft_model(model, setups[ours][0])
        return model, torch.optim.AdamW(_trainable(model), lr=1e-5, fused=True), state

    def compiled_setup():
        model, opt, state = fastllm_setup()
        from fastllm.parallel import decoder_layers
        from fastllm.train.model import compile_layers

        # each layer, as `fastllm train torch_compile=true`; on a CPU (--smoke, the tests) dynamo
        # and AOTAutograd only: the code path, without inductor's C++ compile
        compile_layers(decoder_layers(model), backend="inductor" if cuda else "aot_eager")
        return model, opt, state

    def graph_setup(setup, optimizer):
        def make():
            model, _, state = setup()
            return model, optimizer(_trainable(model), lr=1e-5, capturable=True), state
        return make

    hf = "HF + PEFT" if finetune == "lora" else "HF"
    lig = LIGER_STEP + (" + PEFT" if finetune == "lora" else "")
    ours = "fastllm"
    makers = {ours: fastllm_setup, hf: hf_setup}  # fastllm first: PEFT copies its adapter
    if liger:
        makers[lig] = liger_setup
    ours_graph, hf_graph = ours + GRAPH, hf + GRAPH
    graphed = (ours_graph, hf_graph) if cuda and not compiled else ()
    if graphed:
        makers[ours_graph] = graph_setup(fastllm_setup, fastllm.optim.AdamW)
        makers[hf_graph] = graph_setup(hf_setup, functools.partial(torch.optim.AdamW, fused=True))
    if compiled:
        makers[COMPILED] = compiled_setup

    def train_step(model, opt, state):
        def step():
            with _in_state(modeling_llama, state, hf_state) if state else contextlib.nullcontext():
                # no KV cache, as `fastllm train` and HF's Trainer under gradient checkpointing:
                # in training it is never read, and a compiled layer would be compiled again
                # for each layer index the cache's update is guarded on
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    setups, fns, first_loss, held, failed = {}, {}, {}, {}, {}
    for name, make in makers.items():
        before = allocated()
        try:
            setups[name] = make()
            if name in graphed:  # (the warm-up leaves the grads None: the capture's own)
                fns[name] = _graphed(lambda: train_step(*setups[name]), device)
            else:
                fns[name] = train_step(*setups[name])
            first_loss[name] = float(fns[name]())
            for _ in range(warmup - 1):
                fns[name]()
        except Exception as exc:
            failed[name] = _failure(name, exc, device, (lig,))
            setups.pop(name, None)
            fns.pop(name, None)
            continue
        held[name] = allocated() - before  # params, optimizer state, whatever it keeps
    # (a replay allocates nothing: its activations live in the graph's pool, not counted here)
    peaks = {name: None if name in graphed else _peak_mib(fn, device) for name, fn in fns.items()}
    order = [n for n in (hf, lig, ours, COMPILED, hf_graph, ours_graph) if n in fns]
    timings = harness.measure_many({n: fns[n] for n in order}, device=device, warmup=0,
                                   min_reps=rounds, max_reps=rounds, min_time_s=0.0)
    # kernels per step, and the GPU's share of a step
    kernels, gpu_time = {}, {}
    for n in order:
        kernels[n], gpu_time[n] = _kernel_profile(fns[n], device)

    size = (f"SmolLM2-135M shape, random init, {shape.layers} layers, "
            f"{shape.batch}x{shape.seq} tokens, {finetune}"
            f"{' r=16 on q/v' if finetune == 'lora' else ''}, pure bf16 (bf16 params and AdamW "
            "state on every side)" + (", the torch.compile part" if compiled else ""))
    result, by_name = {}, {}
    for name in order:
        ms = timings[name].median_ms
        peak = None if peaks[name] is None else held[name] / M + peaks[name]
        result[name] = (shape.tokens / ms * 1e3, peak)
        notes = [f"{shape.tokens / ms * 1e3:.0f} tokens/s",
                 None if peak is None else
                 f"peak {peak:.0f} MiB (params, grads, optimizer state, activations)",
                 f"first loss {first_loss[name]:.4f}",
                 None if kernels[name] is None else f"{kernels[name]} kernels per step"]
        if name == lig:
            notes.append(f"liger-kernel {liger.version}")
        if gpu_time[name]:
            notes.append(f"kernels {sum(gpu_time[name].values()):.1f} ms of the step, most: "
                         f"{_top_kernels(gpu_time[name], 4)}")
        by_name[name] = {"op": "model step", "size": size, "provider": name, "time_ms": ms,
                         "tokens_per_s": shape.tokens / ms * 1e3, "peak_mib": peak,
                         "first_loss": first_loss[name], "baseline": hf,
                         "note": ", ".join(n for n in notes if n)}
        rows.append(by_name[name])
    for mine in (ours, COMPILED, ours_graph):
        for peer in (hf, lig) + ((hf_graph,) if mine == ours_graph else ()):
            if peer in result and mine in by_name:
                tps, peak = result[peer]
                vs = f"vs {peer}: x{result[mine][0] / tps:.2f} tokens/s"
                if peak and result[mine][1]:
                    vs += f", {100 * result[mine][1] / peak:.0f}% of its memory"
                by_name[mine]["note"] += "; " + vs
    for name, note in failed.items():
        rows.append({"op": "model step", "size": size, "provider": name, "time_ms": None,
                     "note": note})
    if not liger:
        rows.append({"op": "model step", "size": size, "provider": lig, "time_ms": None,
                     "note": why})


def model(device, scale, rows):
    shape = _model_shape(scale)
    liger, why = _liger(device)
    _model_ops(shape, device, scale, liger, why, rows)
    if _checkpoint:
        _checkpoint()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    base = _llama(shape, device)
    torch.manual_seed(0)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=device)
    rounds, warmup = (STEP_ROUNDS, STEP_WARMUP) if scale == 1 else (1, 1)
    parts = [("full", False), ("lora", False)]
    if os.environ.get("FASTLLM_DEVICE_COMPILE", "1") != "0":  # (=0: without the compiled part)
        parts.append(("full", True))
    for finetune, compiled in parts:
        _model_step_case(base, ids, finetune, shape, device, liger, why, rows, rounds, warmup,
                         compiled)
        if _checkpoint:
            _checkpoint()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def _packed_doc_start(batch, seq, shortest, longest, device):
    """(B, T) doc_start of rows packed with documents of uniform random lengths."""
    from fastllm.ops.attention import doc_start_from_position_ids

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        pos = []
        while len(pos) < seq:
            n = int(torch.randint(shortest, longest + 1, (1,), generator=g))
            pos += list(range(min(n, seq - len(pos))))
        rows.append(pos)
    return doc_start_from_position_ids(torch.tensor(rows, device=device))


def packed(device, scale, rows, dtype=torch.bfloat16):
    """Packed documents' attention, fwd+bwd: SDPA with the document mask (transformers' way)
    against fastllm.ops.attention; dtype other than the GPU run's bf16 for CPU runs (fp32)."""
    from fastllm.ops.attention import _mask, attention, document_segments, gpu_varlen_applies

    shape = _model_shape(scale)
    b, t, hq, hkv = shape.batch, shape.seq, shape.heads, shape.kv_heads
    d = shape.hidden // shape.heads
    doc_start = _packed_doc_start(b, t, max(1, 64 // scale), max(2, 1024 // scale), device)
    segments = document_segments(doc_start)
    mask = _mask(doc_start, t, device)
    lengths = torch.diff(segments.cu_seqlens).double()
    # causal (L(L+1)/2 products per document); forward 2 GEMMs, backward 5 (S recomputed):
    # bench_model.py's convention (flash attention's), 3.5x the forward's 2 * 2 * H * d * pairs
    flops = 7 * 2 * hq * d * float((lengths * (lengths + 1) / 2).sum())

    def make_set():
        q = torch.randn(b, t, hq, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, t, hkv, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, t, hkv, d, device=device, dtype=dtype, requires_grad=True)
        return [q, k, v], [], [torch.randn(b, t, hq, d, device=device, dtype=dtype)]

    def sdpa(q, k, v, attn_mask, is_causal):
        if attn_mask is not None:  # what transformers does with a mask (use_gqa_in_sdpa): a
            # mask with enable_gqa would leave SDPA only its math kernel
            k, v = k.repeat_interleave(hq // hkv, dim=2), v.repeat_interleave(hq // hkv, dim=2)
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
            is_causal=is_causal, enable_gqa=attn_mask is None).transpose(1, 2)

    providers = {
        "torch sdpa + document mask": lambda q, k, v: sdpa(q, k, v, mask, False),
        "fastllm": lambda q, k, v: attention(q, k, v, doc_start=doc_start, segments=segments),
        "torch sdpa causal, no documents": lambda q, k, v: sdpa(q, k, v, None, True),
    }
    sets = _input_sets(make_set, device)
    fns = {name: _fwd_bwd(fn, sets) for name, fn in providers.items()}
    size = (f"{b}x{t} tokens in {segments.cu_seqlens.numel() - 1} documents of "
            f"{max(1, 64 // scale)}-{max(2, 1024 // scale)}, {hq}/{hkv} heads of {d}, "
            f"{str(dtype).split('.')[-1]}, fwd+bwd")
    peak = {name: _peak_mib(fn, device) for name, fn in fns.items()}
    q, k = sets[0][0][:2]
    route = ("PyTorch's varlen flash attention" if gpu_varlen_applies(q, k)
             else "no varlen here: " + ("fastllm's cpp kernel" if q.device.type == "cpu"
                                        else "SDPA with the document mask"))
    for name, timing in _time(fns, device).items():
        row = {"op": "attention (packed)", "size": size, "provider": name,
               "time_ms": timing.median_ms, "baseline": "torch sdpa + document mask",
               "peak_mib": peak[name]}
        if name != "torch sdpa causal, no documents":  # the same useful work
            row["flops"] = flops
        if name == "fastllm":
            row["note"] = route
        rows.append(row)


CASES = {"ceilings": ceilings, "adamw": adamw, "master": master, "lowbyte": lowbyte,
         "lora": lora, "large": large, "packed": packed, "model": model, "qlora": qlora}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU run of the code)")
    parser.add_argument("--cases", default=",".join(CASES))
    opts = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not opts.smoke else "cpu"
    scale = 64 if opts.smoke else 1
    machine = harness.machine_description(device)
    rows, failed = [], []

    def save():  # whole or not at all: a kill mid-write leaves the last JSON
        try:
            harness.annotate(rows)
        except Exception:  # the measured times are still worth keeping, unannotated
            traceback.print_exc()
        with open(opts.json + ".tmp", "w") as f:
            json.dump({"device": device, "machine": machine, "rows": rows, "failed": failed}, f,
                      indent=1, default=str)
        os.replace(opts.json + ".tmp", opts.json)

    global _checkpoint
    _checkpoint = save
    for name in opts.cases.split(","):
        print(f"device_bench: {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            CASES[name](device, scale, rows)
        except Exception as exc:  # one case failing must not lose the others' numbers
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        print(f"device_bench: {name} took {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        save()  # after every case: a run cut short keeps what it measured
    # a provider's FAILED row (on the GPU each is kept as a row, not raised; the peers' excepted)
    failed += [f"{r['op']} {r['size']}: {r['provider']}: {r['note']}" for r in rows
               if str(r.get("note")).startswith("FAILED") and "liger" not in r["provider"].lower()]
    save()
    print(f"{device}: {machine}\n")
    print(harness.format_table(rows))
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
