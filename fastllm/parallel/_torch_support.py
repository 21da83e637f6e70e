"""The oldest torch each engine of fastllm.parallel passed fastllm's tests with on CPU meshes
(Gloo), and the refusal below it: an error naming the release and what it did, raised before
anything is wrapped, instead of a deadlock, an abort inside torch, or a run that trains to other
numbers. Measured 2026-12-03 (README, "Tested PyTorch releases") with torch 2.6.0, 2.7.1, 2.8.0,
2.9.1 and 2.10.0, every test in tests/ on each. GPU meshes (NCCL) are not refused: those releases
were not run there.
"""

import torch
from torch.torch_version import TorchVersion

__all__ = ["MINIMUM_ON_CPU", "FSDP2_INTEGER_PARAMS", "fsdp2_integer_params_refusal", "require",
           "require_fsdp2_integer_params"]

TORCH = TorchVersion(torch.__version__)

# engine -> (the oldest release that passed, what the older ones did)
MINIMUM_ON_CPU = {
    "FSDP2": ((2, 9), "on torch 2.7 and 2.8 a DCP checkpoint resumed at another world size trains "
                      "to losses 2-5% off the one-process run (torch.optim.AdamW as well as "
                      "fastllm's), and torch 2.6's CPU streams have no record_event"),
    "tensor parallel": ((2, 10), "on torch 2.9 DTensor has no sharding strategy for aten.alias, "
                                 "which tensor-parallel training reaches, and on 2.7 and 2.8 "
                                 "the vocabulary-parallel embedding failed `assert "
                                 "self.mask_buffer.data is not None` in DTensor's _MaskPartial "
                                 "and the norms of partial gradients came out wrong"),
    "pipeline parallel": ((2, 10), "on torch 2.7 and 2.8 the 1F1B schedule deadlocks on Gloo, "
                                   "and on 2.9 Gloo aborts the process on a send and a receive "
                                   "of different sizes"),
}


def require(engine, device_type):
    """Raise RuntimeError when `engine` (a key of MINIMUM_ON_CPU) runs on a CPU mesh of a torch
    older than the oldest release it passed with there."""
    minimum, what = MINIMUM_ON_CPU[engine]
    if device_type == "cpu" and TORCH < minimum:
        raise RuntimeError(
            f"fastllm.parallel: {engine} on CPU (Gloo) needs torch >= {minimum[0]}.{minimum[1]}, "
            f"this is {TORCH}: {what}. Use a newer torch or a layout without {engine} (README, "
            f"'Tested PyTorch releases')")


# The oldest release whose FSDP2 shards integer parameters (the NF4 layers' uint8 codes, made
# parameters by fastllm.quant's shardable()), on any device: before it, fully_shard builds each
# sharded parameter with requires_grad=True and sets the original's only afterwards, which an
# integer tensor refuses (pytorch/pytorch#177844). torch 2.11.0 failed so (`make
# device-rehearsal`, 2026-12-07); 2.12.0's FSDP2 passes the original's requires_grad at both of
# those places (read in its wheel; not run), 2.13.0 passes every FSDP-QLoRA test.
FSDP2_INTEGER_PARAMS = (2, 12)


def fsdp2_integer_params_refusal(where):
    """Why this torch's FSDP2 cannot shard integer parameters (FSDP2_INTEGER_PARAMS), naming
    `where`; None where it can."""
    if TORCH >= FSDP2_INTEGER_PARAMS:
        return None
    major, minor = FSDP2_INTEGER_PARAMS
    return (f"{where}: FSDP2 in torch {TORCH} cannot shard the NF4 layers' 4-bit codes (uint8 "
            f"parameters): its fully_shard makes every sharded parameter require grad first, "
            f"which an integer tensor refuses (pytorch/pytorch#177844). Sharding a QLoRA model "
            f"(FSDP-QLoRA) needs torch >= {major}.{minor}; on this torch keep the NF4 base whole "
            f"on each rank (parallel.strategy=ddp, or none) or use a dense base")


def require_fsdp2_integer_params(where):
    """Raise RuntimeError where fsdp2_integer_params_refusal(where) says why."""
    why = fsdp2_integer_params_refusal(where)
    if why:
        raise RuntimeError(why)
