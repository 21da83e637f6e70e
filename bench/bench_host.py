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

Then the model ops' host cost: one forward and backward of each op fastllm.patch puts in a
model, on inputs so small (16 tokens) that the time is the Python and dispatch around the
kernels, against the torch eager maths Hugging Face runs (on an H200 a patched SmolLM2 step
spent 59 ms in kernels and 198 ms in all: the host's part, 2026-12-04); and a whole training step
of a 30-layer Llama as small, patched against Hugging Face's. Then the same ops and step on
fastllm's GPU path with its Triton launches stubbed out (bench/host_gpu_path.py, in a process of
its own): the host work a GPU step pays around fastllm's kernels, measured without a GPU.

    fastllm bench --ops host
"""

import torch
import torch.nn.functional as F

import fastllm
from fastllm.bench import harness

# CPU tensors by design: `fastllm bench --ops all --device cuda` leaves it out
DEVICES = ("cpu",)
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


def model_op_pairs():
    """{op: (fastllm's forward, torch eager's forward of the same maths)} on 16 tokens, each
    returning a tensor of the op's result (the rotary pair: the sum of q's and k's)."""
    from fastllm.ops import (fused_linear_cross_entropy, lora_linear, rms_norm,
                             rotary_embedding, swiglu)
    from fastllm.ops.gated_mlp import swiglu_mlp

    gen = torch.Generator().manual_seed(0)

    def r(*shape, grad=True):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    x, w = r(16, 64), r(64)
    q, k = r(1, 16, 4, 16), r(1, 16, 2, 16)
    cos, sin = r(1, 16, 16, grad=False), r(1, 16, 16, grad=False)
    gate, up = r(16, 128), r(16, 128)
    base, a, b = r(64, 64, grad=False), r(8, 64), r(64, 8)
    hidden, head, labels = r(16, 64), r(256, 64), torch.randint(0, 256, (16,), generator=gen)
    # (scaled as a model's are, 1 / sqrt(fan in): outputs of order 1, whose float rounding the
    # same-maths check of tests/test_bench.py compares at 1e-5)
    wg, wu, wd = ((torch.randn(*shape, generator=gen) / shape[1] ** 0.5).requires_grad_()
                  for shape in ((128, 64), (128, 64), (64, 128)))

    def rope(t):  # Hugging Face's rotate-half form
        c, s_ = cos.unsqueeze(2), sin.unsqueeze(2)
        half = t.shape[-1] // 2
        return t * c + torch.cat((-t[..., half:], t[..., :half]), -1) * s_

    def torch_rms():
        v = x.float().pow(2).mean(-1, keepdim=True)
        return w * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)

    pairs = {
        "rms_norm 16x64": (lambda: rms_norm(x, w), torch_rms),
        "rotary_embedding q 16x4x16, k 2 heads": (
            lambda: sum(t.sum() for t in rotary_embedding(q, k, cos, sin)),
            lambda: rope(q).sum() + rope(k).sum()),
        "swiglu 16x128": (lambda: swiglu(gate, up), lambda: F.silu(gate) * up),
        "lora_linear 16x64 -> 64, r=8": (
            lambda: lora_linear(x, base, a, b, 2.0),
            lambda: F.linear(x, base) + F.linear(F.linear(x, a), b) * 2.0),
        "fused_linear_cross_entropy 16x64 -> 256": (
            lambda: fused_linear_cross_entropy(hidden, head, labels),
            lambda: F.cross_entropy(F.linear(hidden, head).float(), labels)),
        # the patched MLP where its projections are plain layers (fastllm.ops.gated_mlp)
        "swiglu_mlp 16x64 -> 128 -> 64": (
            lambda: swiglu_mlp(x, wg, wu, wd),
            lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)),
    }
    return pairs


def model_op_rows(progress, ours="fastllm", suffix=""):
    """Rows of model_op_pairs() timed fwd+bwd, fastllm's side named `ours`; `suffix` ends each
    case's name (bench/host_gpu_path.py's rows say how they ran)."""
    rows = []
    for op, fns in model_op_pairs().items():
        mine, theirs = (lambda f=f: f().sum().backward() for f in fns)
        size = f"model op fwd+bwd, {op}, 1 thread{suffix}"
        progress(f"host: {size}")
        times = harness.measure_many({ours: mine, "torch eager": theirs}, warmup=20,
                                     min_reps=50, max_reps=2000, min_time_s=1.0)
        for name in (ours, "torch eager"):
            us = times[name].median_ms * 1e3
            rows.append({"op": "host", "size": size, "provider": name,
                         "time_ms": times[name].median_ms, "baseline": "torch eager",
                         "note": f"{us:.0f} us per call"})
    return rows


def tiny_llama():
    """(a 30-layer LlamaForCausalLM so small, hidden 64, that a step's time is the host's, in
    train mode; 16 token ids for it)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train(), torch.randint(0, 256, (1, 16))


def step_of(model, ids):
    """A training step's forward (labels: the ids) and backward, no optimizer."""
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
    return step


def _tiny_llama_step_rows(progress):
    """A whole training step (forward with labels, backward) of tiny_llama(): Hugging Face's
    model against fastllm.patch's."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    import copy

    base, ids = tiny_llama()
    size = "model step fwd+bwd, 30-layer Llama, hidden 64, 16 tokens, 1 thread"
    progress(f"host: {size}")
    fns = {"fastllm.patch": step_of(fastllm.patch(copy.deepcopy(base)), ids),
           "Hugging Face": step_of(copy.deepcopy(base), ids)}
    times = harness.measure_many(fns, warmup=3, min_reps=10, max_reps=200, min_time_s=3.0)
    return [{"op": "host", "size": size, "provider": name, "time_ms": times[name].median_ms,
             "baseline": "Hugging Face"} for name in fns]


def gpu_path_env(base=None):
    """The environment bench/host_gpu_path.py runs in: `base` (os.environ) with its settings.
    TRITON_INTERPRET must be set before fastllm is imported (fastllm refuses Triton on CPU
    tensors otherwise), and `python -m fastllm.bench.host_gpu_path` imports fastllm before the
    module's own lines run: without it in the environment the ops ran their reference instead
    of the stubbed Triton path, with no launch to count."""
    import os

    from fastllm.bench import GPU_PATH_ENV  # (not host_gpu_path: importing it sets them here)

    return {**(os.environ if base is None else base), **GPU_PATH_ENV}


def _gpu_path_rows(progress):
    """bench/host_gpu_path.py's rows (the GPU path's host work, Triton launches stubbed), from
    a process of its own: TRITON_INTERPRET must be set before triton is imported."""
    import importlib.util
    import json
    import subprocess
    import sys

    from fastllm import _backend

    if not _backend.triton_available() or importlib.util.find_spec("transformers") is None:
        return []  # (its steps are of a transformers Llama; the LoRA one needs peft too)
    progress("host: the GPU path (Triton launches stubbed), in a process of its own")
    done = subprocess.run([sys.executable, "-m", "fastllm.bench.host_gpu_path"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=1800,
                          env=gpu_path_env())
    if done.returncode:
        raise RuntimeError("bench/host_gpu_path.py failed:\n" + done.stderr[-4000:])
    return json.loads(done.stdout)


def settings(full=False, device="cpu"):
    """Checked by fastllm bench before any benchmark runs: the device."""
    if torch.device(device).type not in DEVICES:
        raise SystemExit("fastllm bench --ops host: a host-cost measurement on CPU tensors (its "
                         "GPU path is measured with Triton's launches stubbed); run it with "
                         "--device cpu")


def run(device="cpu", full=False, progress=print):
    settings(full, device)
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
        rows += model_op_rows(progress)
        rows += _tiny_llama_step_rows(progress)
        rows += _gpu_path_rows(progress)
    finally:
        torch.set_num_threads(threads)
    return rows
