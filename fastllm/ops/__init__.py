"""fastllm ops: each a torch.library custom op (schema in fastllm/_library.py), its plain-PyTorch
reference `<op>_ref`, and a functional wrapper."""

from fastllm.ops.adamw import adamw_step, adamw_step_ref
from fastllm.ops.adamw_master import adamw_master_step, adamw_master_step_ref
from fastllm.ops.l2norm import l2norm, l2norm_ref
from fastllm.ops.lora_linear import lora_linear, lora_linear_ref

__all__ = [
    "adamw_master_step", "adamw_master_step_ref", "adamw_step", "adamw_step_ref", "l2norm",
    "l2norm_ref", "lora_linear", "lora_linear_ref",
]
