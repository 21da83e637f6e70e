"""Optimizers: drop-in replacements for torch.optim classes and the memory-lean ones."""

from fastllm.optim.adamw import AdamW, AdamW8bit
from fastllm.optim.badam import BAdam
from fastllm.optim.galore import GaLoreAdamW
from fastllm.optim.grad_norm import clip_coefficient, global_grad_norm
from fastllm.optim.state_layout import convert_state

__all__ = ["AdamW", "AdamW8bit", "BAdam", "GaLoreAdamW", "clip_coefficient", "convert_state",
           "global_grad_norm"]
