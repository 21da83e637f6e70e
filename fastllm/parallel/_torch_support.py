"""The oldest torch each engine of fastllm.parallel passed fastllm's tests with on CPU meshes
(Gloo), and the refusal below it: an error naming the release and what it did, raised before
anything is wrapped, instead of a deadlock, an abort inside torch, or a run that trains to other
numbers. Measured 2026-12-03 (README, "Tested PyTorch releases") with torch 2.6.0, 2.7.1, 2.8.0,
2.9.1 and 2.10.0, every test in tests/ on each. GPU meshes (NCCL) are not refused: those releases
were not run there.
"""

import torch
from torch.torch_version import TorchVersion

__all__ = ["MINIMUM_ON_CPU", "require"]

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
