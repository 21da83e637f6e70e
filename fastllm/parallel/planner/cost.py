"""An analytic cost model for data x tensor x pipeline parallel training, and the planner on top.

Given a model shape, a sequence length, a global batch and a cluster (GPU type, count, node
size), :func:`plan` enumerates layouts (dp/tp/pp, ZeRO stage, micro-batch, activation
recomputation, pipeline schedule, full or LoRA training) and :func:`estimate` prices one:

- memory per GPU: weights, gradients, optimizer state (fp32 master + two moments), activations;
- compute time from the matmul FLOPs at the GPU's achievable matmul rate, plus the
  memory-bound elementwise traffic at its HBM bandwidth;
- communication from each collective's bytes and the bandwidth of the link it crosses (tensor
  parallel is kept inside a node; data and pipeline groups cross nodes when they must);
- the pipeline bubble, and the share of data-parallel communication that overlaps backward.

Everything is in bytes and seconds. Formulas and their sources:

- Matmul FLOPs per layer and the "achieved FLOP/s" convention (recomputation counted, logits
  not recomputed): Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC 2021, section 5.1.
- Pipeline bubble (p - 1) / (v m) of the ideal time for GPipe/1F1B (v = 1) and the interleaved
  schedule (v chunks per stage): the same paper, sections 2.2.1-2.2.2.
- Ring all-reduce moves 2 (n - 1) / n of the buffer per rank, reduce-scatter and all-gather
  (n - 1) / n each; ZeRO stages shard optimizer state, gradients and weights over dp:
  Rajbhandari et al., "ZeRO", SC 2020.
- Activations saved per Llama decoder layer were counted from the tensors PyTorch's autograd
  saves for transformers' ``LlamaDecoderLayer`` (SDPA attention; fp32 and bf16); the test suite
  checks the count against ``torch.autograd.graph.saved_tensors_hooks`` on a real model.
- What torch.distributed.pipelining holds (its ``schedules.py`` and ``stage.py``, torch 2.13):
  Schedule1F1B runs pp - i forwards on stage i before its first backward; every stage keeps a
  receive buffer per micro-batch for the whole step and the last stage keeps every
  micro-batch's output; with FSDP2 inside a stage, backward gathers the weights once and
  reduce-scatters once, after the last micro-batch. The tests check the memory of each CPU
  layout against the peak a real run holds.
"""

import dataclasses
import itertools
import types

from fastllm.parallel.layout import ParallelLayout, bubble_fraction
from fastllm.parallel.planner.catalog import GPUS, MODELS
from fastllm.parallel.planner.memory import activation_bytes_per_layer, lora_params_per_layer


def sync_cost(gpu, n):
    """The extra wait of a collective over n ranks on `gpu`'s shared cores: the figure measured
    for the largest group size not above n (0 when nothing was measured)."""
    known = [(size, c) for size, c in gpu.sync_costs if size <= n]
    return max(known)[1] if known else 0.0


# --- a layout ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """dp x tp x pp ranks; tp innermost (inside a node), then dp, then pp (Megatron's order)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0               # 0: replicated; 1: optimizer state; 2: + grads; 3: + weights
    micro_batch: int = 1
    recompute: bool = False     # full activation recomputation per layer
    schedule: str = "1f1b"      # gpipe | 1f1b | interleaved
    chunks: int = 1             # model chunks per stage (interleaved)
    sequence_parallel: bool = False
    lora_rank: int = 0          # 0: full training
    nf4: bool = False           # QLoRA: the layers' linear weights frozen in 4-bit NF4
    double_quant: bool = False  # ... with their absmax double-quantised

    def describe(self):
        s = f"dp{self.dp} tp{self.tp} pp{self.pp}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.chunks}" if self.schedule == "interleaved" else "")
        s += f" mb{self.micro_batch}"
        if self.zero:
            s += f" zero{self.zero}"
        if self.recompute:
            s += " recompute"
        if self.sequence_parallel:
            s += " sp"
        if self.lora_rank:
            s += f" {'qlora' if self.nf4 else 'lora'}{self.lora_rank}"
            s += "+dq" if self.double_quant else ""
        return s

    def base_bytes(self, e):
        """Bytes a frozen linear weight of the decoder layers takes per element: NF4's 4-bit
        code and fp32 absmax per 64 (0.5625; double-quantised, 8 bits per absmax and an fp32
        scale per 256 of them: 0.5159), else the training dtype's e."""
        if not self.nf4:
            return e
        return 0.5 + ((1 + 4 / 256) if self.double_quant else 4) / 64


@dataclasses.dataclass(frozen=True)
class RuntimeSpec:
    """What a training runtime issues per step, beyond FLOPs and bytes.

    tp_allreduces: tensor-parallel all-reduces per decoder layer and micro-batch, forward and
    backward (Megatron-LM fuses q/k/v and gate/up: 2 and 2; DTensor's plan on transformers'
    Llama reduces the input gradient of q, k, v, gate and up separately: 2 and 5).
    The op counts price host-bound machines (GPUSpec.op_overhead): eager aten ops per decoder
    layer and micro-batch, forward + backward (without and with tensor parallel, where some run
    on DTensors), FSDP2's per layer and micro-batch, per micro-batch outside the layers
    (embedding, head, loss), and the optimizer's and clipping's per parameter tensor.
    """

    name: str
    tp_allreduces: tuple = (2, 2)
    tp_allreduces_outside: int = 0   # per micro-batch: vocabulary-parallel embedding and head
    ops_layer: int = 0
    ops_layer_tp: tuple = (0, 0)     # (plain ops, DTensor ops)
    ops_fsdp_layer: int = 0
    ops_outside: int = 0
    ops_param: int = 0
    small_collectives: int = 0       # per step: loss and gradient-norm all-reduces
    # torch.distributed.pipelining: every micro-batch's receive buffers and the last stage's
    # outputs are held until the step ends (Megatron-LM allocates them per transfer)
    pipeline_buffers: bool = False


MEGATRON = RuntimeSpec("megatron")
# fastllm.parallel on transformers' LlamaForCausalLM with torch AdamW (foreach off on CPU):
# counted with a TorchDispatchMode over one step of each layout (tests/test_plan.py
# ::test_runtime_op_counts recounts them).
FASTLLM = RuntimeSpec("fastllm.parallel", tp_allreduces=(2, 5), tp_allreduces_outside=2,
                      ops_layer=246, ops_layer_tp=(199, 69), ops_fsdp_layer=84, ops_outside=100,
                      ops_param=8, small_collectives=1, pipeline_buffers=True)


def _shape(model):
    """What fastllm.parallel.ParallelLayout reads of a transformers config."""
    return types.SimpleNamespace(num_attention_heads=model.heads,
                                 num_key_value_heads=model.kv_heads, intermediate_size=model.ffn,
                                 num_hidden_layers=model.layers, vocab_size=model.vocab,
                                 tie_word_embeddings=model.tied_embeddings)


def check_layout(model, layout, seq_len, global_batch, fastllm_rules=False):
    """Raise ValueError naming the setting when the layout cannot run this model and batch:
    the runtime's rules (fastllm.parallel.ParallelLayout), with stages of equal layer counts
    (the cost model prices one stage for all). fastllm_rules: also fastllm's rule that a
    pipeline needs untied embeddings (build_pipeline_stage; Megatron-LM pipelines tied ones,
    all-reducing the embedding's gradient between the first and last stages), and `fastllm
    train`'s that data parallel beside tp or pp > 1 is FSDP2's (ZeRO-3:
    fastllm.parallel.apply_fsdp)."""
    lo = layout
    if lo.micro_batch < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {lo.micro_batch}")
    if lo.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0-3, got {lo.zero}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    par = ParallelLayout(dp=lo.dp, tp=lo.tp, pp=lo.pp, schedule=lo.schedule, chunks=lo.chunks,
                         sequence_parallel=lo.sequence_parallel)
    par.check_model(_shape(model), even_stages=True)
    if fastllm_rules and model.tied_embeddings and lo.pp > 1:
        raise ValueError(f"parallel.pp={lo.pp} needs untied embeddings (tie_word_embeddings="
                         f"False): the embedding and the head live on different stages")
    if fastllm_rules and lo.dp > 1 and (lo.tp > 1 or lo.pp > 1) and lo.zero != 3:
        raise ValueError(f"dp={lo.dp} beside tp={lo.tp} x pp={lo.pp} is FSDP2 (zero3) in "
                         f"fastllm train, not zero{lo.zero}")
    if lo.nf4 or lo.double_quant:
        if not (lo.nf4 and lo.lora_rank):
            raise ValueError(f"nf4 (QLoRA) needs lora_rank > 0 and double_quant needs nf4, got "
                             f"lora_rank={lo.lora_rank} nf4={lo.nf4} "
                             f"double_quant={lo.double_quant}")
        # (fastllm.quant's NF4 layers: whole on each rank or FSDP2-sharded, no tp/pp shards)
        if lo.tp > 1 or lo.pp > 1 or lo.zero in (1, 2):
            raise ValueError(f"QLoRA (nf4) runs with tp = pp = 1 under DDP (zero0) or FSDP2 "
                             f"(zero3), got tp={lo.tp} pp={lo.pp} zero{lo.zero}")
    par.micro_batches(global_batch, lo.micro_batch)


# --- the cost model ---------------------------------------------------------------------------

def _collective_time(kind, nbytes, n, bandwidth, latency=5e-6):
    """Ring algorithm time for `kind` over n ranks of an nbytes buffer."""
    if n <= 1 or nbytes == 0:
        return 0.0
    factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}[kind]
    return factor * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def estimate(model, layout, seq_len, global_batch, gpu, node_size=8, flash=True,
             dp_overlap=0.5, grad_bytes=None, check=True, runtime=None, fastllm_rules=None):
    """Price one layout. Returns a dict of bytes (per GPU) and seconds (per optimizer step).

    dp_overlap: the fraction of data-parallel communication hidden behind backward compute.
    grad_bytes: bytes per gradient element (default: the training dtype's).
    runtime: a RuntimeSpec (default MEGATRON: fused projections, no host cost); FASTLLM for
    fastllm.parallel's layouts, whose op and collective counts matter on a host-bound machine.
    fastllm_rules: price the layout as fastllm's runtime lays it out (default: when runtime is
    FASTLLM; plan() always does): pipelines only with untied embeddings, the embedding and the
    head whole on every tp rank when tied or when tp does not divide the vocabulary
    (ParallelLayout.vocab_parallel), the logits gathered whole on a pipeline's last stage.
    Without them all three are split over tp, as Megatron-LM splits them (padding the vocabulary).
    """
    lo = layout
    rt = runtime or MEGATRON
    if fastllm_rules is None:
        fastllm_rules = rt.name == FASTLLM.name
    if check:
        check_layout(model, lo, seq_len, global_batch, fastllm_rules)
    e = gpu.dtype_bytes
    g = grad_bytes or e
    mixed = e < 4
    n_gpus = lo.dp * lo.tp * lo.pp
    m = global_batch // (lo.dp * lo.micro_batch)
    b, s, t = lo.micro_batch, seq_len, lo.tp
    v = lo.chunks if lo.schedule == "interleaved" else 1
    layers_stage = model.layers // lo.pp
    # the embedding's and head's share of each tp rank (1: whole), and the logits'
    tv = t
    if fastllm_rules and not ParallelLayout(tp=t).vocab_parallel(_shape(model)):
        tv = 1
    tl = 1 if fastllm_rules and lo.pp > 1 else tv  # (vocab_parallel_logits=False in a stage)

    # memory per stage kind: the first (embedding), a middle one, the last (head + logits);
    # report the largest
    def stage_params(first, last):
        p = layers_stage * model.layer_params() / t
        if first:
            p += model.embedding_params() / tv
        if last:
            p += model.head_params() / tv + model.hidden / t
            if model.tied_embeddings and not first:
                p += model.embedding_params() / tv
        return p

    # QLoRA: the decoder layers' linear weights held in NF4 (the rest in e)
    quantised = layers_stage * model.layer_linear_params() / t
    nf4_saving = quantised * (e - lo.base_bytes(e))

    def stage_bytes(first, last):
        return stage_params(first, last) * e - nf4_saving

    act_layer = activation_bytes_per_layer(model, b, s, e, t, lo.sequence_parallel, flash)

    def in_flight(i):
        """Micro-batches whose activations pipeline rank i holds at its peak, in units of one
        micro-batch through all of its layers. 1F1B: rank i runs pp - i forwards before its
        first backward (Schedule1F1B's warm-up; Megatron-LM's pp - i - 1 warm-up forwards and
        the steady state's forward before its backward). Interleaved: (v - 1) pp + 2 (pp - 1
        - i) chunk forwards of warm-up plus one (ScheduleInterleaved1F1B; Megatron-LM's
        get_num_warmup_microbatches), at most all m v; rank 0's is p (1 + (p - 1) / (p v)),
        Narayanan et al. section 2.2.2. GPipe: all m."""
        if lo.pp == 1:
            return 1
        if lo.schedule == "gpipe":
            return m
        if lo.schedule == "interleaved":
            return min((v - 1) * lo.pp + 2 * (lo.pp - 1 - i) + 1, m * v) / v
        return min(lo.pp - i, m)

    layer_input = b * s * model.hidden * e / (t if lo.sequence_parallel else 1)
    fsdp = lo.dp > 1 and lo.zero == 3  # ZeRO-3 is FSDP2's layout
    # ... kept gathered through the step in a pipeline stage (reshard_after_forward=False, as
    # fastllm train and torchtitan shard stages): the stage's weights and grads whole all step
    kept = fsdp and lo.pp > 1

    def stage_acts(i):
        if lo.recompute:
            # layer inputs of every micro-batch in flight, and one layer recomputed whole
            return layers_stage * layer_input * in_flight(i) + act_layer
        return layers_stage * act_layer * in_flight(i)

    # logits, their fp32 copy (none when already fp32), the log-softmax the loss keeps
    logits = b * s * model.vocab / tl * (e + (4 if e < 4 else 0) + 4)
    # torch.distributed.pipelining keeps, until the step ends, a receive buffer per micro-batch
    # (and chunk) for each boundary tensor a stage receives: the activation from the previous
    # stage, the gradient from the next (PipelineStage args_recv_info / grad_recv_info); and
    # the last stage keeps every micro-batch's output, the logits (output_chunks, merged into
    # step()'s result)
    # when micro-batches accumulate into an existing .grad, a backward holds the new gradient
    # of a parameter beside the accumulated one (autograd's AccumulateGrad adds it in
    # afterwards): the largest parameter tensor of the stage. (The logits' gradient replaces
    # the log-softmax the loss frees: one process measures no net growth there.)
    largest_layer_param = max(model.hidden * model.ffn, model.hidden * model.q_dim) / t

    # (rank, holds the embedding, holds the head): rank 1 has the most micro-batches in flight
    # of the middle ranks, which otherwise hold the same
    stages = {(0, True, lo.pp == 1), (lo.pp - 1, lo.pp == 1, True)}
    if lo.pp > 2:
        stages.add((1, False, False))
    best = None
    most_trainable = most_params = 0
    for i, first, last in sorted(stages):
        p = stage_params(first, last)
        most_params = max(most_params, p)
        if lo.lora_rank:
            trainable = layers_stage * lora_params_per_layer(model, lo.lora_rank) / t
            # ZeRO shards them as it shards full fine-tuning's (the frozen weights at stage 3)
        else:
            trainable = p
        weights = stage_bytes(first, last) / (lo.dp if lo.zero >= 3 else 1)
        grads = trainable * g / (lo.dp if lo.zero >= 2 else 1)
        optim = trainable * (12 if mixed else 8) / (lo.dp if lo.zero >= 1 else 1)
        if kept:
            # the weight shards, and beside them the whole weights; grads accumulate whole
            # across micro-batches and become shards only after the last backward (each
            # layer's whole ones freed as its shards are made; zero_grad frees the shards)
            weights += stage_bytes(first, last)
            grads = trainable * g
        most_trainable = max(most_trainable, trainable)
        # under 1F1B each backward after the first runs with every gradient of the stage
        # already allocated; GPipe holds all m micro-batches, the loss's logits included
        gpipe = lo.pp > 1 and lo.schedule == "gpipe"
        a = stage_acts(i)
        if last:
            a += logits * (m if gpipe else 1)
            if lo.pp > 1 and not gpipe and rt.pipeline_buffers:
                a += (m - 1) * b * s * model.vocab / tl * e  # the other micro-batches' outputs
        mem = {"weights": weights, "grads": grads, "optimizer": optim, "activations": a}
        if lo.pp > 1 and rt.pipeline_buffers:
            # each of the rank's v chunks receives an activation and a gradient, but the
            # model's first chunk no activation and its last no gradient
            mem["pipeline_buffers"] = m * (2 * v - first - last) * layer_input
        work = 0.0
        accumulating = m > 1 and (kept or not fsdp)  # FSDP2 resharding: in "gathered"
        if accumulating and not lo.lora_rank:
            largest = largest_layer_param
            if first:
                largest = max(largest, model.embedding_params() / tv)
            if last:
                largest = max(largest, model.head_params() / tv)
            work += largest * g
        mem["backward_workspace"] = work
        if lo.nf4:
            # one layer's weights dequantised into e for a product, forward and backward:
            # fastllm.patch's q/k/v (or gate/up) at once
            h = model.hidden
            mem["dequantized"] = e * max(h * (model.q_dim + 2 * model.kv_dim),
                                         (2 if model.gated_mlp else 1) * h * model.ffn)
        if fsdp and not kept:
            # FSDP2 gathers each layer whole (the next one prefetched) and keeps the root's
            # parameters (final norm, head, a tied embedding; an untied one is a unit of its
            # own, gathered for its forward and backward only) whole from forward to
            # backward; a layer's and the root's gradients (LoRA: the adapters' alone) are
            # whole until their reduce-scatter
            # (this tp rank's share of them)
            root = ((model.embedding_params() / tv if first and model.tied_embeddings else 0)
                    + ((model.head_params() / tv + model.hidden / t) if last else 0))
            layer = model.layer_params() / t
            layers_whole = 2 * (layer * e - nf4_saving / layers_stage)
            if lo.lora_rank:
                mem["gathered"] = (layers_whole + root * e
                                   + lora_params_per_layer(model, lo.lora_rank) / t * g)
            else:
                units = layers_whole + layer * g
                if first and not model.tied_embeddings:
                    # the untied embedding's unit, gathered again for its backward (the last):
                    # its weight and grad whole beside the root's
                    units = max(units, model.embedding_params() / tv * (e + g))
                mem["gathered"] = units + root * (e + g)
        total = sum(mem.values())
        if best is None or total > best[0]:
            best = (total, mem)
    total, mem = best
    # the slowest stage's gradients and optimizer set the data-parallel and optimizer times
    trainable = most_trainable

    # compute per micro-batch on one stage
    # ranks sharing cores (a CPU): a blocking collective also waits for descheduled peers
    shared = bool(gpu.cores) and n_gpus > gpu.cores

    def sync(n):
        return sync_cost(gpu, n) if shared and n > 1 else 0.0
    tokens = b * s
    # attention's scores and weighted sum: 2 matmuls of (s x head_dim x s) per head
    layer_fwd = 2 * tokens * model.layer_linear_params() + 4 * b * s * s * model.q_dim
    head_fwd = 2 * tokens * model.hidden * model.vocab
    bwd_factor = 1 if lo.lora_rank else 2  # LoRA: input grads only through frozen weights
    passes = 1 + bwd_factor + (1 if lo.recompute else 0)
    # the last stage carries the head too, and the pipeline runs at its pace
    layers_flops = layers_stage * layer_fwd * passes / t
    head_flops_micro = head_fwd * (1 + bwd_factor) / tv
    rate = gpu.peak_flops * gpu.matmul_efficiency
    # elementwise work (norms, rotary, activation functions, softmax without flash) is
    # memory-bound: about one activation-sized read and write per pass
    elementwise = layers_stage * 2 * act_layer * passes
    if lo.nf4:  # each pass dequantises the weights: NF4 read, e written (and read by the GEMM)
        elementwise += quantised * (lo.base_bytes(e) + e) * passes
    # host cost of the eager ops (zero on a GPU, whose kernels queue behind the host);
    # recomputation repeats the forward's ops, about a third of forward + backward
    plain_ops, dtensor_ops = rt.ops_layer_tp if t > 1 else (rt.ops_layer, 0)
    rec = 4 / 3 if lo.recompute else 1.0
    op, dop = gpu.op_overhead, gpu.op_overhead + gpu.dtensor_overhead
    host_layers = layers_stage * (rec * (plain_ops * op + dtensor_ops * dop)
                                  + (rt.ops_fsdp_layer * op if fsdp else 0.0))
    host_outside = rt.ops_outside * op
    t_layers_micro = layers_flops / rate + elementwise / gpu.hbm_bandwidth + host_layers
    t_head_micro = head_flops_micro / rate + host_outside
    t_compute_micro = t_layers_micro + t_head_micro

    # tensor parallel: all-reduces (or reduce-scatter + all-gather) per layer per pass
    bw_tp = gpu.intra_node_bandwidth * gpu.comm_efficiency
    if t > node_size:
        bw_tp = gpu.inter_node_bandwidth * gpu.comm_efficiency
    tp_bytes = tokens * model.hidden * e
    n_fwd, n_bwd = rt.tp_allreduces
    # (a whole embedding and head on every tp rank need none)
    tp_count = layers_stage * (n_fwd * (2 if lo.recompute else 1) + n_bwd) \
        + (rt.tp_allreduces_outside if tv > 1 else 0)
    t_tp_micro = 0.0
    if t > 1:
        t_tp_micro = tp_count * (_collective_time("all_reduce", tp_bytes, t, bw_tp, gpu.latency)
                                 + sync(t))

    t_micro = t_compute_micro + t_tp_micro
    t_bubble = (lo.pp - 1) / v * t_micro

    # pipeline p2p: activations forward, their grads backward, on each micro-batch and chunk
    pp_inside = lo.tp * lo.dp * lo.pp <= node_size
    bw_pp = gpu.comm_efficiency * (gpu.intra_node_bandwidth if pp_inside
                                   else gpu.inter_node_bandwidth)
    t_p2p = 0.0
    if lo.pp > 1:
        t_p2p = 2 * (m * v + lo.pp - 1) * (tokens * model.hidden * e / bw_pp + gpu.latency
                                          + sync(2))

    # data parallel: gradients reduced (ZeRO: reduce-scatter, then all-gather of weights)
    dp_inside = lo.tp * lo.dp <= node_size
    bw_dp = gpu.comm_efficiency * (gpu.intra_node_bandwidth if dp_inside
                                   else gpu.inter_node_bandwidth)
    grad_buf = trainable * g
    # FSDP2 and bucketed DDP issue one collective per layer (plus the root's): the latency is
    # paid per bucket, the bandwidth on the whole buffer
    buckets = layers_stage + 1

    def coll(kind, nbytes):
        if lo.dp <= 1:
            return 0.0
        return buckets * (_collective_time(kind, nbytes / buckets, lo.dp, bw_dp, gpu.latency)
                          + sync(lo.dp))

    if lo.zero == 0:
        t_dp = coll("all_reduce", grad_buf)
    else:
        t_dp = coll("reduce_scatter", grad_buf) + coll("all_gather", trainable * e)
        if kept:
            # gathered once, at the first micro-batch's forward, reduced after the last's
            # backward (torch.distributed.pipelining's set_requires_gradient_sync): LoRA's
            # frozen base too
            if lo.lora_rank:
                t_dp += coll("all_gather", (most_params - trainable) * e)
        elif lo.zero == 3:
            # weights re-gathered for forward and backward of every micro-batch
            # (the stage's every weight, frozen ones too: LoRA's base is sharded and gathered,
            # QLoRA's in NF4)
            t_dp += coll("all_gather", most_params * e - nf4_saving) * (2 * m - 1)
    t_dp_exposed = t_dp * (1 - dp_overlap)
    # the loss and the gradient norm: one tiny all-reduce each, over every rank
    n_small = rt.small_collectives + (lo.pp > 1) + (lo.dp > 1) if rt.small_collectives else 0
    t_small = n_small * (_collective_time("all_reduce", 8, n_gpus, bw_dp, gpu.latency)
                         + sync(n_gpus))

    # optimizer: memory-bound over the local shard (master, two moments, grad, weight), and
    # the host cost of its ops per parameter tensor (on DTensors under tp or FSDP)
    opt_elems = trainable / (lo.dp if lo.zero >= 1 else 1)
    tensors = layers_stage * model.layer_tensors() + (3 if lo.pp == 1 else 2)
    t_opt = opt_elems * (2 * (12 if mixed else 8) + g + e) / gpu.hbm_bandwidth \
        + tensors * rt.ops_param * (dop if (t > 1 or lo.dp > 1) else op)

    comm = m * t_tp_micro + t_p2p + t_dp_exposed + t_small
    step = m * t_micro + t_bubble + t_p2p + t_dp_exposed + t_opt + t_small
    if shared:
        # more ranks than cores: a rank idle in a bubble or a collective leaves its core to
        # another, so the step is at least every rank's work shared out over the cores
        # (the head's work is on one stage of pp), plus the communication
        busy = m * (t_layers_micro + t_head_micro / lo.pp) + t_opt
        step = max(step, n_gpus / gpu.cores * busy + comm)
    compute = m * t_compute_micro
    tokens_step = global_batch * seq_len
    # model FLOPs (no recomputation) for MFU; Megatron's counted FLOPs for "achieved"
    head_flops = 2 * seq_len * model.hidden * model.vocab
    fwd = (model.layers * (2 * seq_len * model.layer_linear_params() + 4 * seq_len * seq_len
                           * model.q_dim) + head_flops) * global_batch
    model_flops = fwd * (1 + bwd_factor)
    # recomputation repeats the layers' forward, not the head's
    hw_flops = model_flops + (fwd - head_flops * global_batch if lo.recompute else 0)
    memory_total = total + gpu.reserved
    warnings = []
    if comm / step > 0.15:
        warnings.append(f"communication {100 * comm / step:.0f}% of the step")
    if t_bubble / step > 0.15:
        warnings.append(f"pipeline bubble {100 * t_bubble / step:.0f}% of the step")
    return {
        "layout": lo,
        "n_gpus": n_gpus,
        "micro_batches": m,
        "memory": mem,
        "memory_total": memory_total,
        "fits": memory_total <= gpu.memory,
        "time_compute": compute,
        "time_tp": m * t_tp_micro,
        "time_pp_p2p": t_p2p,
        "time_dp": t_dp,
        "time_dp_exposed": t_dp_exposed,
        "time_bubble": t_bubble,
        "time_optimizer": t_opt,
        "time_small_collectives": t_small,
        "time_host": m * (host_layers + host_outside),
        "shared_cores": shared,
        "step_time": step,
        "tokens_per_s": tokens_step / step,
        "mfu": model_flops / step / (n_gpus * gpu.peak_flops),
        "achieved_flops_per_gpu": hw_flops / step / n_gpus,
        "comm_share": comm / step,
        "bubble_share": t_bubble / step,
        "bubble_fraction": bubble_fraction(lo.pp, m, v),
        "warnings": warnings,
    }


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(model, seq_len, global_batch, gpu, n_gpus, node_size=8, top=5, lora_rank=0,
         flash=True, dp_overlap=0.5, zero_stages=(0, 1, 2, 3), micro_batches=(1, 2, 4, 8),
         sequence_parallel=False, nf4=False, double_quant=False):
    """All layouts of n_gpus that can run the model, priced; the `top` fastest that fit first.

    nf4 (with lora_rank): QLoRA, the layers' linear weights in 4-bit NF4 (double_quant: their
    absmax double-quantised), as `fastllm train lora.quantize_base=nf4` runs it: tp = pp = 1,
    DDP or FSDP2.

    sequence_parallel: price tensor-parallel layouts with sequence parallelism (Megatron,
    torchtitan, and fastllm's runtime with parallel.sequence_parallel); off by default.

    Returns (best, all_estimates): best is a list of estimate dicts sorted by step time (empty
    when none fits in memory). Raises ValueError naming the rules each dp x tp x pp broke when
    no layout can run the model and batch at all.
    """
    if isinstance(model, str):
        model = MODELS[model]
    if isinstance(gpu, str):
        gpu = GPUS[gpu]
    if n_gpus % node_size and n_gpus > node_size:
        raise ValueError(f"gpus={n_gpus} is not a multiple of node_size={node_size}")
    results = []
    refused = {}  # "dp tp pp" -> the first rule its layouts broke
    for tp, pp in itertools.product(_divisors(min(n_gpus, node_size)), _divisors(n_gpus)):
        if n_gpus % (tp * pp):
            continue
        dp = n_gpus // (tp * pp)
        schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)]
        for (sched, v), mb, zero, rec in itertools.product(schedules, micro_batches,
                                                           zero_stages, (False, True)):
            if dp > 1 and (tp > 1 or pp > 1) and zero != 3:
                # fastllm train's data parallel beside tp or pp is FSDP2 (check_layout's rule,
                # skipped here so that a refused dp x tp x pp names the rule all its layouts
                # break)
                continue
            if dp == 1 and zero:
                continue
            lo = Layout(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, recompute=rec,
                        schedule=sched, chunks=v, sequence_parallel=sequence_parallel and tp > 1,
                        lora_rank=lora_rank, nf4=nf4, double_quant=double_quant)
            try:
                # the layouts `fastllm train` can run: fastllm's rules
                check_layout(model, lo, seq_len, global_batch, fastllm_rules=True)
            except ValueError as e:
                refused.setdefault(f"dp{dp} tp{tp} pp{pp}", str(e))
                continue
            results.append(estimate(model, lo, seq_len, global_batch, gpu, node_size, flash,
                                    dp_overlap, check=False, fastllm_rules=True))
    if not results:
        # no memory remedy helps here: say which split rule each dp x tp x pp broke
        raise ValueError(
            f"no valid layout of {n_gpus} GPUs ({node_size} per node; tp within a node) for "
            f"{model.name} at global batch {global_batch}: tp must divide the heads "
            f"({model.heads}), kv heads ({model.kv_heads}) and ffn ({model.ffn}), pp the layers "
            f"({model.layers}), and dp x micro-batch the global batch; "
            + "; ".join(f"{k}: {why}" for k, why in refused.items()))
    fitting = sorted((r for r in results if r["fits"]), key=lambda r: r["step_time"])
    return fitting[:top], results
