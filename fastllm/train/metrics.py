"""Metrics: one JSON line per step in output_dir/metrics.jsonl, a progress bar (or plain log
lines when stderr is not a terminal), optional TensorBoard events, and the run summary.

Each step's wall time is split into data wait (blocked on the loader), forward+backward,
exposed communication (gradient reduction not hidden behind backward, plus the loss/flag
all-reduces) and optimizer; the summary warns at > 10% data wait or > 15% exposed
communication. Exposed communication is measured for DDP (from the last gradient bucket's launch
to the end of backward, by a comm hook) plus the per-step loss all-reduce; FSDP's and
DistributedOptimizer's own collectives are counted in forward+backward / optimizer.
Under pipeline parallel (parallel.pp > 1) the schedule's run is split into bubble_s, its idle
share by the schedule's formula ((pp - 1) / (chunks * micro-batches + pp - 1), planner's
bubble_fraction), and forward+backward (the rest, the stages' sends and receives included);
the summary warns at a bubble > 15%.

peak_mem_bytes: on CUDA torch.cuda.max_memory_allocated of the step; on the CPU in one process
and under FSDP2 the peak tensor memory of the first step (fastllm.train.memory.PeakMemory,
params, grads and optimizer state included; under FSDP2 this rank's shards, gathers and
reduce-scatters, all torch ops the mode sees); on the CPU with other strategies (DDP's reducer
allocates its buckets in C++, out of the mode's sight) the process's peak RSS.
"""

import json
import math
import os
import sys
import time

from fastllm._files import write_replacing

__all__ = ["FIELDS", "MetricsWriter", "read_metrics", "summarize", "format_summary",
           "write_summary", "start_line"]

FIELDS = ("step", "loss", "lr", "grad_norm", "skipped", "tokens", "tokens_per_s", "step_time_s",
          "data_wait_s", "fwd_bwd_s", "comm_s", "optim_s", "peak_mem_bytes")

DATA_WAIT_WARN = 0.10
COMM_WARN = 0.15
BUBBLE_WARN = 0.15


def read_metrics(path, key="step"):
    """The records of a metrics.jsonl that carry `key` ("step": training steps, "eval_step":
    evaluations), in order of that key, the last record of each kept (a resumed run repeats the
    steps after its checkpoint); a torn last line is ignored."""
    by_step = {}
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if key in rec:
                by_step[rec[key]] = rec
    return [by_step[s] for s in sorted(by_step)]


class MetricsWriter:
    """Appends to metrics.jsonl (rank 0 only) and shows progress."""

    def __init__(self, cfg, output_dir, enabled, max_steps, start_step):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.max_steps = max_steps
        self.log_interval = max(1, cfg.log_interval)
        self._file = None
        self._bar = None
        self._tb = None
        self._t0 = time.perf_counter()
        self._start_step = start_step
        if not enabled:
            return
        self._truncate_after(start_step)
        self._file = open(self.path, "a")
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=max_steps, initial=start_step, desc="train",
                                 dynamic_ncols=True)
            except ImportError:
                self._bar = None
        self._tb_dir = os.path.join(output_dir, "tensorboard")
        if cfg.report_to == "tensorboard":
            try:
                self._open_tb(start_step)
            except ImportError:
                print("fastllm train: report_to=tensorboard but tensorboard is not installed "
                      "(pip install tensorboard); writing metrics.jsonl only", file=sys.stderr)

    def _open_tb(self, step):
        """TensorBoard's writer from `step` on: the events an earlier run (or the steps before a
        rollback) logged after it are purged, as metrics.jsonl's lines are (TensorBoard drops
        a run's events at or after a purge_step it finds logged later)."""
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(self._tb_dir, purge_step=step + 1)

    def _truncate_after(self, step):
        """A resumed run rewrites the steps after its checkpoint: drop their old lines, the
        evaluations' ({"eval_step": s}) too (a rollback redoes them; a resume's were dropped
        already by fastllm.train.evaluate.Evaluator.start)."""
        if not os.path.exists(self.path):
            return
        keep = []
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if max(rec.get("step", 0), rec.get("eval_step", 0)) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)

    def rewind(self, step):
        """After a rollback to `step`: drop the lines of the steps (and evaluations) that will
        be redone; samples.jsonl is the Evaluator's (Evaluator.rewind)."""
        if not self.enabled:
            return
        self._file.close()
        self._truncate_after(step)
        self._file = open(self.path, "a")
        if self._tb is not None:
            self._tb.close()
            self._open_tb(step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, rec):
        if not self.enabled:
            return
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        step = rec["step"]
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s",
                        "comm_s", "optim_s", "rewards/accuracies", "rewards/margins"):
                if isinstance(rec.get(key), (int, float)):
                    self._tb.add_scalar(f"train/{key}", rec[key], step)
        loss = rec["loss"]
        text = (f"loss {loss:.4f} lr {rec['lr']:.2e} tok/s {rec['tokens_per_s']:.0f}"
                + (" SKIPPED" if rec["skipped"] else "")
                + (f" reward_acc {rec['rewards/accuracies']:.2f} margin "
                   f"{rec['rewards/margins']:.3f}" if "rewards/margins" in rec else "")
                + (f" eval_loss {rec['eval_loss']:.4f}" if rec.get("eval_loss") is not None
                   else "")
                + (f" eval_ppl {rec['eval_ppl']:.2f}" if rec.get("eval_ppl") is not None
                   else "")
                + (f" eval_reward_acc {rec['eval_rewards/accuracies']:.2f}"
                   if rec.get("eval_rewards/accuracies") is not None else ""))
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        elif (step % self.log_interval == 0 or step == self.max_steps or step == 1
              or rec.get("eval_loss") is not None):
            done = step - self._start_step
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / max(done, 1) * (self.max_steps - step)
            print(f"step {step}/{self.max_steps} {text} eta {eta:.0f}s", file=sys.stderr,
                  flush=True)

    def message(self, text):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _mean(values):
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(records, skip_first=1):
    """Totals and means of a run's step records (the first steps, which include warm-up, are left
    out of the timing means when there are enough; so are the steps that compiled graphs under
    torch_compile, where any step did not)."""
    if not records:
        return {}
    timed = records[skip_first:] if len(records) > skip_first + 2 else records
    # torch_compile: a step that compiled (the first ones; one that met a new shape, mask or mix
    # of grads) timed the compiler, seconds at a time, not the run
    timed = [r for r in timed if not r.get("compiles")] or timed
    step_time = sum(r["step_time_s"] for r in timed)
    keys = ["data_wait_s", "fwd_bwd_s", "comm_s", "optim_s"]
    if any("bubble_s" in r for r in records):
        keys.insert(2, "bubble_s")
    split = {k: sum((r.get(k) or 0.0) for r in timed) for k in keys}
    losses = [r["loss"] for r in records if not r["skipped"]]
    n = max(1, min(10, len(losses) // 5))
    return {
        "steps": records[-1]["step"],
        "first_loss": _mean(losses[:n]) if losses else float("nan"),
        "final_loss": _mean(losses[-n:]) if losses else float("nan"),
        "skipped_steps": sum(1 for r in records if r["skipped"]),
        "tokens": sum(r["tokens"] for r in records),
        "tokens_per_s": sum(r["tokens"] for r in timed) / step_time if step_time else 0.0,
        "step_time_s": step_time / len(timed),
        "split": {k: (v / step_time if step_time else 0.0) for k, v in split.items()},
        "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0) for r in records),
        "eval_loss": next((r["eval_loss"] for r in reversed(records)
                           if r.get("eval_loss") is not None), None),
        # objective=dpo|cpo|orpo: the last held-out reward accuracy (no perplexity there)
        "eval_reward_accuracy": next((r["eval_rewards/accuracies"] for r in reversed(records)
                                      if r.get("eval_rewards/accuracies") is not None), None),
        "compile_steps": [r["step"] for r in records if r.get("compiles")],
    }


def format_summary(s, title="run summary"):
    if not s:
        return f"{title}: no steps"
    split = s["split"]
    lines = [
        f"{title}:",
        f"  steps {s['steps']}, tokens {s['tokens']:,}, skipped steps {s['skipped_steps']}",
        f"  loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}  (mean of the first / last steps)",
        f"  throughput {s['tokens_per_s']:,.0f} tokens/s, {s['step_time_s'] * 1e3:.1f} ms/step",
        "  time split: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1%}"
                                     for k, v in split.items()),
        f"  peak memory {s['peak_mem_bytes'] / 2**20:.1f} MiB",
    ]
    steps = s.get("compile_steps")
    if steps:
        shown = ", ".join(map(str, steps[:8])) + (f" and {len(steps) - 8} more"
                                                   if len(steps) > 8 else "")
        lines.append(f"  torch_compile: graphs compiled in steps {shown} (left out of the timing; "
                     f"TORCH_LOGS=recompiles says why a later step compiled)")
    if s.get("eval_reward_accuracy") is not None:
        lines.append(f"  eval loss {s['eval_loss']:.4f} (reward accuracy "
                     f"{s['eval_reward_accuracy']:.3f})")
    elif s.get("eval_loss") is not None:
        lines.append(f"  eval loss {s['eval_loss']:.4f} (perplexity "
                     f"{math.exp(min(s['eval_loss'], 700)):.2f})")
    if split["data_wait_s"] > DATA_WAIT_WARN:
        lines.append(f"  WARNING: data wait is {split['data_wait_s']:.0%} of the step (> 10%): "
                     f"raise data.prefetch, or make the data pipeline faster")
    if split["comm_s"] > COMM_WARN:
        lines.append(f"  WARNING: exposed communication is {split['comm_s']:.0%} of the step "
                     f"(> 15%): use a larger micro batch or gradient accumulation, or overlap "
                     f"more (fsdp/zero2)")
    if split.get("bubble_s", 0.0) > BUBBLE_WARN:
        lines.append(f"  WARNING: the pipeline bubble is {split['bubble_s']:.0%} of the step "
                     f"(> 15%): use more micro-batches per step (a larger global_batch_size or "
                     f"a smaller micro_batch_size) or parallel.schedule=interleaved")
    return "\n".join(lines)


def _finite_or_none(value):
    """value with every nan or infinite float in it (dicts and lists walked) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def write_summary(output_dir, status, step, **run):
    """The run summary (summarize over output_dir/metrics.jsonl, plus status and `run`'s
    fields) written to output_dir/summary.json and printed. Returns it, with the losses."""
    records = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    summary = summarize(records)
    summary.update(status=status, output_dir=output_dir, **run,
                   losses=[r["loss"] for r in records])
    # null for a nan or inf (no loss: every step skipped): NaN is not JSON, and this file is for
    # other tools (metrics.jsonl keeps NaN, which Python's json reads back)
    fields = _finite_or_none({k: v for k, v in summary.items() if k != "losses"})

    def write(file):
        with open(file, "w") as f:
            json.dump(fields, f, indent=1, allow_nan=False)
    # replaced whole: a failed write leaves the previous run's summary as it was
    write_replacing(output_dir, {"summary.json": write})
    print(format_summary(summary, f"fastllm train: {status} at step {step} ({output_dir})"),
          flush=True)
    return summary


def start_line(trainer):
    """The run's opening log line: the model and what trains, the devices and layout, the data
    and batch, the recomputed layers, the strategy's and objective's details."""
    from fastllm.train.model import weight_count

    cfg, lay, strategy = trainer.cfg, trainer.layout, trainer.strategy
    # this rank's parameters (a tp shard counts whole: DTensor.numel is the global size)
    n_params = weight_count(trainer.module)
    n_train = sum(p.numel() for p in trainer.module.parameters() if p.requires_grad)
    shape = f" ({lay.describe()})" if lay.tp > 1 or lay.pp > 1 else ""
    rows = "preference pairs" if trainer.objective is not None else "sequences"
    nf4 = ""
    if cfg.lora.quantize_base == "nf4":
        from fastllm.quant import NF4Linear, nf4_bytes

        whole, held = nf4_bytes(trainer.module), nf4_bytes(trainer.module, held=True)
        # (a nested bitsandbytes folder stays double-quantised as loaded)
        layers = [m for m in trainer.module.modules() if isinstance(m, NF4Linear)]
        double = " double-quantised" if layers and all(m.double_quant for m in layers) else ""
        nf4 = f", NF4 base {whole / 2**20:.1f} MiB{double}" + (
            f" ({held / 2**20:.1f} MiB on this rank)" if held != whole else "")
    objective = f"; {trainer.objective.describe()}" if trainer.objective is not None else ""
    return (f"fastllm train: {cfg.model} ({n_params / 1e6:.2f}M params, "
            f"{n_train / 1e6:.3f}M trainable"
            f"{' on rank 0' if lay.pp > 1 else ''}{nf4}, finetune={cfg.finetune}, "
            f"precision={cfg.precision}, backend={cfg.backend}, optim={cfg.optim}) on "
            f"{trainer.world} x {trainer.device.type}{shape}, strategy={strategy.name}; "
            f"{trainer.dataset.num_sequences} {rows} of {cfg.data.seq_len} tokens; global "
            f"batch {trainer.global_batch} = {cfg.micro_batch_size} x "
            f"{trainer.loader.accumulation} accumulation x {lay.dp} data parallel; "
            f"{trainer.n_checkpointed}/{trainer.n_layers} layers recomputed"
            f"{strategy.describe()}{objective}")
