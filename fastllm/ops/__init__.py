"""fastllm ops: each a torch.library custom op (schema in fastllm/_library.py), its plain-PyTorch
reference `<op>_ref`, and a functional wrapper."""

from fastllm.ops.adamw import adamw_step, adamw_step_ref
from fastllm.ops.adamw_master import adamw_master_step, adamw_master_step_ref
from fastllm.ops.l2norm import l2norm, l2norm_ref
from fastllm.ops.linear import linear, linear_ref
from fastllm.ops.lora_linear import lora_linear, lora_linear_ref
from fastllm.ops.scaled_copy import scaled_copy, scaled_copy_ref
from fastllm.ops.galore_adam_step import galore_adam_step, galore_adam_step_ref
from fastllm.ops.orthogonalize import orthogonalize, orthogonalize_ref
from fastllm.ops.powersgd_decompress import powersgd_decompress, powersgd_decompress_ref
from fastllm.ops.adamw8bit import adamw8bit_step, adamw8bit_step_ref
from fastllm.ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy, fused_linear_cross_entropy_ref)
from fastllm.ops.rms_norm import rms_norm, rms_norm_ref
from fastllm.ops.rotary_embedding import rotary_embedding, rotary_embedding_ref
from fastllm.ops.swiglu import geglu, geglu_ref, swiglu, swiglu_ref
from fastllm.ops.attention import attention, attention_ref
from fastllm.ops.nf4 import nf4_dequantize, nf4_dequantize_ref, nf4_quantize

__all__ = [
    "adamw_master_step", "adamw_master_step_ref", "adamw_step", "adamw_step_ref", "l2norm",
    "l2norm_ref", "linear", "linear_ref", "lora_linear", "lora_linear_ref",
    "scaled_copy", "scaled_copy_ref",
    "galore_adam_step", "galore_adam_step_ref", "orthogonalize", "orthogonalize_ref",
    "powersgd_decompress", "powersgd_decompress_ref",
    "adamw8bit_step", "adamw8bit_step_ref",
    "fused_linear_cross_entropy", "fused_linear_cross_entropy_ref",
    "rms_norm", "rms_norm_ref", "rotary_embedding", "rotary_embedding_ref", "swiglu", "swiglu_ref",
    "geglu", "geglu_ref",
    "attention", "attention_ref", "nf4_dequantize", "nf4_dequantize_ref", "nf4_quantize",
]
