"""The host cost of the model ops and of a tiny patched step, for comparing two checkouts.

    cd <checkout> && taskset -c 1 python bench/host_checkout.py     # one line per run

Times, in the checkout it is run from (its `fastllm` package first on sys.path), one forward and
backward of each of `fastllm bench --ops host`'s model ops (bench/bench_host.py model_op_pairs:
tiny inputs, so the time is the host's Python and dispatch) and a training step of its
tiny_llama() patched by fastllm.patch, 1 thread: medians of 7 rounds of 200 calls per op
and of 5 rounds of 10 steps. Run it alternately in the two checkouts (same fastllm._C) and
compare medians. (`fastllm bench --ops host` compares fastllm with torch eager in one process
through bench/harness.py; two checkouts cannot share a process, hence this plain timer.)
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fastllm  # noqa: E402
from bench_host import model_op_pairs, step_of, tiny_llama  # noqa: E402


def _median_s(fn, reps, rounds=7):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def main():
    torch.set_num_threads(1)
    ops = {op.split(" ")[0]: (lambda f=fns[0]: f().sum().backward())
           for op, fns in model_op_pairs().items()}
    model, ids = tiny_llama()
    step = step_of(fastllm.patch(model), ids)

    for fn in ops.values():
        for _ in range(50):
            fn()
    for _ in range(5):
        step()
    cells = [f"{op} {_median_s(fn, 200) * 1e6:.1f} us" for op, fn in ops.items()]
    cells.append(f"tiny step {_median_s(step, 10, 5) * 1e3:.1f} ms")
    print(f"{os.getcwd()} ({os.path.dirname(fastllm.__file__)}): " + " | ".join(cells))


if __name__ == "__main__":
    main()
