"""Data parallel with torch's DistributedDataParallel: every rank holds the model, gradients
are all-reduced in buckets during backward."""

import time

from fastllm.train.strategies.base import Strategy


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


class DDP(Strategy):
    name = "ddp"

    def wrap(self, model, loss_fn):
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        self.module = model
        # BAdam trains one block at a time (requires_grad off elsewhere): the other blocks get no
        # grads, which DDP must be told to expect (without it the second step raises)
        # QLoRA's 4-bit codes are buffers every rank made identically from the same weights: DDP
        # would otherwise broadcast them all from rank 0 at every forward (0.56 bytes a weight)
        # objective=dpo: the pairs' scoring (self.policy), whose forward is the step's
        self.model = DistributedDataParallel(
            model if self.policy is None else self.policy, device_ids=ids,
            find_unused_parameters=self.cfg.finetune == "badam",
            broadcast_buffers=self.cfg.lora.quantize_base == "none")
        self.comm_timer = _CommTimer()
        self.model.register_comm_hook(None, self.comm_timer.hook)

    def no_sync(self):
        return self.model.no_sync()
