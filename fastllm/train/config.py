"""The training config: one dataclass tree, read from YAML, overridable as dotted key=value.

    cfg = TrainConfig.from_args(["--config", "run.yaml", "max_steps=200", "lora.r=16"])
    cfg.save(cfg.output_dir)             # output_dir/config.yaml, the resolved config

Names follow Hugging Face's TrainingArguments where the concept is the same (output_dir,
max_steps, warmup_steps, seed, report_to, gradient_accumulation_steps is derived from
global_batch_size / (micro_batch_size * data-parallel size); the data-parallel size is
world_size / (parallel.tp * parallel.pp)). Under pipeline parallel those accumulation
micro-batches are the pipeline's micro-batches.
"""

import collections.abc
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field

from fastllm.train.config_checks import validate_objective, validate_values
from fastllm.train.config_values import (ConfigError, convert as _convert,
                                         field_names as _field_names, field_type as _field_type,
                                         parse_free as _parse_free, update as _update)

__all__ = ["TrainConfig", "DataConfig", "EvalConfig", "LoraConfig", "PrefixConfig",
           "FreezeConfig", "GaloreConfig", "BAdamConfig", "CheckpointConfig", "ParallelConfig",
           "DPOConfig", "CPOConfig", "ORPOConfig", "ConfigError", "HF_NAMES", "hf_names"]


@dataclass
class DataConfig:
    path: typing.Optional[str] = None     # text or .jsonl/.json, file or folder; None: pydoc_data
    tokenizer: str = "byte"               # byte | bpe (trained on the corpus) | a tokenizer folder
    vocab_size: int = 1024                # for tokenizer=bpe
    seq_len: int = 128
    prefetch: int = 0                     # sequences the background loader keeps ready; 0: 4 batches
    cache_dir: typing.Optional[str] = None  # token files; None: $FASTLLM_CACHE or ~/.cache/fastllm
    log_indices: bool = False             # write each step's sample indices to metrics.jsonl
    format: str = "auto"                  # auto (.jsonl/.json: jsonl) | text | jsonl (SFT records)
    packing: bool = True                  # jsonl: several examples per row, kept apart
    train_on_prompt: bool = False         # jsonl: the loss counts prompt/system tokens too
    padding_free: bool = False            # dpo/cpo/orpo: a micro-batch's rows as one, no padding
    eval_path: typing.Optional[str] = None  # jsonl: held-out examples
    eval_fraction: float = 0.0            # jsonl: hold out this fraction of data.path (seeded)


@dataclass
class LoraConfig:
    target_modules: typing.List[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    layers: int = 0                       # adapt only the last N decoder layers; 0: all
    use_dora: bool = False                # DoRA: a learned magnitude per output (PEFT's use_dora)
    quantize_base: str = "none"           # none | nf4: QLoRA, the base linears in 4-bit NF4
    double_quant: bool = False            # nf4: its absmax in 8 bits (bnb_4bit_use_double_quant)


@dataclass
class EvalConfig:
    prompts: typing.List[str] = field(default_factory=list)  # generated greedily at each eval
    prompts_file: typing.Optional[str] = None  # .txt lines; .jsonl/.json {"prompt"[, "tools", ...]}
    max_new_tokens: int = 64
    batches: int = 0                      # eval batches per evaluation; 0: the whole eval set
    on_start: bool = True                 # also evaluate before the first step


@dataclass
class PrefixConfig:
    num_virtual_tokens: int = 16          # learned key/value vectors per layer
    prefix_projection: bool = False       # PEFT's reparameterisation (a tanh MLP)
    encoder_hidden_size: int = 0          # its hidden size; 0: kv_heads * head_dim


@dataclass
class GaloreConfig:
    """finetune=galore: fastllm.optim.GaLoreAdamW's projected param group (the decoder layers'
    weight matrices)."""
    rank: int = 16                        # at most the smallest matrix side (clamped to it)
    update_proj_gap: int = 200            # steps between projector refreshes
    scale: float = 0.25                   # the back-projected update's factor
    proj_type: str = "std"                # std | reverse_std | left | right


@dataclass
class BAdamConfig:
    """finetune=badam: fastllm.optim.BAdam's block schedule."""
    switch_block_every: int = 100
    switch_mode: str = "ascending"        # ascending | descending | random
    blocks: typing.Optional[typing.List[typing.List[str]]] = None  # name prefixes; None: per layer


@dataclass
class FreezeConfig:
    layers: int = 1                       # finetune=freeze trains the last N decoder layers + head


@dataclass
class DPOConfig:
    """objective=dpo: TRL DPOConfig's names (fastllm.preference.dpo_loss): beta, loss_type (one),
    label_smoothing (with sigmoid: conservative DPO, as TRL < 1.0 and Liger-Kernel; TRL 1.16's
    sigmoid ignores it), rpo_alpha (TRL < 1.0's; in TRL 1.16 loss_type ["sigmoid", "sft"] with
    loss_weights [1, rpo_alpha])."""
    beta: float = 0.1
    loss_type: str = "sigmoid"            # fastllm.preference.LOSS_TYPES
    label_smoothing: float = 0.0          # sigmoid (cDPO) and robust: in [0, 0.5)
    rpo_alpha: float = 0.0                # > 0: plus this x the chosen completions' NLL (RPO)
    precompute_ref_log_probs: bool = False  # the reference scored once, before step 1 (TRL's)
    disable_dropout: bool = True          # TRL's: the model's nn.Dropout modules p=0


@dataclass
class CPOConfig:
    """objective=cpo: reference-free, TRL CPOConfig's names (fastllm.preference.cpo_loss);
    SimPO is loss_type simpo with cpo_alpha 0."""
    beta: float = 0.1
    loss_type: str = "sigmoid"            # fastllm.preference.CPO_LOSS_TYPES (ipo, simpo: means)
    label_smoothing: float = 0.0          # sigmoid and simpo: in [0, 0.5)
    cpo_alpha: float = 1.0                # x the chosen completions' NLL per token (0: none)
    simpo_gamma: float = 0.5              # loss_type=simpo: the target margin
    disable_dropout: bool = True          # TRL's: the model's nn.Dropout modules p=0


@dataclass
class ORPOConfig:
    """objective=orpo: reference-free, TRL ORPOConfig's beta (the paper's lambda, the odds-ratio
    term's weight beside the chosen completions' NLL; fastllm.preference.orpo_loss)."""
    beta: float = 0.1
    disable_dropout: bool = True          # TRL's: the model's nn.Dropout modules p=0


@dataclass
class CheckpointConfig:
    interval: int = 100                   # steps between checkpoints; 0: only at the end
    keep_last: int = 2
    auto_resume: bool = True              # resume from the newest valid output_dir/checkpoint-<step>


@dataclass
class ParallelConfig:
    strategy: str = "auto"                # auto (ddp when world > 1) | none | ddp | fsdp | zero1 | zero2
    dp: int = -1                          # -1: world_size / (tp * pp)
    tp: int = 1
    pp: int = 1                           # pipeline stages (micro-batches: the accumulation)
    schedule: str = "1f1b"                # pipeline schedule: gpipe | 1f1b | interleaved
    sequence_parallel: bool = False       # tp > 1: norms and residual sharded on the sequence
    timeout_s: float = 300.0              # a collective waiting longer fails its step; 0: torch's
    init_timeout_s: float = 600.0         # the same for set-up and the first step; 0: torch's


DEFAULT_MAX_STEPS = 300                   # neither max_steps nor num_train_epochs given

_MODES = ("full", "freeze", "lora", "galore", "badam", "prefix")
_PRECISIONS = ("fp32", "bf16", "fp16")
_STRATEGIES = ("auto", "none", "ddp", "fsdp", "zero1", "zero2")
_SCHEDULES = ("gpipe", "1f1b", "interleaved")
_OPTIMS = ("adamw", "adamw_bf16", "adamw8bit")


@dataclass
class TrainConfig:
    model: str = "mini"                   # built-in name (tiny, mini, small, base) or an HF folder
    model_config: typing.Dict[str, typing.Any] = field(default_factory=dict)  # LlamaConfig overrides
    output_dir: str = "runs/default"
    overwrite_output_dir: bool = False    # a fresh run may delete another run's files there
    seed: int = 0
    max_steps: int = -1                   # > 0: the steps (overrides num_train_epochs, as HF's)
    num_train_epochs: float = 0.0         # > 0 with max_steps unset: steps from the data (HF's)
    gradient_accumulation_steps: int = 0  # > 0: global batch = micro x this x dp (HF's name)
    eval_interval: int = 0                # steps between evaluations (and at the end); 0: the end
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune: str = "full"                # full | freeze | lora | galore | badam | prefix
    objective: str = "lm"                 # lm (next token: text, SFT) | dpo | cpo | orpo (pairs)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    cpo: CPOConfig = field(default_factory=CPOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    galore: GaloreConfig = field(default_factory=GaloreConfig)
    badam: BAdamConfig = field(default_factory=BAdamConfig)
    lr: float = 3e-3
    min_lr: typing.Optional[float] = None  # the cosine's floor; None: 0.1 x lr
    betas: typing.List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    micro_batch_size: int = 8
    global_batch_size: int = 0            # 0: micro_batch_size * dp size (x pp under pipelining)
    precision: str = "fp32"               # fp32 | bf16 | fp16 (low precision: fp32 master weights)
    max_grad_norm: float = 1.0            # 0: no clipping
    checkpoint_ratio: float = 0.0         # fraction of decoder layers recomputed in backward
    optimizer_in_backward: bool = False   # step each param as its grad is ready (full, no accum)
    max_bad_steps: int = 3                # consecutive non-finite losses before a rollback
    report_to: str = "none"               # none | tensorboard
    log_interval: int = 10                # plain log lines (the progress bar updates every step)
    device: str = "auto"                  # auto | cpu | cuda
    threads: int = 0                      # torch intra-op threads per process; 0: torch's default
    backend: str = "fastllm"              # fastllm | torch (torch.optim.AdamW fused, PEFT, autocast)
    kernels: str = "fastllm"              # fastllm: fastllm.patch on HF-folder models | none
    torch_compile: bool = False           # torch.compile each decoder layer (HF's name)
    # HF's names too; either given: torch_compile=true. None: torch.compile's default
    torch_compile_backend: typing.Optional[str] = None  # inductor, aot_eager, ...
    torch_compile_mode: typing.Optional[str] = None  # default | reduce-overhead | max-autotune...
    optim: str = "adamw"                  # adamw (fp32 state) | adamw_bf16 | adamw8bit (fastllm)
    track_memory: bool = True             # measure step 1's peak tensor memory on CPU (PeakMemory)
    nan_batches: typing.List[int] = field(default_factory=list)  # fault injection: poisoned steps
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self):
        def need(ok, message):
            if not ok:
                raise ConfigError(f"fastllm train: {message}")
        need(self.finetune in _MODES, f"finetune must be one of {_MODES}, got {self.finetune!r}")
        need(self.precision in _PRECISIONS,
             f"precision must be one of {_PRECISIONS}, got {self.precision!r}")
        need(self.parallel.strategy in _STRATEGIES,
             f"parallel.strategy must be one of {_STRATEGIES}, got {self.parallel.strategy!r}")
        need(self.backend in ("fastllm", "torch"), f"backend must be fastllm or torch, got "
             f"{self.backend!r}")
        need(self.kernels in ("fastllm", "none"), f"kernels must be fastllm or none, got "
             f"{self.kernels!r}")
        need(self.report_to in ("none", "tensorboard"),
             f"report_to must be none or tensorboard, got {self.report_to!r}")
        need(self.max_steps >= 1 or self.max_steps == -1, f"max_steps must be >= 1 (or -1: "
             f"num_train_epochs, else {DEFAULT_MAX_STEPS}), got {self.max_steps}")
        need(self.output_dir.strip() != "", "output_dir is empty: give a folder")
        # the data order and RNG streams seed with seed x 1_000_003 + epoch (64-bit)
        need(0 <= self.seed < 2 ** 32, f"seed must be in [0, 2**32), got {self.seed}")
        need(self.micro_batch_size >= 1, "micro_batch_size must be >= 1")
        need(self.global_batch_size >= 0, "global_batch_size must be >= 0")
        need(0.0 <= self.checkpoint_ratio <= 1.0,
             f"checkpoint_ratio must be in [0, 1], got {self.checkpoint_ratio}")
        need(math.isfinite(self.lr) and self.lr > 0, f"lr must be finite and > 0, got {self.lr}")
        need(self.min_lr is None or 0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr="
             f"{self.lr}] (or null: 0.1 x lr), got {self.min_lr}")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"betas must be two numbers in [0, 1), got {self.betas}")
        need(self.warmup_steps >= 0, "warmup_steps must be >= 0")
        need(self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0: no clipping)")
        need(self.max_bad_steps >= 1, "max_bad_steps must be >= 1")
        need(self.data.seq_len >= 2, "data.seq_len must be >= 2")
        self._validate_sft(need)
        need(self.checkpoint.interval >= 0, "checkpoint.interval must be >= 0")
        need(self.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1")
        need(self.lora.r >= 1 and 0 <= self.lora.dropout < 1, "need lora.r >= 1 and "
             "lora.dropout in [0, 1)")
        validate_values(self, need)
        validate_objective(self, need)
        need(self.parallel.tp >= 1 and self.parallel.pp >= 1, "parallel.tp and pp must be >= 1")
        need(self.parallel.dp >= -1, f"parallel.dp must be >= 1 (or 0 / -1: world_size / (tp * pp)),"
             f" got {self.parallel.dp}")
        need(self.parallel.schedule in _SCHEDULES, f"parallel.schedule must be one of "
             f"{_SCHEDULES}, got {self.parallel.schedule!r}")
        if self.parallel.sequence_parallel:
            need(self.parallel.tp > 1, "parallel.sequence_parallel needs parallel.tp > 1")
            need(self.parallel.pp == 1, "parallel.sequence_parallel is not supported with "
                 "parallel.pp > 1 (the stages exchange whole-sequence activations)")
            need(self.data.seq_len % self.parallel.tp == 0, f"parallel.sequence_parallel needs "
                 f"data.seq_len ({self.data.seq_len}) divisible by parallel.tp "
                 f"({self.parallel.tp})")
        need(self.optim in _OPTIMS, f"optim must be one of {_OPTIMS}, got {self.optim!r}")
        if self.optim != "adamw":
            need(self.backend == "fastllm", f"optim={self.optim} is fastllm's optimizer; "
                 f"backend=torch runs torch.optim.AdamW(fused=True) (use optim=adamw)")
            need(self.finetune in ("full", "freeze", "lora", "prefix"), f"optim={self.optim} "
                 f"does not apply to finetune={self.finetune} (it brings its own optimizer)")
            need(not self.optimizer_in_backward, f"optim={self.optim} is not supported with "
                 f"optimizer_in_backward")
            # The runtime's sharded layouts (FSDP2/DTensor full-state checkpoints, ZeRO's flat
            # shards) do not carry low-byte state (8-bit absmax is per local block).
            need(self.parallel.strategy in ("auto", "none", "ddp") and self.parallel.tp == 1
                 and self.parallel.pp == 1, f"optim={self.optim} runs on plain (unsharded) "
                 f"parameters only: parallel.strategy none/ddp/auto with parallel.tp=1 and "
                 f"parallel.pp=1, got strategy={self.parallel.strategy} tp={self.parallel.tp} "
                 f"pp={self.parallel.pp}")
        if self.finetune in ("galore", "badam"):
            # Their optimizers step whole, unsharded matrices (GaLore projects a weight's
            # gradient, BAdam swaps blocks in and out): ZeRO's DistributedOptimizer, which also
            # reduces the grads, is not theirs, FSDP/tensor-parallel shards would be projected
            # or checkpointed shard by shard.
            need(self.parallel.strategy in ("auto", "none", "ddp") and self.parallel.tp == 1,
                 f"finetune={self.finetune} runs on plain (unsharded) parameters: "
                 f"parallel.strategy none/ddp/auto with parallel.tp=1, got "
                 f"strategy={self.parallel.strategy} tp={self.parallel.tp}")
        if self.finetune == "lora" and self.backend == "torch" and self.parallel.strategy == "fsdp":
            # (PEFT's save_pretrained also writes the frozen base weight of an adapted
            # embed_tokens / lm_head, which FSDP2 holds in shards: the first checkpoint failed)
            embedding = [t for t in self.lora.target_modules
                         if t.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")]
            need(not embedding, f"finetune=lora with backend=torch and parallel.strategy=fsdp "
                 f"cannot save an adapter of {embedding} (PEFT writes its frozen base weight, "
                 f"held in FSDP2's shards): use backend=fastllm or parallel.strategy=ddp")
        # (ZeRO is fastllm's DistributedOptimizer, which also reduces the grads: torch's AdamW
        # in its place trained each rank on its own grads, unsynchronised)
        need(self.parallel.strategy not in ("zero1", "zero2") or self.backend == "fastllm",
             f"parallel.strategy={self.parallel.strategy} is fastllm's DistributedOptimizer: it "
             f"runs with backend=fastllm (backend=torch: parallel.strategy=ddp or fsdp)")
        if self.parallel.tp > 1:
            # (tensor parallel shards data parallel with FSDP2, as pp does: another strategy
            # was ignored; torch's fused AdamW refuses the mix of DTensor and plain params)
            need(self.parallel.strategy in ("auto", "fsdp"), f"parallel.tp > 1 shards data "
                 f"parallel with FSDP2: parallel.strategy must be auto or fsdp, got "
                 f"{self.parallel.strategy}")
            need(self.backend == "fastllm", "parallel.tp > 1 runs with backend=fastllm (torch's "
                 "fused AdamW refuses the mix of sharded and plain params)")
            # (fastllm.parallel refuses it when it shards the layers: after the run started)
            need(not (self.finetune == "lora" and self.lora.use_dora), "lora.use_dora=true with "
                 "parallel.tp > 1: a DoRA magnitude needs the whole weight's row norms; train "
                 "DoRA with parallel.tp=1 (parallel.strategy=fsdp or zero2 shard it)")
        if self.parallel.pp > 1:
            need(self.finetune in ("full", "freeze", "lora"), f"parallel.pp > 1 trains "
                 f"finetune=full, freeze or lora, got finetune={self.finetune}")
            need(self.backend == "fastllm" and self.precision != "fp16", "parallel.pp > 1 runs "
                 "with backend=fastllm and precision fp32 or bf16")
            need(self.parallel.strategy in ("auto", "fsdp"), f"parallel.pp > 1 shards data "
                 f"parallel with FSDP2: parallel.strategy must be auto or fsdp, got "
                 f"{self.parallel.strategy}")
        if self.optimizer_in_backward:
            need(self.finetune == "full" and self.backend == "fastllm",
                 "optimizer_in_backward is for finetune=full with backend=fastllm")
            need(self.max_grad_norm == 0, "optimizer_in_backward steps each param before the "
                 "global grad norm exists: set max_grad_norm=0")
            need(self.precision != "fp16", "optimizer_in_backward does not do fp16 loss scaling")
            # Each micro-batch's backward would step every parameter on its share of the grad:
            # nothing accumulates (HF's and torchtitan's optimizer-in-backward refuse it too).
            need(self.gradient_accumulation_steps <= 1 and self.global_batch_size in (
                0, self.micro_batch_size), f"optimizer_in_backward steps inside every backward "
                 f"and cannot accumulate gradients: set gradient_accumulation_steps=1 and "
                 f"global_batch_size=0 (got gradient_accumulation_steps="
                 f"{self.gradient_accumulation_steps}, global_batch_size={self.global_batch_size},"
                 f" micro_batch_size={self.micro_batch_size})")
        return self

    def uses_cuda(self):
        """Whether the run trains on a GPU: device=cuda, or auto with one available."""
        import torch

        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def check_files(self):
        """Refuse a data.tokenizer, data.path, data.eval_path or eval.prompts_file naming no file
        or folder here (a typo), and a trained BPE on a pretrained model, before the run writes
        anything (validate() checks values only: a config may be written before its files)."""
        def need(ok, message):
            if not ok:
                raise ConfigError(f"fastllm train: {message}")
        tok = self.data.tokenizer
        need(tok in ("byte", "bpe") or os.path.isdir(tok), f"data.tokenizer={tok!r} is neither "
             f"byte, bpe nor a folder (a tokenizer's or a model's)")
        need(not (tok == "bpe" and os.path.isdir(self.model)), f"data.tokenizer=bpe trains a new "
             f"vocabulary, which model={self.model}'s embeddings do not fit; leave data.tokenizer "
             f"unset (the model folder's own tokenizer) or name a tokenizer folder")
        for key, path in (("data.path", self.data.path), ("data.eval_path", self.data.eval_path),
                          ("eval.prompts_file", self.eval.prompts_file)):
            need(path is None or os.path.exists(path), f"{key}={path} does not exist")
        # model and tokenizer folders kept as absolute paths: the run's config.yaml names them
        # for fastllm export and generate, run from anywhere (a relative one was looked up from
        # their working directory, and another folder of that name there would be used)
        if os.path.isdir(self.model):
            self.model = os.path.abspath(self.model)
        if tok not in ("byte", "bpe"):
            self.data.tokenizer = os.path.abspath(tok)
        return self

    def resolved_max_steps(self, num_sequences, global_batch):
        """max_steps when set (> 0: it overrides num_train_epochs, as HF's does), else the steps
        num_train_epochs take over num_sequences, else DEFAULT_MAX_STEPS. Every step is a whole
        global batch: an epoch whose rows do not fill its last step takes the next epoch's
        first rows there (torch's DistributedSampler pads so); data of fewer rows than one
        global batch is refused (fastllm.train.sft_data.check_rows)."""
        if self.max_steps > 0:
            return self.max_steps
        if not self.num_train_epochs:
            return DEFAULT_MAX_STEPS
        return max(1, math.ceil(self.num_train_epochs * num_sequences / global_batch))

    def resolved_global_batch(self, layout):
        """global_batch_size when set; else micro_batch_size x gradient_accumulation_steps x dp
        (HF's per_device x accumulation x world: under pipeline parallel these are the
        pipeline's micro-batches, not pp times as many); else layout's default (one micro-batch
        per data-parallel rank, times pp under pipelining)."""
        if self.global_batch_size:
            return self.global_batch_size
        if self.gradient_accumulation_steps:
            return self.micro_batch_size * self.gradient_accumulation_steps * layout.dp
        return layout.default_global_batch(self.micro_batch_size)

    @property
    def resolved_min_lr(self):
        """min_lr, or 0.1 x lr where it is left null."""
        return 0.1 * self.lr if self.min_lr is None else self.min_lr

    def _validate_sft(self, need):
        need(self.data.format in ("auto", "text", "jsonl"),
             f"data.format must be auto, text or jsonl, got {self.data.format!r}")
        need(self.data.format != "jsonl" or self.data.path,
             "data.format=jsonl reads JSONL (SFT) examples from data.path: give data.path (a "
             ".jsonl/.json file or a folder of them)")
        need(0.0 <= self.data.eval_fraction < 1.0,
             f"data.eval_fraction must be in [0, 1), got {self.data.eval_fraction}")
        need(not (self.data.eval_path and self.data.eval_fraction),
             "give data.eval_path or data.eval_fraction, not both")
        if self.data.eval_path or self.data.eval_fraction:
            from fastllm.train.sft_data import data_format

            # a held-out set is made of JSONL examples; text windows have no split
            fmt = data_format(self.data.path, self.data.format)
            need(fmt == "jsonl", f"data.eval_path and data.eval_fraction hold out JSONL (SFT) "
                 f"examples; data.path={self.data.path} is {fmt} data (use a .jsonl/.json file or "
                 f"data.format=jsonl, or drop them)")
        need(self.eval_interval >= 0 and self.eval.max_new_tokens >= 1 and self.eval.batches >= 0,
             "need eval_interval >= 0, eval.max_new_tokens >= 1 and eval.batches >= 0")
        need(math.isfinite(self.num_train_epochs) and self.num_train_epochs >= 0,
             f"num_train_epochs must be finite and >= 0, got {self.num_train_epochs}")
        need(self.gradient_accumulation_steps >= 0, "gradient_accumulation_steps must be >= 0")
        need(not (self.gradient_accumulation_steps and self.global_batch_size),
             "give global_batch_size or gradient_accumulation_steps, not both")
        if self.finetune == "prefix":
            need(self.prefix.num_virtual_tokens >= 1 and self.prefix.encoder_hidden_size >= 0,
                 "need prefix.num_virtual_tokens >= 1 and prefix.encoder_hidden_size >= 0")
            need(self.backend == "fastllm" and self.parallel.tp == 1 and self.parallel.pp == 1,
                 "finetune=prefix runs with backend=fastllm and parallel.tp = parallel.pp = 1")
            # a checkpointed transformers layer drops the KV cache the prefix rides in (PEFT
            # refuses prefix tuning with gradient checkpointing too)
            need(self.checkpoint_ratio == 0, f"finetune=prefix does not work with activation "
                 f"checkpointing (checkpoint_ratio={self.checkpoint_ratio}): a checkpointed layer "
                 f"drops the KV cache that holds the prefix; set checkpoint_ratio=0")
        if self.eval_interval or self.eval.prompts or self.eval.prompts_file:
            need(self.parallel.pp == 1, "evaluation (eval_interval, eval.prompts) does not run "
                 "under parallel.pp > 1")

    # ----- reading and writing -----

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        cfg = cls()
        _update(cfg, hf_names(data), "")
        return cfg

    def save(self, directory, name="config.yaml"):
        import yaml

        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path):
        import yaml

        with open(path) as f:
            data = yaml.load(f, Loader=_unique_keys_loader(yaml)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"fastllm train: {path} must hold a mapping, got "
                              f"{type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_args(cls, overrides=(), config_path=None):
        """The config file (if any), then each `dotted.key=value` in order."""
        cfg = cls.load(config_path) if config_path else cls()
        spelled = {}  # fastllm's key -> how the command line named it (a later value wins)
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"fastllm train: expected key=value, got {item!r}")
            key = key.strip()
            first = spelled.setdefault(HF_NAMES.get(key, key), key)
            if first != key:  # as a config file giving both names is refused
                raise ConfigError(f"fastllm train: {key} and {first} are the same key; give one")
            cfg.set(key, value)
        return cfg.validate()

    def set(self, dotted, text):
        """Set one field from its command-line text, converted to the field's type."""
        dotted = HF_NAMES.get(dotted, dotted)
        *parents, leaf = dotted.split(".")
        target, path = self, ""
        for part in parents:
            if isinstance(target, dict):
                target = target.setdefault(part, {})
                continue
            if not dataclasses.is_dataclass(target) or part not in _field_names(target):
                raise ConfigError(f"fastllm train: unknown config key {dotted!r}")
            target = getattr(target, part)
            path += part + "."
        if isinstance(target, dict):
            target[leaf] = _parse_free(text)
            return
        if leaf not in _field_names(target):
            known = ", ".join(path + n for n in _field_names(target))
            raise ConfigError(f"fastllm train: unknown config key {dotted!r}; known: {known}")
        current = getattr(target, leaf)
        setattr(target, leaf, _convert(dotted, text, current, _field_type(target, leaf)))


def _unique_keys_loader(yaml):
    """A SafeLoader that refuses a key given twice in one mapping (yaml.safe_load keeps the last
    silently: a second `lora:` section would drop the first), naming the key and its lines."""

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, collections.abc.Hashable):
                    continue  # SafeLoader's own error names it
                if key in seen:
                    raise ConfigError(f"fastllm train: {key_node.start_mark.name}: key {key!r} "
                                      f"is given twice (lines {seen[key]} and {line})")
                seen[key] = line
            return super().construct_mapping(node, deep)

    return UniqueKeys


# Hugging Face TrainingArguments names -> fastllm's, where the concept is the same
# (gradient_accumulation_steps and num_train_epochs are fields of their own)
HF_NAMES = {"learning_rate": "lr", "per_device_train_batch_size": "micro_batch_size",
            "eval_steps": "eval_interval", "save_steps": "checkpoint.interval",
            "logging_steps": "log_interval", "save_total_limit": "checkpoint.keep_last"}


def hf_names(data):
    """A config mapping with HF_NAMES' top-level keys renamed to fastllm's (nested where the
    fastllm name is dotted); a key given both ways is refused."""
    if not isinstance(data, dict):
        return data
    out = {k: v for k, v in data.items() if k not in HF_NAMES}
    for key, value in data.items():
        if key not in HF_NAMES:
            continue
        *parents, leaf = HF_NAMES[key].split(".")
        target = out
        for part in parents:
            target[part] = dict(target.get(part) or {})
            target = target[part]
        if leaf in target:
            raise ConfigError(f"fastllm train: {key} is {HF_NAMES[key]}; give one of them")
        target[leaf] = value
    return out
