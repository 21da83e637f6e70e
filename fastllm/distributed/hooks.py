"""DDP communication hooks with a low-precision wire format, each cast one fused fastllm pass.

    ddp.register_comm_hook(None, fastllm.distributed.hooks.bf16_wire_hook)
    ddp.register_comm_hook(LowPrecisionState(loss_scaler=scaler), unscale_bf16_wire_hook)

What torch's `bf16_compress_hook` does (which torch allows only on CUDA/NCCL or XPU), for any
backend (other names, because DDP refuses any hook named bf16_compress_hook off CUDA): the
gradient bucket (a flat fp32 tensor) is cast to bf16 with the 1/world-size average folded into
the same pass (fastllm::scaled_copy), all-reduced in bf16 (half the wire bytes), and
cast back into the bucket in a second fused pass. The `unscale_*` hooks also divide by a loss
scale in the first pass, so the optimizer receives unscaled grads: then the optimizer must not
unscale again (give it no loss_scaler, or step with a scale of 1).

Sums travel in the wire dtype, so the result matches the fp32 all-reduce to bf16 (fp16)
precision: within a few wire-dtype rounding steps of the mean.
"""

import torch
import torch.distributed as dist

from fastllm.ops.scaled_copy import scaled_copy

__all__ = ["LowPrecisionState", "bf16_wire_hook", "fp16_wire_hook",
           "unscale_bf16_wire_hook", "unscale_fp16_wire_hook", "wire_bytes"]


class LowPrecisionState:
    """State of the hooks: the process group (None: the default group) and, for the unscale hooks,
    a fastllm.amp.LossScaler or torch.amp.GradScaler whose current scale grads are divided by."""

    def __init__(self, process_group=None, loss_scaler=None):
        self.process_group = process_group
        self.loss_scaler = loss_scaler

    def scale_tensor(self):
        scaler = self.loss_scaler
        if scaler is None:
            return None
        if hasattr(scaler, "scale_tensor"):
            return scaler.scale_tensor()
        return torch.tensor(float(scaler.get_scale()), dtype=torch.float32)


def _group(state):
    if state is None:
        return None
    if isinstance(state, LowPrecisionState):
        return state.process_group
    return state  # torch's hooks take the process group itself as the state


def _compress(state, bucket, wire_dtype, divisor):
    group = _group(state)
    group_to_use = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group_to_use)
    buffer = bucket.buffer()
    wire = torch.empty(buffer.shape, dtype=wire_dtype, device=buffer.device)
    scaled_copy([wire], [buffer], 1.0 / world, divisor)
    fut = dist.all_reduce(wire, group=group_to_use, async_op=True).get_future()

    def decompress(fut):
        scaled_copy([buffer], [fut.value()[0]], 1.0)
        return buffer

    return fut.then(decompress)


def bf16_wire_hook(state, bucket):
    """DDP comm hook: average the bucket over a bf16 wire. state: a process group, None, or a
    LowPrecisionState. Returns a Future holding the averaged fp32 bucket."""
    return _compress(state, bucket, torch.bfloat16, None)


def fp16_wire_hook(state, bucket):
    """As bf16_wire_hook with an fp16 wire (more mantissa, less range)."""
    return _compress(state, bucket, torch.float16, None)


def _unscale(state, bucket, wire_dtype):
    if not isinstance(state, LowPrecisionState) or state.loss_scaler is None:
        raise ValueError("fastllm.distributed.hooks: the unscale hooks need a LowPrecisionState "
                         "with a loss_scaler")
    return _compress(state, bucket, wire_dtype, state.scale_tensor())


def unscale_bf16_wire_hook(state, bucket):
    """bf16_wire_hook that also divides by the loss scale of state.loss_scaler in the cast."""
    return _unscale(state, bucket, torch.bfloat16)


def unscale_fp16_wire_hook(state, bucket):
    """fp16_wire_hook that also divides by the loss scale of state.loss_scaler in the cast."""
    return _unscale(state, bucket, torch.float16)


def wire_bytes(numel, wire_dtype):
    """Bytes one rank sends for an all-reduce of `numel` elements in `wire_dtype` (payload only)."""
    return int(numel) * torch.empty((), dtype=wire_dtype).element_size()
