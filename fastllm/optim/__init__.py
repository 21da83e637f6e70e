"""Optimizers: drop-in replacements for torch.optim classes."""

from fastllm.optim.adamw import AdamW

__all__ = ["AdamW"]
