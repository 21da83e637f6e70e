"""fastllm.train.Trainer: the training loop, read top to bottom in the order things happen.

    from fastllm.train import Trainer, TrainConfig
    summary = Trainer(TrainConfig(max_steps=100, output_dir="runs/a")).train()

Data, model, mode, optimizer and schedule are built from one TrainConfig; each step runs
accumulation micro-batches, checks the loss across ranks (a non-finite loss skips the step;
max_bad_steps in a row roll back to the last checkpoint and the offending batches are skipped),
steps the optimizer, logs a metrics line and checkpoints every checkpoint.interval steps.
SIGTERM/SIGINT finish the step, save a checkpoint and return. Under torchrun the same code
trains data parallel, and with parallel.tp / parallel.pp tensor and pipeline parallel (the
accumulation micro-batches then run through a torch.distributed.pipelining schedule); a
checkpoint (one process's layout) resumes at any world size and layout.
"""

import math
import os
import random
import resource
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from fastllm.train import checkpoint as ckpt
from fastllm.train import faults, run_dir, watchdog
from fastllm.train.config import TrainConfig
from fastllm.train.memory import PeakMemory
from fastllm.train.data import Loader, PackedDataset, build_tokenizer, load_text, tokenize_to_file
from fastllm.train.metrics import MetricsWriter, format_summary, read_metrics, summarize
from fastllm.train.model import (_parallelize, apply_activation_checkpointing, apply_finetune,
                                 build_model, build_pipeline, data_parallel_size, decoder_layers,
                                 global_batch_size, unwrap)

__all__ = ["Trainer", "lr_at"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# optim= -> the optimizer state's dtype (fastllm.optim.convert_state's state_dtype)
_STATE_DTYPES = {"adamw": torch.float32, "adamw_bf16": torch.bfloat16, "adamw8bit": torch.uint8}


def _pipeline_loss(logits, input_ids):
    """transformers' causal LM loss (mean token cross-entropy of the next token, in fp32) from
    the last stage's logits (batch, seq, vocab) and the micro-batch's input_ids (batch, seq)."""
    from fastllm.parallel.loss import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits[:, :-1], input_ids[:, 1:])


def _decay_split(module):
    """module's trainable parameters as (decayed, not decayed) lists of (name, param): matrices
    and embeddings are decayed, vectors (norms, biases) not; each in model order."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in named if p.ndim >= 2], [(n, p) for n, p in named if p.ndim < 2]


def _state_dtype_of(optim_state):
    """The moments' dtype of an AdamW-style optimizer state_dict: uint8 (8-bit), bf16 or fp32;
    None for other layouts (GaLore/BAdam, per-parameter optimizers)."""
    if not isinstance(optim_state, dict) or "state" not in optim_state:
        return None
    if optim_state.get("fastllm_lowbyte") is not None:
        return torch.uint8
    for entry in optim_state["state"].values():
        avg = entry.get("exp_avg") if isinstance(entry, dict) else None
        if isinstance(avg, torch.Tensor):
            return avg.dtype if avg.dtype == torch.bfloat16 else torch.float32
    return torch.float32


def lr_at(cfg, step):
    """The learning rate of optimizer step `step` (1-based): linear warmup over warmup_steps, then
    cosine decay from lr to min_lr at max_steps."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.resolved_min_lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class _CommTimer:
    """A DDP comm hook (plain all-reduce, as DDP's default) that notes when the last bucket
    launched; backward's end minus that is the communication backward could not hide."""

    def __init__(self, group=None):
        self.group = group
        self.last_launch = None

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.last_launch = time.perf_counter()
        return default_hooks.allreduce_hook(self.group, bucket)


class Trainer:
    def __init__(self, cfg=None, log=None):
        self.cfg = (cfg or TrainConfig()).validate()
        self._log = log
        self._owns_pg = False
        self._stop_signal = None
        self._poisoned = False

    # ----- set-up -----

    def _setup_distributed(self):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        want_cuda = self.cfg.device == "cuda" or (self.cfg.device == "auto"
                                                  and torch.cuda.is_available())
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if want_cuda else "gloo",
                                    timeout=watchdog.pg_timeout(self.cfg))
            self._owns_pg = True
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # tensor and pipeline ranks share their batch: the batch is split over dp only
        self.dp_size = data_parallel_size(self.cfg, self.world)
        if want_cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)

    def log(self, text):
        if self.rank == 0:
            (self._log or (lambda t: print(t, file=sys.stderr, flush=True)))(text)

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    def _build_data(self):
        cfg = self.cfg
        from fastllm.train.model import is_model_dir

        model_dir = cfg.model if is_model_dir(cfg.model) else None
        docs = load_text(cfg.data.path)
        # Rank 0 tokenizes (and trains a BPE) first; the others then find the cached files.
        for turn in ((0,) if self.world == 1 else (0, 1)):
            if (self.rank == 0) == (turn == 0):
                tok = build_tokenizer(cfg.data.tokenizer, docs, cfg.data.vocab_size,
                                      cfg.data.cache_dir, model_dir)
                path = tokenize_to_file(docs, tok, cfg.data.cache_dir)
            self._barrier()
        self.tokenizer = tok
        self.dataset = PackedDataset(path, cfg.data.seq_len, cfg.seed)
        self.global_batch = global_batch_size(cfg, self.dp_size)

    def _build_model(self):
        cfg = self.cfg
        low = cfg.precision != "fp32"
        # fastllm: low-precision params with fp32 master weights in the optimizer; torch: fp32
        # params under autocast.
        dtype = _DTYPES[cfg.precision] if cfg.backend == "fastllm" else torch.float32
        model = build_model(cfg, self.tokenizer.vocab_size, dtype)
        model = apply_finetune(model, cfg)
        model.to(self.device)
        model.train()
        self.n_checkpointed = apply_activation_checkpointing(model, cfg.checkpoint_ratio)
        self.n_layers = len(decoder_layers(model))
        self.pipeline = None
        if cfg.parallel.pp > 1:
            # The whole model's trainable names in one process's optimizer order, taken before
            # the model is cut into stages: the index layout of optimizer.pt, so that a pipeline
            # checkpoint resumes in any layout (stages keep the full model's names).
            decay, no_decay = _decay_split(model)
            self.model_param_names = [n for n, _ in decay + no_decay]
            self.model_n_decay = len(decay)
            self.pipeline = build_pipeline(model, cfg, self.world, self.device, self._stage_loss)
            self.model, self.strategy = self.pipeline.module, "pipeline"
        else:
            self.model, self.strategy = _parallelize(model, cfg, self.world, self.device)
        self.module = unwrap(self.model)
        self.autocast = (torch.autocast(self.device.type, dtype=_DTYPES[cfg.precision])
                         if low and cfg.backend == "torch" else None)
        self.comm_timer = None
        if self.strategy == "ddp":
            self.comm_timer = _CommTimer()
            self.model.register_comm_hook(None, self.comm_timer.hook)
        if cfg.optimizer_in_backward and self.strategy != "none":
            raise ValueError("fastllm train: optimizer_in_backward runs on one process only")

    def _param_groups(self):
        decay, no_decay = _decay_split(self.module)
        if not decay and not no_decay:
            raise ValueError(f"fastllm train: finetune={self.cfg.finetune} left no trainable "
                             f"parameters")
        self.param_names = [n for n, _ in decay + no_decay]
        self.n_decay = len(decay)
        return [{"params": [p for _, p in decay], "weight_decay": self.cfg.weight_decay},
                {"params": [p for _, p in no_decay], "weight_decay": 0.0}]

    def _build_optimizer(self):
        cfg = self.cfg
        groups = self._param_groups()
        kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        clip = cfg.max_grad_norm or None
        self.loss_scaler = None
        self.grad_scaler = None
        if cfg.backend == "torch":
            self.optimizer = torch.optim.AdamW(groups, fused=True, **kw)
            if cfg.precision == "fp16":
                self.grad_scaler = torch.amp.GradScaler(self.device.type)
            return
        import fastllm
        from fastllm.amp import LossScaler

        if cfg.precision == "fp16":
            self.loss_scaler = LossScaler()
        # Under pipeline parallel each rank holds some layers: the step clips by the norm over
        # all stages (fastllm.parallel.clip_grad_norm_), not inside the optimizer.
        opt_kw = dict(kw, master_weights=cfg.precision != "fp32",
                      max_grad_norm=None if self.pipeline is not None else clip,
                      loss_scaler=self.loss_scaler)
        adamw = fastllm.optim.AdamW8bit if cfg.optim == "adamw8bit" else fastllm.optim.AdamW
        if cfg.optim == "adamw_bf16":
            opt_kw["state_dtype"] = torch.bfloat16
        if cfg.finetune in ("galore", "badam"):
            self.optimizer = _compression_optimizer(cfg, self.model, groups, opt_kw)
        elif self.strategy in ("zero1", "zero2"):
            try:
                from fastllm.distributed import DistributedOptimizer
            except ImportError:
                raise NotImplementedError(
                    f"fastllm train: parallel.strategy={self.strategy} needs "
                    f"fastllm.distributed.DistributedOptimizer, which this install does not "
                    f"have; use ddp or fsdp") from None
            if self.world == 1:
                raise ValueError(f"fastllm train: parallel.strategy={self.strategy} needs "
                                 f"torchrun with more than one process")
            # One param group (weight decay on every param): DistributedOptimizer's layout. The
            # loop reads params only in forward and state_dict, which wait: overlap is safe.
            opt_kw.pop("master_weights")
            self.optimizer = DistributedOptimizer(
                self.model, optimizer_class=fastllm.optim.AdamW, stage=int(self.strategy[-1]),
                weight_decay=cfg.weight_decay, overlap_param_gather=True, **opt_kw)
        elif cfg.optimizer_in_backward:
            self.optimizer = _InBackwardOptimizer(groups, opt_kw)
        else:
            self.optimizer = adamw(groups, **opt_kw)

    def _stage_loss(self, logits, input_ids):
        loss = _pipeline_loss(logits, input_ids)
        return loss * float("nan") if self._poisoned else loss

    # ----- checkpoints -----

    def _state(self):
        """Everything a resume needs besides the model and optimizer tensors."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        rngs = [rng]
        if self.world > 1:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, rng)
        return {
            "step": self.step,
            "data": {"position": self.position, "global_batch": self.global_batch},
            "schedule": {"kind": "warmup_cosine", "step": self.step},
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "rng": rngs,
            "world_size": self.world,
            "counters": {"skipped": self.skipped_total, "bad_in_a_row": self.bad_in_a_row,
                         "rollbacks": self.rollbacks},
        }

    def _model_state(self):
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)

            return get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def _optimizer_state(self):
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_optimizer_state_dict)

            full = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
            if self.rank != 0:  # the full state is gathered on rank 0 only
                return None
            index = {n: i for i, n in enumerate(self.param_names)}
            state = {index[k]: v for k, v in full["state"].items()}
            groups = [dict(g, params=[index[n] for n in g["params"]])
                      for g in full["param_groups"]]
            return {"state": state, "param_groups": groups}
        return self.optimizer.state_dict()

    def _pipeline_states(self):
        """(model state, optimizer state) of the whole model in one process's layout on rank 0,
        (None, None) elsewhere: each stage's full state (gathered over its dp and tp ranks by
        DCP's get_*_state_dict), then the stages' states gathered to rank 0 over the pipeline."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)

        pipe = self.pipeline
        opts = StateDictOptions(full_state_dict=True)
        msd = get_model_state_dict(self.model, options=opts)
        osd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if pipe.dp[0] != 0 or pipe.tp_rank != 0:  # a copy of what a dp 0, tp 0 rank holds
            return None, None

        def cpu(t):
            return t.detach().cpu() if isinstance(t, torch.Tensor) else t

        mine = {"model": {k: cpu(v) for k, v in msd.items()},
                "state": {k: {kk: cpu(vv) for kk, vv in v.items()}
                          for k, v in osd["state"].items()},
                "groups": osd["param_groups"]}
        parts = [None] * pipe.pp if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=pipe.pp_group)
        if self.rank != 0:
            return None, None
        model_state, state, hyper = {}, {}, {}
        for part in parts:
            model_state.update(part["model"])
            state.update(part["state"])
            for g in part["groups"]:
                for n in g["params"]:
                    hyper[n] = {k: v for k, v in g.items() if k != "params"}
        names, nd = self.model_param_names, self.model_n_decay
        index = {n: i for i, n in enumerate(names)}
        groups = [dict(hyper[names[0]], params=list(range(nd)))]
        if nd < len(names):
            groups.append(dict(hyper[names[nd]], params=list(range(nd, len(names)))))
        return model_state, {"state": {index[n]: v for n, v in state.items()},
                             "param_groups": groups}

    def _load_pipeline(self, model_state, optim_state):
        """Load this rank's stage(s) from a checkpoint in one process's layout."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        local = set(self.model.state_dict())
        set_model_state_dict(self.model, {k: v for k, v in model_state.items() if k in local},
                             options=opts)
        names, mine = self.model_param_names, set(self.param_names)
        n_saved = sum(len(g["params"]) for g in optim_state["param_groups"])
        if n_saved != len(names):
            raise ValueError(f"fastllm train: the checkpoint's optimizer holds {n_saved} "
                             f"parameters, this model {len(names)}")
        fqn = {"state": {names[i]: v for i, v in optim_state["state"].items() if names[i] in mine},
               "param_groups": [dict(g, params=[names[i] for i in g["params"] if names[i] in mine])
                                for g in optim_state["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, fqn, options=opts)

    def _convert_optimizer_state(self, optim_state, path):
        """A checkpoint saved with another optim= (fp32, bf16 or 8-bit moments) converted to
        this run's (fastllm.optim.convert_state): a run can switch optim at a checkpoint."""
        want = torch.float32 if self.cfg.backend == "torch" else _STATE_DTYPES[self.cfg.optim]
        have = _state_dtype_of(optim_state)
        if have is None or have == want:
            return optim_state
        from fastllm.optim import convert_state

        kw = {}
        if want == torch.uint8:
            kw = dict(block_size=self.optimizer.block_size,
                      min_8bit_size=self.optimizer.min_8bit_size)
        self.log(f"fastllm train: {path} holds {have} optimizer moments; converting them to "
                 f"{want} for optim={self.cfg.optim}")
        return convert_state(optim_state, want, **kw)

    def save_checkpoint(self):
        cfg = self.cfg
        state = self._state()
        if self.pipeline is not None:
            model_state, optim_state = self._pipeline_states()
        else:
            # First: DistributedOptimizer.state_dict also finishes its pending parameter all-gather.
            optim_state = self._optimizer_state()
            model_state = self._model_state()
        if self.rank == 0:
            writers = {
                "trainer_state.pt": lambda p: ckpt.save_file(state, p),
                "optimizer.pt": lambda p: ckpt.save_file(optim_state, p),
                "config.yaml": lambda p: cfg.save(os.path.dirname(p), os.path.basename(p)),
            }
            if cfg.finetune == "lora":
                writers["adapter"] = self._save_adapter
            else:
                writers["model.pt"] = lambda p: ckpt.save_file(model_state, p)
            path = ckpt.save(cfg.output_dir, self.step, writers)
            ckpt.prune(cfg.output_dir, cfg.checkpoint.keep_last, keep=path)
            self.log(f"fastllm train: saved {path}")
        self._barrier()
        self.last_saved = self.step

    def _save_adapter(self, path):
        if self.cfg.backend == "torch":
            self.module.save_pretrained(path)
            return
        from fastllm.lora import save_adapter

        save_adapter(self.module, path, task_type="CAUSAL_LM")

    def _load_adapter(self, path):
        from safetensors.torch import load_file

        if self.cfg.backend == "torch":
            import peft

            peft.set_peft_model_state_dict(
                self.module, load_file(os.path.join(path, "adapter_model.safetensors")))
            return
        from fastllm.lora import load_adapter

        load_adapter(self.module, path)

    def load_checkpoint(self, path):
        """Restore model, optimizer, schedule, scalers, data position, RNG and counters."""
        cfg = self.cfg
        state = ckpt.load_file(os.path.join(path, "trainer_state.pt"))
        optim_state = ckpt.load_file(os.path.join(path, "optimizer.pt"))
        optim_state = self._convert_optimizer_state(optim_state, path)
        if self.pipeline is not None:
            self._load_pipeline(ckpt.load_file(os.path.join(path, "model.pt")), optim_state)
        elif cfg.finetune == "lora":
            self._load_adapter(os.path.join(path, "adapter"))
        else:
            model_state = ckpt.load_file(os.path.join(path, "model.pt"))
            if self.strategy == "fsdp":
                from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                     set_model_state_dict)

                set_model_state_dict(self.model, model_state,
                                     options=StateDictOptions(full_state_dict=True))
            else:
                self.module.load_state_dict(model_state)
        if self.pipeline is not None:
            pass  # loaded with the model by _load_pipeline
        elif self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_optimizer_state_dict)

            fqn = {"state": {self.param_names[i]: v for i, v in optim_state["state"].items()},
                   "param_groups": [dict(g, params=[self.param_names[i] for i in g["params"]])
                                    for g in optim_state["param_groups"]]}
            set_optimizer_state_dict(self.model, self.optimizer, fqn,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(optim_state)
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.grad_scaler is not None and state["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if state["data"]["global_batch"] != self.global_batch:
            raise ValueError(f"fastllm train: {path} was trained with global_batch_size="
                             f"{state['data']['global_batch']}, this run has "
                             f"{self.global_batch}; keep the global batch to resume")
        self.step = state["step"]
        self.position = state["data"]["position"]
        counters = state["counters"]
        self.skipped_total, self.bad_in_a_row = counters["skipped"], counters["bad_in_a_row"]
        self.rollbacks = counters["rollbacks"]
        rngs = state["rng"]
        if len(rngs) == self.world:
            rng = rngs[self.rank]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        else:
            # Another world size: per-rank streams cannot be carried over; a fresh stream per rank.
            torch.manual_seed(cfg.seed * 7919 + self.rank + 1_000_003 * self.step)
            random.seed(cfg.seed + self.rank + self.step)
        self.last_saved = self.step

    # ----- the loop -----

    def _install_signal_handlers(self):
        self._old_handlers = {}
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self._stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self):
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)

    def _forward_backward(self, micro, step_index):
        """Forward and backward over this rank's micro-batches. Returns (summed loss, exposed
        communication seconds)."""
        if self.pipeline is not None:
            return self._pipeline_forward_backward(micro, step_index)
        accum = len(micro)
        loss_sum = torch.zeros((), dtype=torch.float64)
        exposed = 0.0
        poisoned = step_index in self._nan_batches
        for m, (_, ids) in enumerate(micro):
            ids = ids.to(self.device, non_blocking=True)
            last = m == accum - 1
            sync = _nullcontext()
            if not last and self.strategy == "ddp":
                sync = self.model.no_sync()
            elif not last and self.strategy in ("zero1", "zero2"):
                sync = self.optimizer.no_sync()
            with sync:
                if self.autocast is not None:
                    with self.autocast:
                        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
                else:
                    loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
                if poisoned:
                    loss = loss * float("nan")
                loss_sum += loss.detach().double().cpu()
                scaled = loss / accum
                if self.loss_scaler is not None:
                    scaled = self.loss_scaler.scale(scaled)
                elif self.grad_scaler is not None:
                    scaled = self.grad_scaler.scale(scaled)
                if self.comm_timer is not None:
                    self.comm_timer.last_launch = None
                scaled.backward()
                end = time.perf_counter()
                if last and self.comm_timer is not None and self.comm_timer.last_launch:
                    exposed += end - self.comm_timer.last_launch
        return loss_sum, exposed

    def _pipeline_forward_backward(self, micro, step_index):
        """One run of the pipeline schedule over this step's micro-batches (the accumulation
        micro-batches: torch splits the concatenated batch back into them). The last stage
        holds the losses; returns (their sum, 0.0): the pipeline's sends and receives are not
        timed apart from its compute."""
        pipe = self.pipeline
        ids = torch.cat([m for _, m in micro]).to(self.device, non_blocking=True)
        self._poisoned = step_index in self._nan_batches
        losses = []
        if pipe.first:
            pipe.schedule.step(ids)
        elif pipe.last:
            pipe.schedule.step(target=ids, losses=losses)
        else:
            pipe.schedule.step()
        loss_sum = torch.zeros((), dtype=torch.float64)
        for loss in losses:
            loss_sum += loss.detach().double().cpu()
        return loss_sum, 0.0

    def _optimizer_step(self):
        """Clip (inside fastllm's AdamW), step, zero the grads. Returns (grad_norm, skipped)."""
        cfg = self.cfg
        grad_norm = None
        if cfg.backend == "torch":
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(self.optimizer)
            if cfg.max_grad_norm:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(
                    [p for g in self.optimizer.param_groups for p in g["params"]],
                    cfg.max_grad_norm))
            skipped = False
            if self.grad_scaler is not None:
                scale = self.grad_scaler.get_scale()
                self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
                skipped = self.grad_scaler.get_scale() < scale
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, skipped
        if self.pipeline is not None:
            from fastllm.parallel.clip import clip_grad_norm_

            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            norm = clip_grad_norm_(params, cfg.max_grad_norm or None, self.pipeline.pp_group)
            grad_norm = float(norm)
            if not math.isfinite(grad_norm):  # as fastllm AdamW's own clipping: a no-op step
                self.optimizer.zero_grad(set_to_none=True)
                return grad_norm, True
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        self.optimizer.step()
        norm = getattr(self.optimizer, "grad_norm", None)
        grad_norm = float(norm) if norm is not None else None
        skipped = bool(getattr(self.optimizer, "step_skipped", False))
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _rollback(self):
        found = ckpt.latest_valid(self.cfg.output_dir, log=self.log) if self.rank == 0 else None
        if self.world > 1:
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        if found is None:
            raise RuntimeError(f"fastllm train: {self.bad_in_a_row} non-finite losses in a row "
                               f"(max_bad_steps={self.cfg.max_bad_steps}) and no checkpoint in "
                               f"{self.cfg.output_dir} to roll back to")
        position = self.position
        skipped, rollbacks = self.skipped_total, self.rollbacks
        self.load_checkpoint(found[1])
        # Keep going from where the data is: the batches that gave non-finite losses are skipped.
        self.position = position
        self.skipped_total, self.rollbacks, self.bad_in_a_row = skipped, rollbacks + 1, 0
        self.loader.reset(self.position)
        self.log(f"fastllm train: rolled back to {found[1]} (step {self.step}); data continues "
                 f"at sample {self.position}")

    def _peak_memory(self, tracker):
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if tracker is not None:
            return int(tracker.peak)
        if self._tracked_peak is not None:
            return self._tracked_peak
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def train(self):
        """Run to cfg.max_steps (or a stop signal). Returns the run summary (a dict)."""
        self._setup_distributed()
        self._run_lock = None
        try:
            return self._train()
        finally:
            run_dir.release(self._run_lock)
            loader = getattr(self, "loader", None)
            if loader is not None:
                loader.close()
            if self._owns_pg and dist.is_initialized():
                dist.destroy_process_group()

    def _train(self):
        cfg = self.cfg
        if self.rank == 0:
            self._run_lock = run_dir.prepare(cfg, self.log)
            cfg.save(cfg.output_dir)
        self._barrier()
        self._build_data()
        self._build_model()
        self._build_optimizer()
        torch.manual_seed(cfg.seed * 7919 + self.rank)
        random.seed(cfg.seed + self.rank)
        self.step, self.position = 0, 0
        self.skipped_total = self.bad_in_a_row = self.rollbacks = 0
        self.last_saved = None
        self._nan_batches = set(cfg.nan_batches)
        self._tracked_peak = None
        resumed = None
        if cfg.checkpoint.auto_resume:
            found = ckpt.latest_valid(cfg.output_dir, log=self.log) if self.rank == 0 else None
            if self.world > 1:
                box = [found]
                dist.broadcast_object_list(box, src=0)
                found = box[0]
            if found is not None:
                self.load_checkpoint(found[1])
                resumed = found[1]
                self.log(f"fastllm train: resumed from {resumed} (step {self.step}, sample "
                         f"{self.position})")
                if self.step >= cfg.max_steps:
                    self.log(f"fastllm train: {cfg.output_dir} is already at max_steps="
                             f"{cfg.max_steps}; raise max_steps or pick another output_dir to "
                             f"train more")
        # the ranks of one tensor-parallel group, and the stages of one pipeline, read the same
        # batch
        if self.pipeline is not None:
            dp_rank, dp_world = self.pipeline.dp
        else:
            dp_rank, dp_world = getattr(self.module, "_fastllm_dp", (self.rank, self.world))
        if dp_world != self.dp_size:
            raise RuntimeError(f"fastllm train: the model is split over {dp_world} data-parallel "
                               f"ranks, the batch over {self.dp_size}")
        self.loader = Loader(self.dataset, dp_rank, dp_world, cfg.micro_batch_size,
                             self.global_batch, cfg.data.prefetch, self.position)
        # this rank's parameters (a tp shard counts whole: DTensor.numel is the global size)
        n_params = sum(p.numel() for p in self.module.parameters())
        n_train = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        par = cfg.parallel
        layout = ""
        if par.tp > 1 or par.pp > 1:
            layout = f" (dp {self.dp_size} x tp {par.tp} x pp {par.pp})"
        pipeline = ""
        if self.pipeline is not None:
            pipeline = (f"; pipeline {par.schedule}, {self.pipeline.n_microbatches} micro-batches,"
                        f" rank 0 holds {len(decoder_layers(self.module))}/{self.n_layers} "
                        f"layers, bubble "
                        f"{self.pipeline.bubble:.1%}")
        self.log(f"fastllm train: {cfg.model} ({n_params / 1e6:.2f}M params, "
                 f"{n_train / 1e6:.3f}M trainable"
                 f"{' on rank 0' if self.pipeline is not None else ''}, finetune={cfg.finetune}, "
                 f"precision={cfg.precision}, backend={cfg.backend}, optim={cfg.optim}) on "
                 f"{self.world} x {self.device.type}{layout}, strategy={self.strategy}; "
                 f"{self.dataset.num_sequences} sequences of {cfg.data.seq_len} tokens; global "
                 f"batch {self.global_batch} = {cfg.micro_batch_size} x "
                 f"{self.loader.accumulation} accumulation x {self.dp_size} data parallel; "
                 f"{self.n_checkpointed}/{self.n_layers} layers recomputed{pipeline}")
        writer = MetricsWriter(cfg, cfg.output_dir, self.rank == 0, cfg.max_steps, self.step)
        tokens_per_step = self.global_batch * cfg.data.seq_len
        self._install_signal_handlers()
        status = "completed"
        try:
            while self.step < cfg.max_steps:
                faults.before_step(self.step + 1)
                t_start = time.perf_counter()
                step_index = self.position // self.global_batch
                micro, data_wait = self.loader.next_step()
                self.position += self.global_batch
                track = (cfg.track_memory and self._tracked_peak is None
                         and self.device.type == "cpu" and self.strategy == "none")
                tracker = None
                if track:
                    tracker = PeakMemory(self.module, self.optimizer)
                    tracker.__enter__()
                elif self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                try:
                    # Set before backward: optimizer_in_backward steps inside it.
                    for g in self.optimizer.param_groups:
                        g["lr"] = lr_at(cfg, self.step + 1)
                    t_fb = time.perf_counter()
                    loss_sum, exposed = self._forward_backward(micro, step_index)
                    t_comm = time.perf_counter()
                    flags = torch.tensor([float(loss_sum), float(self._stop_signal is not None)],
                                         dtype=torch.float64)
                    if self.world > 1:
                        dist.all_reduce(flags)
                    t_opt = time.perf_counter()
                    # every rank of the last pipeline stage holds the loss (tp ranks: copies)
                    loss = float(flags[0]) / (len(micro) * self.world // cfg.parallel.pp)
                    finite = math.isfinite(loss)
                    if finite:
                        grad_norm, skipped = self._optimizer_step()
                        self.bad_in_a_row = 0
                    else:
                        self.optimizer.zero_grad(set_to_none=True)
                        grad_norm, skipped = None, True
                        self.bad_in_a_row += 1
                    t_end = time.perf_counter()
                finally:
                    if tracker is not None:
                        tracker.__exit__(None, None, None)
                if tracker is not None:
                    self._tracked_peak = self._peak_memory(tracker)
                self.step += 1
                self.skipped_total += int(skipped)
                step_time = t_end - t_start
                # One process has nothing to reduce: building the flags tensor is not communication.
                comm = exposed + (t_opt - t_comm if self.world > 1 else 0.0)
                rec = {
                    "step": self.step, "loss": loss if finite else None,
                    "lr": lr_at(cfg, self.step), "grad_norm": grad_norm, "skipped": skipped,
                    "tokens": tokens_per_step, "tokens_per_s": tokens_per_step / step_time,
                    "step_time_s": step_time, "data_wait_s": data_wait,
                    "fwd_bwd_s": (t_comm - t_fb) - exposed + (0.0 if self.world > 1
                                                               else t_opt - t_comm),
                    "comm_s": comm,
                    "optim_s": t_end - t_opt, "peak_mem_bytes": self._peak_memory(None),
                }
                if self.pipeline is not None:
                    # the schedule's idle share (planner.bubble_fraction), taken out of compute
                    rec["bubble_s"] = self.pipeline.bubble * rec["fwd_bwd_s"]
                    rec["fwd_bwd_s"] -= rec["bubble_s"]
                if self.loss_scaler is not None:
                    rec["loss_scale"] = self.loss_scaler.get_scale()
                if cfg.data.log_indices:
                    rec["samples"] = sorted(self._gather_samples(micro))
                if not finite:
                    writer.message(f"fastllm train: step {self.step}: non-finite loss, step "
                                   f"skipped ({self.bad_in_a_row} in a row)")
                    rec["loss"] = float("nan")
                writer.log(rec)
                if not finite and self.bad_in_a_row >= cfg.max_bad_steps:
                    self._rollback()
                    writer.rewind(self.step)
                    continue
                stop = float(flags[1]) > 0
                due = cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0
                if due or self.step == cfg.max_steps or stop:
                    self.save_checkpoint()
                if stop:
                    status = "stopped"
                    name = signal.Signals(self._stop_signal).name if self._stop_signal else "signal"
                    self.log(f"fastllm train: {name} received: saved checkpoint-{self.step} "
                             f"and stopped")
                    break
                watchdog.after_step(cfg)
                faults.after_step(self.step)
        except RuntimeError as e:
            watchdog.reraise(e, self.step, cfg)
        finally:
            self._restore_signal_handlers()
            writer.close()
        summary = {}
        if self.rank == 0:
            records = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
            summary = summarize(records)
            summary.update(status=status, resumed_from=resumed, output_dir=cfg.output_dir,
                           world_size=self.world, strategy=self.strategy,
                           rollbacks=self.rollbacks,
                           losses=[r["loss"] for r in records])
            import json

            with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
                json.dump({k: v for k, v in summary.items() if k != "losses"}, f, indent=1)
            print(format_summary(summary, f"fastllm train: {status} at step {self.step} "
                                          f"({cfg.output_dir})"), flush=True)
        self._barrier()
        return summary

    def _gather_samples(self, micro):
        mine = [s for samples, _ in micro for s in samples]
        if self.world == 1:
            return mine
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        # the tp ranks and pipeline stages of one data-parallel rank read the same samples
        return list({s for part in everyone for s in part})


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _InBackwardOptimizer:
    """fastllm AdamW stepped inside backward: one optimizer per parameter, run by a
    post-accumulate-grad hook that then frees the grad, so full training never holds all
    gradients at once. step() and zero_grad() are no-ops; param_groups proxy every optimizer's
    (so the schedule can set lr); state_dict is index-keyed like one optimizer's."""

    def __init__(self, groups, kw):
        import fastllm

        self.optimizers = []
        self._params = []
        for group in groups:
            for p in group["params"]:
                opt = fastllm.optim.AdamW([p], weight_decay=group["weight_decay"], **kw)
                self.optimizers.append(opt)
                self._params.append(p)
                p.register_post_accumulate_grad_hook(self._hook(opt))

    @staticmethod
    def _hook(opt):
        def step(p):
            opt.step()
            p.grad = None
        return step

    @property
    def param_groups(self):
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        for p in self._params:
            p.grad = None

    def state_dict(self):
        return {"per_param": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        per = state_dict["per_param"]
        if len(per) != len(self.optimizers):
            raise ValueError(f"fastllm train: checkpoint has {len(per)} per-parameter optimizer "
                             f"states, this model {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, per):
            opt.load_state_dict(sd)


def _compression_optimizer(cfg, model, groups, kw):
    """finetune=galore: GaLoreAdamW with the transformer blocks' weight matrices in a projected
    group (cfg.galore: rank (default 16, at most the smallest matrix side), update_proj_gap,
    scale, proj_type) and everything else in plain AdamW groups. finetune=badam: BAdam over the
    model's named parameters, one block per layer (cfg.badam: switch_block_every, switch_mode,
    blocks)."""
    import dataclasses

    import fastllm

    options = dataclasses.asdict(getattr(cfg, cfg.finetune))
    if cfg.finetune == "badam":
        return fastllm.optim.BAdam(model.named_parameters(), weight_decay=cfg.weight_decay,
                                   **kw, **options)
    projected = {id(p) for name, p in model.named_parameters()
                 if p.requires_grad and p.dim() == 2 and ".layers." in f".{name}"}
    matrices = [p for g in groups for p in g["params"] if id(p) in projected]
    rank = int(options.pop("rank", 16))
    if matrices:
        rank = max(1, min(rank, min(min(p.shape) for p in matrices)))
    rest = [dict(g, params=[p for p in g["params"] if id(p) not in projected]) for g in groups]
    low_rank = dict(params=matrices, rank=rank, weight_decay=cfg.weight_decay, **options)
    return fastllm.optim.GaLoreAdamW([low_rank] + [g for g in rest if g["params"]], **kw)
