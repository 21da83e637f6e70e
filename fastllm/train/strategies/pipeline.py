"""Pipeline parallel over the "pp" ranks (torch.distributed.pipelining, built by
fastllm.parallel.build_pipeline), each stage tensor parallel over "tp" and FSDP2 over "dp". A
step's accumulation micro-batches are the schedule's micro-batches; the grad norm spans the
stages; checkpoints gather the stages to rank 0 in one process's layout."""

import torch

from fastllm.parallel import apply_fsdp, apply_tensor_parallel, build_pipeline, decoder_layers
from fastllm.train import checkpoint_layout
from fastllm.train.strategies.base import Strategy


class Pipeline(Strategy):
    name = "pipeline"

    def wrap(self, model, loss_fn):
        cfg, lay = self.cfg, self.layout
        # The whole model's trainable names in one process's optimizer order, taken before the
        # model is cut into stages: the index layout of optimizer.pt (stages keep the names).
        decay, no_decay = checkpoint_layout.param_order(model)
        self.model_names, self.model_n_decay = [n for n, _ in decay + no_decay], len(decay)
        self.n_layers = len(decoder_layers(model))
        if cfg.finetune == "lora":  # its files name every layer: rank 0's stage holds some
            self.adapter_layout = checkpoint_layout.adapter_layout(model)
        lay.check_model(model.config)
        # the trainer's global batch: the schedule must split it into the loader's micro-batches
        n_mb = lay.micro_batches(cfg.resolved_global_batch(lay), cfg.micro_batch_size)
        mesh = lay.build_mesh(self.device.type)
        vocab_parallel = lay.vocab_parallel(model.config)

        def shard(stage):
            if lay.tp > 1:
                # gathered logits: torch's schedules run the loss's backward outside
                # loss_parallel
                apply_tensor_parallel(stage, mesh["tp"], vocab_parallel_logits=False,
                                      vocab_parallel=vocab_parallel)
            if lay.dp > 1:
                # gathered once a step and kept through every micro-batch (torchtitan's policy
                # under pipelining): resharded after each forward, the stage's weights were
                # gathered again for every micro-batch (m + 1 all-gathers a step)
                apply_fsdp(stage, mesh["dp"], reshard_after_forward=False)
            return stage

        self.pipe = build_pipeline(model, mesh, n_mb, lay.schedule, loss_fn, self.device,
                                   cfg.data.seq_len, shard)
        self.model = self.module = self.pipe.module
        self._check_every_stage_trains()
        self.bubble, self.clip_group = self.pipe.bubble, self.pipe.pp_group
        _, dp_rank, tp_rank = lay.coords(self.rank)
        self.writer = dp_rank == 0 and tp_rank == 0  # the others hold copies of its stages

    def _check_every_stage_trains(self):
        """Refuse, on every rank, a model whose trainable parameters (LoRA's lora.layers or
        target_modules, freeze.layers) leave a rank's stages none: it would have nothing to
        step."""
        import torch.distributed as dist

        mine = any(p.requires_grad for p in self.module.parameters())
        flag = torch.tensor([int(mine)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            raise ValueError(
                f"fastllm train: finetune={self.cfg.finetune} with parallel.pp="
                f"{self.layout.pp}: a pipeline stage holds no trainable parameter (rank "
                f"{self.rank}'s has {'some' if mine else 'none'}); train layers on every "
                f"stage (raise lora.layers or widen lora.target_modules; raise freeze.layers)")

    def describe(self):
        return (f"; pipeline {self.layout.schedule}, {self.pipe.n_microbatches} micro-batches, "
                f"rank 0 holds {len(decoder_layers(self.module))}/{self.n_layers} layers, bubble "
                f"{self.pipe.bubble:.1%}")

    def forward_backward(self, micro, step_loss):
        """One run of the schedule over this step's micro-batches (torch splits the
        concatenated batch back into them). Returns (the last stage's summed loss, 0.0): the
        sends and receives are not timed apart from the compute."""
        ids = torch.cat([m for _, m in micro]).to(self.device, non_blocking=True)
        # transformers' causal LM labels: the next token, none after the last
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for loss in self.pipe.step(ids, labels):
            loss_sum += loss.detach().double().cpu()
        return loss_sum, 0.0

    def state(self):
        return checkpoint_layout.gather_stages(
            self.model, self.optimizer, self.model_names, self.model_n_decay, self.clip_group,
            self.writer, trainable_only=self.adapter_layout is not None)

    def load(self, model_state, optim_state):
        checkpoint_layout.load_full(self.model, self.optimizer, model_state, optim_state,
                               self.model_names)
