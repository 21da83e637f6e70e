"""Tensor and data parallel for Llama-style models on PyTorch's engines.

`parallelize` applies, in a fixed order: tensor parallel (DTensor `parallelize_module`) over
mesh["tp"], activation checkpointing per decoder layer, then FSDP2 (`fully_shard`) over
mesh["dp"]. The model must be a transformers Llama-style causal LM (`model.model.layers`,
`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `model.model.embed_tokens`,
`model.lm_head`; Qwen3's per-head `self_attn.{q,k}_norm` too), or a pipeline stage built from
one by `fastllm.parallel.build_pipeline_stage`.
Optional sequence parallelism shards the norms and the residual stream on the sequence; the
projections may be wrapped by fastllm.lora (LoRALinear), whose adapters are sharded with them.
"""

import functools

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fastllm._modules import output_layer
from fastllm.lora import LoRALinear
from fastllm.ops.lora_linear import lora_linear, new_dropout_seed
from fastllm.parallel import _torch_support
from fastllm.parallel.layout import ParallelLayout, mesh_size
from fastllm.quant import NF4Linear, shardable_nf4


def decoder_layers(model):
    """The transformer blocks of a causal LM (model.model.layers; under a PEFT wrapper too) or
    of a pipeline stage (a ModuleDict keyed by layer index), as a list in order."""
    if hasattr(model, "get_base_model"):  # a PEFT wrapper
        model = model.get_base_model()
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected "
                         f"model.model.layers)")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_activation_checkpointing(model, ratio=1.0):
    """Recompute round(ratio * L) of the L decoder layers in backward (torch.utils.checkpoint,
    non-reentrant); returns how many. The first layers are chosen: their activations live
    longest. Uses transformers' GradientCheckpointingLayer switch, which checkpoints the
    layer's forward inside its __call__, so FSDP2's hooks stay outside the recomputation."""
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    n = int(round(ratio * len(layers)))
    fn = functools.partial(checkpoint, use_reentrant=False)
    for i, layer in enumerate(layers):
        on = i < n
        if hasattr(type(layer), "gradient_checkpointing"):
            layer.gradient_checkpointing = on
            layer._gradient_checkpointing_func = fn
        elif on:
            raise ValueError(f"{type(layer).__name__} does not support activation "
                             f"checkpointing (not a transformers GradientCheckpointingLayer)")
    return n


def llama_tp_plan(sequence_parallel=False):
    """The per-layer plan: q/k/v and gate/up column-parallel, o and down row-parallel.

    Column-parallel q/k/v split the heads, so each rank holds heads/tp query heads and
    kv_heads/tp key/value heads (grouped-query attention keeps its ratio; transformers'
    attention reshapes with -1 heads).

    sequence_parallel (Megatron-LM's, Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models"): between the tensor-parallel regions the
    residual stream (batch, seq, hidden) stays sharded on seq; the two RMSNorms run on
    sequence shards (`SequenceParallel`, weights replicated), attention and MLP inputs are
    all-gathered on seq (`PrepareModuleInput`) before the column-parallel projections, and
    o/down reduce-scatter onto seq instead of all-reducing. Attention itself sees the whole
    sequence, so transformers' rotary positions and causal mask stay right.
    """
    if not sequence_parallel:
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    return {
        "input_layernorm": SequenceParallel(),
        # transformers calls attention with hidden_states=..., the MLP positionally
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


class _ColwiseLoRALinear(LoRALinear):
    """A LoRALinear whose base weight and lora_B are split on out_features over the tp mesh
    (Shard(0)) and lora_A is replicated: y_local = x W_local^T + s x A^T B_local^T, one fused
    `lora_linear` on the local shards. x: (..., in_features), the same on every tp rank; its
    gradient and lora_A's are partial sums over the ranks, reduced by DTensor."""

    def forward(self, x):
        weight, bias = self.base_layer.weight, self.base_layer.bias
        mesh = weight.device_mesh
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        # tp ranks share torch's seed, so they draw the same dropout mask for the replicated x
        return lora_linear(x, weight.to_local(), self.lora_A.to_local(grad_placements=[Partial()]),
                           self.lora_B.to_local(), 0.0 if self.disabled else self.scaling,
                           None if bias is None else bias.to_local(), self.dropout,
                           training=self.training)


class _RowwiseLoRALinear(LoRALinear):
    """A LoRALinear whose base weight and lora_A are split on in_features over the tp mesh
    (Shard(1)) and lora_B is replicated: each rank computes x_local W_local^T + s (x_local
    A_local^T) B^T, a partial sum of the output, reduced in one collective with the base
    output (all-reduce, or reduce-scatter onto the sequence under sequence parallelism); the
    bias is added once after it. x: (..., in_features / tp), the column-parallel output."""

    def forward(self, x):
        weight, bias = self.base_layer.weight, self.base_layer.bias
        mesh = weight.device_mesh
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Shard(-1)]).to_local()
        seed = None
        if self.training and self.dropout > 0.0:
            # x holds other columns on each rank: decorrelate the ranks' masks (the
            # constant is Knuth's 2^32 / golden ratio)
            seed = (new_dropout_seed(x.device if x.device.type == "cuda" else None)
                    + mesh.get_local_rank() * 0x9E3779B9)
        y = lora_linear(x, weight.to_local(), self.lora_A.to_local(),
                        self.lora_B.to_local(grad_placements=[Partial()]),
                        0.0 if self.disabled else self.scaling, None,
                        self.dropout, training=self.training, seed=seed)
        y = DTensor.from_local(y, mesh, [Partial()], run_check=False)
        y = y.redistribute(placements=[self._tp_output_layout]).to_local()
        if bias is not None:
            seq_sharded = isinstance(self._tp_output_layout, Shard)
            y = y + bias.to_local(grad_placements=[Partial()] if seq_sharded else None)
        return y


def _check_lora_layers(model):
    """Refuse the LoRA layers tensor parallel cannot take, before anything is sharded (checked
    in the style, the embedding and head and earlier layers were sharded already)."""
    for m in model.modules():
        if isinstance(m, LoRALinear) and m.merged:
            raise ValueError("tensor parallel of a merged LoRA layer: unmerge_lora first")
        if getattr(m, "is_dora", False):
            raise NotImplementedError(
                "tensor parallel of a DoRA layer (its magnitude needs the whole weight's row "
                "norms): not supported; train DoRA with tp=1 (FSDP2 or ZeRO shard it)")


class _LoRAParallel(ParallelStyle):
    """Column- or row-parallel for a fastllm.lora.LoRALinear (torch's Colwise/RowwiseParallel
    take only nn.Linear): column-parallel splits W and lora_B on out_features and replicates
    lora_A; row-parallel splits W and lora_A on in_features and replicates lora_B and the bias.
    Inputs and outputs are local tensors, as with torch's styles' defaults."""

    def __init__(self, colwise, output_layout=None):
        super().__init__()
        self.colwise = colwise
        self.output_layout = output_layout or (Shard(-1) if colwise else Replicate())

    def _apply(self, module, device_mesh):
        if not isinstance(module, LoRALinear):
            raise TypeError(f"expected a fastllm.lora.LoRALinear, got {type(module).__name__}")
        _check_lora_layers(module)
        col = self.colwise

        def shard(owner, name, placement):
            t = getattr(owner, name)
            if t is not None:
                owner.register_parameter(name, nn.Parameter(
                    distribute_tensor(t.detach(), device_mesh, [placement]),
                    requires_grad=t.requires_grad))

        shard(module.base_layer, "weight", Shard(0) if col else Shard(1))
        shard(module.base_layer, "bias", Shard(0) if col else Replicate())
        shard(module, "lora_A", Replicate() if col else Shard(1))
        shard(module, "lora_B", Shard(0) if col else Replicate())
        module.__class__ = _ColwiseLoRALinear if col else _RowwiseLoRALinear
        module._tp_output_layout = self.output_layout
        return module


def _lora_aware(layer, plan):
    """`plan` with torch's Colwise/RowwiseParallel replaced by `_LoRAParallel` on the
    submodules of `layer` that are LoRALinear."""
    out = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if isinstance(module, LoRALinear) and isinstance(style, (ColwiseParallel,
                                                                  RowwiseParallel)):
            col = isinstance(style, ColwiseParallel)
            expected_in = Replicate() if col else Shard(-1)
            if (style.input_layouts[0] != expected_in
                    or (col and style.output_layouts[0] != Shard(-1))
                    or not style.use_local_output):
                raise ValueError(f"tensor parallel LoRA on {name}: only the default layouts "
                                 f"(and a row-parallel output on the sequence) are supported, "
                                 f"got {style}")
            style = _LoRAParallel(col, style.output_layouts[0])
        out[name] = style
    return out


# per-head norms applied to the column-parallel projections' local heads before the rotation
# (Qwen3's q_norm/k_norm: RMSNorm over head_dim, weight (head_dim,))
_HEAD_NORMS = {"self_attn.q_norm": "self_attn.q_proj", "self_attn.k_norm": "self_attn.k_proj"}


def _with_head_norms(layer, plan):
    """`plan` plus the per-head norms of `layer` whose projection it splits by heads.

    A column-parallel q_proj hands each rank its local heads, (batch, seq, heads / tp,
    head_dim) once viewed, and q_norm normalises each head over head_dim: the right numbers
    with the weight replicated, but each rank's weight grad sums over its own heads only. Left
    plain, the grads stay per-rank partial sums, the ranks' weights drift apart after the first
    step and the loss leaves the one-process run's. Here the weight becomes a replicated DTensor
    and the input a DTensor sharded on the heads (torch's SequenceParallel on dim 2 does both),
    so the grad comes out Partial and is summed over tp as it is accumulated
    (`_grad_to_param_layout`), as the norms' under sequence parallelism are."""
    out = dict(plan)
    for norm, proj in _HEAD_NORMS.items():
        style = plan.get(proj)
        if norm in plan or style is None or _get_submodule(layer, norm) is None:
            continue
        if not (isinstance(style, ColwiseParallel) and style.output_layouts[0] == Shard(-1)
                and style.use_local_output):
            raise ValueError(f"tensor parallel of {norm}: its input is {proj}'s output, which "
                             f"the plan shards as {style}; give {norm} its own style in the "
                             f"plan (only a column-parallel {proj} with local outputs is "
                             f"handled here)")
        out[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return out


def _check_plan_divides(layer, plan, tp):
    """Raise ValueError naming the module when a column- or row-parallel style of `plan` would
    split a dimension tp does not divide: DTensor shards it unevenly without a word, and the
    ranks then hold different numbers of heads or columns."""
    for name, style in plan.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        module = layer.get_submodule(name)
        module = module.base_layer if isinstance(module, LoRALinear) else module
        col = isinstance(style, ColwiseParallel)
        if isinstance(module, nn.Linear):  # weight (out_features, in_features)
            dim, what = (0, "out_features") if col else (1, "in_features")
        elif isinstance(module, nn.Embedding):  # weight (num_embeddings, embedding_dim)
            dim, what = (1, "embedding_dim") if col else (0, "num_embeddings")
        else:
            continue  # torch's styles refuse other modules themselves
        if module.weight.shape[dim] % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {name}.{what}="
                             f"{module.weight.shape[dim]}, which the plan's "
                             f"{type(style).__name__} on {name} splits; change the plan or tp")


def _get_submodule(module, name):
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _check_seq_len(tp):
    def hook(module, args):
        seq = args[0].shape[1]
        if seq % tp:
            raise ValueError(f"parallel.sequence_parallel needs the sequence length ({seq}) "
                             f"divisible by parallel.tp={tp}")
    return hook


def _grad_to_param_layout(param):
    # DTensor leaves grads in whatever layout the backward produced: Partial (unreduced) on
    # replicated weights used with sharded activations (norms under sequence parallelism,
    # column-parallel lora_A, row-parallel lora_B; Megatron-LM all-reduces its sequence-parallel
    # norm grads likewise), Replicate on the vocabulary-split embedding. Put each grad in its
    # parameter's layout as it is accumulated, so optimizers and clipping that work on local
    # shards see the right numbers. FSDP2 replaces the parameters (dropping this hook) and
    # redistributes the grads itself.
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def _keep_frozen(model, frozen):
    """Freeze again the parameters named in `frozen`. torch's parallel styles (Colwise/
    RowwiseParallel, SequenceParallel) re-create each weight they shard or replicate as a new
    Parameter, which up to torch 2.10 (not 2.13) requires grad whatever the old one did: under
    LoRA the frozen embedding, head, norms and unadapted projections trained (torch 2.8, 2.10)."""
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in frozen:
            p.requires_grad_(False)


def _fresh_redistribute_plans(module, args):
    """Up to torch 2.10 DTensor partitions the ids for a vocabulary-parallel embedding with the
    mask placement of its cached redistribute plan, while the embedding's output carries the
    one its sharding strategy made: the same object only while both caches hit or miss
    together. A second embedding with the same ids' layout (another dtype, another model in
    the process) missed one and hit the other, and the output's reduction failed `assert
    self.mask_buffer.data is not None` (torch 2.10: a bf16 model after an fp32 one). Emptying
    the plan cache before each embedding keeps them together (torch 2.11 and 2.13 pass the same
    tests without it)."""
    from torch.distributed.tensor import _redistribute

    _redistribute._gen_transform_infos.cache_clear()


def _hook_grad_layouts(model):
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(_grad_to_param_layout)


def apply_tensor_parallel(model, tp_mesh, vocab_parallel_logits=True, vocab_parallel=True,
                          sequence_parallel=False):
    """Shard a Llama-style model (or pipeline stage) over tp_mesh in place.

    Embedding and head are vocabulary-parallel; the head returns logits as a DTensor sharded
    on the vocabulary for `vocab_parallel_cross_entropy` (vocab_parallel_logits=False: the
    logits are gathered into a plain tensor, which torch's pipeline schedules need because
    they run the loss's backward outside loss_parallel). vocab_parallel=False keeps the
    embedding and head whole on every rank (a vocabulary tp does not divide, tied weights).

    sequence_parallel: see `llama_tp_plan`. The embedding's output stays whole (transformers
    derives positions and the causal mask from its length); the first decoder layer takes its
    sequence shard, and the final norm runs on shards before the head gathers them (when the
    head is vocabulary-parallel; else, and at the end of a pipeline stage without the head,
    the last layer's output is gathered). The sequence length must divide by tp.

    Projections wrapped by fastllm.lora (LoRALinear) get the LoRA-aware column/row styles
    (`_LoRAParallel`): adapters are sharded with their base weight and stay the only trainable
    parameters.
    """
    _torch_support.require("tensor parallel", tp_mesh.device_type)
    tp = tp_mesh.size()
    ParallelLayout(tp=tp).check_model(model.config, vocab_parallel=vocab_parallel)
    _check_lora_layers(model)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    inner = model.model
    embed = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    norm = getattr(inner, "norm", None)
    if vocab_parallel and any(isinstance(m, LoRALinear) for m in (embed, head)):
        raise ValueError("tensor parallel LoRA on embed_tokens/lm_head is not supported: "
                         "adapt the decoder layers' projections only")
    if vocab_parallel and embed is not None:
        parallelize_module(embed, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        if _torch_support.TORCH < (2, 11):
            embed.register_forward_pre_hook(_fresh_redistribute_plans)
    head_takes_shards = sequence_parallel and vocab_parallel and norm is not None
    if vocab_parallel and head is not None:
        parallelize_module(head, tp_mesh,
                           ColwiseParallel(input_layouts=Shard(1) if head_takes_shards
                                           else Replicate(),
                                           output_layouts=Shard(-1) if vocab_parallel_logits
                                           else Replicate(),
                                           use_local_output=not vocab_parallel_logits))
    plan = llama_tp_plan(sequence_parallel)
    layers = decoder_layers(model)
    norms = ("input_layernorm", "post_attention_layernorm")
    for layer in layers:
        parallelize_module(layer, tp_mesh, _lora_aware(
            layer, _with_head_norms(layer, {k: v for k, v in plan.items() if k not in norms})))
        if sequence_parallel:
            for name in norms:
                parallelize_module(layer.get_submodule(name), tp_mesh, SequenceParallel())
    if sequence_parallel and layers:
        layers[0].register_forward_pre_hook(_check_seq_len(tp), prepend=True)
        parallelize_module(layers[0], tp_mesh,
                           PrepareModuleInput(input_layouts=(Replicate(),),
                                              desired_input_layouts=(Shard(1),),
                                              use_local_output=True))
        if head_takes_shards:
            parallelize_module(norm, tp_mesh, SequenceParallel())
        else:
            parallelize_module(layers[-1], tp_mesh,
                               PrepareModuleOutput(output_layouts=(Shard(1),),
                                                   desired_output_layouts=(Replicate(),),
                                                   use_local_output=True))
    _keep_frozen(model, frozen)
    _hook_grad_layouts(model)
    return model


def wrap_activation_checkpointing(model):
    """Wrap each decoder layer in torch's checkpoint_wrapper (non-reentrant): the layer is
    recomputed in backward. Unlike apply_activation_checkpointing (transformers' switch, which
    the training runtime uses and which keeps parameter names), the wrapper adds
    `_checkpoint_wrapped_module.` to named_parameters (state_dict strips it); the planner's
    recomputation memory was measured with it (examples/parallel_train.py)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for k in keys:
        layers[k] = checkpoint_wrapper(layers[k])
    return model


def apply_fsdp(model, dp_mesh, param_dtype=None, reduce_dtype=None, reshard_after_forward=True,
               root=None):
    """FSDP2 per decoder layer, then the root (which takes embedding, norm and head): `model`,
    or `root`, a module holding `model` whose forward runs it (returned then). An input
    embedding not tied to the head is a unit of its own (torchtitan's), gathered for its forward
    and backward only, where the root would hold it whole for the step; a tied one, and the
    head (which fastllm's fused loss reads without calling it), stay in the root. NF4 layers
    (fastllm.quant) are made shardable first: their 4-bit weights sharded with their layer, as
    frozen uint8/fp32 parameters: hand an optimizer the parameters that require grad (torch's
    fused AdamW refuses any non-float parameter)."""
    _torch_support.require("FSDP2", dp_mesh.device_type)
    nf4 = [n for n, m in model.named_modules() if isinstance(m, NF4Linear)]
    if nf4 and param_dtype is not None:
        raise ValueError(f"apply_fsdp: param_dtype={param_dtype} would cast the fp32 absmax of "
                         f"the NF4 layers ({nf4[0]}, {len(nf4)} in all) with the parameters; an "
                         "NF4Linear computes in its own dtype: cast the model (model.to(dtype)) "
                         "and shard with param_dtype=None")
    shardable_nf4(model)  # (the 4-bit codes and absmax sharded with their decoder layer)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # (not a transformers model, or one it
        embedding = None                           # cannot resolve: all in the root)
    head = output_layer(model)
    if embedding is not None and (head is None or getattr(head, "weight", None) is not getattr(
            embedding, "weight", None)):
        fully_shard(embedding, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    root = model if root is None else root
    fully_shard(root, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return root


def parallelize(model, mesh, plan=None, *, activation_checkpointing=False, param_dtype=None,
                reduce_dtype=None, reshard_after_forward=True, vocab_parallel_logits=True,
                sequence_parallel=False):
    """Apply tensor parallel over mesh["tp"] and FSDP2 over mesh["dp"], in place; returns model.

    mesh: a DeviceMesh from `build_mesh` (or any mesh with dims named "tp" and/or "dp"; a
    missing or size-1 dimension is skipped). plan: None for the Llama plan
    (`llama_tp_plan()`, with vocabulary-parallel embedding and head), or a dict
    {submodule name within a decoder layer: ParallelStyle} applied to every decoder layer
    (the embedding and head stay whole on every rank; per-head q/k norms behind a column-parallel
    q/k_proj are added; every dimension it splits must divide by tp, checked on every layer
    before any is changed).
    param_dtype/reduce_dtype: FSDP2's mixed precision (e.g. torch.bfloat16 / torch.float32).
    vocab_parallel_logits: see `apply_tensor_parallel` (False inside a pipeline, and for
    model.generate, whose sampling reads whole logits).
    sequence_parallel: shard the residual stream and the norms on the sequence between the
    tensor-parallel regions (`llama_tp_plan`; the sequence length must divide by tp; only with
    plan=None and a tp dimension of size > 1). Projections wrapped by fastllm.lora are sharded
    with their adapters.
    Pipeline parallel is not applied here: build the stage first (`build_pipeline_stage`),
    then parallelize the stage module over the tp/dp submesh.
    """
    tp = mesh_size(mesh, "tp")
    dp = mesh_size(mesh, "dp")
    if plan is not None and not isinstance(plan, dict):
        raise ValueError(f"plan must be None or a dict, got {plan!r}")
    if sequence_parallel and tp == 1:
        # nothing would be sharded: a run that asked for it should not train without it
        raise ValueError("sequence_parallel=True needs a mesh with a \"tp\" dimension of "
                         "size > 1 (parallel.sequence_parallel needs parallel.tp > 1)")
    if sequence_parallel and plan is not None:
        raise ValueError("sequence_parallel=True needs plan=None (the Llama plan); a custom "
                         "plan sets its own layouts (llama_tp_plan(sequence_parallel=True))")
    if tp > 1:
        if plan is None:
            apply_tensor_parallel(model, mesh["tp"], vocab_parallel_logits,
                                  sequence_parallel=sequence_parallel)
        else:
            # a custom plan shards decoder-layer submodules only: the embedding and head stay
            # whole, so tied weights and a vocabulary tp does not divide are fine
            ParallelLayout(tp=tp).check_model(model.config, vocab_parallel=False)
            layers = decoder_layers(model)
            _check_lora_layers(model)
            for layer in layers:  # every layer checked before the first one is changed
                _check_plan_divides(layer, plan, tp)
            plans = [_lora_aware(layer, _with_head_norms(layer, plan)) for layer in layers]
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False)
                      if not p.requires_grad}
            for layer, layer_plan in zip(layers, plans):
                parallelize_module(layer, mesh["tp"], layer_plan)
            _keep_frozen(model, frozen)  # the styles re-create the weights they place
            _hook_grad_layouts(model)
    if activation_checkpointing:
        wrap_activation_checkpointing(model)
    if dp > 1:
        apply_fsdp(model, mesh["dp"], param_dtype, reduce_dtype, reshard_after_forward)
    return model
