"""The model: a built-in Llama config or a local Hugging Face folder, and the training mode
(which parameters train). How it is then split over ranks is the strategy's
(fastllm.train.strategies)."""

import contextlib
import os

import torch

from fastllm._modules import output_layer
from fastllm.parallel import decoder_layers
from fastllm.train.config_values import ConfigError

__all__ = ["PRESETS", "build_model", "model_skeleton", "apply_finetune", "lora_targets",
           "is_model_dir", "check_model"]

# Llama-architecture sizes, random init (transformers' LlamaConfig). vocab_size comes from the
# tokenizer. tiny is for tests, mini for the default run.
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "mini": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
    "base": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}


def is_model_dir(name):
    """Whether model=`name` is a model folder. A built-in name (PRESETS) is the built-in model:
    a run saves a folder's absolute path (TrainConfig.validate), so a bare `tiny` in a run's
    config.yaml never meant a folder that export or generate finds under that name."""
    return name not in PRESETS and os.path.isdir(name)


def check_model(cfg):
    """Refuse a model= that is neither a preset nor a folder, a PEFT adapter folder, a bad
    model_config and freeze.layers / lora.layers above the model's decoder layers (before the
    run folder is written to: a run that cannot start writes nothing)."""
    if cfg.model not in PRESETS and not is_model_dir(cfg.model):
        raise ConfigError(f"fastllm train: model={cfg.model!r} is neither a built-in "
                          f"({', '.join(PRESETS)}) nor a folder")
    if is_model_dir(cfg.model):
        _refuse_adapter_folder(cfg.model)
        _check_4bit_folder(cfg)
    if cfg.model_config and cfg.model in PRESETS:
        # LlamaConfig's own validators (types, heads dividing hidden_size), no weights built
        try:
            _preset_config(cfg, vocab_size=257)
        except Exception as e:  # huggingface_hub's StrictDataclassError, TypeError, ValueError
            given = ", ".join(f"model_config.{k}={v!r}" for k, v in cfg.model_config.items())
            why = " ".join(str(e).split())
            raise ConfigError(f"fastllm train: {given} is not a valid LlamaConfig for "
                              f"model={cfg.model}: {why}") from None
    # (lora.layers: preflight.check_lora_targets applies it to the skeleton it builds anyway)
    if cfg.finetune == "freeze":
        try:  # the meta skeleton: a folder's config.json only, no weights read
            _last_layer_indices(model_skeleton(cfg), cfg.freeze.layers, "freeze.layers")
        except ConfigError:
            raise
        except (ValueError, OSError):  # an architecture fastllm cannot read: refused when built
            pass


def _refuse_adapter_folder(name):
    """A PEFT adapter folder is no base model: transformers' from_pretrained loads the base its
    adapter_config.json names and applies the adapter on top (finetune=full then trained base
    and adapter weights both, and the run could not be exported)."""
    from fastllm.adapter_files import ADAPTER_CONFIG, read_config

    if not os.path.isfile(os.path.join(name, ADAPTER_CONFIG)):
        return
    try:
        base = read_config(name).get("base_model_name_or_path")
    except ValueError:
        base = None
    base = f"the base model its {ADAPTER_CONFIG} names ({base})" if base else "its base model"
    raise ConfigError(f"fastllm train: model={name} is a PEFT adapter folder ({ADAPTER_CONFIG}), "
                      f"not a model: train {base}, or a merged folder (`fastllm export RUN_DIR "
                      f"OUT_DIR --merged` folds the adapter into the weights)")


def _check_4bit_folder(cfg):
    """A bitsandbytes 4-bit folder trains as QLoRA only (its weights are NF4 codes)."""
    from fastllm.quant import bnb_4bit_config

    try:
        quantized = bnb_4bit_config(cfg.model) is not None
    except ValueError as e:  # (FP4)
        raise ConfigError(f"fastllm train: model={cfg.model}: {e}") from None
    if quantized and not (cfg.finetune == "lora" and cfg.lora.quantize_base == "nf4"):
        raise ConfigError(f"fastllm train: model={cfg.model} holds bitsandbytes 4-bit NF4 "
                          f"weights: train it with finetune=lora lora.quantize_base=nf4 (QLoRA), "
                          f"or give the dense model's folder")


def build_model(cfg, vocab_size, dtype):
    """A LlamaForCausalLM from a preset (seeded by cfg.seed) or an HF causal LM from a folder."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from fastllm import quant

    qlora = cfg.finetune == "lora" and cfg.lora.quantize_base == "nf4"
    if is_model_dir(cfg.model):
        _refuse_adapter_folder(cfg.model)
        if qlora and quant.bnb_4bit_config(cfg.model) is not None:  # read without bitsandbytes
            model = quant.from_pretrained(cfg.model, dtype=dtype)  # (its absmax as saved)
            if cfg.lora.double_quant:
                for layer in model.modules():
                    if isinstance(layer, quant.NF4Linear):
                        layer.double_quantize()
            return model
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype,
                                                     local_files_only=True)
        return quant.quantize_nf4(model, double_quant=cfg.lora.double_quant) if qlora else model
    config = _preset_config(cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    model = _cast_keeping_rope_fp32(model, dtype)
    return quant.quantize_nf4(model, double_quant=cfg.lora.double_quant) if qlora else model


# RoPE's inverse frequencies (and the copy dynamic RoPE resets to): transformers computes them in
# fp32 and from_pretrained leaves them so at any dtype; cast to bf16 they gave the run other
# logits than its exported folder
_ROPE_BUFFERS = ("inv_freq", "original_inv_freq")


def _cast_keeping_rope_fp32(model, dtype):
    """model.to(dtype), its rotary inv_freq buffers kept fp32 (as transformers loads them)."""
    keep = {name: buf for name, buf in model.named_buffers()
            if name.rsplit(".", 1)[-1] in _ROPE_BUFFERS and buf.dtype == torch.float32}
    model.to(dtype)
    for name, buf in keep.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buf)
    return model


def _preset_config(cfg, vocab_size):
    from transformers import LlamaConfig

    if cfg.model not in PRESETS:
        raise ValueError(f"fastllm train: model={cfg.model!r} is neither a built-in "
                         f"({', '.join(PRESETS)}) nor a folder")
    kwargs = dict(PRESETS[cfg.model])
    # no special token ids of LlamaConfig's own (bos 1, eos 2): the run's tokenizer has its
    # own, and a sample's generation stopped at token 2 (`"` of a trained BPE); export sets them
    kwargs.update(vocab_size=vocab_size, max_position_embeddings=max(256, cfg.data.seq_len),
                  tie_word_embeddings=False, use_cache=False, bos_token_id=None,
                  eos_token_id=None)
    kwargs.update(cfg.model_config)
    return LlamaConfig(**kwargs)


def model_skeleton(cfg):
    """The model build_model makes for cfg, on the meta device: its modules and shapes, no
    weights read or allocated (a folder's config.json only). The vocabulary is a stand-in (the
    tokenizer's is not known yet)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if is_model_dir(cfg.model):
        try:
            config = AutoConfig.from_pretrained(cfg.model, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"fastllm train: model={cfg.model}: no readable model config "
                              f"there ({e})") from None
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        return LlamaForCausalLM(_preset_config(cfg, vocab_size=257))


def _last_layer_indices(model, n, key):
    """The indices of the last n decoder layers (n <= 0: all); n above the model's layer count is
    refused naming `key` (it was clamped: freeze.layers=5 on 2 layers trained every layer)."""
    total = len(decoder_layers(model))
    if n > total:
        raise ConfigError(f"fastllm train: {key}={n} is more than the model's {total} decoder "
                          f"layers; give at most {total}")
    n = total if n <= 0 else n
    return list(range(total - n, total))


def apply_finetune(model, cfg):
    """Set which parameters train. full: all; freeze: the last freeze.layers blocks, the final
    norm and the head; lora: injected LoRA adapters only (fastllm's fused LoRA, or PEFT when
    backend=torch); galore/badam: all (their optimizers decide what moves). New parameters
    (adapters, prefixes) are initialised from cfg.seed, as a preset model's weights are: the same
    seed, the same run (HF's Trainer seeds before the model and PEFT's adapters likewise)."""
    if cfg.finetune not in ("lora", "prefix"):
        return _apply_finetune(model, cfg)
    devices = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed)
        return _apply_finetune(model, cfg)


def _apply_finetune(model, cfg):
    mode = cfg.finetune
    if mode in ("full", "galore", "badam"):
        model.requires_grad_(True)
        return model
    if mode == "freeze":
        model.requires_grad_(False)
        layers = decoder_layers(model)
        for i in _last_layer_indices(model, cfg.freeze.layers, "freeze.layers"):
            layers[i].requires_grad_(True)
        inner = getattr(model, "model", model)
        for name in ("norm",):
            if hasattr(inner, name):
                getattr(inner, name).requires_grad_(True)
        head = output_layer(model)
        if head is not None:
            head.requires_grad_(True)
        return model
    if mode == "prefix":
        from fastllm.prefix import attach_prefix

        return attach_prefix(model, cfg.prefix.num_virtual_tokens, cfg.prefix.prefix_projection,
                             cfg.prefix.encoder_hidden_size or None)
    # lora
    targets = lora_targets(model, cfg)
    if cfg.backend == "torch":
        import peft

        peft_cfg = peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                   lora_dropout=cfg.lora.dropout, target_modules=targets,
                                   use_dora=cfg.lora.use_dora, task_type="CAUSAL_LM")
        return _peft_drawn_as_fastllm(model, peft_cfg)
    from fastllm.dora import inject_dora
    from fastllm.lora import inject_lora

    (inject_dora if cfg.lora.use_dora else inject_lora)(
        model, target_modules=targets, r=cfg.lora.r, alpha=cfg.lora.alpha,
        dropout=cfg.lora.dropout)
    return model


def _peft_drawn_as_fastllm(model, peft_cfg):
    """peft.get_peft_model(model, peft_cfg) with its LoRA A matrices drawn as fastllm's
    inject_lora draws them from the same generator state (and the generators left where it
    leaves them), so that backend=torch starts from fastllm's adapters: PEFT's layers draw more
    (an nn.Linear init for A and for B, then A again) and on the CPU whatever the base's
    device."""
    import peft
    from peft.tuners.lora import LoraLayer

    from fastllm.lora import init_lora_a_

    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        peft_model = peft.get_peft_model(model, peft_cfg)
    for module in peft_model.modules():  # (model order: the order inject_lora draws in)
        if isinstance(module, LoraLayer):
            for a in module.lora_A.values():
                init_lora_a_(a.weight)
    return peft_model


def weight_count(model):
    """Parameters of `model`, a 4-bit NF4 layer's weights counted as its parameters (its codes
    and absmax not, parameters as they are once FSDP2 shards them)."""
    from fastllm.quant import NF4Linear

    nf4 = [m for m in model.modules() if isinstance(m, NF4Linear)]
    codes = {id(t) for m in nf4 for t in (m.weight_packed, m.weight_absmax)}
    return sum(p.numel() for p in model.parameters() if id(p) not in codes) + sum(
        m.in_features * m.out_features for m in nf4)


def lora_targets(model, cfg, entries=None):
    """The target_modules inject_lora (or PEFT) is given for cfg.lora.target_modules (or
    `entries`, a list of its entries) on `model`: all-linear as the distinct last names of those
    layers, and under lora.layers > 0 a regex for them in the last lora.layers decoder layers."""
    targets = list(cfg.lora.target_modules if entries is None else entries)
    if [t.lower() for t in targets] == ["all-linear"]:
        # PEFT's shorthand, as the distinct last names of those layers (q_proj, ..., down_proj),
        # so that lora.layers and backend=torch take it as any list
        from fastllm.lora import all_linear

        targets = sorted({n.rsplit(".", 1)[-1] for n in all_linear(model)})
    if cfg.lora.layers > 0:
        idx = "|".join(str(i) for i in _last_layer_indices(model, cfg.lora.layers,
                                                           "lora.layers"))
        mods = "|".join(targets)
        targets = rf".*\.layers\.({idx})\.(.*\.)?({mods})"
    return targets


def compile_model(model, cfg, reference=None):
    """torch_compile=true for a run: compile_layers over the model's decoder layers and those of
    DPO's frozen reference copy (a full fine-tune's), with the run's torch_compile_backend and
    torch_compile_mode."""
    layers = decoder_layers(model) + (decoder_layers(reference) if reference is not None else [])
    compile_layers(layers, cfg.torch_compile_backend, cfg.torch_compile_mode,
                   PREFIX_GRAPHS_PER_LAYER if cfg.finetune == "prefix" else 0)


def compile_layers(layers, backend=None, mode=None, per_layer_graphs=0):
    """torch_compile=true: each decoder layer compiled in place (`layer.compile()`, torchtitan's
    per-block compile: after activation checkpointing, before FSDP2 or a layout wraps them) with
    torch.compile's `backend` (inductor where None) and `mode`, and dynamo's recompile limits
    raised for the graphs the layers may need over those their code objects already hold
    (another run's in this process: --compare torch runs two); per_layer_graphs more for each
    layer (finetune=prefix: each layer reads its own entry of the prefix's KV cache). The
    trainer calls it inside compile_settings(cfg), which restores the limits after the run; the
    benchmarks (bench/compile_time.py, bench/device_bench.py) leave them raised."""
    need = LAYER_GRAPHS + per_layer_graphs * len(layers)
    config, held = torch._dynamo.config, _graphs_on(layers)
    for name in (RECOMPILE_LIMIT, ACCUMULATED_LIMIT):
        setattr(config, name, max(getattr(config, name), held + need))
    for layer in layers:
        layer.compile(backend=backend or "inductor", mode=mode)


def compiled_graphs():
    """How many graphs dynamo has compiled in this process (its counter, which every new graph of
    any frame raises): a training step that raised it compiled, and its time is not the run's
    speed (metrics.jsonl's `compiles`, left out of the summary's timing)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _graphs_on(layers):
    """The most graphs dynamo holds for one of the code objects a compiled layer starts in (its
    class's forward, or a forward bound to the instance)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # (a private helper: every graph this process compiled, an upper bound)
        return compiled_graphs()
    codes = set()
    for layer in layers:
        for forward in (type(layer).forward, layer.forward):
            code = getattr(getattr(forward, "__func__", forward), "__code__", None)
            if code is not None:
                codes.add(code)
    return max((len(_debug_get_cache_entry_list(c)) for c in codes), default=0)


def compile_settings(cfg):
    """Dynamo's settings for a run's compiled layers. A checkpointed layer's recomputation
    replays its forward's Python side effects in eager mode and not in a compiled graph, and
    dynamo breaks the graph at any: transformers' attention (unpatched: model=tiny,
    kernels=none) sets and resets the `kernels` package's context variable in its forward
    (`use_kernelized_func`), a round trip that leaves nothing to replay. The recompile limits
    are restored on exit (compile_layers raises them)."""
    if not cfg.torch_compile:
        return contextlib.nullcontext()
    config = torch._dynamo.config
    settings = {name: getattr(config, name) for name in (RECOMPILE_LIMIT, ACCUMULATED_LIMIT)}
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # (torch >= 2.7)
        settings["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
    return config.patch(**settings)


# Dynamo's limit on the graphs of one code object, which all the decoder layers share (8 by
# default): a run's layers need a graph for each mix of checkpointed or not, grad mode, train or
# eval mode, the first layer's input needing no grad, LoRA adapters disabled (DPO's reference),
# static or dynamic lengths. LoRA DPO with evaluation, half the layers checkpointed and pairs of
# several lengths took 16 (tests/test_train_dpo.py), and past the limit dynamo runs the layer
# eagerly. finetune=prefix: a graph per layer for each of train and eval, static and dynamic.
# (cache_size_limit: torch < 2.7's name, an alias of recompile_limit since; the accumulated
# limit, 256 by default, caps all of a code object's graphs.)
LAYER_GRAPHS = 32
PREFIX_GRAPHS_PER_LAYER = 4
RECOMPILE_LIMIT = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                   else "cache_size_limit")
ACCUMULATED_LIMIT = ("accumulated_recompile_limit"
                     if hasattr(torch._dynamo.config, "accumulated_recompile_limit")
                     else "accumulated_cache_size_limit")
