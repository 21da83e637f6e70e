"""Pipeline parallel for Llama-style models on torch.distributed.pipelining.

`build_pipeline_stage` cuts a transformers causal LM into a stage module that keeps the
original parameter names (`model.layers.5.mlp.up_proj.weight`, `lm_head.weight`), so DCP
checkpoints move between pipeline and non-pipeline layouts; `build_schedule` wraps torch's
GPipe, 1F1B and interleaved 1F1B schedules; `build_pipeline` does both for this rank (every
chunk of an interleaved schedule) and returns a `Pipeline`, whose `step` runs the schedule.
The training runtime and examples/parallel_train.py both build their pipelines with it.
"""

import copy
import inspect

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from fastllm import _hf
from fastllm.parallel import _torch_support
from fastllm.parallel.layout import bubble_fraction, check_micro_batches
from fastllm.parallel.loss import vocab_parallel_cross_entropy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

# config.model_type of the causal LMs whose forward a LlamaStage reproduces: embed_tokens, the
# decoder layers, norm, lm_head and nothing else (checked in transformers 5.25's modeling_*.py;
# none of their configs has a field that scales the embeddings or the logits). Others compute
# more: Granite multiplies the embeddings and divides the logits, Gemma scales the embeddings
# by sqrt(hidden) and soft-caps the logits.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def split_layers(layer_costs, num_stages, first_cost=0.0, last_cost=0.0):
    """Contiguous split of layers into stages minimising the most expensive stage.

    layer_costs: cost per layer (FLOPs, or measured seconds); first_cost/last_cost: the extra
    cost of the first stage (embedding) and of the last (final norm, head, loss). Returns
    num_stages + 1 boundaries: stage i holds layers [b[i], b[i + 1]).
    """
    n = len(layer_costs)
    if num_stages < 1:
        raise ValueError(f"parallel.pp must be >= 1, got {num_stages}")
    if n < num_stages:
        raise ValueError(f"parallel.pp={num_stages} stages need at least as many layers; the model "
                         f"has num_hidden_layers={n}")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(stage, lo, hi):
        c = prefix[hi] - prefix[lo]
        if stage == 0:
            c += first_cost
        if stage == num_stages - 1:
            c += last_cost
        return c

    # best[s][i]: the least max-stage cost placing layers [0, i) on stages [0, s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                val = max(best[s - 1][j], cost(s - 1, j, i))
                if val < best[s][i]:
                    best[s][i], cut[s][i] = val, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def llama_layer_costs(config, seq_len):
    """Per-layer, embedding and head costs in forward FLOPs per sequence (planner's formulas)."""
    from fastllm.parallel.planner import model_from_hf_config

    spec = model_from_hf_config(config.to_dict())
    layer = 2 * seq_len * spec.layer_linear_params() + 4 * seq_len * seq_len * spec.q_dim
    head = 2 * seq_len * spec.hidden * spec.vocab
    return [layer] * spec.layers, 0.0, head


def _attention_type(layer, config):
    """"sliding_attention" or "full_attention": the mask transformers' model forward gives this
    decoder layer. Qwen2/Qwen3 attention carries its own `sliding_window` (None on full layers,
    from config.layer_types); Mistral's reads config.sliding_window for every layer; Llama has
    neither."""
    attn = getattr(layer, "self_attn", None)
    window = (attn.sliding_window if hasattr(attn, "sliding_window")
              else getattr(config, "sliding_window", None))
    return "full_attention" if window is None else "sliding_attention"


def _causal_masks(config, h, pos, kinds):
    """transformers' masks for each attention kind in `kinds`, as its model forward builds them
    (transformers.masking_utils): None where SDPA's own causal flag suffices, else a 4D mask
    (batch, 1, seq, seq), or a flex BlockMask. h: (batch, seq, hidden); pos: (1, seq) int64."""
    from transformers import masking_utils

    if h.device.type == "meta":  # torch < 2.13's pipeline shape inference: shapes only
        return dict.fromkeys(kinds)
    builders = {"full_attention": masking_utils.create_causal_mask,
                "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    masks = {}
    for kind in kinds:
        build = builders[kind]
        # the keywords changed across releases (4.x: input_embeds, cache_position,
        # past_key_values; 5.2x: inputs_embeds, cache, with past_key_values deprecated)
        params = inspect.signature(build).parameters
        # position_ids None: pos is one arange, nothing packed to look for (transformers reads
        # a value back to the host to look, a sync per micro-batch, and fails on meta tensors)
        args = {"config": config, "attention_mask": None, "position_ids": None,
                "inputs_embeds" if "inputs_embeds" in params else "input_embeds": h,
                "cache" if "cache" in params else "past_key_values": None}
        if "cache_position" in params:
            args["cache_position"] = pos[0]
        masks[kind] = build(**args)
    return masks


class LlamaStage(nn.Module):
    """Layers [lo, hi) of a transformers Llama-style causal LM, plus the embedding on the first
    stage and the final norm and head on the last. Parameter names are the full model's.

    forward: first stage takes input_ids (batch, seq) int64, others hidden (batch, seq, hidden);
    the last stage returns logits (batch, seq, vocab), others hidden states. Each layer gets the
    causal mask of its kind (sliding-window layers of Mistral, Qwen2, Qwen3: the windowed one),
    as in the model's own forward.
    """

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        inner = model.model
        # read before parallelize_fn may wrap the layers (activation checkpointing)
        self.attention_types = {str(i): _attention_type(inner.layers[i], model.config)
                                for i in range(lo, hi)}
        inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm = None
        self.model = inner
        self.lm_head = model.lm_head if last else None
        if not last:
            # `model` is consumed, but a caller may still hold it: drop the head there too, so
            # that only the last stage keeps its (vocab x hidden) weight alive
            model.lm_head = None
        self.config = model.config
        self.first, self.last = first, last

    def forward(self, x):
        inner = self.model
        h = inner.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = inner.rotary_emb(h, pos)
        masks = _causal_masks(self.config, h, pos, set(self.attention_types.values()))
        for name, layer in inner.layers.items():
            h = layer(h, attention_mask=masks[self.attention_types[name]], position_ids=pos,
                      position_embeddings=pe)
        if self.last:
            h = self.lm_head(inner.norm(h))
        return h


def check_pipeline_model(model):
    """Raise ValueError naming the model type unless `model` is one of MODEL_TYPES' causal LMs
    running transformers' own forward (a subclass's forward may compute more), whose maths a
    LlamaStage reproduces: another model's stages would train to other losses, silently."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    inner = getattr(model, "model", None)
    if (kind in MODEL_TYPES and _hf.stock_forward(model, MODEL_TYPES)
            and inner is not None and _hf.stock_forward(inner, MODEL_TYPES)):
        return
    why = (f"{type(model).__name__} (model_type {kind!r})" if kind not in MODEL_TYPES else
           f"{type(model).__name__} (model_type {kind!r}, a forward of its own)")
    raise ValueError(f"pipeline parallel runs the forward of {', '.join(MODEL_TYPES)} causal "
                     f"LMs (embedding, decoder layers, final norm, head), not of {why}: its "
                     f"stages would compute other logits (e.g. an embedding or logit scaling "
                     f"left out); train it with parallel.pp=1")


def merge_stages(stages):
    """One module holding the parameters of several LlamaStages of a rank (interleaved
    schedules), under the full model's names: for optimizers and DCP state dicts."""
    merged = nn.Module()
    merged.model = nn.Module()
    merged.model.layers = nn.ModuleDict()
    merged.config = stages[0].config
    merged.lm_head = None
    for st in stages:
        merged.model.layers.update(st.model.layers)
        if st.first:
            merged.model.embed_tokens = st.model.embed_tokens
        if st.last:
            merged.model.norm = st.model.norm
            merged.lm_head = st.lm_head
    return merged


def build_pipeline_stage(model, stage_index, num_stages, group=None, device="cpu",
                         boundaries=None, seq_len=None, parallelize_fn=None):
    """Cut `model` (consumed: its layer list is replaced) into stage `stage_index` of
    `num_stages`; returns (LlamaStage, PipelineStage).

    parallelize_fn(stage_module) runs before the PipelineStage is made (tensor parallel,
    checkpointing, FSDP over the stage's dp/tp submesh), as torch's pipelining requires.
    boundaries: explicit layer cuts (num_stages + 1 ints); by default the layers are balanced
    by estimated FLOPs, the head's cost counted on the last stage (`split_layers`).
    group: the pipeline process group (mesh["pp"].get_group()).
    """
    _torch_support.require("pipeline parallel", torch.device(device).type)
    check_pipeline_model(model)
    if getattr(model.config, "tie_word_embeddings", False) and num_stages > 1:
        raise ValueError("pipeline parallel needs untied embeddings (tie_word_embeddings=False): "
                         "the embedding and the head live on different stages")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} not in [0, {num_stages})")
    if boundaries is None:
        costs, first, last = llama_layer_costs(model.config, seq_len or 1)
        boundaries = split_layers(costs, num_stages, first, last)
    n = model.config.num_hidden_layers
    if len(boundaries) != num_stages + 1 or boundaries[0] != 0 or boundaries[-1] != n or any(
            a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries {boundaries} must rise strictly from 0 to "
                         f"num_hidden_layers={n} in {num_stages} steps")
    lo, hi = boundaries[stage_index], boundaries[stage_index + 1]
    module = LlamaStage(model, lo, hi, stage_index == 0, stage_index == num_stages - 1)
    if parallelize_fn is not None:
        module = parallelize_fn(module) or module
    stage = PipelineStage(module, stage_index, num_stages, torch.device(device), group=group)
    return module, stage


def build_schedule(stages, n_microbatches, loss_fn, schedule="1f1b", batch_size=None):
    """A torch pipelining schedule. stages: one PipelineStage (GPipe, 1F1B) or this rank's
    list of stages (interleaved). Gradients come out averaged over micro-batches.

    batch_size (the per-pipeline batch), when given, is checked to split evenly.
    """
    stage_list = stages if isinstance(stages, (list, tuple)) else [stages]
    num_stages = stage_list[0].num_stages
    _check_schedule(schedule, num_stages // len(stage_list), n_microbatches, batch_size)
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(list(stage_list), n_microbatches, loss_fn=loss_fn)
    if len(stage_list) != 1:
        raise ValueError(f"{schedule} runs one stage per rank; got {len(stage_list)}")
    return SCHEDULES[schedule](stage_list[0], n_microbatches, loss_fn=loss_fn)


def _check_schedule(schedule, pp, n_microbatches, batch_size):
    """The schedule's name, its rules on n_microbatches, and the batch splitting evenly."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    # first: it also checks that n_microbatches is an int >= 1, which the division needs
    check_micro_batches(schedule, pp, n_microbatches)
    if batch_size is not None and batch_size % n_microbatches:
        raise ValueError(f"the per-pipeline batch ({batch_size}) is not divisible by "
                         f"n_microbatches={n_microbatches}")


def pipeline_loss(logits, labels):
    """The last stage's loss: mean token cross-entropy (fp32) of logits (batch, seq, vocab)
    against labels (batch, seq), already shifted (-100: ignored), as transformers' causal LM
    loss."""
    return vocab_parallel_cross_entropy(logits, labels)


class Pipeline:
    """This rank's part of a pipeline-parallel model: `module` (its stage, or its stages merged
    under the full model's parameter names), the torch `schedule`, and where the rank sits."""

    def __init__(self, module, schedule, pp_mesh, n_microbatches, chunks):
        self.module, self.schedule = module, schedule
        self.pp, self.pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.pp_group = pp_mesh.get_group()
        self.first, self.last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.n_microbatches, self.chunks = n_microbatches, chunks
        # the idle fraction of the schedule (as the planner prices it), reported per step
        self.bubble = bubble_fraction(self.pp, n_microbatches, chunks)

    def step(self, input_ids, labels):
        """One run of the schedule over the batch (batch, seq), split into the micro-batches.
        Returns the micro-batches' losses on the last stage, [] elsewhere."""
        for name, t in (("input_ids", input_ids), ("labels", labels)):
            if t is not None and t.shape[0] % self.n_microbatches:
                # every rank that holds the batch refuses it before the schedule's first send
                raise ValueError(f"Pipeline.step: the batch of {t.shape[0]} rows ({name}) does "
                                 f"not split into n_microbatches={self.n_microbatches}")
        losses = []
        if self.first and self.last:
            # pp=1: the one rank feeds the inputs and computes the loss
            self.schedule.step(input_ids, target=labels, losses=losses)
        elif self.first:
            self.schedule.step(input_ids)
        elif self.last:
            self.schedule.step(target=labels, losses=losses)
        else:
            self.schedule.step()
        return losses


def build_pipeline(model, mesh, n_microbatches, schedule="1f1b", loss_fn=pipeline_loss,
                   device="cpu", seq_len=None, parallelize_fn=None, batch_size=None):
    """Cut `model` (consumed) into this rank's stage(s) over mesh["pp"]: one stage, or two
    (pp_rank and pp_rank + pp of 2 pp) for the interleaved schedule; layers balanced by
    estimated cost (`split_layers`); parallelize_fn(stage) applied to each (tensor parallel,
    FSDP2 over the rank's dp/tp submesh). loss_fn(logits, labels) runs on the last stage.
    Returns a Pipeline."""
    pp_mesh = mesh["pp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    # before the model is cut up (consumed), not only once its stages are built
    _check_schedule(schedule, pp, n_microbatches, batch_size)
    if schedule == "interleaved" and pp == 1:
        # one rank, no other stage to interleave with: 1F1B is the same maths (torch 2.11's
        # interleaved schedule sent between the rank's own two stages over Gloo, which has no
        # pair to itself)
        schedule = "1f1b"
    chunks = 2 if schedule == "interleaved" else 1
    layers = model.config.num_hidden_layers
    if chunks > 1 and layers < pp * chunks:  # (split_layers would name pp * chunks stages)
        raise ValueError(f"the interleaved schedule at parallel.pp={pp} runs {pp * chunks} "
                         f"stages of at least one layer each; the model has "
                         f"num_hidden_layers={layers} (use 1f1b or gpipe)")
    check_pipeline_model(model)  # (before a copy is made for the interleaved schedule)
    modules, stages = [], []
    for c in range(chunks):
        source = copy.deepcopy(model) if c < chunks - 1 else model
        module, stage = build_pipeline_stage(source, pp_rank + c * pp, pp * chunks,
                                             group=pp_mesh.get_group(), device=device,
                                             seq_len=seq_len, parallelize_fn=parallelize_fn)
        modules.append(module)
        stages.append(stage)
    module = modules[0] if chunks == 1 else merge_stages(modules)
    sched = build_schedule(stages if chunks > 1 else stages[0], n_microbatches, loss_fn,
                           schedule, batch_size)
    return Pipeline(module, sched, pp_mesh, n_microbatches, chunks)
