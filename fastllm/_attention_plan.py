"""The attention plan fastllm.patch hands a model's attention layers: whether a forward's
attention is plain causal or packed documents, known once per forward from its inputs, so that
each patched attention layer can run fastllm.ops.attention (the CPU kernel; on a GPU PyTorch's
varlen flash attention for packed rows) instead of transformers' masked attention.

The patched decoder stack (*Model) computes it in training, however it is called (by the causal
LM, patched or not, or directly by TRL's fused LM head), and hands it on through its **kwargs
under ATTENTION_PLAN; the patched attention pops it.
"""

import torch

__all__ = ["ATTENTION_PLAN", "AttentionPlan", "attention_plan", "fastllm_attention_applies"]

# The keyword the patched decoder stack hands the attention layers (through the model's
# **kwargs) when it knows the attention is causal with no padding: the same rule as transformers'
# masking_utils (packed documents from position ids only with no 2-D mask and no cache).
ATTENTION_PLAN = "fastllm_attention_plan"


class AttentionPlan:
    __slots__ = ("doc_start", "packed", "_on", "_segments")

    def __init__(self, doc_start, packed=False):
        # (B, T) int64 from the position ids, or None (none given: plain causal). A layer that
        # sees a cache ignores it: transformers looks for packed rows only when the model runs
        # without one (masking_utils), and whether it does is only known there (the model may
        # make a cache for use_cache, or not, as under gradient checkpointing in training).
        # packed: a row holds several documents (known on the CPU only: a host read)
        self.doc_start, self.packed = doc_start, packed
        self._on, self._segments = {}, {}

    def doc_start_on(self, device):
        """doc_start on `device` (a model split across GPUs: each layer's own), copied once."""
        if self.doc_start is None or self.doc_start.device == device:
            return self.doc_start
        if device not in self._on:
            self._on[device] = self.doc_start.to(device)
        return self._on[device]

    def segments(self, device):
        """document_segments(doc_start) on `device`, computed by the first layer there that needs
        it (the GPU's varlen route; its host reads once per forward, not per layer) and kept for the
        others and for the recomputation under gradient checkpointing."""
        from fastllm.ops.attention import document_segments

        if device not in self._segments:  # (from the position ids: whole documents, never None)
            self._segments[device] = document_segments(self.doc_start_on(device))
        return self._segments[device]


def attention_plan(model, inputs, attention_mask, position_ids, cache):
    from fastllm.ops.attention import (cpu_attention_available, doc_start_from_position_ids,
                                       gpu_varlen_available, worth_it)

    if inputs is None or attention_mask is not None:
        return None
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    if cache is not None and cache.get_seq_length() > 0:
        return None
    device = inputs.device
    if device.type == "cuda":
        # rows with position ids (packed when they restart), where PyTorch has varlen flash
        # attention; each layer decides from its own q and k whether it applies
        # (gpu_varlen_applies) and otherwise runs transformers' attention (SDPA with its
        # (B, 1, T, T) block-diagonal mask for packed rows)
        if position_ids is None or not gpu_varlen_available():
            return None
    elif device.type != "cpu" or not cpu_attention_available():
        return None
    doc_start = None if position_ids is None else doc_start_from_position_ids(
        position_ids.expand(inputs.shape[0], -1).to(device))
    if device.type != "cpu":
        return AttentionPlan(doc_start, False)
    # whether the rows hold several documents: a host read (one reduction a forward; not while
    # torch.compile traces: a compiled model's packed rows take the kernel where plain ones
    # would). Each layer decides with its own q's dtype (autocast), so it is read whatever this
    # model's dtype would decide
    packed = (doc_start is not None and not torch.compiler.is_compiling()
              and bool((doc_start != 0).any()))
    if not worth_it(inputs.shape[1], getattr(model, "dtype", torch.float32), packed):
        return None
    return AttentionPlan(doc_start, packed)


def wants_attentions(module, kwargs):
    """Whether the caller asked for attention weights: the argument, or the model's config
    (transformers 5 records the weights with hooks and passes neither down to the layers)."""
    return bool(kwargs.get("output_attentions") or getattr(module.config, "output_attentions",
                                                           False))


def fastllm_attention_applies(module, dropout, kwargs, tokens):
    # the device, dtype and length are checked by the layer (_attention_forward) on its own q
    config = module.config
    # Qwen2 sets sliding_window per layer (None: full attention); Mistral and Phi-3 in their
    # configs. A window of at least the row's tokens masks nothing (a key k positions back is
    # seen for k < window): Phi-3.5's and Phi-4-mini's 262144, Phi-3-mini-4k's 2047 on rows up
    # to 2047 tokens
    window = (module.sliding_window if hasattr(module, "sliding_window")
              else getattr(config, "sliding_window", None))
    return (dropout == 0.0 and getattr(module, "is_causal", True)
            and kwargs.get("is_causal", True) is not False
            and not wants_attentions(module, kwargs)
            and (window is None or tokens <= window)
            and getattr(config, "attn_logit_softcapping", None) is None)
