"""The flat-shard bridge of the low-byte optimizer state (fastllm.optim.AdamW8bit,
AdamW(state_dtype=torch.bfloat16)): export_state / import_state between a param's low-byte
moments and torch's fp32 ones, and convert_state for whole state_dicts. The layouts themselves
are in fastllm/optim/state_layout.py, the optimizer in fastllm/optim/adamw.py."""

from fastllm.optim.state_layout import convert_state, export_state, import_state

__all__ = ["convert_state", "export_state", "import_state"]
