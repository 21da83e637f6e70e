"""Tensor parallel over the "tp" ranks (DTensor `parallelize_module`; with sequence parallel
on parallel.sequence_parallel), FSDP2 over "dp" when there are several: fastllm.parallel's
engines on the runtime's model. Logits are gathered (the runtime takes transformers' loss on
them); the embedding and head stay whole when tp does not divide the vocabulary."""

from fastllm.parallel import apply_fsdp, apply_tensor_parallel
from fastllm.train.strategies.fsdp import Sharded


class TensorParallel(Sharded):
    name = "tp"

    def wrap(self, model, loss_fn):
        lay = self.layout
        mesh = lay.build_mesh(self.device.type)
        apply_tensor_parallel(model, mesh["tp"], vocab_parallel_logits=False,
                              vocab_parallel=lay.vocab_parallel(model.config),
                              sequence_parallel=lay.sequence_parallel)
        if lay.dp > 1:
            apply_fsdp(model, mesh["dp"])
        self.model = self.module = model
