"""Which modules of a Hugging Face model fastllm.patch swaps: the families it knows (by
config.model_type and the modeling file their forwards come from) and the module shapes it
recognises (RMSNorms, attention, gated MLPs, decoder stacks, causal LMs)."""

from torch import nn

from fastllm import _hf

# config.model_type of the models whose attention and causal-LM loss the patch reproduces
# (Phi-3's, Phi-3.5's and Phi-4's, "phi3": one qkv_proj and one gate_up_proj, and Phi-4-mini's
# rotary on the first partial_rotary_factor of each head)
_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")
# and of those whose causal-LM loss alone it computes (their logits lm_head(hidden), capped by
# cap * tanh(logits / cap) where config.final_logit_softcapping is set: Gemma 2 and 3), with the
# modeling file their forward is in (Gemma 3's text-only model is "gemma3_text", in gemma3's)
_LOSS_MODEL_FILES = {**{t: t for t in _MODEL_TYPES}, "gemma": "gemma", "gemma2": "gemma2",
                     "gemma3_text": "gemma3"}
# and of those whose attention it runs with the rotary kernel (Gemma 1's is Llama's; Gemma 3's
# normalises q and k per head first, as Qwen3's; Gemma 2's softcaps its scores: its own)
_ATTENTION_MODEL_FILES = {**{t: t for t in _MODEL_TYPES}, "gemma": "gemma",
                          "gemma3_text": "gemma3"}

# the RMSNorms that scale by (1 + weight) (transformers' modeling_gemma, _gemma2, _gemma3);
# Gemma3n's and Gemma4's scale by weight (initialised to ones) and are left alone
_GEMMA_RMS_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def _is_llama_rms_norm(m):
    return (type(m).__name__.endswith("RMSNorm") and not type(m).__name__.startswith("Gemma")
            and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1
            and hasattr(m, "variance_epsilon") and _hf.stock_norm(m))


def _is_gemma_rms_norm(m):
    return (type(m).__name__ in _GEMMA_RMS_NORMS
            and isinstance(getattr(m, "weight", None), nn.Parameter) and hasattr(m, "eps")
            and _hf.stock_norm(m))


def _is_attention(m):
    model_type = getattr(getattr(m, "config", None), "model_type", None)
    projections = ("qkv_proj",) if model_type == "phi3" else ("q_proj", "k_proj", "v_proj")
    return (type(m).__name__.endswith("Attention") and all(
        hasattr(m, a) for a in projections + ("o_proj", "head_dim", "scaling", "config",
                                              "layer_idx"))
            and model_type in _ATTENTION_MODEL_FILES
            and _hf.stock_forward(m, (_ATTENTION_MODEL_FILES[model_type],)))


def _is_gated_mlp(m):
    # down_proj(act_fn(gate_proj(x)) * up_proj(x)) with SiLU (SwiGLU: Llama, Qwen, Mistral) or
    # the tanh GELU (GeGLU: Gemma 1-3); or Phi-3's, gate and up the halves of gate_up_proj(x)
    if type(m).__name__.endswith("MLP") and "gate_up_proj" in m._modules:
        return (hasattr(m, "down_proj") and _is_silu(getattr(m, "activation_fn", None))
                and _hf.stock_forward(m, ("phi3",)))
    act = getattr(m, "act_fn", None)
    return (type(m).__name__.endswith("MLP") and all(
        hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
            and (_is_silu(act) or _is_tanh_gelu(act)) and _hf.is_swiglu_forward(type(m).forward))


def _is_silu(act):
    # nn.SiLU, or transformers' own SiLUActivation (what ACT2FN["silu"] is in transformers 5)
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or (
        getattr(act, "__name__", None) == "silu")


# transformers' modules computing gelu(x, approximate="tanh") (ACT2FN's gelu_pytorch_tanh, and
# gelu_python_tanh and gelu_new, the same maths written out; PytorchGELUTanh before 5.x)
_TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation")


def _is_tanh_gelu(act):
    if type(act) is nn.GELU:
        return act.approximate == "tanh"
    return (type(act).__name__ in _TANH_GELUS
            and type(act).__module__ == "transformers.activations")


def _is_backbone(m):
    # the decoder stack a causal LM calls (LlamaModel, Qwen2Model, GemmaModel, ...),
    # transformers' own, in the families whose attention the patch runs (it hands them the plan)
    model_type = getattr(getattr(m, "config", None), "model_type", None)
    return (type(m).__name__.endswith("Model") and "layers" in m._modules
            and "embed_tokens" in m._modules and model_type in _ATTENTION_MODEL_FILES
            and _hf.stock_forward(m, (_ATTENTION_MODEL_FILES[model_type],)))


def _is_causal_lm(m):
    # the HF model itself, not a wrapper that forwards attributes to it (PEFT's PeftModel)
    model_type = getattr(getattr(m, "config", None), "model_type", None)
    return (type(m).__name__.endswith("ForCausalLM") and "lm_head" in m._modules
            and "model" in m._modules and model_type in _LOSS_MODEL_FILES
            and _hf.stock_forward(m, (_LOSS_MODEL_FILES[model_type],)))


def logit_softcap(lm):
    """The cap of a causal LM's logits (cap * tanh(logits / cap)) that its forward applies after
    lm_head: Gemma 2's and 3's config.final_logit_softcapping; None for every other family."""
    if getattr(lm.config, "model_type", None) not in ("gemma2", "gemma3_text"):
        return None
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)
