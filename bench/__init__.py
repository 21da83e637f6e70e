"""Kernel benchmarks (installed as fastllm.bench): one bench_<op>.py per op on harness.py.

Each module exposes `run(device, full, progress) -> list[dict]` (rows: see harness.py), and
may expose `settings(full, device)` (checked for every op before any runs; SystemExit for a bad
FASTLLM_BENCH_* or device) and `DEVICES` (the device types it runs on, by default cpu and cuda:
`--ops all` leaves out the others). A skipped provider is reported with
harness.note(progress, message), which stays on screen and is listed under the table.
`fastllm bench` runs the modules in OPS, so they must import without pytest (the bench extra
does not install it): pytest-benchmark tests go in test_benchmarks.py
(`pytest bench --benchmark-only`).
"""

# What bench/host_gpu_path.py (the GPU path's host work, on CPU tensors) runs under, set in its
# process's environment before fastllm is imported (here: bench_host.py reads it in the parent
# process, where importing host_gpu_path would set these for every later benchmark too)
GPU_PATH_ENV = {"TRITON_INTERPRET": "1", "FASTLLM_CPU_ATTENTION": "torch",
                "FASTLLM_CPU_FP32_MATMUL": "aten"}

# op name -> module, in the order `fastllm bench` runs them
OPS = {
    "adamw": "fastllm.bench.bench_adamw",
    "adamw_master": "fastllm.bench.bench_adamw_master",
    "lora_linear": "fastllm.bench.bench_lora_linear",
    # the training runtime
    "train": "fastllm.bench.bench_train",
    # 3D parallel layouts and the planner
    "parallel": "fastllm.bench.bench_parallel",
    # data parallel (DDP, ZeRO-1/2 DistributedOptimizer, comm hooks)
    "distributed": "fastllm.bench.bench_distributed",
    # PowerSGD, GaLore, BAdam
    "compression": "fastllm.bench.bench_compression",
    # low-byte optimizer state
    "adamw8bit": "fastllm.bench.bench_adamw8bit",
    # host cost per tensor of an optimizer step (tiny CPU tensors)
    "host": "fastllm.bench.bench_host",
    # the LM head + loss, fused (minutes on 2 CPU cores: SmolLM2's 49152-token vocabulary)
    "fused_linear_cross_entropy": "fastllm.bench.bench_fused_linear_cross_entropy",
    # RMSNorm, rotary, SwiGLU, and a SmolLM2-shaped training step under fastllm.patch
    "model": "fastllm.bench.bench_model",
    # fp32 CPU GEMMs: ATen's against fastllm's oneDNN route (fastllm/_gemm.py)
    "gemm": "fastllm.bench.bench_gemm",
}

# what `fastllm bench` (and `make bench`) runs without --ops: about a minute on an
# idle 2-core machine. The others take minutes (adamw8bit's bitsandbytes and torchao peers take
# seconds per CPU step; train, parallel, distributed, compression run whole training steps) and
# run with `--ops NAME` or `--ops all`.
DEFAULT_OPS = ["adamw", "adamw_master", "lora_linear"]
