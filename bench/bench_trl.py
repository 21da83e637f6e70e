"""What fastllm.patch gives a user of TRL's SFTTrainer: a real Llama checkpoint fine-tuned by
SFTTrainer unpatched, patched, and patched with fastllm's CPU attention forced.

    PYTHONPATH=<trl> python bench/bench_trl.py MODEL_DIR [--cases lora-fp32-packed,...]
        [--rounds 2] [--steps 3] [--batch 4] [--length 256]

Cases are {lora,full}-{fp32,bf16}-{packed,padded}: LoRA r=16 on q_proj/v_proj through
SFTTrainer's `peft_config` or full fine-tuning; fp32, or `bf16=True` (fp32 params under
autocast, as Trainer does it); `packing=True` (TRL's best-fit packing, padding-free rows) or
False (rows padded to the longest of the batch). Each (case, round, provider) is its own process,
providers interleaved (a, b, c, a, b, c): one warm-up step, then `--steps` timed steps
(on_step_begin to on_step_end: forward, backward, optimizer). Tokens/s counts the non-pad input
tokens of the timed steps (TRL's own `num_tokens`: the attention mask's sum, or the packed row's
length). Peak RSS is the process's ru_maxrss (model load included). Not a pytest test (the
module has no tests; `__test__` keeps pytest out of it) and not one of `fastllm bench`'s ops:
it needs TRL, which fastllm does not depend on.
"""

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

__test__ = False

PROVIDERS = {  # name -> (patch, FASTLLM_CPU_ATTENTION)
    "unpatched": (False, None),
    "fastllm.patch": (True, None),
    "fastllm.patch + attention=fastllm": (True, "fastllm"),
}
DEFAULT_CASES = "lora-fp32-packed,lora-fp32-padded,full-fp32-packed,full-fp32-padded"


def dataset_rows(n=256, seed=0):
    """n prompt/completion chats (conversational), 40-270 tokens each, the same every run."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(1, 500)
        b = a + rng.randrange(4, 30)
        answer = " ".join(f"{k} squared is {k * k}." for k in range(a, b))
        rows.append({"prompt": [{"role": "user", "content": f"Square each number from {a} "
                                 f"to {b - 1}."}],
                     "completion": [{"role": "assistant", "content": answer}]})
    return rows


def timed_trainer(base, out):
    """(a subclass of the TRL trainer class `base` that appends each step's input tokens and loss
    to out["tokens"] and out["losses"], a callback that appends its time, on_step_begin to
    on_step_end, to out["times"]). Tokens: the attention mask's sum (ORPO's and CPO's batches:
    the chosen and the rejected rows'), or a packed row's length."""
    import torch
    import transformers

    class Timed(base):
        def training_step(self, model, inputs, *rest, **kw):
            mask = inputs.get("attention_mask")
            if mask is None and "chosen_attention_mask" in inputs:  # (ORPO's, CPO's batches)
                mask = torch.cat([inputs["chosen_attention_mask"].flatten(),
                                  inputs["rejected_attention_mask"].flatten()])
            out["tokens"].append(int(mask.sum()) if mask is not None
                                 else int(inputs["position_ids"].size(1)))
            loss = super().training_step(model, inputs, *rest, **kw)
            out["losses"].append(float(loss))
            return loss

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            out["times"].append(time.perf_counter() - self.t0)

    return Timed, Clock()


def child(args):
    """One SFTTrainer run; prints one JSON line: step times, tokens, losses, peak RSS."""
    try:
        import datasets
        import trl
    except ImportError:
        sys.exit("bench_trl.py needs TRL (pip install trl datasets): not importable here")
    import torch
    import transformers

    import fastllm

    torch.set_num_threads(2)
    finetune, precision, layout = args.case.split("-")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if PROVIDERS[args.provider][0]:
        fastllm.patch(model)
    peft_config = None
    if finetune == "lora":
        import peft
        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                      target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    out = {"times": [], "tokens": [], "losses": []}
    Timed, clock = timed_trainer(trl.SFTTrainer, out)
    with tempfile.TemporaryDirectory() as tmp:
        config = trl.SFTConfig(
            output_dir=tmp, max_steps=1 + args.steps, per_device_train_batch_size=args.batch,
            max_length=args.length, packing=layout == "packed", bf16=precision == "bf16",
            learning_rate=2e-4 if finetune == "lora" else 2e-5, lr_scheduler_type="constant",
            logging_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=True,
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = Timed(model=model, args=config, train_dataset=datasets.Dataset.from_list(
            dataset_rows()), peft_config=peft_config, callbacks=[clock])
        trainer.train()
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["patched"] = sum(fastllm.patched(trainer.model).values())
    print("RESULT " + json.dumps(out))


def describe_machine():
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return (f"{info.get('model name', platform.processor())} (family {info.get('cpu family')} "
            f"model {info.get('model')}), {os.cpu_count()} cores, 2 torch threads")


def versions():
    code = ("import torch, transformers, trl, peft; print(f'torch {torch.__version__}, "
            "transformers {transformers.__version__}, trl {trl.__version__}, peft "
            "{peft.__version__}')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "trl not importable"


def interleaved(providers, rounds, run):
    """{provider: its results}: run(provider) for every provider, round after round (a, b, c, a,
    b, c), so a drifting machine weighs on each alike."""
    runs = {name: [] for name in providers}
    for _ in range(rounds):
        for name in providers:
            runs[name].append(run(name))
    return runs


def throughput(label, results, cells):
    """(step times after each run's first, tokens/s over them) of one provider's results; None
    where a run failed: its table row (`label` then FAILED, `cells` cells in all) printed, and
    its error to stderr."""
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        print(f"| {label} | FAILED |" + " |" * (cells - len(label.split("|")) - 1))
        print(failed[0], file=sys.stderr)
        return None
    times = [t for r in results for t in r["times"][1:]]
    tokens = [n for r in results for n in r["tokens"][1:]]
    return times, sum(tokens) / sum(times)


def run_child(args, case, provider):
    env = dict(os.environ)
    env.pop("FASTLLM_CPU_ATTENTION", None)
    if PROVIDERS[provider][1]:
        env["FASTLLM_CPU_ATTENTION"] = PROVIDERS[provider][1]
    cmd = [sys.executable, os.path.abspath(__file__), args.model, "--child", case, provider,
           "--steps", str(args.steps), "--batch", str(args.batch), "--length", str(args.length)]
    return child_result(cmd, env=env)


def child_result(cmd, **kw):
    """The JSON of the last "RESULT " line the child process `cmd` printed, or {"error": the
    end of its output} when it failed or printed none."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout)[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--child", nargs=2, metavar=("CASE", "PROVIDER"))
    args = p.parse_args(argv)
    if args.child:
        args.case, args.provider = args.child
        return child(args)
    import importlib.util
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        sys.exit("bench_trl.py needs TRL (pip install trl datasets): not importable here")
    providers = args.providers.split(",")
    print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
    print(f"machine: {describe_machine()}; {versions()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}; {args.batch} x {args.length} tokens/step max, "
          f"{args.steps} timed steps after 1 warm-up, {args.rounds} rounds")
    # (the ratio and the loss difference are against the first provider, whichever it is)
    print(f"\n| case | provider | median step s | tokens/s | x {providers[0]} | peak RSS MiB "
          f"| first loss | last loss | max rel. loss diff vs {providers[0]} |"
          f"\n|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        runs = interleaved(providers, args.rounds, lambda name: run_child(args, case, name))
        speed = {}
        for name, results in runs.items():
            measured = throughput(f"{case} | {name}", results, 9)
            if measured is None:
                continue
            times, speed[name] = measured
            ratio = speed[name] / speed[providers[0]] if providers[0] in speed else float("nan")
            losses = results[0]["losses"]
            same = all(r["losses"] == losses for r in results)
            base = runs[providers[0]][0].get("losses", [])  # every step's loss against provider a
            diff = max((abs(x - y) / abs(y) for x, y in zip(losses, base)), default=float("nan"))
            print(f"| {case} | {name} | {statistics.median(times):.2f} | {speed[name]:.0f} | "
                  f"{ratio:.2f} | {max(r['rss_mib'] for r in results):,.0f} | "
                  f"{losses[0]:.6f} | {losses[-1]:.6f}{'' if same else ' (varies by round)'} | "
                  f"{diff:.1e} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
