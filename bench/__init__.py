"""Kernel benchmarks (installed as fastllm.bench): one bench_<op>.py per op on harness.py.

Each module exposes `run(device, full, progress) -> list[dict]` (rows: see harness.py) and
pytest-benchmark tests (`pytest bench --benchmark-only`). `fastllm bench` runs the modules in OPS.
"""

# op name -> module, in the order `fastllm bench` runs them
OPS = {
    "adamw": "fastllm.bench.bench_adamw",
    "adamw_master": "fastllm.bench.bench_adamw_master",
    "lora_linear": "fastllm.bench.bench_lora_linear",
}
