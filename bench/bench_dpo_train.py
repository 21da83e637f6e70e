"""A whole DPO fine-tuning run: TRL's DPOTrainer (+ PEFT) against `fastllm train objective=dpo`
on the same checkpoint, pairs, held-out split and hyperparameters; and the reference-free ORPO
and SimPO against TRL's ORPOTrainer and CPOTrainer.

    PYTHONPATH=<trl> python bench/bench_dpo_train.py MODEL_DIR [--providers trl,fastllm,...]
        [--rounds 1] [--steps 20] [--threads 2] [--data examples/data/capital_preferences.jsonl]
        [--seq-len 256]

--data varied writes (seeded) 48 pairs of unequal lengths instead, as real preference data
has (a prompt of 1-6 sentences, a short chosen and a long rejected answer or the reverse:
rows of about 40-400 tokens), where padding costs most: what data.padding_free saves.

Both sides: LoRA r=16, alpha=32, no dropout, on the seven projections; fp32; 4 pairs a step
(per_device_train_batch_size), rows cut to --seq-len tokens (keep_start); DPO sigmoid, beta 0.1,
plus the chosen answers' mean token NLL with weight 1 (TRL 1.16: loss_type ["sigmoid", "sft"],
loss_weights [1, 1]; fastllm: dpo.rpo_alpha=1, the same term); AdamW lr 1e-4, weight decay 0,
2 warmup steps then cosine to 0; the reference is the model with its adapters off; the data's
held-out pairs (fastllm's seeded data.eval_fraction split, written out for TRL) evaluated once
at the end. Providers:
    trl                 trl.DPOTrainer(peft_config=LoraConfig(...)), TRL's defaults otherwise
                        (gradient_checkpointing on; bf16 set False: TRL's configs default to
                        bf16 autocast, which a CPU without bf16 GEMMs runs 13x slower here)
    trl-no-checkpointing  the same with gradient_checkpointing=False (as fastllm's default)
    trl-precompute      trl with precompute_ref_log_probs=True
    fastllm             fastllm.train.Trainer (fastllm.patch, fastllm's LoRA and AdamW, the
                        log-probabilities without logits)
    fastllm-precompute  the same with dpo.precompute_ref_log_probs=true
    trl-orpo            trl.experimental.orpo.ORPOTrainer, beta 0.1 (the NLL plus the odds
                        ratio term; no reference), gradient_checkpointing=False, bf16=False
    fastllm-orpo        objective=orpo orpo.beta=0.1 (examples/orpo_lora.yaml)
    trl-simpo           trl.experimental.cpo.CPOTrainer, loss_type simpo, cpo_alpha 0, beta 2.0,
                        simpo_gamma 0.5 (SimPO, TRL's way), gradient_checkpointing=False
    fastllm-simpo       objective=cpo cpo.loss_type=simpo cpo.cpo_alpha=0 cpo.beta=2.0
    fastllm-padding-free  fastllm with data.padding_free=true (each micro-batch's rows scored
                        as one row without padding, TRL's padding_free)
    fastllm-none        fastllm with kernels=none (the model unpatched: HF's attention and
                        the log-probabilities from its logits)
    fastllm-none-padding-free  the same with data.padding_free=true (HF's SDPA over the packed
                        row, its mask block-diagonal but dense: rows x rows)
Each (round, provider) is its own process. Step time: TRL's on_step_begin to on_step_end, and
fastllm's metrics.jsonl step_time_s (the same span: forward, backward, optimizer); the first step
is left out of the mean. Tokens: the step's non-pad input tokens (both rows of every pair).
Peak RSS: the process's ru_maxrss (model load included). Not a pytest test (`__test__`): it needs
TRL and a checkpoint folder (`python ../shared/models/prepare_smollm2.py DIR`).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_qlora import chosen_providers  # noqa: E402
from bench_trl import (child_result, describe_machine, interleaved, throughput,  # noqa: E402
                       timed_trainer, versions)

__test__ = False

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROVIDERS = ("trl", "trl-no-checkpointing", "fastllm", "trl-precompute",
             "fastllm-precompute", "trl-orpo", "fastllm-orpo", "trl-simpo", "fastllm-simpo",
             "fastllm-padding-free", "fastllm-none", "fastllm-none-padding-free")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EVAL_FRACTION = 0.17


def _split(path, tmp):
    """fastllm's held-out split of `path` (its seeded data.eval_fraction), as two JSONL files."""
    from fastllm.train.sft_data import split_examples

    with open(path) as f:
        lines = [line for line in f if line.strip()]
    train, held = split_examples(len(lines), EVAL_FRACTION, 0)
    names = []
    for part, rows in (("train", train), ("eval", held)):
        name = os.path.join(tmp, f"{part}.jsonl")
        with open(name, "w") as f:
            f.writelines(lines[i] for i in rows)
        names.append(name)
    return names


_SENTENCES = ("It has been the seat of government for a long time.",
              "Many visitors come for its museums, markets and old quarters.",
              "The city lies near a river that shaped its early trade.",
              "Its population has grown quickly over the last century.",
              "Several universities and national institutions are based there.",
              "The climate is mild for most of the year, with a short rainy season.",
              "Its architecture mixes historic buildings with modern districts.",
              "Public transport connects the centre with the surrounding region.")


def varied_pairs(path, n=48, seed=0):
    """n preference records of unequal lengths (seeded) from examples/data/capitals.jsonl's
    questions: a prompt of 1-6 sentences, the preferred short answer with 0-2 extra sentences,
    the rejected one with 1-24, or the reverse for every third pair."""
    import random

    rng = random.Random(seed)
    with open(os.path.join(ROOT, "examples", "data", "capitals.jsonl")) as f:
        chats = [json.loads(line)["messages"] for line in f if line.strip()]
    with open(path, "w") as f:
        for i in range(n):
            question, answer = chats[i % len(chats)][0]["content"], chats[i % len(chats)][1]
            context = " ".join(rng.choice(_SENTENCES) for _ in range(rng.randint(0, 5)))
            short = " ".join([answer["content"]] + [rng.choice(_SENTENCES)
                                                    for _ in range(rng.randint(0, 2))])
            long = " ".join(rng.choice(_SENTENCES) for _ in range(rng.randint(1, 24)))
            chosen, rejected = (short, long) if i % 3 else (long, short)
            f.write(json.dumps({
                "prompt": [{"role": "user", "content": f"{context} {question}".strip()}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}) + "\n")
    return path


def _trl(args, tmp):
    import datasets
    import peft
    import torch
    import transformers
    import trl

    train, held = _split(args.data, tmp)
    out = {"times": [], "tokens": [], "losses": []}
    common = dict(
        output_dir=os.path.join(tmp, "out"), max_steps=args.steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, max_length=args.seq_len, learning_rate=1e-4,
        weight_decay=0.0,
        lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", seed=0, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=False)  # (TRL's configs default to bf16 autocast; both sides here run fp32)
    if args.provider == "trl-orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer_cls = ORPOTrainer
        config = ORPOConfig(beta=0.1, gradient_checkpointing=False, **common)
    elif args.provider == "trl-simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer_cls = CPOTrainer
        config = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5,
                           gradient_checkpointing=False, **common)
    else:
        trainer_cls = trl.DPOTrainer
        config = trl.DPOConfig(
            beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0],
            precompute_ref_log_probs=args.provider == "trl-precompute",
            gradient_checkpointing=args.provider != "trl-no-checkpointing", **common)
    Timed, clock = timed_trainer(trainer_cls, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    trainer = Timed(model=model, args=config, processing_class=tok,
                    train_dataset=datasets.load_dataset("json", data_files=train)["train"],
                    eval_dataset=datasets.load_dataset("json", data_files=held)["train"],
                    peft_config=peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                target_modules=TARGETS, task_type="CAUSAL_LM"),
                    callbacks=[clock])
    trainer.train()
    metrics = trainer.evaluate()
    out["eval_loss"] = metrics["eval_loss"]
    out["eval_accuracy"] = metrics.get("eval_rewards/accuracies")
    return out


def _fastllm(args, tmp):
    from fastllm.train import TrainConfig, Trainer
    from fastllm.train.metrics import read_metrics

    run = os.path.join(tmp, "run")
    free = {"fastllm-orpo": [], "fastllm-simpo": [
        "objective=cpo", "cpo.loss_type=simpo", "cpo.cpo_alpha=0", "cpo.beta=2.0",
        "cpo.simpo_gamma=0.5"]}.get(args.provider)
    variant = [f"data.seq_len={args.seq_len}"]
    if "-none" in args.provider:
        variant.append("kernels=none")
    if args.provider.endswith("padding-free"):
        variant.append("data.padding_free=true")
    cfg = TrainConfig.from_args(
        [f"model={args.model}", f"output_dir={run}", f"max_steps={args.steps}", "min_lr=0",
         f"threads={args.threads}", "eval_steps=0", "eval.prompts=[]", "save_steps=0",
         f"data.path={args.data}", f"data.eval_fraction={EVAL_FRACTION}",
         f"data.cache_dir={os.path.join(tmp, 'cache')}", "log_interval=1000",
         "learning_rate=1e-4",  # (TRL's side's; examples/orpo_lora.yaml trains at 5e-4)
         *variant,
         *(free if free is not None else [
             f"dpo.precompute_ref_log_probs={str(args.provider.endswith('precompute')).lower()}"
         ])],
        os.path.join(ROOT, "examples", "orpo_lora.yaml" if free is not None else "dpo_lora.yaml"))
    Trainer(cfg).train()
    recs = read_metrics(os.path.join(run, "metrics.jsonl"))
    last = [r for r in recs if r.get("eval_loss") is not None][-1]
    return {"times": [r["step_time_s"] for r in recs], "tokens": [r["tokens"] for r in recs],
            "losses": [r["loss"] for r in recs], "eval_loss": last["eval_loss"],
            "eval_accuracy": last["eval_rewards/accuracies"]}


def child(args):
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = (_trl if args.provider.startswith("trl") else _fastllm)(args, tmp)
        out["wall_s"] = time.perf_counter() - t0
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def run_child(args, provider):
    cmd = [sys.executable, os.path.abspath(__file__), args.model, "--child", provider,
           "--steps", str(args.steps), "--threads", str(args.threads), "--data", args.data,
           "--seq-len", str(args.seq_len)]
    return child_result(cmd, cwd=ROOT)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--providers", default="trl,fastllm")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=os.path.join(ROOT, "examples", "data",
                                                  "capital_preferences.jsonl"))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--child", metavar="PROVIDER")
    args = p.parse_args(argv)
    if args.data == "varied":
        args.data = varied_pairs(os.path.join(tempfile.gettempdir(),
                                              "fastllm_bench_varied_pairs.jsonl"))
    args.model, args.data = os.path.abspath(args.model), os.path.abspath(args.data)
    if args.child:
        args.provider = args.child
        return child(args)
    providers = chosen_providers(args.providers, PROVIDERS, "bench_dpo_train")
    print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
    print(f"machine: {describe_machine()}; {versions()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}; {args.steps} steps of 4 pairs, rows cut to "
          f"{args.seq_len} tokens, {args.rounds} round(s); data {args.data}")
    print(f"\n| provider | mean step s (2..) | tokens/s | x {providers[0]} | peak RSS MiB | "
          f"loss step 1 | loss last | held-out eval loss | held-out reward accuracy | "
          f"run wall s |\n|---|---|---|---|---|---|---|---|---|---|")
    runs = interleaved(providers, args.rounds, lambda name: run_child(args, name))
    speed = {}
    for name, results in runs.items():
        measured = throughput(name, results, 10)
        if measured is None:
            continue
        times, speed[name] = measured
        ratio = speed[name] / speed[providers[0]] if providers[0] in speed else float("nan")
        r0 = results[0]
        print(f"| {name} | {statistics.mean(times):.2f} | {speed[name]:.0f} | {ratio:.2f} | "
              f"{max(r['rss_mib'] for r in results):,.0f} | {r0['losses'][0]:.4f} | "
              f"{r0['losses'][-1]:.4f} | {r0['eval_loss']:.4f} | {r0['eval_accuracy']} | "
              f"{r0['wall_s']:.0f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
