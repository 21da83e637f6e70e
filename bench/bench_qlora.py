"""QLoRA on a real checkpoint: fastllm's 4-bit NF4 base (fastllm.quant) against fastllm's LoRA on
the dense base and against PEFT + bitsandbytes' QLoRA, one training step at a time.

    [PYTHONPATH=<bitsandbytes>] python bench/bench_qlora.py MODEL_DIR [--dtype fp32|bf16]
        [--providers fastllm-lora,fastllm-qlora,peft-bnb-qlora,fastllm-qlora-dq,
                     peft-bnb-qlora-dq] [--rounds 1] [--steps 3]
        [--batch 8] [--length 512] [--threads 2] [--targets qv|all] [--json PATH]
    [PYTHONPATH=<bitsandbytes>] python bench/bench_qlora.py --dequantize [--threads 2]

--dequantize times the dequantisation alone instead (SmolLM2's MLP shape and a 4096 x 4096
weight, fp32 and bf16, interleaved rounds, median): fastllm's op into an existing buffer (what
a QLoRA step does) and returning a new tensor, the PyTorch reference, and bitsandbytes'
dequantize_4bit where it is importable (checked equal to fastllm's first).

Every provider fine-tunes LoRA r=16, alpha=32 on q_proj/v_proj (`--targets all`: "all-linear",
every linear layer but the head, as QLoRA's recipe: q/k/v/o and gate/up/down in a Llama) of
the model loaded in `--dtype`, on the same random token batch (seeded), with AdamW at lr 1e-4:
    fastllm-lora     fastllm.lora.inject_lora + fastllm.patch + fastllm.optim.AdamW, dense base
    fastllm-qlora    the same after fastllm.quant.quantize_nf4 (every linear but lm_head in NF4)
    peft-bnb-qlora   transformers' BitsAndBytesConfig(load_in_4bit, nf4, compute dtype = --dtype,
                     no double quantisation) + peft.prepare_model_for_kbit_training (without
                     gradient checkpointing: like for like, nothing recomputed) + get_peft_model
                     + torch.optim.AdamW(fused=True); needs bitsandbytes (not a fastllm
                     dependency): skipped when it is not importable
    fastllm-qlora-dq, peft-bnb-qlora-dq   the same two with QLoRA's double quantisation of the
                     absmax (quantize_nf4(double_quant=True); bnb_4bit_use_double_quant=True)
Each (round, provider) is its own process, providers interleaved: one warm-up step, then
`--steps` timed steps (forward, backward, optimizer step). Peak RSS is the process's VmHWM over
the steps: after the model is built its tensors are copied out of the checkpoint's mmap (whose
pages would count once read) and the high-water mark is reset; "load_peak_rss_mib" is the peak
while loading and quantising. "base weights" is the bytes of the linear layers' weights as
stored (NF4: codes and absmax). "tensor peak" is fastllm.train.memory.PeakMemory over one more
step: the live tensors' bytes at the step's peak, what the allocator keeps aside.
Not a pytest test (`__test__`), not one of `fastllm bench`'s ops: it needs a checkpoint folder
(bench: `python ../shared/models/prepare_smollm2.py DIR` makes SmolLM2-135M-Instruct).
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

__test__ = False

PROVIDERS = ("fastllm-lora", "fastllm-qlora", "peft-bnb-qlora", "fastllm-qlora-dq",
             "peft-bnb-qlora-dq")


def _batch(vocab, batch, length, seed=0):
    import torch

    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _build(provider, model_dir, dtype, targets):
    """(model, optimizer, bytes of the linear layers' stored base weights)."""
    import torch
    import transformers

    double = provider.endswith("-dq")
    if provider.startswith("peft-bnb-qlora"):
        import bitsandbytes as bnb
        import peft

        qcfg = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=double)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, quantization_config=qcfg, device_map="cpu", dtype=dtype)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets,
            task_type="CAUSAL_LM"))
        states = [(m.weight, m.weight.quant_state) for m in model.modules()
                  if isinstance(m, bnb.nn.Linear4bit)]
        stored = sum(w.numel() * w.element_size() + q.absmax.numel() * q.absmax.element_size()
                     + (4 * (q.state2.absmax.numel() + 1) if q.nested else 0)
                     for w, q in states)  # (codes, absmax; nested: its scales and offset)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=1e-4, fused=True), stored
    import fastllm
    from fastllm import quant
    from fastllm.lora import inject_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    head = model.get_output_embeddings()
    stored = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and m is not head)
    if provider.startswith("fastllm-qlora"):
        quant.quantize_nf4(model, double_quant=double)
        stored = quant.nf4_bytes(model)
    inject_lora(model, target_modules=targets, r=16, alpha=32)
    fastllm.patch(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, fastllm.optim.AdamW(params, lr=1e-4), stored


def _anonymous(model):
    """Every tensor of `model` in its own process memory: from_pretrained leaves weights as views
    of the mmapped checkpoint, whose pages count in RSS once read (the first forward reads them
    all, a quantisation too) and stay mapped while any view lives (the embedding)."""
    import ctypes
    import gc

    import torch

    with torch.no_grad():
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is not None:
                        t.data = t.data.clone()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss():
    # Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # (elsewhere the peak includes the load)
        pass


def _peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def chosen_providers(text, known, tag):
    """The comma-separated provider names of `text`; exits naming any not in `known`."""
    providers = [name.strip() for name in text.split(",")]
    unknown = [name for name in providers if name not in known]
    if unknown:
        sys.exit(f"{tag}: unknown providers {unknown}; choose from {known}")
    return providers


def print_rows(rows, columns, json_path=None):
    """rows as a Markdown table, columns [(header, row -> cell)]; and as JSON to json_path."""
    print("| " + " | ".join(h for h, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(cell(row)) for _, cell in columns) + " |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def run_rounds(script, model_dir, providers, rounds, extra, tag):
    """Each (round, provider) in its own process (`script model_dir --one NAME *extra`, which
    prints one JSON line), providers interleaved; the rows, each printed as it comes."""
    rows = []
    for round_ in range(rounds):
        for name in providers:
            cmd = [sys.executable, script, model_dir, "--one", name, *extra]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{tag}: {name} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = round_
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_one(args):
    """One provider's steps in this process; prints one JSON line."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model, opt, stored = _build(args.one, args.model_dir, dtype,
                                ["q_proj", "v_proj"] if args.targets == "qv" else "all-linear")
    load_s = time.perf_counter() - t0
    load_peak = _peak_rss_mib()
    _anonymous(model)
    _reset_peak_rss()
    model.train()
    ids = _batch(model.config.vocab_size, args.batch, args.length)
    times, losses = [], []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    step_s = statistics.median(times[1:])
    # one more step under fastllm's tensor tracker: bytes of live tensors at the step's peak
    # (params, buffers, grads, optimizer state and what the step allocates), allocator aside
    from fastllm.train.memory import PeakMemory

    with PeakMemory(list(model.parameters()), list(model.buffers()), opt.state) as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(json.dumps({
        "provider": args.one, "dtype": args.dtype, "targets": args.targets,
        "step_s": round(step_s, 3),
        "tokens_per_s": round(args.batch * args.length / step_s, 1),
        "step_times_s": [round(t, 3) for t in times], "losses": [round(v, 5) for v in losses],
        "peak_rss_mib": round(_peak_rss_mib(), 1), "load_peak_rss_mib": round(load_peak, 1),
        "tensor_peak_mib": round(tracker.peak / 2**20, 1),
        "base_weights_mib": round(stored / 2**20, 1), "load_s": round(load_s, 1),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))


def dequantize_bench(threads, rounds=15):
    import importlib.util

    import torch

    from fastllm.ops.nf4 import (nf4_dequantize, nf4_dequantize_into, nf4_dequantize_ref,
                                 nf4_quantize)

    torch.set_num_threads(threads)
    bnb = importlib.util.find_spec("bitsandbytes") is not None
    print("| weight | dtype | provider | ms (median) | ns a weight |\n|---|---|---|---|---|")
    for shape in ((1536, 576), (4096, 4096)):
        w = torch.randn(shape) * 0.02
        packed, absmax = nf4_quantize(w, 64)
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(shape, dtype=dtype)
            fns = {"fastllm, into a buffer": lambda: nf4_dequantize_into(out, packed, absmax),
                   "fastllm, new tensor": lambda: nf4_dequantize(packed, absmax, shape, 64,
                                                                 dtype),
                   "PyTorch reference": lambda: nf4_dequantize_ref(packed, absmax, shape, 64,
                                                                   dtype)}
            if bnb:
                import bitsandbytes.functional as bnbf

                q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                              compress_statistics=False)
                state.dtype = dtype
                fns["bitsandbytes"] = lambda: bnbf.dequantize_4bit(q, state, quant_type="nf4")
                assert torch.equal(fns["bitsandbytes"]().reshape(shape), fns["fastllm, new "
                                                                             "tensor"]())
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            for name, ts in times.items():
                ms = statistics.median(ts[3:]) * 1e3
                print(f"| {shape[0]} x {shape[1]} | {str(dtype)[6:]} | {name} | {ms:.3f} | "
                      f"{ms * 1e6 / w.numel():.3f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--dequantize", action="store_true")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--targets", default="qv", choices=("qv", "all"))
    p.add_argument("--json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # (internal: run this provider here)
    args = p.parse_args()
    if args.dequantize:
        return dequantize_bench(args.threads)
    if args.model_dir is None:
        p.error("give MODEL_DIR (or --dequantize)")
    if args.one:
        return run_one(args)
    providers = chosen_providers(args.providers, PROVIDERS, "bench_qlora")
    import importlib.util

    if "peft-bnb-qlora" in providers and importlib.util.find_spec("bitsandbytes") is None:
        print("bench_qlora: bitsandbytes is not importable; peft-bnb-qlora skipped")
        providers.remove("peft-bnb-qlora")
    rows = run_rounds(os.path.abspath(__file__), args.model_dir, providers, args.rounds,
                      ["--dtype", args.dtype, "--steps", str(args.steps), "--batch",
                       str(args.batch), "--length", str(args.length), "--threads",
                       str(args.threads), "--targets", args.targets], "bench_qlora")
    print(f"\n{args.model_dir}, {args.dtype}, LoRA on {args.targets}, "
          f"{args.batch} x {args.length} tokens, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}")
    keys = ("provider", "step_s", "tokens_per_s", "tensor_peak_mib", "peak_rss_mib",
            "load_peak_rss_mib", "base_weights_mib")
    headers = ("provider", "step s (median)", "tokens/s", "tensor peak MiB",
               "peak RSS MiB (steps)", "peak RSS MiB (load)", "base weights MiB")
    print_rows(rows, [(h, lambda r, k=k: r[k]) for h, k in zip(headers, keys)]
               + [("first loss", lambda r: r["losses"][0])], args.json)


if __name__ == "__main__":
    main()
