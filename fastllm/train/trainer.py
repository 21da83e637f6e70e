"""fastllm.train.Trainer: the training loop, read top to bottom in the order things happen.

    summary = Trainer(TrainConfig(max_steps=100, output_dir="runs/a")).train()

Data, model, strategy, optimizer and schedule come from one TrainConfig; each step runs the
accumulation micro-batches, checks the loss across ranks (non-finite: the step is skipped;
max_bad_steps in a row roll back to the last checkpoint), steps, logs and checkpoints. How the
model runs is its strategy's (fastllm.train.strategies); a checkpoint is one process's layout
(fastllm.train.checkpoint_layout) and resumes at any world size and layout.
"""

import contextlib
import copy
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from fastllm.patch import patch as patch_kernels
from fastllm.parallel import ParallelLayout, apply_activation_checkpointing, decoder_layers
from fastllm.parallel.pipeline import pipeline_loss
from fastllm.train import checkpoint as ckpt
from fastllm.train import (checkpoint_layout, faults, preference_data, preflight, run_dir,
                           sft_data, strategies, watchdog)
from fastllm.train.config import DEFAULT_MAX_STEPS, TrainConfig
from fastllm.train.data import Loader
from fastllm.train.evaluate import Evaluator
from fastllm.train.memory import PeakMemory, step_peak
from fastllm.train.metrics import MetricsWriter, start_line, write_summary
from fastllm.train.signals import StopSignals
from fastllm.train.model import (apply_finetune, build_model, compile_model,
                                 compile_settings, compiled_graphs, is_model_dir)
from fastllm.train.preference_step import PreferenceObjective

__all__ = ["Trainer", "lr_at"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_at(cfg, step):
    """The learning rate of optimizer step `step` (1-based): linear warmup over warmup_steps, then
    cosine decay from lr to min_lr at max_steps."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, (cfg.max_steps if cfg.max_steps > 0 else DEFAULT_MAX_STEPS) - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.resolved_min_lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, cfg=None, log=None):
        # its own copy: train() resolves max_steps in it, the caller's config is left as given
        self.cfg = copy.deepcopy(cfg or TrainConfig()).validate()
        self.given_cfg = copy.deepcopy(self.cfg)  # (taken again in train(), after its checks)
        self._log = log
        self._owns_pg = False
        self._poisoned = False

    def log(self, text):
        if self.rank == 0:
            (self._log or (lambda t: print(t, file=sys.stderr, flush=True)))(text)

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    def _from_rank0(self, value):
        if self.world > 1:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            value = box[0]
        return value

    def train(self):
        """Run to cfg.max_steps (or a stop signal). Returns the run summary (a dict)."""
        cfg = self.cfg
        want_cuda = cfg.uses_cuda()
        self.world = (dist.get_world_size() if dist.is_initialized()
                      else int(os.environ.get("WORLD_SIZE", "1")))
        # the layout's rules first: a run that cannot start writes nothing
        self.layout = ParallelLayout.from_config(cfg.parallel, self.world)
        preflight.check(cfg, self.layout)  # the batch, model, files and prompts
        # what config.yaml records: the paths made absolute by the check, max_steps as given
        self.given_cfg = copy.deepcopy(cfg)  # (-1 under num_train_epochs stays -1)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if want_cuda else "gloo",
                                    timeout=watchdog.pg_timeout(cfg))
            self._owns_pg = True
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = torch.device("cpu")
        if want_cuda:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        threads, self._run_lock = torch.get_num_threads(), None
        torch.set_num_threads(cfg.threads or threads)  # (the caller's count restored after)
        try:
            with compile_settings(cfg):
                return self._train()
        finally:
            torch.set_num_threads(threads)
            run_dir.release(self._run_lock)
            if getattr(self, "loader", None) is not None:
                self.loader.close()
            if self._owns_pg and dist.is_initialized():
                dist.destroy_process_group()

    # ----- set-up: data, model, strategy, optimizer -----

    def _build_data(self):
        cfg = self.cfg
        if self.rank == 0:  # (read only) an output_dir in use or holding another run
            run_dir.check(cfg)
        model_dir = cfg.model if is_model_dir(cfg.model) else None
        # text or JSONL (SFT) examples; rank 0 tokenizes (and trains a BPE) first
        build = (preference_data if cfg.objective != "lm" else sft_data).build_datasets
        self.tokenizer, self.dataset, self.eval_dataset = build(
            cfg, model_dir, self.rank, self.world, self._barrier, self.log)
        self.global_batch = cfg.resolved_global_batch(self.layout)
        cfg.max_steps = sft_data.max_steps(self.given_cfg, self.dataset, self.global_batch,
                                           self.layout.dp)
        self._dp_sum = sft_data.dp_sum(self.layout, self.device, self.world)

    def _build_model(self):
        cfg = self.cfg
        # fastllm: low-precision params, fp32 masters in the optimizer; torch: fp32 + autocast
        dtype = _DTYPES[cfg.precision] if cfg.backend == "fastllm" else torch.float32
        model = apply_finetune(build_model(cfg, self.tokenizer.vocab_size, dtype), cfg)
        if cfg.kernels == "fastllm" and cfg.backend == "fastllm" and is_model_dir(cfg.model):
            # HF's norms, rotary, SwiGLU and loss on fastllm's kernels, before any layout: under
            # tensor parallel they run on the local shards (tests/test_patch_distributed.py)
            patch_kernels(model)
        model.to(self.device)
        model.train()
        # (DPO's reference: the model as built, before checkpointing, compile and any step)
        self.objective = PreferenceObjective.make(cfg, model)
        self.n_checkpointed = apply_activation_checkpointing(model, cfg.checkpoint_ratio)
        self.n_layers = len(decoder_layers(model))
        if cfg.torch_compile:  # each decoder layer, as torchtitan, before FSDP2 wraps (README)
            compile_model(model, cfg, getattr(self.objective, "reference", None))
        self.strategy = strategies.make(cfg, self.layout, self.device, self.rank)
        if self.objective is not None:  # (what DDP/FSDP wrap: the pairs' scoring, not the forward)
            self.strategy.policy = self.objective.policy(model)
            self.strategy.reference = self.objective.reference_scorer
        self.strategy.wrap(model, self._stage_loss)
        self.strategy.build_optimizer()
        self.module, self.optimizer = self.strategy.module, self.strategy.optimizer
        self.autocast = (torch.autocast(self.device.type, dtype=_DTYPES[cfg.precision])
                         if cfg.precision != "fp32" and cfg.backend == "torch"
                         else contextlib.nullcontext())
        if self.objective is not None:  # (dpo.precompute_ref_log_probs)
            self.objective.prepare(self)

    def _step_loss(self, model, ids):
        with self.autocast:
            loss = (self.objective(model, ids) if self.objective is not None else
                    model(**sft_data.model_inputs(ids), use_cache=False).loss)
        return loss * float("nan") if self._poisoned else loss

    def _stage_loss(self, logits, labels):
        loss = pipeline_loss(logits, labels)
        return loss * float("nan") if self._poisoned else loss

    # ----- checkpoints -----

    def save_checkpoint(self):
        cfg = self.cfg
        state = {
            "step": self.step,
            "data": {"position": self.position, "global_batch": self.global_batch},
            "schedule": {"kind": "warmup_cosine", "step": self.step},
            **self.strategy.scalers.state_dict(),
            "rng": checkpoint_layout.rng_states(self.device, self.world),
            "world_size": self.world,
            "counters": {"skipped": self.skipped_total, "bad_in_a_row": self.bad_in_a_row,
                         "rollbacks": self.rollbacks},
        }
        model_state, optim_state = self.strategy.state()
        # a poisoned checkpoint would be what max_bad_steps rolls back to
        if self.rank == 0 and not checkpoint_layout.non_finite(model_state, self.module,
                                                               self.step, self.log):
            writers = {
                "trainer_state.pt": lambda p: ckpt.save_file(state, p),
                "optimizer.pt": lambda p: ckpt.save_file(optim_state, p),
                "config.yaml": lambda p: self.given_cfg.save(os.path.dirname(p),
                                                             os.path.basename(p)),
            }
            if cfg.finetune in ("lora", "prefix"):
                writers["adapter"] = lambda p: checkpoint_layout.save_adapter(
                    self.module, p, cfg.backend, model_state, self.strategy.adapter_layout)
            else:
                writers["model.pt"] = lambda p: ckpt.save_file(model_state, p)
            path = ckpt.save(cfg.output_dir, self.step, writers)
            ckpt.prune(cfg.output_dir, cfg.checkpoint.keep_last, keep=path)
            self.log(f"fastllm train: saved {path}")
        self._barrier()
        self.last_saved = self.step

    def load_checkpoint(self, path):
        """Restore model, optimizer, schedule, scalers, data position, RNG and counters."""
        cfg = self.cfg
        state = ckpt.load_file(os.path.join(path, "trainer_state.pt"))
        checkpoint_layout.check_trainer_state(state, path, self.global_batch, self.device)
        optim_state = checkpoint_layout.convert_moments(
            ckpt.load_file(os.path.join(path, "optimizer.pt")), cfg, self.optimizer, self.log, path)
        model_state = None
        if cfg.finetune in ("lora", "prefix"):
            checkpoint_layout.load_adapter(self.module, os.path.join(path, "adapter"), cfg.backend,
                                           self.strategy.adapter_layout)
        else:
            model_state = ckpt.load_file(os.path.join(path, "model.pt"))
        checkpoint_layout.load_state(self.strategy, model_state, optim_state, path, self.log)
        self.strategy.scalers.load_state_dict(state)
        self.step = state["step"]
        self.position = state["data"]["position"]
        counters = state["counters"]
        self.skipped_total, self.bad_in_a_row = counters["skipped"], counters["bad_in_a_row"]
        self.rollbacks = counters["rollbacks"]
        checkpoint_layout.restore_rng(state["rng"], self.rank, self.device, cfg.seed, self.step)
        self.last_saved = self.step

    def _rollback(self):
        found = self._from_rank0(ckpt.latest_valid(self.cfg.output_dir, log=self.log)
                                 if self.rank == 0 else None)
        if found is None:
            raise RuntimeError(f"fastllm train: {self.bad_in_a_row} non-finite losses in a row "
                               f"(max_bad_steps={self.cfg.max_bad_steps}) and no checkpoint in "
                               f"{self.cfg.output_dir} to roll back to")
        position = self.position
        skipped, rollbacks = self.skipped_total, self.rollbacks
        self.load_checkpoint(found[1])
        # Keep going from where the data is: the batches that gave non-finite losses are skipped.
        self.position = position
        self.skipped_total, self.rollbacks, self.bad_in_a_row = skipped, rollbacks + 1, 0
        self.loader.reset(self.position)
        self.log(f"fastllm train: rolled back to {found[1]} (step {self.step}); data continues "
                 f"at sample {self.position}")

    # ----- the loop -----

    def _train(self):
        cfg = self.cfg
        # first: a refused record, batch, model or layout leaves output_dir as it was
        self._build_data()
        self._build_model()
        if self.rank == 0:
            self._run_lock = run_dir.prepare(cfg, self.log)
        self._barrier()
        torch.manual_seed(cfg.seed * 7919 + self.rank)
        random.seed(cfg.seed + self.rank)
        self.step, self.position = 0, 0
        self.skipped_total = self.bad_in_a_row = self.rollbacks = 0
        self.last_saved = None
        nan_batches = set(cfg.nan_batches)
        tracked_peak = None
        resumed = None
        if cfg.checkpoint.auto_resume and not cfg.overwrite_output_dir:  # (run_dir.prepare)
            found = ckpt.usable(self._from_rank0(ckpt.resume_point(cfg.output_dir, self.log)
                                                 if self.rank == 0 else None))
            if found is not None:
                checkpoint_layout.check_resume_config(found[1], cfg, self.log)
                self.load_checkpoint(found[1])
                resumed = found[1]
                self.log(f"fastllm train: resumed from {resumed} (step {self.step}, sample "
                         f"{self.position})")
                if self.step >= cfg.max_steps:
                    self.log(f"fastllm train: {cfg.output_dir} is already at max_steps="
                             f"{cfg.max_steps}; raise max_steps or pick another output_dir to "
                             f"train more")
        if self.rank == 0:  # (after the resume checks: a refused resume leaves the old ones)
            run_dir.save_run_files(cfg.output_dir, self.given_cfg, self.tokenizer)
        # the ranks of one tensor-parallel group, and the stages of one pipeline, read the same
        # batch: the data is split over dp only
        lay, strategy = self.layout, self.strategy
        self.loader = Loader(self.dataset, lay.coords(self.rank)[1], lay.dp, cfg.micro_batch_size,
                             self.global_batch, cfg.data.prefetch, self.position)
        self.log(start_line(self))
        evaluator = Evaluator.start(self)  # before MetricsWriter opens metrics.jsonl
        writer = MetricsWriter(cfg, cfg.output_dir, self.rank == 0, cfg.max_steps, self.step)
        tokens_per_step = self.global_batch * cfg.data.seq_len
        status = "completed"
        with StopSignals() as signals, writer:
            try:
                while self.step < cfg.max_steps:
                    faults.before_step(self.step + 1)
                    t_start, graphs = time.perf_counter(), compiled_graphs()
                    self._poisoned = self.position // self.global_batch in nan_batches
                    micro, data_wait = self.loader.next_step()
                    self.position += self.global_batch
                    tracker = None
                    # (not under torch_compile: compiled code allocates outside its dispatch mode)
                    if (cfg.track_memory and tracked_peak is None and self.device.type == "cpu"
                            and strategy.name in ("none", "fsdp") and not cfg.torch_compile):
                        # (DPO's frozen reference copy, where one is held, counts too)
                        tracker = PeakMemory(self.module, self.optimizer,
                                             getattr(self.objective, "reference", None))
                        tracker.__enter__()
                    elif self.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(self.device)
                    try:
                        # Set before backward: optimizer_in_backward steps inside it.
                        for g in self.optimizer.param_groups:
                            g["lr"] = lr_at(cfg, self.step + 1)
                        t_fb = time.perf_counter()
                        sft = sft_data.prepare_step(micro, self._dp_sum, lay.dp)  # or None
                        # no target on any rank: all skip (a 0 loss would still decay weights)
                        no_targets = sft is not None and sft[1] == 0
                        loss_sum, exposed = ((torch.zeros((), dtype=torch.float64), 0.0)
                                             if no_targets else
                                             strategy.forward_backward(micro, self._step_loss))
                        t_comm = time.perf_counter()
                        flags = torch.tensor([float(loss_sum), float(signals.signum is not None)],
                                             dtype=torch.float64)
                        if self.world > 1:
                            dist.all_reduce(flags)
                        t_opt = time.perf_counter()
                        # every rank of the last pipeline stage holds the loss (tp ranks: copies)
                        loss = float(flags[0]) / (len(micro) * lay.dp * lay.tp)
                        finite = math.isfinite(loss)
                        if finite and not no_targets:
                            grad_norm, skipped = strategy.step()
                            self.bad_in_a_row = 0
                        else:
                            self.optimizer.zero_grad(set_to_none=True)
                            grad_norm, skipped = None, True
                            self.bad_in_a_row += int(not finite)
                        t_end = time.perf_counter()
                    finally:
                        if tracker is not None:
                            tracker.__exit__(None, None, None)
                    if tracker is not None:
                        tracked_peak = int(tracker.peak)
                    self.step += 1
                    self.skipped_total += int(skipped)
                    step_time = t_end - t_start
                    # One process has nothing to reduce: building the flags is not communication.
                    comm = exposed + (t_opt - t_comm if self.world > 1 else 0.0)
                    rec = {
                        "step": self.step, "loss": loss if finite else None,
                        "lr": lr_at(cfg, self.step), "grad_norm": grad_norm, "skipped": skipped,
                        "tokens": sft[0] if sft else tokens_per_step,
                        "tokens_per_s": (sft[0] if sft else tokens_per_step) / step_time,
                        "step_time_s": step_time, "data_wait_s": data_wait,
                        "fwd_bwd_s": (t_comm - t_fb) - exposed + (0.0 if self.world > 1
                                                                   else t_opt - t_comm),
                        "comm_s": comm, "optim_s": t_end - t_opt,
                        "peak_mem_bytes": step_peak(self.device, tracked_peak),
                    }
                    if cfg.torch_compile:  # graphs compiled in this step (summarize: untimed)
                        rec["compiles"] = compiled_graphs() - graphs
                    if strategy.bubble is not None:
                        # the schedule's idle share (planner.bubble_fraction), taken out of compute
                        rec["bubble_s"] = strategy.bubble * rec["fwd_bwd_s"]
                        rec["fwd_bwd_s"] -= rec["bubble_s"]
                    if self.objective is not None:  # (TRL's rewards/* and logps/*)
                        rec.update(self.objective.pop_metrics(self.device))
                    if strategy.scalers.loss_scaler is not None:
                        rec["loss_scale"] = strategy.scalers.loss_scaler.get_scale()
                    if cfg.data.log_indices:
                        rec["samples"] = sorted(sft_data.gather_samples(micro, self.world))
                    if not finite or no_targets:
                        writer.message(f"fastllm train: step {self.step}: " + (
                            "no target token (all truncated by data.seq_len?), step skipped"
                            if no_targets else f"non-finite loss, step skipped "
                            f"({self.bad_in_a_row} in a row)"))
                        rec["loss"] = float("nan")
                    if evaluator is not None and evaluator.due(self.step):
                        rec.update(evaluator.run(self, self.step))
                    writer.log(rec)
                    if not finite and self.bad_in_a_row >= cfg.max_bad_steps:
                        self._rollback()
                        writer.rewind(self.step)
                        if evaluator is not None:
                            evaluator.rewind(self.step)
                        continue
                    stop = float(flags[1]) > 0
                    due = cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0
                    if due or self.step == cfg.max_steps or stop:
                        self.save_checkpoint()
                    if stop:
                        status = "stopped"
                        self.log(f"fastllm train: {signals.name} received: saved "
                                 f"checkpoint-{self.step} and stopped")
                        break
                    watchdog.after_step(cfg)
                    faults.after_step(self.step)
            except RuntimeError as e:
                watchdog.reraise(e, self.step, cfg)
        summary, self.status = {}, status  # (every rank's: completed or stopped)
        if self.rank == 0:
            summary = write_summary(cfg.output_dir, status, self.step, resumed_from=resumed,
                                    world_size=self.world, strategy=strategy.name,
                                    rollbacks=self.rollbacks)
        self._barrier()
        return summary
