"""TrainConfig.validate's checks of single values and of the preference objective, each error
naming its key (fastllm/train/config.py holds the dataclasses and the checks between them)."""

import math
import os
import typing

from fastllm.train.config_values import consumed, convert, validate_quantize_base

__all__ = ["validate_values", "validate_objective"]

_DEVICES = ("auto", "cpu", "cuda")


def validate_values(cfg, need):
    """Ranges of the values validate() does not check inline, each error naming its key."""
    _validate_compile(cfg, need)
    need(cfg.finetune not in ("galore", "badam") or cfg.backend == "fastllm", f"finetune="
         f"{cfg.finetune} is fastllm's optimizer; backend=torch has no GaLore/BAdam (it would "
         f"train every parameter with torch.optim.AdamW)")
    need(cfg.device in _DEVICES, f"device must be one of {_DEVICES}, got {cfg.device!r}")
    if cfg.device == "cuda":
        import torch

        need(torch.cuda.is_available(), f"device=cuda but torch.cuda.is_available() is False "
             f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use device=cpu "
             f"or auto")
    need(cfg.threads >= 0, f"threads must be >= 0 (0: torch's default), got {cfg.threads}")
    need(cfg.freeze.layers >= 1, f"freeze.layers must be >= 1 (the last N decoder layers "
         f"train), got {cfg.freeze.layers}")
    need(cfg.lora.layers >= 0, f"lora.layers must be >= 0 (0: all layers), got "
         f"{cfg.lora.layers}")
    need(math.isfinite(cfg.lora.alpha) and cfg.lora.alpha > 0, f"lora.alpha must be finite and "
         f"> 0, got {cfg.lora.alpha}")
    validate_quantize_base(cfg, need)
    need(cfg.log_interval >= 1, f"log_interval must be >= 1, got {cfg.log_interval}")
    need(math.isfinite(cfg.eps) and cfg.eps >= 0, f"eps must be finite and >= 0, got {cfg.eps}")
    need(math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0, f"weight_decay must be "
         f"finite and >= 0, got {cfg.weight_decay}")
    need(math.isfinite(cfg.max_grad_norm), f"max_grad_norm must be finite, got "
         f"{cfg.max_grad_norm}")
    for key in ("timeout_s", "init_timeout_s"):
        value = getattr(cfg.parallel, key)
        need(math.isfinite(value) and value >= 0, f"parallel.{key} must be finite and >= 0 (0: "
             f"torch's default), got {value}")
    need(cfg.data.path is None or cfg.data.path.strip() != "", "data.path is empty: give a "
         "text file or folder, or null for the built-in corpus")
    if cfg.data.path is not None and os.path.exists(cfg.data.path):
        need(os.path.isfile(cfg.data.path) or os.path.isdir(cfg.data.path),
             f"data.path {cfg.data.path} is not a regular file or folder (a device or pipe?)")
    need(cfg.data.cache_dir is None or cfg.data.cache_dir.strip() != "", "data.cache_dir is "
         "empty: give a folder, or null for $FASTLLM_CACHE or ~/.cache/fastllm")
    need(cfg.data.vocab_size >= 2, f"data.vocab_size must be >= 2, got {cfg.data.vocab_size}")
    # (the trained BPE starts from the 256 bytes and <|endoftext|>: a smaller size was ignored)
    need(cfg.data.tokenizer != "bpe" or cfg.data.vocab_size >= 257, f"data.vocab_size="
         f"{cfg.data.vocab_size} with data.tokenizer=bpe: its byte-level alphabet and "
         f"<|endoftext|> are 257 tokens already; give >= 257")
    need(cfg.data.prefetch >= 0, f"data.prefetch must be >= 0, got {cfg.data.prefetch}")
    g = cfg.galore
    need(g.rank >= 1, f"galore.rank must be >= 1, got {g.rank}")
    need(g.update_proj_gap >= 1, f"galore.update_proj_gap must be >= 1, got {g.update_proj_gap}")
    need(math.isfinite(g.scale) and g.scale > 0, f"galore.scale must be finite and > 0, got "
         f"{g.scale}")
    need(g.proj_type in ("std", "reverse_std", "left", "right"), f"galore.proj_type must be one "
         f"of std, reverse_std, left, right, got {g.proj_type!r}")
    b = cfg.badam
    need(b.switch_block_every >= 1, f"badam.switch_block_every must be >= 1, got "
         f"{b.switch_block_every}")
    need(b.switch_mode in ("ascending", "descending", "random"), f"badam.switch_mode must be "
         f"ascending, descending or random, got {b.switch_mode!r}")
    need(b.blocks is None or (b.blocks and all(b.blocks)), f"badam.blocks must be null or a "
         f"non-empty list of non-empty lists of name prefixes, got {b.blocks!r}")
    if cfg.model_config:
        need(not os.path.isdir(cfg.model), f"model_config applies to the built-in models; "
             f"model={cfg.model} is a folder whose config.json is used as it is")
        from transformers import LlamaConfig
        try:  # (transformers 5's; 4.x keeps rope_theta a LlamaConfig field)
            from transformers.modeling_rope_utils import RopeParameters
        except ImportError:
            RopeParameters = dict

        known = LlamaConfig().to_dict()
        unknown = sorted(k for k, v in cfg.model_config.items()
                         if k not in known and not consumed(LlamaConfig, k, v))
        need(not unknown, f"unknown model_config key(s) {unknown} (neither LlamaConfig fields "
             f"nor arguments it takes, such as rope_theta)")
        floats = [k for k, t in typing.get_type_hints(RopeParameters).items()
                  if float in typing.get_args(t)]  # rope_theta, partial_rotary_factor, ...
        floats += [k for k, v in known.items() if isinstance(v, float)]
        # the embedding and head are sized for the tokenizer's ids (a smaller table fails
        # mid-step with an IndexError, a larger one trains rows no id reaches)
        need("vocab_size" not in cfg.model_config, f"model_config.vocab_size="
             f"{cfg.model_config.get('vocab_size')!r}: the vocabulary is the tokenizer's "
             f"(data.tokenizer; data.vocab_size for bpe); drop the key")
        for key, value in cfg.model_config.items():
            # a float field as the top-level ones take it: YAML 1.1 reads 1e-5 as a string
            if key in floats and isinstance(value, str):
                cfg.model_config[key] = convert(f"model_config.{key}", value, None, float)


def _validate_compile(cfg, need):
    """torch_compile_backend / torch_compile_mode: as Hugging Face's TrainingArguments, either
    one given turns torch_compile on; names torch.compile knows, checked before anything runs."""
    backend, mode = cfg.torch_compile_backend, cfg.torch_compile_mode
    if backend is None and mode is None:
        return
    cfg.torch_compile = True
    if backend is not None:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        need(backend in known, f"torch_compile_backend must be one of torch.compile's backends "
             f"{known}, got {backend!r}")
    if mode is not None:
        import torch._inductor

        modes = sorted(torch._inductor.list_mode_options())
        need(mode in modes, f"torch_compile_mode must be one of inductor's modes {modes}, got "
             f"{mode!r}")
        # (torch.compile passes any other mode on to the backend, which takes none)
        need(backend in (None, "inductor") or mode == "default", f"torch_compile_mode={mode} is "
             f"a mode of the inductor backend, not of torch_compile_backend={backend}")


_OBJECTIVES = ("lm", "dpo", "cpo", "orpo")
PREFERENCE_OBJECTIVES = ("dpo", "cpo", "orpo")  # (each its config section of the same name)


def validate_objective(cfg, need):
    """objective and its section (dpo, cpo or orpo): TRL's loss types and ranges, and what a
    preference run reads and runs on (preference records; one process, DDP or FSDP; DPO's
    reference being the adapters switched off or a frozen copy of the model)."""
    import dataclasses

    need(cfg.objective in _OBJECTIVES, f"objective must be one of {_OBJECTIVES}, got "
         f"{cfg.objective!r}")
    for name in PREFERENCE_OBJECTIVES:
        if cfg.objective != name:
            section = getattr(cfg, name)
            changed = [f"{name}.{f.name}" for f in dataclasses.fields(section)
                       if getattr(section, f.name) != f.default]
            need(not changed, f"{', '.join(changed)} set but objective={cfg.objective}: the "
                 f"{name} section applies to objective={name}")
    if cfg.objective == "lm":
        need(not cfg.data.padding_free, "data.padding_free is for objective=dpo|cpo|orpo (TRL's "
             "padding_free for preference pairs); objective=lm packs examples by data.packing")
        return
    from fastllm.train.sft_records import data_format

    {"dpo": _validate_dpo, "cpo": _validate_cpo, "orpo": _validate_orpo}[cfg.objective](
        cfg, need)
    obj = f"objective={cfg.objective}"
    need(cfg.finetune != "prefix", f"{obj} with finetune=prefix: " + (
        "a prefix cannot be switched off for the reference; use finetune=lora (or full, "
        "freeze, galore, badam: the reference is a frozen copy of the model)"
        if cfg.objective == "dpo" else "not supported yet (the pairs' scoring has not been "
        "tested with prefix-tuning's virtual tokens); use finetune=lora (or full, freeze, "
        "galore, badam)"))
    fmt = data_format(cfg.data.path, cfg.data.format) if cfg.data.path else None
    need(fmt == "jsonl", f"{obj} trains on preference records ({{\"prompt\", "
         f"\"chosen\", \"rejected\"}}) in .jsonl/.json files: data.path={cfg.data.path} with "
         f"data.format={cfg.data.format} reads {fmt or 'the built-in text'}")
    need(not cfg.data.train_on_prompt, f"{obj} scores the chosen and rejected "
         "completions only: data.train_on_prompt must be false")
    p = cfg.parallel
    # (ZeRO-1/2 leave the model unwrapped: DistributedOptimizer reduces whatever grads the
    # pairs' scoring made; tensor and pipeline parallel would need the scoring split)
    need(p.tp == 1 and p.pp == 1, f"{obj} runs on one process, DDP, ZeRO-1/2 or FSDP for now "
         f"(parallel.tp=1, pp=1), got tp={p.tp} pp={p.pp}")
    need(not cfg.optimizer_in_backward, f"{obj} does not run with optimizer_in_backward")
    # TRL + PEFT: PEFT's lora_dropout is an nn.Dropout, which disable_dropout turns off too;
    # fastllm's LoRA dropout is not a module: said rather than applied against the setting
    need(not (getattr(cfg, cfg.objective).disable_dropout and cfg.finetune == "lora" and
              cfg.lora.dropout > 0), f"{obj} turns dropout off ({cfg.objective}.disable_dropout="
         f"true, TRL's default, which also turns off PEFT's LoRA dropout): set lora.dropout=0, "
         f"or {cfg.objective}.disable_dropout=false to train with lora.dropout={cfg.lora.dropout}")


def _beta(name, beta, need):
    need(math.isfinite(beta) and beta > 0, f"{name}.beta must be finite and > 0, got {beta}")


def _pairwise(name, section, types, smoothed, weight, need):
    """The dpo or cpo section: loss_type among `types`, beta, label_smoothing (used by the
    `smoothed` types only) and the NLL term's weight (its field `weight`)."""
    need(section.loss_type in types, f"{name}.loss_type must be one of {', '.join(types)}, got "
         f"{section.loss_type!r}")
    _beta(name, section.beta, need)
    ls = section.label_smoothing
    need(0.0 <= ls < 0.5, f"{name}.label_smoothing must be in [0, 0.5), got {ls}")
    need(not ls or section.loss_type in smoothed, f"{name}.label_smoothing is used by "
         f"{name}.loss_type {' and '.join(smoothed)} only, got {section.loss_type}")
    w = getattr(section, weight)
    need(math.isfinite(w) and w >= 0, f"{name}.{weight} must be finite and >= 0 (0: no NLL "
         f"term), got {w}")


def _validate_dpo(cfg, need):
    from fastllm.preference import LOSS_TYPES

    _pairwise("dpo", cfg.dpo, LOSS_TYPES, ("sigmoid", "robust"), "rpo_alpha", need)


def _validate_cpo(cfg, need):
    from fastllm.preference import CPO_LOSS_TYPES

    c = cfg.cpo
    _pairwise("cpo", c, CPO_LOSS_TYPES, ("sigmoid", "simpo"), "cpo_alpha", need)
    need(math.isfinite(c.simpo_gamma), f"cpo.simpo_gamma must be finite, got {c.simpo_gamma}")


def _validate_orpo(cfg, need):
    _beta("orpo", cfg.orpo.beta, need)
