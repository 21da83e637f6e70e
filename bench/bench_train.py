"""fastllm train against the same loop on plain PyTorch parts, activation checkpointing memory,
and the time split of a 2-process run.

    fastllm bench --ops train

Throughput: `fastllm train` (backend=fastllm: fastllm.optim.AdamW with fused clipping, fp32 master
weights for bf16, fastllm LoRA) against backend=torch (torch.optim.AdamW(fused=True) with
clip_grad_norm_, autocast for bf16, PEFT LoRA): same model, data, seed and step; the two runs
alternate in rounds and the median step time over rounds is reported (the first step of each
run, with its warm-up, is left out). Memory: peak tensor memory of one training step of a
24-layer model at checkpoint_ratio 0, 0.5 and 1 (fastllm.train.memory.PeakMemory on CPU,
torch.cuda.max_memory_allocated on GPU). Time split: a 2-process DDP run under torchrun (Gloo).
"""

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

# (name, overrides): the throughput cases
QUICK = [
    ("full fp32", ["model=mini", "finetune=full", "precision=fp32"]),
    ("full bf16 (fp32 master weights)", ["model=mini", "finetune=full", "precision=bf16"]),
    ("lora r=16 fp32", ["model=mini", "finetune=lora", "lora.r=16",
                        "lora.target_modules=q_proj,k_proj,v_proj,o_proj"]),
]
# One thread: on a shared 2-core machine OpenMP teams of 2 stall whenever another job runs.
COMMON = ["data.seq_len=128", "micro_batch_size=8", "threads=1", "checkpoint.interval=0",
          "checkpoint.auto_resume=false", "track_memory=false", "log_interval=100000"]


def _train(overrides, cache):
    from fastllm.train import TrainConfig, Trainer

    cfg = TrainConfig.from_args(COMMON + [f"data.cache_dir={cache}"] + overrides)
    quiet = io.StringIO()  # the bench prints one table, not each run's log and summary
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(quiet), \
            contextlib.redirect_stderr(quiet):
        cfg.output_dir = out
        return Trainer(cfg).train()


def _throughput(device, rounds, steps, progress, cache):
    rows = []
    for name, overrides in QUICK:
        times = {"fastllm train": [], "torch loop": []}
        losses = {}
        for r in range(rounds):
            for provider, backend in (("fastllm train", "fastllm"), ("torch loop", "torch")):
                progress(f"train {name}: {provider}, round {r + 1}/{rounds}")
                s = _train(overrides + [f"backend={backend}", f"max_steps={steps}",
                                        f"device={device}"], cache)
                times[provider].append(s["step_time_s"])
                losses[provider] = s["final_loss"]
        size = f"{name}, mini (4 layers, hidden 128), 8 x 128 tokens/step"
        for provider, ts in times.items():
            ms = statistics.median(ts) * 1e3
            rows.append(dict(op="train", size=size, provider=provider, time_ms=ms,
                             baseline="torch loop",
                             note=f"{8 * 128 / ms * 1e3:,.0f} tokens/s, final loss "
                                  f"{losses[provider]:.4f}"))
    return rows


def _activation_memory(device, progress, cache):
    rows = []
    peaks = {}
    for ratio in (0.0, 0.5, 1.0):
        progress(f"train memory: 24 layers, checkpoint_ratio={ratio}")
        s = _train(["model=mini", "model_config.num_hidden_layers=24", "max_steps=1",
                    f"checkpoint_ratio={ratio}", "track_memory=true", f"device={device}"], cache)
        peaks[ratio] = s["peak_mem_bytes"]
    size = "peak step memory, mini at 24 layers (hidden 128), 8 x 128 tokens"
    for ratio, peak in peaks.items():
        rows.append(dict(op="train memory", size=size, provider=f"checkpoint_ratio={ratio}",
                         note=f"peak {peak / 2**20:.1f} MiB, saves "
                              f"{(peaks[0.0] - peak) / 2**20:.1f} MiB "
                              f"({1 - peak / peaks[0.0]:.0%}) against ratio 0"))
    return rows


def _time_split(progress, cache):
    progress("train: 2-process DDP run under torchrun")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(29400 + os.getpid() % 500), "-m", "fastllm", "train",
               "model=mini", "max_steps=30", "parallel.strategy=ddp", f"output_dir={out}",
               f"data.cache_dir={cache}", *COMMON]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, capture_output=True, env=env, timeout=600)
        if done.returncode != 0:
            return [dict(op="train 2-process", size="ddp", provider="fastllm train",
                         note="torchrun failed: " + done.stderr.decode()[-300:])]
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
    split = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1%}" for k, v in s["split"].items())
    return [dict(op="train 2-process", size="mini, DDP on 2 CPU processes (Gloo), 8 x 128 "
                 "tokens per rank per step", provider="fastllm train",
                 time_ms=s["step_time_s"] * 1e3,
                 note=f"{s['tokens_per_s']:,.0f} tokens/s; time split: {split}")]


def run(device="cpu", full=False, progress=print):
    dev = torch.device(device).type
    with tempfile.TemporaryDirectory() as cache:
        rows = _throughput(dev, rounds=5 if full else 3, steps=16 if full else 12,
                           progress=progress, cache=cache)
        rows += _activation_memory(dev, progress, cache)
        if dev == "cpu":
            rows += _time_split(progress, cache)
    return rows
