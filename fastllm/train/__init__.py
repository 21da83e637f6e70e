"""The training runtime: `fastllm train` and fastllm.train.Trainer.

    config.py      TrainConfig, one dataclass tree (YAML + dotted key=value overrides)
    data.py        token file cached by content hash, packed sequences, prefetching loader
    model.py       built-in Llama configs, training modes, activation checkpointing, the
                   data/tensor parallel wrapping (_parallelize), pipeline stages (build_pipeline)
    checkpoint.py  atomic checkpoint-<step>/ folders with a manifest of checksums
    metrics.py     metrics.jsonl, progress, the time split and the run summary
    trainer.py     the loop
    report.py      `fastllm report RUN_DIR`: curves and the time split to a PNG
"""

from fastllm.train.config import ConfigError, TrainConfig
from fastllm.train.trainer import Trainer, lr_at

__all__ = ["ConfigError", "TrainConfig", "Trainer", "lr_at"]
