"""`fastllm train --compare hf`: the same run through Hugging Face's Trainer (+ PEFT for LoRA and
DoRA), for tokens/s, peak memory and eval loss side by side.

Same model (build_model from the config), same batches in the same order (fastllm's datasets,
masking and packing, one collated micro-batch per HF item, read sequentially), same seed,
learning rate, warmup + cosine to min_lr (fastllm's lr_at as HF's scheduler), AdamW
betas/eps/weight decay, clipping and accumulation; HF normalises the loss over the step's target tokens as fastllm does.
Precision: HF keeps fp32 parameters and runs bf16 under autocast (TrainingArguments.bf16), where
fastllm holds bf16 parameters with fp32 master weights. Peak memory is measured the same way on
both sides on the CPU: fastllm.train.memory.PeakMemory over the first step (params, grads,
optimizer state and every tensor the step allocates); with torch_compile (both sides compiled)
it is not tracked: fastllm reports its process's peak RSS, HF nothing.
"""

import math
import os
import time

import torch

__all__ = ["run_hf"]


class _Steps(torch.utils.data.Dataset):
    """Item i: the i-th micro-batch of the fastllm run (a dict of tensors)."""

    def __init__(self, dataset, micro, n_micro):
        self.dataset, self.micro, self.n = dataset, micro, n_micro

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        samples = list(range(i * self.micro, (i + 1) * self.micro))
        batch = self.dataset.batch(samples)
        if isinstance(batch, torch.Tensor):  # plain text windows
            return {"input_ids": batch, "labels": batch.clone(),
                    "num_tokens": torch.tensor(batch.numel())}
        return batch


def check(cfg):
    """Refuse what the HF side cannot run, before either side runs (the fastllm run first would
    otherwise train, and write its run folder, for nothing)."""
    from fastllm.train.config import ConfigError

    if cfg.finetune not in ("full", "lora"):
        raise ConfigError(f"fastllm train --compare hf: finetune={cfg.finetune} has no HF "
                          f"Trainer counterpart here (full, lora)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("fastllm train --compare hf runs on one process")
    if cfg.objective != "lm":
        raise ConfigError(f"fastllm train --compare hf runs HF's Trainer on the next-token loss; "
                          f"objective={cfg.objective} compares with TRL's trainers in "
                          f"bench/bench_dpo_train.py (objective=dpo: TRL's DPOTrainer; "
                          f"--compare torch runs the same objective on PEFT and the logits)")
    if cfg.lora.quantize_base != "none":
        raise ConfigError(f"fastllm train --compare hf: lora.quantize_base="
                          f"{cfg.lora.quantize_base} has no counterpart on the HF side here "
                          f"(it would train LoRA on the dense base); bench/bench_qlora.py "
                          f"compares QLoRA with PEFT + bitsandbytes")


def run_hf(cfg, log=print):
    """Train cfg with transformers.Trainer on one process; returns a summary dict (tokens_per_s,
    step_time_s, peak_mem_bytes, first_loss, final_loss, eval_loss)."""
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fastllm.train.evaluate import evaluate_loss
    from fastllm.train.memory import PeakMemory
    from fastllm.train import sft_data
    from fastllm.train.model import apply_finetune, build_model, compiled_graphs, is_model_dir
    from fastllm.train.trainer import lr_at

    check(cfg)
    model_dir = cfg.model if is_model_dir(cfg.model) else None
    tokenizer, dataset, held = sft_data.build_datasets(cfg, model_dir, 0, 1, lambda: None, log)
    accum = (cfg.global_batch_size // cfg.micro_batch_size if cfg.global_batch_size
             else max(1, cfg.gradient_accumulation_steps))
    cfg.max_steps = sft_data.max_steps(cfg, dataset, accum * cfg.micro_batch_size)
    model = build_model(cfg, tokenizer.vocab_size, torch.float32)
    if cfg.finetune == "lora":
        torch_cfg = type(cfg).from_dict(cfg.to_dict())
        torch_cfg.backend = "torch"  # PEFT's LoRA / DoRA, its A matrices drawn as fastllm's
        model = apply_finetune(model, torch_cfg)
    transformers.set_seed(cfg.seed)
    items = _Steps(dataset, cfg.micro_batch_size, cfg.max_steps * accum)
    args = TrainingArguments(
        output_dir=cfg.output_dir + "-hf", max_steps=cfg.max_steps, learning_rate=cfg.lr,
        per_device_train_batch_size=1, gradient_accumulation_steps=accum,
        warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_epsilon=cfg.eps,
        max_grad_norm=cfg.max_grad_norm or 0.0, seed=cfg.seed, data_seed=cfg.seed,
        bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16", logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
        optim="adamw_torch", torch_compile=cfg.torch_compile,
        torch_compile_backend=cfg.torch_compile_backend, torch_compile_mode=cfg.torch_compile_mode)
    record = {"losses": [], "times": [], "compiled": [], "peak": None}
    fetched = []  # each micro-batch's real tokens, in order

    def collate(features):
        batch = dict(features[0])
        fetched.append(int(batch.pop("num_tokens")))
        return batch

    class Clock(TrainerCallback):
        tracker = None

        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.graphs = time.perf_counter(), compiled_graphs()
            if state.global_step == 0 and cfg.track_memory and not cfg.torch_compile:
                self.tracker = PeakMemory(hf.model, hf.optimizer)
                self.tracker.__enter__()

        def on_step_end(self, a, state, control, **kw):
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                record["peak"] = int(self.tracker.peak)
                self.tracker = None
            record["times"].append(time.perf_counter() - self.t0)
            record["compiled"].append(compiled_graphs() > self.graphs)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                record["losses"].append(float(logs["loss"]))

    class Sequential(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            # fastllm's schedule exactly (HF's cosine_with_min_lr is the same curve one step
            # earlier: its lambda takes the 0-based step)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, lambda k: lr_at(cfg, k + 1) / cfg.lr)
            return self.lr_scheduler

    hf = Sequential(model=model, args=args, train_dataset=items, data_collator=collate,
                    callbacks=[Clock()])
    hf.train()
    # the first step's data loading happens before on_step_begin; leave it out as fastllm does,
    # and under torch_compile the steps that compiled graphs (as fastllm's summary, where any
    # other step is left)
    steps = [sum(fetched[k * accum:(k + 1) * accum]) for k in range(len(record["times"]))]
    keep = list(range(1, len(steps))) or list(range(len(steps)))
    keep = [k for k in keep if not record["compiled"][k]] or keep
    times, toks = [record["times"][k] for k in keep], [steps[k] for k in keep]
    out = {"tokens_per_s": sum(toks) / max(sum(times), 1e-12),
           "step_time_s": sum(times) / max(len(times), 1), "peak_mem_bytes": record["peak"],
           "first_loss": record["losses"][0] if record["losses"] else math.nan,
           "final_loss": record["losses"][-1] if record["losses"] else math.nan,
           "eval_loss": None, "steps": len(record["times"])}
    if held is not None:
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.precision == "bf16"
                    else None)
        out["eval_loss"] = evaluate_loss(hf.model, held, cfg.micro_batch_size,
                                         torch.device("cpu"), autocast,
                                         max_batches=cfg.eval.batches)["eval_loss"]
    os.makedirs(args.output_dir, exist_ok=True)
    return out


def compare_hf(cfg):
    """Both runs, one after the other, and the table (fastllm train --compare hf)."""
    import copy

    from fastllm.train.trainer import Trainer

    check(cfg)
    c = copy.deepcopy(cfg)
    c.checkpoint.auto_resume, c.checkpoint.interval = False, 0
    c.eval_interval = 0  # evaluate at the end only, as the HF side does
    trainer = Trainer(c.validate())
    mine = trainer.train()
    if trainer.status == "stopped":  # a stop signal: the run saved a checkpoint; HF's waits
        print("fastllm train --compare hf: the fastllm run stopped; not compared")
        return None
    theirs = run_hf(copy.deepcopy(c))
    rows = [("fastllm", mine), ("hf", theirs)]
    print(f"\nfastllm train --compare hf ({cfg.model}, finetune={cfg.finetune}"
          f"{' (DoRA)' if cfg.lora.use_dora and cfg.finetune == 'lora' else ''}, "
          f"precision={cfg.precision}, {mine['steps']} steps, same data, masking and seed):")
    print(f"  {'':8} {'tokens/s':>10} {'ms/step':>9} {'peak MiB':>9} {'first loss':>11} "
          f"{'final loss':>11} {'eval loss':>10}")
    for name, s in rows:
        peak = s.get("peak_mem_bytes")
        ev = s.get("eval_loss")
        print(f"  {name:8} {s['tokens_per_s']:10,.0f} {s['step_time_s'] * 1e3:9.1f} "
              f"{peak / 2**20 if peak else float('nan'):9.1f} {s['first_loss']:11.4f} "
              f"{s['final_loss']:11.4f} {ev if ev is not None else float('nan'):10.4f}")
    ratio = mine["tokens_per_s"] / max(theirs["tokens_per_s"], 1e-12)
    mem = (f"{mine['peak_mem_bytes'] / theirs['peak_mem_bytes']:.2f}x"
           if mine.get("peak_mem_bytes") and theirs.get("peak_mem_bytes") else
           "not compared (the Hugging Face side's is tracked with track_memory=true and without "
           "torch_compile only)")
    print(f"  fastllm / hf: tokens/s {ratio:.2f}x, peak memory {mem}")
    return rows
