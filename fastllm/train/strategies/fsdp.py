"""FSDP2 (`fully_shard` per decoder layer, then the root): parameters, gradients and optimizer
state sharded over the data-parallel ranks. Checkpoints gather one process's layout with DCP's
full state dicts (fastllm.train.checkpoint_layout.full_state)."""

import torch

from fastllm.parallel import apply_fsdp
from fastllm.train import checkpoint_layout
from fastllm.train.strategies.base import Strategy


class Sharded(Strategy):
    """A model of DTensor parameters: its state is saved and loaded through DCP."""

    def state(self):
        # an adapter run gathers the adapter only (its checkpoint holds no base weights)
        return checkpoint_layout.full_state(
            self.module, self.optimizer, self.param_names,
            trainable_only=self.cfg.finetune in ("lora", "prefix"))

    def load(self, model_state, optim_state):
        checkpoint_layout.load_full(self.module, self.optimizer, model_state, optim_state,
                               self.param_names)


class FSDP(Sharded):
    name = "fsdp"

    def wrap(self, model, loss_fn):
        from torch.distributed.device_mesh import init_device_mesh

        cfg = self.cfg
        mesh = init_device_mesh(self.device.type, (self.layout.dp,))
        dtypes = {}
        if cfg.backend == "torch" and cfg.precision != "fp32":
            dtypes = dict(param_dtype=torch.bfloat16 if cfg.precision == "bf16"
                          else torch.float16, reduce_dtype=torch.float32)
        if self.policy is None:
            self.model = self.module = apply_fsdp(model, mesh, **dtypes)
            return
        # objective=dpo: the root is the pairs' scoring, which runs the decoder and the head,
        # not the model's forward (preference_step); a frozen reference copy is sharded alike
        self.module = model
        self.model = apply_fsdp(model, mesh, root=self.policy, **dtypes)
        if self.reference is not None:
            apply_fsdp(self.reference.lm, mesh, root=self.reference, **dtypes)
