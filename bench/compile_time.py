"""What `torch_compile=true` costs and gives: a patched SmolLM2-135M-shaped model (random init)
eager, with each decoder layer compiled (`layer.compile()`, what `fastllm train
torch_compile=true` does, torchtitan's per-block compile) and compiled whole (`model.compile()`,
Hugging Face's Trainer's `torch_compile`): the first training step's time (the compile in it),
the median of the steps after it, and dynamo's graph count.

    python -m fastllm.bench.compile_time [--layers 30] [--batch 2] [--seq 128] [--steps 4]

Each mode runs in a process of its own with an empty inductor cache (a cold compile, as a
user's first run; a second run would read the compiled code back from the cache), one after the
other; prints one JSON row per mode. CPU only here: inductor's C++ code for the graphs, the
patched model's fastllm ops as custom ops inside them, fp32.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODES = ("eager", "per-layer", "whole")


def _run(mode, layers, batch, seq, steps):
    import statistics
    import time

    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    import fastllm
    from fastllm.parallel import decoder_layers
    from fastllm.train.model import compile_layers

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    model = fastllm.patch(LlamaForCausalLM(cfg))
    if mode == "per-layer":
        compile_layers(decoder_layers(model))  # (as `fastllm train torch_compile=true`)
    elif mode == "whole":
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - t0

    first = step()
    rest = [step() for _ in range(steps)]
    return {"mode": mode, "layers": layers, "tokens": batch * seq, "first_step_s": round(first, 2),
            "step_ms": round(1e3 * statistics.median(rest), 1),
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "torch": torch.__version__}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # (one mode, in this process)
    a = p.parse_args(argv)
    if a.mode:
        print(json.dumps(_run(a.mode, a.layers, a.batch, a.seq, a.steps)), flush=True)
        return
    for mode in MODES:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            out = subprocess.run(
                [sys.executable, "-m", "fastllm.bench.compile_time", "--mode", mode,
                 "--layers", str(a.layers), "--batch", str(a.batch), "--seq", str(a.seq),
                 "--steps", str(a.steps)], env=env, check=True, stdout=subprocess.PIPE,
                text=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
