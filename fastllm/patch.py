"""fastllm.patch(model): run a Hugging Face Llama-family model on fastllm's kernels, in place.

    model = LlamaForCausalLM.from_pretrained(...)      # or Qwen2/Qwen3/Mistral/Phi3ForCausalLM
    fastllm.patch(model)                                # returns the model
    out = model(input_ids, labels=labels)               # out.loss; in training, out.logits is None
    fastllm.unpatch(model)                              # the original forwards again

What is swapped, per module instance (the class and every other model are untouched):
    *RMSNorm            -> fastllm.ops.rms_norm            (one pass each way, fp32 inside)
    *Attention          -> the same attention with fastllm.ops.rotary_embedding on q and k
                           together, and fastllm.ops.lora_linear_multi for q/k/v when they
                           are fastllm.lora LoRALinear layers (x read once for every A; over
                           NF4Linear bases too: fastllm.quant.nf4_lora_linear_multi)
    *MLP (SwiGLU,       -> fastllm.ops.swiglu (silu(gate) * up recomputed in the backward; for
     GeGLU)                Gemma's tanh-GELU MLP fastllm.ops.geglu, the same way), with
                           gate/up through lora_linear_multi when both are LoRALinear, and a
                           LoRALinear down_proj through fastllm.ops.swiglu_lora_linear (the
                           product not kept for its backward; fastllm/_patch_lora.py)
    nn.Linear           -> fastllm.ops.linear when the input is bf16/fp16 on a CPU without
                           native low-precision GEMMs (products in fp32, fastllm/_lowp.py; the
                           attention's sdpa is then computed in fp32 the same way), or fp32 on a
                           CPU where ATen's fp32 GEMM is slow (oneDNN's, fastllm/_gemm.py)
    *ForCausalLM        -> Llama, Qwen2, Qwen3, Mistral, Phi-3 and Gemma 1-3 (text) only (the others
                           change their logits or add to their loss: logit scales, router
                           losses; Gemma 2's and 3's logit softcap is the fused loss's): with
                           `labels` in training (module.training and grad enabled), the loss by
                           fastllm.ops.fused_linear_cross_entropy on the last hidden states and
                           lm_head's weight: the (tokens, vocab) logits never exist, and the
                           output's `logits` is None (Liger-Kernel's rule; a tuple keeps None in
                           its place). In eval, under no_grad, without labels or with a nonzero
                           `logits_to_keep` the original forward runs (logits for evaluation
                           metrics; generation unchanged); `skip_logits=True` / False forces
                           either, as Liger's does.
    *Model (the decoder -> its own forward, which in training hands the attention layers the
     stack)                attention plan (fastllm/_attention_plan.py) when it is called directly
                           (TRL's fused LM head, cross_entropy=False); with rotary
Each swap is an instance attribute `forward` (the replacement bound to the module: one compiled
graph for all decoder layers under per-block compile, and a patched model pickles; see
fastllm/_patch_bind.py), so parameters, names, state_dicts, hooks, PEFT's wrappers
(patch before or after get_peft_model), gradient checkpointing and torch.compile see the model
they expect. Under an accelerate hook (device_map dispatch, cpu_offload) the swap is the
hook's `_old_forward`, which the hook calls; another instance `forward` already there is refused.
unpatch puts back whatever was there before.

Shapes handled: the modules of transformers' Llama, Qwen2 and Mistral (checked against
transformers 5.x: q/k/v/o_proj, gate/up/down_proj, silu, rotate-half rotary, `variance_epsilon`),
Qwen3's (q and k normalised per head before the rotation), the `1 + weight` RMSNorm, the GeGLU
MLP (the tanh GELU: gelu_pytorch_tanh) and the causal-LM loss of Gemma 1-3, and Gemma 1's and
3's attention (Gemma 3's q/k norms and sliding layers as Qwen3's and Qwen2's; Gemma 2's, which
softcaps its scores, stays its own); Phi-3's qkv_proj and gate_up_proj (q, k, v and gate, up as
column blocks of one projection) and its rotary on part of each head (partial_rotary_factor).
An *MLP only when its class's forward is transformers' gated line itself, or Phi-3's (no
multipliers, clamps or dropout around it), an *Attention or *ForCausalLM only when it runs
transformers' own forward (a subclass's override, an auxiliary loss say, runs as itself). Any
other module is left alone (GPT-2's); `verbose=True` prints the counts per kind.

Distributed: patch before fully_shard (FSDP2) and before tensor-parallel layouts
(tests/test_patch_distributed.py). The kernels take plain tensors; under FSDP2 the modules see
plain unsharded parameters. Under tensor parallel (DTensor parameters) each forward runs its kernel
on local tensors where that is the same maths, else the module's own computation on DTensors:
    *RMSNorm            -> x sharded on any dim but the last, weight replicated (sequence
                           parallel): the kernel on the local rows; the weight's grad is a partial
                           sum that DTensor reduces. Other DTensor layouts: the original forward
    *Attention, *MLP    -> the projections' hooks hand back local head / ffn shards: the kernels
                           run on those; a row-parallel down_proj runs as itself after
                           fastllm.ops.swiglu, LoRALinear layers sharded by fastllm.parallel too
    nn.Linear           -> a DTensor weight: F.linear on DTensors (nn.Linear's forward)
    *ForCausalLM        -> a vocabulary-sharded (Shard(0)) head: the vocabulary-parallel fused
                           loss (fastllm.parallel.loss); a tensor-parallel head with a bias: the
                           original forward
"""

import types

import torch
import torch.nn.functional as F
from torch import nn

from fastllm import _gemm, _hf, _lowp, _patch_bind
from fastllm._hooks import hooked as _hooked
from fastllm._patch_lora import down_projection, project as _project
from fastllm._patch_match import (_is_attention, _is_backbone, _is_causal_lm,
                                  _is_gated_mlp, _is_gemma_rms_norm, _is_llama_rms_norm, _is_silu,
                                  _is_tanh_gelu, logit_softcap)
from fastllm._attention_plan import (ATTENTION_PLAN, attention_plan, fastllm_attention_applies,
                                     wants_attentions)
from fastllm._dtensor import is_dtensor
from fastllm.ops import gated_mlp
from fastllm.ops.linear import linear_is_plain

_PATCHED = "_fastllm_patched"
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)

# the kinds of swap, as patch()'s keyword arguments name them
KINDS = ("rms_norm", "rotary", "swiglu", "cross_entropy", "linear")
# swapped with the attention layers (rotary), not counted as a kind of its own: the decoder stack,
# which hands them the attention plan when it is called directly
_BACKBONE = "backbone"

# --- the replacement forwards (bound to each patched module) ---------------------------------

def _linear_forward(self, input):
    # off the CPU (a GPU: cuBLAS) nothing differs from nn.Linear's forward: F.linear first, as
    # cheaply as nn.Linear (a patched step was host-bound on an H200; about 200 calls a step)
    if (input.device.type != "cpu" or is_dtensor(self.weight) or input.is_nested
            or input.layout != torch.strided or torch._C._are_functorch_transforms_active()
            or type(self.weight) not in (torch.Tensor, torch.nn.Parameter)
            or type(input) is not torch.Tensor):
        # (tensor parallel: DTensor's F.linear, the op takes local tensors; nested and sparse
        # inputs, which the op refuses; torch.func transforms, which its autograd does not
        # support; tensor subclasses, a torchao-style quantized weight, which have no rule for
        # the op)
        return F.linear(input, self.weight, self.bias)
    # fastllm.ops.linear where it differs from F.linear: bf16/fp16 matmuls on a CPU without
    # native low-precision GEMMs (fastllm/_lowp.py), autocast's included, and fp32 ones on a CPU
    # where ATen's fp32 GEMM is slow (fastllm/_gemm.py); else nn.Linear's forward
    dtype = input.dtype
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    if _lowp.widens(input.device, dtype) or _gemm.routes(input.device, dtype):
        from fastllm.ops.linear import linear

        return linear(input, self.weight, self.bias)
    return F.linear(input, self.weight, self.bias)


def _rms_norm_forward(self, hidden_states):
    return _rms_norm(self, hidden_states, self.variance_epsilon, 0.0, False)


def _gemma_rms_norm_forward(self, x):
    return _rms_norm(self, x, self.eps, 1.0, True)


def _rms_norm(module, x, eps, offset, keep_dtype):
    from fastllm.ops.rms_norm import rms_norm

    weight = module.weight
    if not (is_dtensor(x) or is_dtensor(weight)):
        if weight.dtype == x.dtype:
            return rms_norm(x, weight, eps, offset)
        # Mixed dtypes (an fp32 norm weight on bf16 activations: Qwen3's and Gemma3's q/k norms
        # under autocast) as HF: computed in the promoted dtype, so the weight's grad keeps its
        # precision; Llama's norm returns the promoted product, Gemma's x's dtype (type_as).
        wide = torch.promote_types(x.dtype, weight.dtype)
        y = rms_norm(x.to(wide), weight.to(wide), eps, offset)
        return y.to(x.dtype) if keep_dtype else y
    return _dtensor_rms_norm(module, x, weight, eps, offset)


def _dtensor_rms_norm(module, x, weight, eps, offset):
    """RMSNorm of a DTensor x (..., H): each row is normalised over H alone, so with H whole on
    every rank (x replicated or sharded on another dim, as sequence parallel shards it) and the
    weight replicated, the kernel on the local rows gives the local rows of the output. The
    weight's local grad then sums over local rows only: Partial on the mesh dims x is sharded on,
    reduced by DTensor (the post-accumulate hooks of fastllm.parallel, or FSDP2). Any other
    layout runs the module's own forward on the DTensors."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from fastllm.ops.rms_norm import rms_norm

    row_local = (
        isinstance(x, DTensor) and isinstance(weight, DTensor)
        and x.device_mesh == weight.device_mesh
        and all(type(p) is Replicate for p in weight.placements)
        and all(type(p) is Replicate or (type(p) is Shard and p.dim % x.ndim != x.ndim - 1)
                for p in x.placements))
    if not row_local:
        return type(module).forward(module, x)
    grad_placements = [Partial() if type(p) is Shard else Replicate() for p in x.placements]
    y = rms_norm(x.to_local(), weight.to_local(grad_placements=grad_placements), eps, offset)
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=torch.empty(x.shape, device="meta").stride())


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                       cache=None, **kwargs):
    from fastllm.ops.rotary_embedding import rotary_embedding

    cache = _hf.take_cache(cache, kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if "qkv_proj" in self._modules:  # Phi-3's one projection: q, k and v its column blocks
        q, k, v = _split_qkv(self, self.qkv_proj(hidden_states))
    else:
        q, k, v = _project(hidden_states, [self.q_proj, self.k_proj, self.v_proj])
    cos, sin = position_embeddings
    if any(is_dtensor(t) for t in (q, k, v, cos, sin)):
        # a tensor-parallel plan whose projections hand back DTensors (fastllm.parallel's and
        # torch's default styles hand back local head shards): the original forward, which
        # projects again
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  **_hf.cache_kwargs(self, cache), **kwargs)
    q, k = q.view(hidden_shape), k.view(hidden_shape)
    if self.config.model_type in ("qwen3", "gemma3_text"):  # each head's q and k normalised
        q, k = self.q_norm(q), self.k_norm(k)
    # (B, S, H, D) as the projections lay them out: the kernel rotates q and k in one pass
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        q, k = rotary_embedding(q, k, cos, sin)
    else:  # partial rotary (Phi-4-mini): each head's first rot features, the rest as they are
        q_rot, k_rot = rotary_embedding(q[..., :rot], k[..., :rot], cos, sin)
        q, k = torch.cat([q_rot, q[..., rot:]], -1), torch.cat([k_rot, k[..., rot:]], -1)
    v = v.view(hidden_shape)
    dropout = 0.0 if not self.training else self.attention_dropout
    plan = kwargs.pop(ATTENTION_PLAN, None)
    if plan is not None and fastllm_attention_applies(self, dropout, kwargs, q.shape[1]):
        # causal attention known from _backbone_forward (no 2-D mask: plain causal, or packed
        # documents from the position ids, as transformers' mask would say), in the projections'
        # (B, T, H, D) layout: fastllm's CPU kernel, or on a GPU PyTorch's varlen flash
        # attention for packed rows
        from fastllm.ops.attention import attention, gpu_varlen_applies, worth_it

        # a layer with a cache (a prefill with use_cache): transformers' mask ignored the
        # position ids (no packed rows with a cache)
        doc_start = None if cache is not None else plan.doc_start_on(q.device)
        segments = None
        if q.is_cuda:
            if doc_start is not None and gpu_varlen_applies(q, k, self.scaling):
                segments = plan.segments(q.device)
            else:
                plan = None  # transformers' own attention
        # this layer's own dtype and device; with a cache, plain causal rows (doc_start None)
        elif not worth_it(q.shape[1], q.dtype, plan.packed and cache is None):
            plan = None
        if plan is not None:
            if cache is not None:  # the cache still gets k and v
                kc, vc = _hf.cache_update(cache, k.transpose(1, 2), v.transpose(1, 2),
                                          self.layer_idx, kwargs, cos, sin)
                if kc.shape[2] == k.shape[1]:
                    # (a prefill: the cache's copies of k and v, read in place, so that one copy
                    # of each is kept, as transformers' attention keeps; a training forward with
                    # use_cache kept both, 6 MiB a layer at SmolLM2's 8 x 512 fp32)
                    k, v = kc.transpose(1, 2), vc.transpose(1, 2)
            out = attention(q, k, v, scale=self.scaling, doc_start=doc_start, segments=segments)
            return self.o_proj(out.reshape(*input_shape, -1)), None
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.transpose(1, 2)
    if cache is not None:
        k, v = _hf.cache_update(cache, k, v, self.layer_idx, kwargs, cos, sin)
    if (_lowp.widen(q) and self.config._attn_implementation == "sdpa" and dropout == 0.0
            and q.shape[2] == k.shape[2] and not wants_attentions(self, kwargs)):
        # bf16/fp16 on a CPU without native low-precision GEMMs: PyTorch's flash attention in
        # fp32 on widened q, k, v (its bf16 backward is ~5x slower there; fastllm/_lowp.py)
        # a caller's is_causal=False (bidirectional) wins, as in sdpa_attention_forward
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(self, "is_causal", True)
        is_causal = q.shape[2] > 1 and attention_mask is None and is_causal
        out = _lowp.scaled_dot_product_attention(q, k, v, attention_mask, is_causal, self.scaling)
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None
    attention_interface = _hf.attention_interface(self.config._attn_implementation,
                                                  self._fastllm_eager_attention)
    extra = {}
    if hasattr(self, "sliding_window"):  # Qwen2, Qwen3, Gemma 3: per layer type
        extra["sliding_window"] = self.sliding_window
    elif self.config.model_type in ("mistral", "phi3") and getattr(
            self.config, "sliding_window", None) is not None:
        # (Mistral's and Phi-3's forwards alone read their config's; a Llama or Gemma 1 config
        # may carry an unused sliding_window key, which flash attention would apply)
        extra["sliding_window"] = self.config.sliding_window
    attn_output, attn_weights = attention_interface(
        self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **extra, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _split_qkv(self, qkv):
    """q, k, v: the column blocks of Phi-3's qkv_proj output (views)."""
    nq = self.config.num_attention_heads * self.head_dim
    nkv = self.num_key_value_heads * self.head_dim
    return qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]


def _backbone_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                      inputs_embeds=None, **kwargs):
    # the decoder stack in training, called by the (patched or not) causal LM or directly (TRL's
    # fused LM head): the attention plan its patched attention layers read
    cache = _hf.take_cache(cache, kwargs)
    # in training; and in any mode for rows scored with their position ids, no mask and no cache
    # (packed rows' log-probabilities: fastllm.preference's padding_free, a reference model's;
    # plain rows so scored take fastllm's attention too where it is on for them)
    if (self.training and torch.is_grad_enabled()) or (
            position_ids is not None and attention_mask is None and cache is None
            and kwargs.get("use_cache") is False):
        plan = attention_plan(self, input_ids if input_ids is not None else inputs_embeds,
                              attention_mask, position_ids, cache)
        if plan is not None:
            kwargs[ATTENTION_PLAN] = plan
    return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, **_hf.cache_kwargs(self, cache),
                              inputs_embeds=inputs_embeds, **kwargs)


def _mlp_forward(self, x):
    if "gate_up_proj" in self._modules:  # Phi-3's: gate and up the halves of one projection
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = self.activation_fn
    else:
        act = self._modules["act_fn"] if "act_fn" in self._modules else self.act_fn
        out = _fused_mlp(self, x, act)
        if out is not None:
            return out
        gate, up = _project(x, [self.gate_proj, self.up_proj])
    from fastllm.ops.swiglu import geglu, geglu_linear, swiglu, swiglu_linear

    down = self.down_proj
    if is_dtensor(gate) or is_dtensor(up):  # a plan whose projections hand back DTensors
        return down(act(gate) * up)
    if _is_silu(act):
        gelu = False
    elif _is_tanh_gelu(act):
        gelu = True
    else:  # an act_fn set after patch(): its own maths
        return down(act(gate) * up)
    # a row-parallel down_proj (DTensor weight) runs as itself: its hooks reduce the output; so
    # does one under an accelerate hook, which may first bring its weight (offload, device_map)
    if (type(down) is nn.Linear and not is_dtensor(down.weight) and not _hooked(down)
            and not _lowp.autocast_enabled(x.device.type)):
        # act(gate) * up, as large as gate, is recomputed for down_proj's weight grad instead
        # of kept: one elementwise pass for (tokens x ffn) of activation memory per layer
        return (geglu_linear if gelu else swiglu_linear)(gate, up, down.weight, down.bias)
    # a LoRA down_proj after SwiGLU: silu(gate) * up not kept either (after GeGLU it is)
    out = None if gelu else down_projection(down, gate, up)
    return down((geglu if gelu else swiglu)(gate, up)) if out is None else out


def _fused_mlp(mlp, x, act):
    """down(act(gate(x)) * up(x)) as one autograd node (fastllm.ops.gated_mlp: the host's work
    of three layers' calls and nodes cut) where the three are plain nn.Linear layers that it
    runs as their own forwards would: x's dtype, unsharded, no hooks, no autocast and none of
    fastllm's CPU matmul policies (always so on a GPU); else None. (Each layer's parameters
    are read from its _parameters: nn.Module.__getattr__ costs 0.6 us an attribute, and the
    checks here run for every MLP call.)"""
    gelu = False if _is_silu(act) else True if _is_tanh_gelu(act) else None
    if gelu is None or is_dtensor(x) or _lowp.autocast_enabled(x.device.type) or (
            not linear_is_plain(x)):
        return None
    modules = mlp._modules
    params = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = modules.get(name)
        # (hooks first: torch.nn.utils.prune and weight_norm take the weight out of _parameters
        # and make it in a forward pre-hook)
        if type(layer) is not nn.Linear or _hooked(layer):
            return None
        weight, bias = layer._parameters.get("weight"), layer._parameters.get("bias")
        # plain tensors only: a tensor subclass (DTensor, a quantised weight kept in an exact
        # nn.Linear) multiplies through its own F.linear, not this node's torch.mm
        if (type(weight) not in _PLAIN_TENSORS or weight.dtype != x.dtype
                or weight.device != x.device
                or (bias is not None and type(bias) not in _PLAIN_TENSORS)):
            return None
        params.append((weight, bias))
    (wg, bg), (wu, bu), (wd, bd) = params
    # (looked up at call time, as the other kernels: tests count the calls)
    return (gated_mlp.geglu_mlp if gelu else gated_mlp.swiglu_mlp)(x, wg, wu, wd, bg, bu, bd)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                       **kwargs):
    cache = _hf.take_cache(cache, kwargs)
    original = type(self).forward
    head = self.lm_head
    skip_logits = kwargs.pop("skip_logits", None)
    if skip_logits and labels is None:  # (Liger's check: the logits would be made after all)
        raise ValueError("fastllm.patch: skip_logits=True needs labels (the loss replaces the "
                         "logits); without labels the forward returns the logits")
    if skip_logits is None:
        # Liger-Kernel's rule, and only with grad: evaluation (Trainer.evaluate's
        # compute_metrics, return_dict=False's (loss, logits, ...)) needs the logits
        skip_logits = self.training and torch.is_grad_enabled()
    # logits_to_keep (the last k positions, or those indices): HF's loss is over those logits
    # alone (labels shaped to them), and so few logits are cheap to make
    keeps = torch.is_tensor(logits_to_keep) or logits_to_keep != 0
    if labels is None or not skip_logits or keeps or type(head) is not nn.Linear or _hooked(
            head) or (is_dtensor(head.weight) and head.bias is not None) or not _hf.default_loss(
            self):
        return original(self, input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, **_hf.cache_kwargs(self, cache),
                        inputs_embeds=inputs_embeds,
                        labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
                        **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    # (the attention plan: made by the patched decoder stack, self.model, in training)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, **_hf.cache_kwargs(self.model, cache),
                         inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # HF's ForCausalLMLoss: token t predicts label t + 1
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    if is_dtensor(head.weight) or is_dtensor(hidden):
        # tensor parallel: a vocabulary-sharded head runs the vocabulary-parallel fused loss
        # (hidden gathered; its grad all-reduced), any other DTensor is gathered first
        from fastllm.parallel.loss import vocab_parallel_linear_cross_entropy as loss_fn
    else:
        from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy as loss_fn
    loss = loss_fn(hidden, head.weight, shift_labels.to(hidden.device), bias=head.bias,
                   ignore_index=ignore_index, reduction=reduction,
                   logit_softcap=logit_softcap(self))
    if num_items_in_batch is not None:
        loss = _hf.per_item(loss, num_items_in_batch)
    # the field by its own name: transformers 5's deprecated alias `past_key_values` warns
    cache_field = "cache" if "cache" in outputs.__dataclass_fields__ else "past_key_values"
    out = self._fastllm_output_cls(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                   attentions=outputs.attentions,
                                   **{cache_field: getattr(outputs, cache_field)})
    use_return_dict = return_dict if return_dict is not None else getattr(
        self.config, "return_dict", True)
    if use_return_dict:
        return out
    # HF's (loss, logits, cache, ...) with None in the logits' place (to_tuple would drop it)
    return (loss, None, *(v for k, v in out.items() if k != "loss"))


# every replacement forward, as the partials patch() binds carry them
_REPLACEMENTS = (_linear_forward, _rms_norm_forward, _gemma_rms_norm_forward, _attention_forward,
                 _mlp_forward, _causal_lm_forward, _backbone_forward)


def _is_ours(f, module):
    return _patch_bind.is_ours(f, module, _REPLACEMENTS)


def _is_patched(m):
    # the mark alone may be stale: transformers' hub kernels, kernelizing again at a change of
    # mode, put the class's forward (or a hub kernel's) back (fastllm/_hf.py); such a module is
    # patched again. (_slot None: some wrapper around ours)
    return m.__dict__.get(_PATCHED) is not None and (any(
        _is_ours(m.__dict__.get(s), m) for s in ("forward", "_old_forward")) or _slot(m) is None)


def _slot(module):
    """The attribute patch() swaps on `module`: "forward", or under an accelerate hook the
    "_old_forward" that the hook's own forward calls; None where some other wrapper holds the
    instance forward (swapping it would drop the wrapper)."""
    d = module.__dict__
    slot = "_old_forward" if _hooked(module) and "_old_forward" in d else "forward"
    f = d.get(slot)
    # the class's forward bound to the module: what accelerate's remove_hook_from_module leaves;
    # or a hub kernel's, which patch() turns off (fastllm/_hf.py) before it binds
    if f is None or "_kernel_repo" in d or (
            getattr(f, "__self__", None) is module
            and getattr(f, "__func__", None) is type(module).forward):
        return slot
    return None


def _bind(module, kind, fn, slot):
    module.__dict__.pop("_fastllm_previous_forward", None)  # a stale patch's (_is_patched)
    if slot in module.__dict__:
        module._fastllm_previous_forward = module.__dict__[slot]
    _patch_bind.bind(module, slot, fn)
    setattr(module, _PATCHED, kind)
    # the cache keyword of what the forward hands the cache to, filled now, not by the first
    # forward: torch.compile guards on that cache's contents, and a first trace that filled it
    # was compiled again at the next call
    if kind in ("rotary", _BACKBONE):
        _hf.cache_keyword(module)
    elif kind == "cross_entropy" and isinstance(getattr(module, "model", None), nn.Module):
        _hf.cache_keyword(module.model)


def _chosen(m, chosen):
    """(kind, replacement) patch() would bind to m, or None."""
    if chosen["rms_norm"] and _is_llama_rms_norm(m):
        return "rms_norm", _rms_norm_forward
    if chosen["rms_norm"] and _is_gemma_rms_norm(m):
        return "rms_norm", _gemma_rms_norm_forward
    if chosen["rotary"] and _is_attention(m):
        return "rotary", _attention_forward
    if chosen["swiglu"] and _is_gated_mlp(m):
        return "swiglu", _mlp_forward
    if chosen["linear"] and type(m) is nn.Linear:
        return "linear", _linear_forward
    if chosen["cross_entropy"] and _is_causal_lm(m):
        return "cross_entropy", _causal_lm_forward
    if chosen["rotary"] and _is_backbone(m):
        return _BACKBONE, _backbone_forward
    return None


def patch(model, rms_norm=True, rotary=True, swiglu=True, cross_entropy=True, linear=True,
          verbose=False):
    """Swap the modules of a Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma model
    (or a PEFT model around one) for fastllm's kernels, in place; returns the model. Each keyword
    turns one kind of swap off (swiglu: the gated MLPs, Gemma's GeGLU too). Patching a patched
    model is a no-op for the modules already patched. A module whose instance `forward` is
    already some wrapper other than accelerate's hook is refused
    (ValueError, nothing patched): patch before wrapping, and before building a TRL trainer (it
    adds its fused LM head, fastllm/_hf.py). transformers' hub kernels (`use_kernels`,
    on from from_pretrained) are turned off while patched, when they would replace a layer the
    patch swaps (RMSNorm) at each train()/eval(); unpatch turns them on again."""
    chosen = {"rms_norm": rms_norm, "rotary": rotary, "swiglu": swiglu,
              "cross_entropy": cross_entropy, "linear": linear}
    todo = _todo(model, chosen)
    wrapped = [f"{name or 'the model'} ({type(m).__name__})"
               for name, m, _, _, slot in todo if slot is None]
    if wrapped:
        raise ValueError(
            "fastllm.patch: these modules already carry an instance `forward` that is not the "
            "class's nor under an accelerate hook, which patching would drop: "
            f"{', '.join(wrapped)}. Patch before wrapping them. Nothing was patched."
            + _hf.trl_hint([m for _, m, *_, slot in todo if slot is None], "patch"))
    kernels_off = _hf.hub_kernels_off(model, [m for _, m, *_ in todo])
    if kernels_off:  # their reset put the class's forwards back
        todo = _todo(model, chosen)
        for m in kernels_off:
            m._fastllm_use_kernels = True  # for unpatch
    counts = dict.fromkeys(KINDS, 0)
    for _, m, kind, fn, slot in todo:
        if kind == "rotary":
            m._fastllm_eager_attention = _hf.eager_attention_of(m)
        elif kind == "cross_entropy":
            import transformers.modeling_outputs as outputs

            m._fastllm_output_cls = outputs.CausalLMOutputWithPast
        _bind(m, kind, fn, slot)
        if kind in counts:
            counts[kind] += 1
    if verbose:
        print("fastllm.patch: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return model


def _todo(model, chosen):
    return [(name, m, *swap, _slot(m)) for name, m in model.named_modules()
            if not _is_patched(m) and (swap := _chosen(m, chosen)) is not None]


def unpatch(model):
    """Undo patch(model): every module runs its class's forward again, or the instance forward
    it had before (an accelerate hook's wrapped forward included). Returns the model."""
    done = [(name, m) for name, m in model.named_modules()
            if m.__dict__.get(_PATCHED) is not None]
    slots = [next((s for s in ("forward", "_old_forward") if _is_ours(m.__dict__.get(s), m)),
                  None) for _, m in done]
    # (a stale mark over the class's forward, _is_patched, is only cleared)
    lost = [f"{name or 'the model'} ({type(m).__name__})"
            for (name, m), slot in zip(done, slots) if slot is None and _slot(m) is None]
    if lost:
        raise RuntimeError(
            "fastllm.unpatch: the patched forward of these modules is wrapped by something "
            f"other than an accelerate hook: {', '.join(lost)}. Remove that wrapper first. "
            "Nothing was unpatched." + _hf.trl_hint([m for (_, m), slot in zip(done, slots)
                                                    if slot is None], "unpatch"))
    for (_, m), slot in zip(done, slots):
        d = m.__dict__
        if slot is None:  # a stale mark: the class's forward (or a hub kernel's) is back
            pass
        elif "_fastllm_previous_forward" in d:
            setattr(m, slot, d.pop("_fastllm_previous_forward"))
        elif slot == "_old_forward":  # a hook added after patch(): it now calls the class's
            m._old_forward = types.MethodType(type(m).forward, m)
        else:
            del m.forward
        for attr in (_PATCHED, "_fastllm_eager_attention", "_fastllm_output_cls",
                     "_fastllm_previous_forward"):
            d.pop(attr, None)
    _hf.hub_kernels_on([m for m in model.modules()
                        if m.__dict__.pop("_fastllm_use_kernels", False)])
    return model


def patched(model):
    """{kind: number of modules patched} for `model` (all zero when it is not patched)."""
    counts = dict.fromkeys(KINDS, 0)
    for _, m in model.named_modules():
        if _is_patched(m) and m.__dict__[_PATCHED] in counts:
            counts[m.__dict__[_PATCHED]] += 1
    return counts
