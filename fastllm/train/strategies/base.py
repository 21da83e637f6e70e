"""The strategy surface, and the one-process strategy every other one builds on.

A strategy is one way of running the model: it wraps the model (`wrap`), runs a step's
micro-batches forward and backward, syncing gradients on the last one only
(`forward_backward`), steps the optimizer (`step`), and saves and loads model and optimizer
state in one process's layout (`state`, `load`; fastllm.train.checkpoint_layout).
"""

import contextlib
import time

import torch

from fastllm.train import checkpoint_layout, optimizers


class Strategy:
    """One process: the model as it is."""

    name = "none"
    bubble = None        # the pipeline's idle share of a step (pipeline only)
    clip_group = None    # a process group the grad norm spans beyond the model's own shards
    zero_stage = 0       # DistributedOptimizer's ZeRO stage (zero.py)
    adapter_layout = None  # a pipeline's LoRA adapter, whole (checkpoint_layout.adapter_layout)
    policy = None        # objective=dpo: the module DDP or FSDP wraps (preference_step.policy)
    reference = None     # objective=dpo, no adapters: the reference's scoring (FSDP shards it)

    def __init__(self, cfg, layout, device, rank):
        self.cfg, self.layout, self.device, self.rank = cfg, layout, device, rank
        self.comm_timer = None

    def wrap(self, model, loss_fn):
        """Take the model (built, fine-tune mode set, on the device). loss_fn(logits, labels):
        the loss a pipeline's last stage computes (the others use the model's own)."""
        self.model = self.module = model

    def build_optimizer(self):
        """self.optimizer and self.scalers (fastllm.train.optimizers.build) for the wrapped
        model."""
        self.optimizer, self.scalers = optimizers.build(
            self.cfg, self.module, self.device.type, self.zero_stage, self.clip_group is None)

    def no_sync(self):
        """Accumulate gradients without synchronising them (every micro-batch but the last)."""
        return contextlib.nullcontext()

    def describe(self):
        return ""

    def forward_backward(self, micro, step_loss):
        """Forward and backward over this rank's micro-batches [(samples, input_ids)].
        step_loss(model, input_ids) -> loss (fp16 runs backward it scaled). Returns (summed
        loss (fp64, CPU), seconds of communication backward could not hide)."""
        accum = len(micro)
        loss_sum = torch.zeros((), dtype=torch.float64)
        exposed = 0.0
        for m, (_, ids) in enumerate(micro):
            ids = ids.to(self.device, non_blocking=True)
            last = m == accum - 1
            with contextlib.nullcontext() if last else self.no_sync():
                loss = step_loss(self.model, ids)
                value = loss.detach().double().cpu()
                loss_sum += value
                if self.cfg.optimizer_in_backward and not torch.isfinite(value):
                    # its backward would step every parameter on non-finite grads; the trainer
                    # then skips the step (one process, one micro-batch: nothing to sync)
                    continue
                if self.comm_timer is not None:
                    self.comm_timer.last_launch = None
                self.scalers.scale(loss / accum).backward()
                end = time.perf_counter()
                if last and self.comm_timer is not None and self.comm_timer.last_launch:
                    exposed += end - self.comm_timer.last_launch
        return loss_sum, exposed

    def step(self):
        """Clip, step, zero the grads. Returns (grad_norm or None, skipped)."""
        return optimizers.step(self.optimizer, self.cfg, self.scalers, self.clip_group)

    def state(self):
        """(model state, optimizer state) in one process's layout; None on ranks that do not
        write the checkpoint."""
        return ({k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                self.optimizer.state_dict())

    def load(self, model_state, optim_state):
        """Load one process's layout (model_state None: a LoRA run loads its adapter apart)."""
        if model_state is not None:
            self.module.load_state_dict(model_state)
        self.optimizer.load_state_dict(optim_state)

    @property
    def param_names(self):
        decay, no_decay = checkpoint_layout.param_order(self.module)
        return [n for n, _ in decay + no_decay]
