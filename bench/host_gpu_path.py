"""The host work of fastllm's GPU path, measured on a CPU: the Triton launches stubbed out.

On an H200 a patched SmolLM2 step was host-bound (2026-12-04: 59 ms of kernels in a 198 ms step,
Hugging Face's 96 in 149): what the host does around each kernel decides the step's time. This
runs that host work on CPU tensors, where it can be measured without a GPU: the Triton backend
forced (the kernels' GPU path) under TRITON_INTERPRET=1, with every Triton launch replaced by a
call that returns at once, so the time is fastllm's Python, autograd and allocations around the
kernels, not the kernels. Not in it: Triton's own launcher (binding and the driver call, the
same for any Triton user, Liger-Kernel's included) and CUDA's per-launch cost of each aten op
(which falls on Hugging Face's side more: it runs more ops). The kernels' outputs are left
unwritten; nothing reads them.

The GPU path's choices are made as on a GPU: fp32 matmuls through ATen (the GPU's F.linear; on a
CPU fastllm may route them to oneDNN), attention by transformers' SDPA (on a GPU fastllm runs no
attention of its own for plain causal rows).

    TRITON_INTERPRET=1 python -m fastllm.bench.host_gpu_path             # JSON rows
    TRITON_INTERPRET=1 python -m fastllm.bench.host_gpu_path --launches  # the Triton launches
                                                                         # of one call of each
(`fastllm bench --ops host` runs it so. TRITON_INTERPRET must be in the environment: `python -m`
imports the fastllm package before this module's lines run, and fastllm refuses Triton on CPU
tensors where the variable was set after its import; without it this refuses to run, where it
measured the reference path, with no launch.)
"""

import copy
import json
import os
import sys

from fastllm.bench import GPU_PATH_ENV

# (for a run without them in its environment: the CPU policies are read at each call; the
# Triton backend on CPU tensors is refused by _prepared, TRITON_INTERPRET having come too late)
os.environ.update(GPU_PATH_ENV)

ENV = tuple(f"{key}={value}" for key, value in GPU_PATH_ENV.items())


def _stub_launches():
    """Make every Triton launch return at once; returns the Counter of launches by kernel."""
    import collections

    from triton.runtime import interpreter

    launches = collections.Counter()

    def run(self, *args, grid=None, warmup=False, **kwargs):
        launches[getattr(self.fn, "__name__", "?")] += 1

    interpreter.InterpretedFunction.run = run
    return launches


# the model ops whose GPU backend (their preference for CUDA tensors) takes CPU tensors here
_MODEL_OPS = ("rms_norm", "rotary_embedding", "swiglu", "fused_linear_cross_entropy",
              "lora_linear")


def _gpu_preferences():
    """Give the model ops on CPU tensors the backend choice they make on a GPU, unforced (a
    forced backend is chosen again on every call, and its backward runs under use_backend; an
    unforced choice is kept, as on a GPU)."""
    import importlib

    from fastllm import _backend

    for name in _MODEL_OPS:
        preference = importlib.import_module(f"fastllm.ops.{name}")._PREFERENCE
        preference["cpu"] = preference["cuda"]
    getattr(_backend, "_CHOSEN", {}).clear()  # (older checkouts, for comparing: no cache)


def _prepared():
    """Stub the launches and take the GPU's backend choices; the Counter of launches."""
    from fastllm import _backend

    why = _backend.unavailable_reason("triton", "cpu")
    if why is not None:
        raise SystemExit(f"bench/host_gpu_path.py: {why}: run it as `TRITON_INTERPRET=1 python "
                         f"-m fastllm.bench.host_gpu_path` (fastllm bench --ops host does)")
    launches = _stub_launches()
    _gpu_preferences()
    return launches


def _launches_of(fn, launches):
    """{kernel: launches} of one call of fn."""
    launches.clear()
    fn()
    return dict(launches)


def rows(progress=lambda msg: None):
    from fastllm.bench.bench_host import model_op_rows

    launches = _prepared()
    note = "GPU path, Triton launches stubbed, " + " ".join(ENV)
    out = model_op_rows(progress, ours="fastllm (triton path)", suffix=f", {note}")
    for finetune in _finetunes():
        out += _step_rows(finetune, launches, note, progress)
    return out


def _finetunes():
    """The steps this machine can build: LoRA's peer is PEFT's."""
    import importlib.util

    return ("full", "lora") if importlib.util.find_spec("peft") is not None else ("full",)


def _models(finetune):
    """{provider: tiny_llama() model}: fastllm.patch against Hugging Face, full fine-tuning or
    LoRA r=16 on q/v (fastllm.lora against PEFT), the same weights on both sides; and the ids."""
    import fastllm
    from fastllm.bench.bench_host import tiny_llama

    base, ids = tiny_llama()
    hf, ours = copy.deepcopy(base), base
    if finetune == "lora":
        import peft

        config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                 lora_dropout=0.0)
        hf = peft.get_peft_model(hf, config, autocast_adapter_dtype=False)
        fastllm.lora.inject_lora(ours, ["q_proj", "v_proj"], r=16, alpha=32)
    # linear=False: on a GPU the patched nn.Linear forward calls F.linear first, as cheaply as
    # nn.Linear's own; on a CPU it first checks fastllm's CPU matmul policies (microseconds a
    # layer that a GPU step does not pay)
    fastllm.patch(ours, linear=False)
    return {"fastllm.patch (triton path)": ours,
            "Hugging Face" + (" + PEFT" if finetune == "lora" else ""): hf}, ids


def _step_rows(finetune, launches, note, progress):
    from fastllm.bench import harness
    from fastllm.bench.bench_host import step_of

    models, ids = _models(finetune)
    fns = {name: step_of(m, ids) for name, m in models.items()}
    ours, peer = fns
    fns[ours]()  # (warm-up: the first call builds what later ones reuse)
    per_step = _launches_of(fns[ours], launches)
    what = "full" if finetune == "full" else "LoRA r=16 q/v"
    size = (f"model step fwd+bwd ({what}), 30-layer Llama, hidden 64, 16 tokens, 1 thread, "
            f"{note}")
    progress(f"host: {size}")
    times = harness.measure_many(fns, warmup=3, min_reps=10, max_reps=200, min_time_s=3.0)
    rows = []
    for name, t in times.items():
        row = {"op": "host", "size": size, "provider": name, "time_ms": t.median_ms,
               "baseline": peer}
        if name == ours:
            row["note"] = f"{sum(per_step.values())} Triton launches per step: " + ", ".join(
                f"{k} {v}" for k, v in sorted(per_step.items()))
        rows.append(row)
    return rows


def launch_counts():
    """{what: {kernel: launches}} of one call of each model op pair's fastllm side and of one
    patched step, on the path rows() times (what tests/test_bench.py checks it times)."""
    from fastllm.bench.bench_host import model_op_pairs, step_of

    launches = _prepared()
    counts = {op: _launches_of(lambda f=ours: f().sum().backward(), launches)
              for op, (ours, _) in model_op_pairs().items()}
    for finetune in _finetunes():
        models, ids = _models(finetune)
        counts[f"step {finetune}"] = _launches_of(step_of(next(iter(models.values())), ids),
                                                  launches)
    return counts


def main():
    import torch

    torch.set_num_threads(1)
    if sys.argv[1:] == ["--launches"]:
        json.dump(launch_counts(), sys.stdout)
        return
    json.dump(rows(progress=lambda msg: print(msg, file=sys.stderr)), sys.stdout)


if __name__ == "__main__":
    main()
