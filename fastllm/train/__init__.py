"""The training runtime: `fastllm train` and fastllm.train.Trainer.

    config.py            TrainConfig, one dataclass tree (YAML + dotted key=value overrides)
    data.py              token file cached by content hash, packed sequences, prefetching loader
    model.py             built-in Llama configs and the training modes (which parameters train)
    preflight.py         what the config names (model, LoRA targets, files, eval prompts), checked
                         before the run writes anything
    strategies/          one way of running per module (one process, DDP, FSDP2, ZeRO-1/2, tensor
                         and pipeline parallel), on the layout of fastllm.parallel.ParallelLayout
    optimizers.py        optimizer construction (fastllm, torch baseline, in-backward, GaLore/BAdam,
                         ZeRO) and the optimizer step
    checkpoint_layout.py checkpoint layouts: every strategy saves and loads one process's layout
    checkpoint.py        atomic checkpoint-<step>/ folders with a manifest of checksums
    run_dir.py           the output_dir lock (flock, the holder's PID) and overwrite_output_dir
    watchdog.py          parallel.timeout_s: a collective timeout names its step, exits nonzero
    faults.py            FASTLLM_FAULT: deterministic kills and hangs for the tests
    metrics.py           metrics.jsonl, progress, the time split and the run summary
    signals.py           SIGTERM/SIGINT: finish the step, checkpoint, stop
    memory.py            the peak tensor memory of a step on the CPU
    trainer.py           the loop
    report.py            `fastllm report RUN_DIR`: curves and the time split to a PNG
"""

from fastllm.train.config import ConfigError, TrainConfig
from fastllm.train.trainer import Trainer, lr_at

__all__ = ["ConfigError", "TrainConfig", "Trainer", "lr_at"]
