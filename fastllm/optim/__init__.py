"""Optimizers: drop-in replacements for torch.optim classes and the memory-lean ones."""

from fastllm.optim.adamw import AdamW
from fastllm.optim.adamw8bit import AdamW8bit, convert_state
from fastllm.optim.badam import BAdam
from fastllm.optim.galore import GaLoreAdamW

__all__ = ["AdamW", "AdamW8bit", "BAdam", "GaLoreAdamW", "convert_state"]
