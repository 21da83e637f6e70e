"""ZeRO-1/2: a DDP-free model whose gradients fastllm.distributed.DistributedOptimizer
reduces in flat buckets (stage 2: reduce-scattered to the shard owner) and whose parameters
it all-gathers after each step."""

from fastllm.train.strategies.base import Strategy


class Zero(Strategy):
    def __init__(self, cfg, layout, device, rank, stage):
        super().__init__(cfg, layout, device, rank)
        self.zero_stage = stage
        self.name = f"zero{stage}"

    def no_sync(self):
        return self.optimizer.no_sync()

    def state(self):
        # optimizer first: DistributedOptimizer.state_dict also finishes its pending parameter
        # all-gather, which the model's state must see
        optim_state = self.optimizer.state_dict()
        return ({k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                optim_state)
