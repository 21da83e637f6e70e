"""The model: a built-in Llama config or a local Hugging Face folder; the training mode (which
parameters train); activation checkpointing; the data and tensor parallel wrapping
(_parallelize); and the pipeline-parallel stages and schedule (build_pipeline)."""

import functools
import os

import torch
from torch import nn

__all__ = ["PRESETS", "build_model", "apply_finetune", "apply_activation_checkpointing",
           "decoder_layers", "data_parallel_size", "global_batch_size", "check_pipeline",
           "build_pipeline", "_parallelize"]

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
    return os.path.isdir(name)


def build_model(cfg, vocab_size, dtype):
    """A LlamaForCausalLM from a preset (seeded by cfg.seed) or an HF causal LM from a folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if is_model_dir(cfg.model):
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype,
                                                     local_files_only=True)
        return model
    if cfg.model not in PRESETS:
        raise ValueError(f"fastllm train: model={cfg.model!r} is neither a built-in "
                         f"({', '.join(PRESETS)}) nor a folder")
    kwargs = dict(PRESETS[cfg.model])
    kwargs.update(vocab_size=vocab_size, max_position_embeddings=max(256, cfg.data.seq_len),
                  tie_word_embeddings=False, use_cache=False)
    kwargs.update(cfg.model_config)
    config = LlamaConfig(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def decoder_layers(model):
    """The model's list of transformer blocks (model.model.layers for Llama-style models)."""
    if hasattr(model, "get_base_model"):  # a PEFT wrapper
        model = model.get_base_model()
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"fastllm train: cannot find the decoder layers of "
                         f"{type(model).__name__} (expected model.model.layers)")
    return layers


def _last_layer_indices(model, n):
    total = len(decoder_layers(model))
    n = total if n <= 0 else min(n, total)
    return list(range(total - n, total))


def apply_finetune(model, cfg):
    """Set which parameters train. full: all; freeze: the last freeze.layers blocks, the final
    norm and the head; lora: injected LoRA adapters only (fastllm's fused LoRA, or PEFT when
    backend=torch); galore/badam: all (their optimizers decide what moves)."""
    mode = cfg.finetune
    if mode in ("full", "galore", "badam"):
        model.requires_grad_(True)
        return model
    if mode == "freeze":
        model.requires_grad_(False)
        layers = decoder_layers(model)
        for i in _last_layer_indices(model, cfg.freeze.layers):
            layers[i].requires_grad_(True)
        inner = getattr(model, "model", model)
        for name in ("norm",):
            if hasattr(inner, name):
                getattr(inner, name).requires_grad_(True)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            head.requires_grad_(True)
        return model
    # lora
    targets = cfg.lora.target_modules
    if cfg.lora.layers > 0:
        idx = "|".join(str(i) for i in _last_layer_indices(model, cfg.lora.layers))
        mods = "|".join(targets)
        targets = rf".*\.layers\.({idx})\.(.*\.)?({mods})"
    if cfg.backend == "torch":
        import peft

        peft_cfg = peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                   lora_dropout=cfg.lora.dropout, target_modules=targets,
                                   task_type="CAUSAL_LM")
        return peft.get_peft_model(model, peft_cfg)
    from fastllm.lora import inject_lora

    inject_lora(model, target_modules=targets, r=cfg.lora.r, alpha=cfg.lora.alpha,
                dropout=cfg.lora.dropout)
    return model


def apply_activation_checkpointing(model, ratio):
    """Recompute round(ratio * L) of the L decoder layers in backward (torch.utils.checkpoint,
    non-reentrant). The first layers are chosen: their activations live longest."""
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    n = int(round(ratio * len(layers)))
    fn = functools.partial(checkpoint, use_reentrant=False)
    for i, layer in enumerate(layers):
        on = i < n
        if hasattr(type(layer), "gradient_checkpointing"):
            # transformers' GradientCheckpointingLayer: checkpoints forward, not __call__, so
            # FSDP2's hooks stay outside the recomputation.
            layer.gradient_checkpointing = on
            layer._gradient_checkpointing_func = fn
        elif on:
            raise ValueError(f"fastllm train: {type(layer).__name__} does not support "
                             f"checkpointing (not a transformers GradientCheckpointingLayer)")
    return n


def _parallelize(model, cfg, world_size, device):
    """Wrap the model for data parallelism (one place, so tensor/pipeline parallel can extend it).

    Returns (model to call, strategy). none: as is; ddp: DistributedDataParallel; fsdp: FSDP2
    fully_shard per decoder layer, then the root; zero1/zero2: plain DDP-free model whose
    gradients fastllm.distributed.DistributedOptimizer reduces (built with the optimizer)."""
    strategy = cfg.parallel.strategy
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "none"
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        try:
            import fastllm.parallel as fp
        except ImportError:
            raise NotImplementedError("fastllm train: parallel.tp/pp > 1 needs fastllm.parallel, "
                                      "which this install does not have") from None
        # DTensor parameters: checkpoints take the DCP full-state-dict path ("fsdp")
        return fp.parallelize_from_config(model, cfg, world_size, device), "fsdp"
    if strategy == "none" or world_size == 1 and strategy in ("ddp", "fsdp"):
        return model, "none" if strategy in ("none", "ddp", "fsdp") else strategy
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids), strategy
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        kw = dict(mesh=mesh)
        if cfg.backend == "torch" and cfg.precision != "fp32":
            dt = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model, strategy
    if strategy in ("zero1", "zero2"):
        return model, strategy
    raise ValueError(f"fastllm train: unknown parallel.strategy {strategy!r}")


def data_parallel_size(cfg, world_size):
    """world_size / (parallel.tp * parallel.pp), checked against parallel.dp when it is set."""
    par = cfg.parallel
    inner = par.tp * par.pp
    if world_size % inner:
        raise ValueError(f"fastllm train: parallel.tp={par.tp} x parallel.pp={par.pp} = {inner} "
                         f"does not divide the world size {world_size}")
    dp = world_size // inner
    if par.dp > 0 and par.dp != dp:
        raise ValueError(f"fastllm train: parallel.dp={par.dp} x parallel.tp={par.tp} x "
                         f"parallel.pp={par.pp} = {par.dp * inner} ranks, but the world size is "
                         f"{world_size}")
    return dp


def global_batch_size(cfg, dp):
    """Sequences per optimizer step: global_batch_size, or by default one micro-batch per
    data-parallel rank (times parallel.pp micro-batches under pipeline parallel, the fewest that
    fill a 1F1B pipeline)."""
    return cfg.global_batch_size or cfg.micro_batch_size * dp * cfg.parallel.pp


def check_pipeline(cfg, num_layers, dp):
    """Raise ValueError naming the setting when parallel.pp cannot run this model and batch.
    Returns (micro-batches per step, model chunks per rank)."""
    par = cfg.parallel
    pp, chunks = par.pp, 2 if par.schedule == "interleaved" else 1
    if num_layers < pp * chunks:
        raise ValueError(f"fastllm train: parallel.pp={pp}"
                         + (" with parallel.schedule=interleaved (2 stages per rank)"
                            if chunks > 1 else "")
                         + f" needs at least {pp * chunks} decoder layers; the model has "
                           f"num_hidden_layers={num_layers}")
    global_batch = global_batch_size(cfg, dp)
    per_replica = cfg.micro_batch_size * dp
    if global_batch % per_replica:
        raise ValueError(f"fastllm train: global_batch_size={global_batch} must be a multiple of "
                         f"micro_batch_size * data-parallel size = {cfg.micro_batch_size} * {dp}")
    n_mb = global_batch // per_replica
    if par.schedule != "gpipe" and n_mb < pp:
        raise ValueError(f"fastllm train: parallel.schedule={par.schedule} needs at least "
                         f"parallel.pp={pp} micro-batches per step, got global_batch_size / "
                         f"(micro_batch_size * dp) = {global_batch} / ({cfg.micro_batch_size} * "
                         f"{dp}) = {n_mb}; raise global_batch_size or lower micro_batch_size")
    if par.schedule == "interleaved" and n_mb % pp:
        raise ValueError(f"fastllm train: parallel.schedule=interleaved needs the micro-batches "
                         f"per step (global_batch_size / (micro_batch_size * dp) = {n_mb}) to be "
                         f"a multiple of parallel.pp={pp}")
    return n_mb, chunks


class Pipeline:
    """This rank's part of a pipeline-parallel model: `module` (its stage, or its stages merged
    under the full model's parameter names), the torch schedule, and the mesh coordinates."""

    def __init__(self, module, schedule, mesh, n_microbatches, chunks):
        self.module, self.schedule = module, schedule
        self.pp = mesh["pp"].size()
        self.pp_rank = mesh["pp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        self.first, self.last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.n_microbatches, self.chunks = n_microbatches, chunks
        self.dp = (mesh["dp"].get_local_rank(), mesh["dp"].size())
        self.tp_rank = mesh["tp"].get_local_rank()
        from fastllm.parallel.planner import bubble_fraction

        # the idle fraction of the schedule (the planner's formula), reported per step
        self.bubble = bubble_fraction(self.pp, n_microbatches, chunks)


def build_pipeline(model, cfg, world_size, device, loss_fn):
    """Cut `model` (consumed) into this rank's pipeline stage(s) over a (pp, dp, tp) mesh:
    layers balanced by estimated cost (fastllm.parallel.split_layers), tensor parallel over
    "tp" and FSDP2 over "dp" applied to each stage, and the schedule of parallel.schedule with
    global_batch_size / (micro_batch_size * dp) micro-batches. loss_fn(logits, input_ids)
    runs on the last stage. Returns a Pipeline."""
    import copy

    from fastllm.parallel import tensor_parallel as tpar
    from fastllm.parallel.mesh import build_mesh
    from fastllm.parallel.pipeline import build_pipeline_stage, build_schedule, merge_stages

    par = cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    n_mb, chunks = check_pipeline(cfg, model.config.num_hidden_layers, dp)
    mesh = build_mesh(dp, par.tp, par.pp, device.type)
    vocab_parallel = (model.config.vocab_size % par.tp == 0
                      and not getattr(model.config, "tie_word_embeddings", False))

    def shard(stage):
        if par.tp > 1:
            # gathered logits: torch's schedules run the loss's backward outside loss_parallel
            tpar.apply_tensor_parallel(stage, mesh["tp"], vocab_parallel_logits=False,
                                       vocab_parallel=vocab_parallel)
        if dp > 1:
            tpar.apply_fsdp(stage, mesh["dp"])
        return stage

    pp_rank, pp = mesh["pp"].get_local_rank(), par.pp
    modules, stages = [], []
    for c in range(chunks):
        # interleaved: this rank holds stages pp_rank and pp_rank + pp of 2 * pp
        source = copy.deepcopy(model) if c < chunks - 1 else model
        module, stage = build_pipeline_stage(source, pp_rank + c * pp, pp * chunks,
                                             group=mesh["pp"].get_group(), device=device,
                                             seq_len=cfg.data.seq_len, parallelize_fn=shard)
        modules.append(module)
        stages.append(stage)
    module = modules[0] if chunks == 1 else merge_stages(modules)
    schedule = build_schedule(stages if chunks > 1 else stages[0], n_mb, loss_fn, par.schedule)
    return Pipeline(module, schedule, mesh, n_mb, chunks)


def unwrap(model):
    """The module under DDP (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
