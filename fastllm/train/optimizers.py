"""Optimizer construction and the optimizer step, for every way `fastllm train` runs:

- backend=fastllm: fastllm.optim.AdamW (optim=adamw_bf16: bf16 moments) or AdamW8bit, with fp32
  master weights under low precision and fastllm.amp.LossScaler under fp16; it clips by the
  global grad norm and skips a non-finite step inside its own step;
- backend=torch: torch.optim.AdamW(fused=True), clipped by the global grad norm, with
  torch.amp.GradScaler under fp16 (the baseline fastllm is measured against);
- optimizer_in_backward: one fastllm AdamW per parameter, stepped by its grad hook;
- finetune=galore / badam: GaLoreAdamW with the blocks' matrices projected, or BAdam;
- parallel.strategy=zero1/zero2: fastllm.distributed.DistributedOptimizer over AdamW.
"""

import dataclasses
import math

import torch

from fastllm.train.checkpoint_layout import param_order

__all__ = ["Scalers", "build", "step", "NO_CLIP"]

NO_CLIP = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass
class Scalers:
    """The fp16 loss scaling of a run: fastllm's LossScaler (inside fastllm's AdamW) or torch's
    GradScaler (around torch's AdamW); both None otherwise."""

    loss_scaler: object = None
    grad_scaler: object = None

    def scale(self, loss):
        if self.loss_scaler is not None:
            return self.loss_scaler.scale(loss)
        if self.grad_scaler is not None:
            return self.grad_scaler.scale(loss)
        return loss

    def state_dict(self):
        return {k: None if s is None else s.state_dict()
                for k, s in (("loss_scaler", self.loss_scaler),
                             ("grad_scaler", self.grad_scaler))}

    def load_state_dict(self, state):
        for k, s in (("loss_scaler", self.loss_scaler), ("grad_scaler", self.grad_scaler)):
            if s is not None and state.get(k) is not None:
                s.load_state_dict(state[k])


def param_groups(cfg, module):
    decay, no_decay = param_order(module)
    if not decay and not no_decay:
        raise ValueError(f"fastllm train: finetune={cfg.finetune} left no trainable parameters")
    return [{"params": [p for _, p in decay], "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in no_decay], "weight_decay": 0.0}]


def build(cfg, module, device_type="cpu", zero_stage=0, clip_inside=True):
    """(optimizer, Scalers) for cfg over module's trainable parameters. zero_stage 1/2:
    DistributedOptimizer (module is the DDP-free model it reduces the grads of). clip_inside
    False: the strategy clips (pipeline stages clip by the norm over all stages)."""
    groups = param_groups(cfg, module)
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.backend == "torch":
        grad_scaler = torch.amp.GradScaler(device_type) if cfg.precision == "fp16" else None
        return torch.optim.AdamW(groups, fused=True, **kw), Scalers(grad_scaler=grad_scaler)
    from fastllm.amp import LossScaler
    from fastllm.optim import AdamW, AdamW8bit

    scalers = Scalers(loss_scaler=LossScaler() if cfg.precision == "fp16" else None)
    # max_grad_norm=0 still measures the norm (HF logs it unclipped) and skips a non-finite
    # step: a bound no finite fp32 norm reaches clips by exactly 1
    opt_kw = dict(kw, master_weights=cfg.precision != "fp32",
                  max_grad_norm=(cfg.max_grad_norm or NO_CLIP) if clip_inside else None,
                  loss_scaler=scalers.loss_scaler)
    if cfg.optim == "adamw_bf16":
        opt_kw["state_dtype"] = torch.bfloat16
    if cfg.finetune in ("galore", "badam"):
        return _low_memory_optimizer(cfg, module, groups, opt_kw), scalers
    if zero_stage:
        from fastllm.distributed import DistributedOptimizer

        # The other strategies' two groups (no decay on vectors: norms, biases), numbered as
        # theirs in optimizer.pt. The loop reads params only in forward and state_dict, which
        # wait: overlap is safe. Not for the preference objectives: their fused scoring reads
        # the head's weight without calling the head, whose pre-hook would wait for its gather
        # (and fastllm.preference sees the hooks and falls back to the logits): gathered at once.
        # Nor under torch_compile: dynamo traces the pre-hooks of the modules inside a compiled
        # layer and broke its graph on the gather's wait
        opt_kw.pop("master_weights")
        _, plain = param_order(module)
        return DistributedOptimizer(module, optimizer_class=AdamW, stage=zero_stage,
                                    weight_decay=cfg.weight_decay,
                                    overlap_param_gather=(cfg.objective == "lm"
                                                          and not cfg.torch_compile),
                                    no_decay=[n for n, _ in plain], **opt_kw), scalers
    if cfg.optimizer_in_backward:
        return InBackwardOptimizer(groups, opt_kw), scalers
    adamw = AdamW8bit if cfg.optim == "adamw8bit" else AdamW
    return adamw(groups, **opt_kw), scalers


def step(optimizer, cfg, scalers, clip_group=None):
    """One optimizer step, then zero the grads. Returns (grad_norm or None, skipped).

    fastllm's optimizers clip and skip a non-finite step themselves; torch's AdamW, and
    fastllm's on pipeline stages (clip_group: the stages, whose grads the norm must span), are
    clipped here by fastllm.parallel.clip_grad_norm_, and a non-finite norm skips the step."""
    grad_norm, skipped = None, False
    external = cfg.backend == "torch" or clip_group is not None
    if external:
        from fastllm.parallel.clip import clip_grad_norm_

        gs = scalers.grad_scaler
        if gs is not None:
            gs.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # max_grad_norm=0: the norm is still logged, as HF's Trainer does
        grad_norm = float(clip_grad_norm_(params, cfg.max_grad_norm or None,
                                          pp_group=clip_group))
        if gs is not None:
            scale = gs.get_scale()
            gs.step(optimizer)
            gs.update()
            skipped = gs.get_scale() < scale
        elif clip_group is not None and not math.isfinite(grad_norm):
            skipped = True  # as fastllm AdamW's own clipping: a no-op step
        else:
            optimizer.step()
    else:
        optimizer.step()
        norm = getattr(optimizer, "grad_norm", None)
        grad_norm = float(norm) if norm is not None else None
        skipped = bool(getattr(optimizer, "step_skipped", False))
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


class InBackwardOptimizer:
    """fastllm AdamW stepped inside backward: one optimizer per parameter, run by a
    post-accumulate-grad hook that then frees the grad, so full training never holds all
    gradients at once. step() and zero_grad() are no-ops; param_groups proxy every optimizer's
    (so the schedule can set lr); state_dict is index-keyed like one optimizer's. Each
    optimizer measures its grad's norm (kw's max_grad_norm: NO_CLIP) and skips on device when
    it is inf/nan; grad_norm is the norm over all of them. The hook steps on every backward:
    the config refuses gradient accumulation with it."""

    def __init__(self, groups, kw):
        from fastllm.optim import AdamW

        self.optimizers = []
        self._params = []
        for group in groups:
            for p in group["params"]:
                opt = AdamW([p], weight_decay=group["weight_decay"], **kw)
                self.optimizers.append(opt)
                self._params.append(p)
                p.register_post_accumulate_grad_hook(self._hook(opt))

    @staticmethod
    def _hook(opt):
        def step(p):
            opt.step()
            p.grad = None
        return step

    @property
    def param_groups(self):
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def grad_norm(self):
        # reduced on the device: one read of the result, not one per parameter
        norms = [opt.grad_norm for opt in self.optimizers if opt.grad_norm is not None]
        if not norms:
            return None
        return torch.stack([n.double() for n in norms]).square().sum().sqrt()

    @property
    def step_skipped(self):
        flags = [opt.step_skipped for opt in self.optimizers
                 if isinstance(opt.step_skipped, torch.Tensor)]
        return bool(torch.stack(flags).any()) if flags else any(
            opt.step_skipped for opt in self.optimizers)

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        for p in self._params:
            p.grad = None

    def state_dict(self):
        return {"per_param": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        per = state_dict["per_param"]
        if len(per) != len(self.optimizers):
            raise ValueError(f"fastllm train: checkpoint has {len(per)} per-parameter optimizer "
                             f"states, this model {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, per):
            opt.load_state_dict(sd)


def _low_memory_optimizer(cfg, model, groups, kw):
    """finetune=galore: GaLoreAdamW with the transformer blocks' weight matrices in a projected
    group (cfg.galore: rank (default 16, at most the smallest matrix side), update_proj_gap,
    scale, proj_type) and everything else in plain AdamW groups. finetune=badam: BAdam over the
    model's named parameters, one block per layer (cfg.badam: switch_block_every, switch_mode,
    blocks)."""
    from fastllm.optim import BAdam, GaLoreAdamW

    options = dataclasses.asdict(getattr(cfg, cfg.finetune))
    if cfg.finetune == "badam":
        # biases and norm weights without weight decay, as the other optimizers' groups
        plain = {id(p) for p in groups[1]["params"]}  # param_groups' no-decay group
        return BAdam(model.named_parameters(), weight_decay=cfg.weight_decay, **kw, **options,
                     no_decay=[n for n, p in model.named_parameters() if id(p) in plain])
    projected = {id(p) for name, p in model.named_parameters()
                 if p.requires_grad and p.dim() == 2 and ".layers." in f".{name}"}
    matrices = [p for g in groups for p in g["params"] if id(p) in projected]
    rank = int(options.pop("rank", 16))
    if matrices:
        rank = max(1, min(rank, min(min(p.shape) for p in matrices)))
    rest = [dict(g, params=[p for p in g["params"] if id(p) not in projected]) for g in groups]
    low_rank = dict(params=matrices, rank=rank, weight_decay=cfg.weight_decay, **options)
    return GaLoreAdamW([low_rank] + [g for g in rest if g["params"]], **kw)
