"""Every fastllm op's schema, declared once under the `fastllm` namespace.

Implementations live beside each op in fastllm/ops/<op>.py: a CPU and a CUDA kernel registered
with `lib.impl` (each routes to the cpp/cuda/triton/ref backend, see fastllm/_backend.py) and a
fake (shape-only) implementation for torch.compile and torch.library.opcheck.
"""

import torch

lib = torch.library.Library("fastllm", "DEF")

SCHEMAS = {
    # torch.optim.AdamW's update over many tensors, in place; the same contract as
    # aten::_fused_adamw_, except that grads are only read (never unscaled in place).
    "adamw_step": (
        "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, *, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, "
        "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()"
    ),
}

for _schema in SCHEMAS.values():
    lib.define(_schema)
