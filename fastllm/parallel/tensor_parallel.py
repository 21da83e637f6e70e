"""Tensor and data parallel for Llama-style models on PyTorch's engines.

`parallelize` applies, in a fixed order: tensor parallel (DTensor `parallelize_module`) over
mesh["tp"], activation checkpointing per decoder layer, then FSDP2 (`fully_shard`) over
mesh["dp"]. The model must be a transformers Llama-style causal LM (`model.model.layers`,
`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `model.model.embed_tokens`,
`model.lm_head`), or a pipeline stage built from one by `fastllm.parallel.build_pipeline_stage`.
"""

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from fastllm.parallel.mesh import mesh_size


def decoder_layers(model):
    """The decoder layers of a causal LM or of a pipeline stage, in order."""
    layers = model.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def llama_tp_plan():
    """The per-layer plan: q/k/v and gate/up column-parallel, o and down row-parallel.

    Column-parallel q/k/v split the heads, so each rank holds heads/tp query heads and
    kv_heads/tp key/value heads (grouped-query attention keeps its ratio; transformers'
    attention reshapes with -1 heads). Sequence parallelism is not offered: transformers'
    Llama derives rotary positions from the local sequence length, which a sequence shard
    would get wrong.
    """
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _check_tp(model, tp, vocab_parallel=True):
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"parallel.tp={tp} does not divide num_attention_heads={heads}")
    if kv % tp:
        raise ValueError(f"parallel.tp={tp} does not divide num_key_value_heads={kv}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"parallel.tp={tp} does not divide "
                         f"intermediate_size={cfg.intermediate_size}")
    if not vocab_parallel:
        return
    if cfg.vocab_size % tp:
        raise ValueError(f"parallel.tp={tp} does not divide vocab_size={cfg.vocab_size}")
    if getattr(cfg, "tie_word_embeddings", False):
        raise ValueError("tensor parallel needs untied embeddings (tie_word_embeddings=False): the "
                         "embedding is row-split and the head column-split on the vocabulary")


def apply_tensor_parallel(model, tp_mesh, vocab_parallel_logits=True, vocab_parallel=True):
    """Shard a Llama-style model (or pipeline stage) over tp_mesh in place.

    Embedding and head are vocabulary-parallel; the head returns logits as a DTensor sharded
    on the vocabulary for `vocab_parallel_cross_entropy` (vocab_parallel_logits=False: the
    logits are gathered into a plain tensor, which torch's pipeline schedules need because
    they run the loss's backward outside loss_parallel). vocab_parallel=False keeps the
    embedding and head whole on every rank (a vocabulary tp does not divide, tied weights).
    """
    _check_tp(model, tp_mesh.size(), vocab_parallel)
    inner = model.model
    if vocab_parallel and getattr(inner, "embed_tokens", None) is not None:
        parallelize_module(inner.embed_tokens, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if vocab_parallel and getattr(model, "lm_head", None) is not None:
        parallelize_module(model.lm_head, tp_mesh,
                           ColwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Shard(-1) if vocab_parallel_logits
                                           else Replicate(),
                                           use_local_output=not vocab_parallel_logits))
    plan = llama_tp_plan()
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)
    return model


def apply_activation_checkpointing(model):
    """Recompute each decoder layer in backward (non-reentrant checkpoint)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for k in keys:
        layers[k] = checkpoint_wrapper(layers[k])
    return model


def apply_fsdp(model, dp_mesh, param_dtype=None, reduce_dtype=None, reshard_after_forward=True):
    """FSDP2 per decoder layer, then the root (which takes embedding, norm and head)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def parallelize(model, mesh, plan=None, *, activation_checkpointing=False, param_dtype=None,
                reduce_dtype=None, reshard_after_forward=True, vocab_parallel_logits=True):
    """Apply tensor parallel over mesh["tp"] and FSDP2 over mesh["dp"], in place; returns model.

    mesh: a DeviceMesh from `build_mesh` (or any mesh with dims named "tp" and/or "dp"; a
    missing or size-1 dimension is skipped). plan: None for the Llama plan
    (`llama_tp_plan()`, with vocabulary-parallel embedding and head), or a dict
    {submodule name within a decoder layer: ParallelStyle} applied to every decoder layer.
    param_dtype/reduce_dtype: FSDP2's mixed precision (e.g. torch.bfloat16 / torch.float32).
    vocab_parallel_logits: see `apply_tensor_parallel` (False inside a pipeline).
    Pipeline parallel is not applied here: build the stage first (`build_pipeline_stage`),
    then parallelize the stage module over the tp/dp submesh.
    """
    tp = mesh_size(mesh, "tp")
    dp = mesh_size(mesh, "dp")
    if tp > 1:
        if plan is None:
            apply_tensor_parallel(model, mesh["tp"], vocab_parallel_logits)
        elif isinstance(plan, dict):
            _check_tp(model, tp)
            for layer in decoder_layers(model):
                parallelize_module(layer, mesh["tp"], plan)
        else:
            raise ValueError(f"plan must be None or a dict, got {plan!r}")
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if dp > 1:
        apply_fsdp(model, mesh["dp"], param_dtype, reduce_dtype, reshard_after_forward)
    return model


def parallelize_from_config(model, cfg, world_size, device):
    """The training runtime's hook (`fastllm.train.model._parallelize`) for parallel.tp > 1.

    Builds the (dp, tp) mesh from cfg.parallel (dp = -1: world_size / tp), applies tensor
    parallel with gathered logits (the runtime computes transformers' loss on them; embedding
    and head stay whole when tp does not divide the vocabulary) and FSDP2 over dp. Sets
    `model._fastllm_dp = (dp_rank, dp)`: the runtime must shard data by these, not by the
    global rank, since the ranks of one tp group must see the same batch. Returns the model.
    """
    par = cfg.parallel
    if par.pp > 1:
        raise NotImplementedError(
            "fastllm train: parallel.pp > 1 is not wired into the trainer yet (its loop calls "
            "the model once per micro-batch); fastllm.parallel.build_pipeline_stage and "
            "build_schedule run pipelines today (python -m fastllm.parallel.run --pp 2)")
    from fastllm.parallel.mesh import build_mesh

    if par.dp not in (-1, 0) and par.dp * par.tp != world_size:
        raise ValueError(f"parallel.dp={par.dp} x parallel.tp={par.tp} != world size {world_size}")
    if world_size % par.tp:
        raise ValueError(f"parallel.tp={par.tp} does not divide the world size {world_size}")
    dp = world_size // par.tp
    mesh = build_mesh(dp, par.tp, 1, device.type)
    cfg_model = model.config
    vocab_parallel = (cfg_model.vocab_size % par.tp == 0
                      and not getattr(cfg_model, "tie_word_embeddings", False))
    apply_tensor_parallel(model, mesh["tp"], vocab_parallel_logits=False,
                          vocab_parallel=vocab_parallel)
    if dp > 1:
        apply_fsdp(model, mesh["dp"])
    model._fastllm_dp = (mesh["dp"].get_local_rank(), dp)
    return model
