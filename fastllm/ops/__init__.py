"""fastllm ops: each a torch.library custom op (schema in fastllm/_library.py), its plain-PyTorch
reference `<op>_ref`, and a functional wrapper."""

from fastllm.ops.adamw import adamw_step, adamw_step_ref

__all__ = ["adamw_step", "adamw_step_ref"]
