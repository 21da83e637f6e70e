"""`fastllm train objective=dpo|cpo|orpo`: the loss of a micro-batch of preference pairs, its
metrics, and the held-out evaluation.

    objective = PreferenceObjective.make(cfg, model)   # None for objective=lm
    loss = objective(model, batch)                     # a PairBatch: the DPO loss (+ RPO's NLL)
    rec.update(objective.pop_metrics(device))          # TRL's rewards/* and logps/* names

objective=cpo (CPO, and SimPO with cpo.loss_type=simpo cpo.cpo_alpha=0) and objective=orpo are
reference-free (TRL's CPOTrainer and ORPOTrainer): the policy's log-probabilities alone, the
completions' means where TRL takes them (ORPO; CPO's ipo and simpo), and an NLL term as TRL's:
cpo.cpo_alpha x the chosen completions' NLL per token, ORPO's over the chosen rows' every token,
prompt included (its per-token log-probabilities from one pass give both). The rest of this
concerns DPO's reference.

The reference is what TRL's DPOTrainer takes without a ref_model: with LoRA adapters (fastllm's
or PEFT's) the same model with its adapters switched off, under no_grad; else (full, freeze,
galore, badam) a frozen copy of the model as it was built, before any step (and before a resumed
checkpoint is loaded: the reference stays the model the run started from). With fastllm's
kernels the log-probabilities come from fastllm.preference.sequence_logps' fused route (no
logits); backend=torch or kernels=none take them from the model's logits, as TRL does.

The policy's scoring is a module of its own (policy(model)), which the strategy wraps in place of
the model, since the scoring calls the model's decoder and head rather than the model's forward:
DistributedDataParallel's reducer learns of a backward only through its forward, and FSDP2's root
gathers the embedding, the final norm and the head only in its own. Under FSDP the frozen
reference copy's scoring (reference_scorer) is sharded alike.
"""

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from fastllm.adapters import disable_adapters
from fastllm.preference import (_causal_lm, _fused_route, cpo_loss, dpo_loss, orpo_log_odds,
                                orpo_loss, padding_free_refusal, sequence_logps)

__all__ = ["PreferenceObjective"]

# TRL's metric names, in the order they are logged
_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected")
# and TRL's CPOTrainer's / ORPOTrainer's own, after them
_EXTRA = {"dpo": (), "cpo": ("nll_loss",),
          "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


class _Policy(nn.Module):
    """A model's scoring as a module: forward(batch) -> the rows' log-probabilities."""

    def __init__(self, lm, logps):
        super().__init__()
        self.lm, self._logps = lm, logps

    def forward(self, batch):
        return self._logps(self.lm, batch)


class PreferenceObjective:
    def __init__(self, dpo, model, adapters, fused, name="dpo", section=None,
                 padding_free=False):
        # fused: the scoring without logits, where the model has that route (a family
        # fastllm.patch knows, a plain head: fastllm.preference); else its logits, as said
        fused = fused and _fused_route(_causal_lm(model)) is not None
        self.dpo, self.fused, self.adapters = dpo, fused, adapters
        self.padding_free = padding_free  # the micro-batch's rows scored as one (TRL's)
        refusal = padding_free_refusal(_causal_lm(model)) if padding_free else None
        if refusal:
            raise ValueError(f"fastllm train: data.padding_free=true {refusal}")
        # name: dpo, cpo or orpo; section: cfg.cpo / cfg.orpo (the reference-free ones)
        self.name, self.section = name, section
        self.precomputed = self._precomputing = False
        self.reference = self.reference_scorer = None
        if getattr(section if name != "dpo" else dpo, "disable_dropout", True):
            # TRL's disable_dropout (its default): every nn.Dropout of the model p=0, so the
            # policy's and the reference's scores are not noise (the frozen copy inherits it)
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        self._kind = "adapters off" if adapters else "a frozen copy of the model"
        if name != "dpo":
            self._kind = None  # (no reference)
        elif dpo.precompute_ref_log_probs and not adapters:
            # prepare() scores the model itself before any step or checkpoint load: no copy
            # (TRL keeps no ref_model either)
            self._kind = "the model as built"
        elif not adapters:
            self.reference = copy.deepcopy(model).requires_grad_(False).eval()
            self.reference_scorer = _Policy(self.reference, self._logps)
        self.metric_names = _METRICS + _EXTRA[name]
        self._sums = torch.zeros(len(self.metric_names) + 2, dtype=torch.float64)

    @classmethod
    def make(cls, cfg, model):
        """The objective of cfg (None for objective=lm), for `model` as built and moved to its
        device, before any wrapping, checkpointing or compilation."""
        if cfg.objective == "lm":
            return None
        fused = cfg.backend == "fastllm" and cfg.kernels == "fastllm"
        return cls(cfg.dpo, model, cfg.finetune == "lora", fused, cfg.objective,
                   getattr(cfg, cfg.objective), cfg.data.padding_free)

    def policy(self, model):
        """The module DDP or FSDP wraps in place of `model` (the trainer's strategy.policy)."""
        return _Policy(model, self._logps)

    def prepare(self, trainer):
        """Before the first step (the trainer's model wrapped by its strategy): with
        dpo.precompute_ref_log_probs (TRL's), the reference's log-probabilities of every training
        and held-out pair, computed once in batches of micro_batch_size pairs in the data's order
        (a resumed run computes the same), split over the ranks; the datasets then serve them in
        their batches (ref_logps). Without adapters the model scored is the policy itself, as
        built: no frozen copy is made (prepare runs before any step or checkpoint load)."""
        if self.name != "dpo" or not self.dpo.precompute_ref_log_probs:
            return
        import time

        t0 = time.perf_counter()
        model = trainer.strategy.model
        lm = self._unwrap(model)[0]
        was_training = lm.training
        lm.eval()
        self._precomputing = True
        try:
            n = sum(self._precompute(model, data, trainer.cfg.micro_batch_size, trainer.device,
                                     trainer.autocast)
                    for data in (trainer.dataset, trainer.eval_dataset) if data is not None)
        finally:
            lm.train(was_training)
            self._precomputing = False
        self.reference = self.reference_scorer = trainer.strategy.reference = None
        self.precomputed = True
        trainer.log(f"fastllm train: the reference's log-probabilities of {n} pairs precomputed "
                    f"in {time.perf_counter() - t0:.1f} s (dpo.precompute_ref_log_probs)")

    def _precompute(self, model, data, batch_size, device, autocast):
        """data.ref_logps: (pairs, 2) fp32 on the CPU, [chosen, rejected]; every rank computes
        an equal share (FSDP's forwards are collective; the last rows repeat to even it) and the
        shares are all-gathered. Returns the pairs."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        n = data.num_sequences
        share = -(-n // world)
        rows = [min(rank * share + k, n - 1) for k in range(share)]
        parts = []
        for k in range(0, share, batch_size):
            batch = data.batch(None, rows=rows[k:k + batch_size])
            batch.pop("num_tokens")
            with autocast if autocast is not None else contextlib.nullcontext():
                ref = self._reference(model, batch.to(device)).float()
            parts.append(torch.stack(ref.chunk(2), 1))
        mine = torch.cat(parts)
        if world > 1:
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            mine = torch.cat(every)
        data.ref_logps = mine[:n].cpu()
        return n

    def describe(self):
        how = f"log-probabilities {'fused, no logits' if self.fused else 'from the logits'}"
        if self.padding_free:
            how += ", each micro-batch's rows as one without padding (data.padding_free)"
        if self.name == "orpo":
            return f"objective=orpo (beta={self.section.beta}; no reference; {how})"
        if self.name == "cpo":
            c = self.section
            gamma = f", simpo_gamma={c.simpo_gamma}" if c.loss_type == "simpo" else ""
            return (f"objective=cpo (loss_type={c.loss_type}, beta={c.beta}, "
                    f"cpo_alpha={c.cpo_alpha}{gamma}; no reference; {how})")
        d = self.dpo
        ref = self._kind
        if d.precompute_ref_log_probs:
            ref += ", its log-probabilities precomputed"
        rpo = f", rpo_alpha={d.rpo_alpha}" if d.rpo_alpha else ""
        return (f"objective=dpo (loss_type={d.loss_type}, beta={d.beta}{rpo}; reference: {ref}; "
                f"{how})")

    def _logps(self, model, batch):
        # (not fused: backend=torch or kernels=none, the model's own logits, TRL's computation)
        if self.name == "orpo":  # per token over the whole rows: ORPO's NLL takes the prompt's
            # too (TRL's), the odds ratio the completions' (score); one pass for both
            whole = batch["input_ids"].where(batch["attention_mask"].bool(), -100)
            return sequence_logps(model, batch["input_ids"], whole, batch["attention_mask"],
                                  fused=self.fused, per_token=True,
                                  padding_free=self.padding_free)
        return sequence_logps(model, batch["input_ids"], batch["labels"],
                              batch["attention_mask"], fused=self.fused,
                              padding_free=self.padding_free)

    @staticmethod
    def _unwrap(model):
        """(the causal LM in `model`, the scoring root to call for it or None)."""
        if isinstance(model, nn.parallel.DistributedDataParallel):  # DDP(policy(lm))
            return model.module.lm, None  # (no backward: DDP's reducer is not needed)
        if isinstance(model, _Policy):  # policy(lm): FSDP's root
            return model.lm, model
        return model, None

    @torch.no_grad()
    def _reference(self, model, batch):
        """The reference's log-probabilities of the batch's rows: the batch's precomputed ones
        (ref_logps), else the frozen copy's scoring, else the model's with its adapters off."""
        if "ref_logps" in batch:
            return batch["ref_logps"]
        if self.reference_scorer is not None:
            return self.reference_scorer(batch)
        if not self.adapters and not self._precomputing:
            raise RuntimeError("fastllm train: objective=dpo has no reference for this batch: "
                               "its pairs were not precomputed (dpo.precompute_ref_log_probs)")
        lm, root = self._unwrap(model)
        # (precomputing without adapters: the model as built is the reference)
        with disable_adapters(lm) if self.adapters else contextlib.nullcontext():
            return root(batch) if root is not None else self._logps(lm, batch)

    def score(self, model, batch):
        """(the pairwise loss's result, the step's loss: the pairs' mean plus the NLL term, the
        policy's chosen and rejected log-probabilities as the loss took them, the sums of the
        objective's extra metrics)."""
        logps = self._logps(model, batch) if self._unwrap(model)[0] is model else model(batch)
        # column t scores token t + 1 (sequence_logps' shift)
        labelled = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:] != -100
        lengths = labelled.sum(-1).chunk(2)
        if self.name == "orpo":  # (per token): the chosen rows' whole NLL, as TRL's
            half = len(logps) // 2
            attended = F.pad(batch["attention_mask"], (0, 1))[:, 1:] != 0
            nll = -logps[:half].sum() / attended[:half].sum().clamp(min=1)
            logps = logps.where(labelled, 0.0).sum(-1)
        chosen, rejected = logps.chunk(2)
        if self.name != "orpo":  # the chosen completions' NLL per token (CPO's, RPO's: TRL's)
            nll = -chosen.sum() / lengths[0].sum().clamp(min=1)
        if self.name != "dpo":
            return self._reference_free(chosen, rejected, lengths, nll)
        ref = self._reference(model, batch)
        # ipo / sigmoid_norm divide by the completion's tokens as TRL's DPOTrainer counts them
        # (its mask, unshifted: a completion at position 0, with an empty prompt and no BOS,
        # counts that token too)
        full = (batch["labels"] != -100).sum(-1).chunk(2)
        out = dpo_loss(chosen, rejected, *ref.chunk(2), beta=self.dpo.beta,
                       loss_type=self.dpo.loss_type, label_smoothing=self.dpo.label_smoothing,
                       chosen_lengths=full[0], rejected_lengths=full[1])
        loss = out.loss.mean()
        if self.dpo.rpo_alpha:  # RPO: the chosen completions' mean token NLL (TRL's "sft")
            loss = loss + self.dpo.rpo_alpha * nll
        return out, loss, chosen.detach(), rejected.detach(), ()

    def _reference_free(self, chosen, rejected, lengths, nll):
        """CPO / SimPO / ORPO from the policy's sums of log-probabilities and the NLL term
        (TRL's formulas)."""
        c = self.section
        if self.name == "orpo" or c.loss_type in ("ipo", "simpo"):  # (the completions' means)
            chosen = chosen / lengths[0].clamp(min=1)
            rejected = rejected / lengths[1].clamp(min=1)
        n = chosen.numel()
        if self.name == "orpo":
            out = orpo_loss(chosen, rejected, beta=c.beta)
            loss = nll + out.loss.mean()
            log_odds = orpo_log_odds(chosen.detach(), rejected.detach())
            extra = (nll.detach() * n, F.logsigmoid(log_odds).sum(), log_odds.sum())
        else:
            out = cpo_loss(chosen, rejected, beta=c.beta, loss_type=c.loss_type,
                           label_smoothing=c.label_smoothing, simpo_gamma=c.simpo_gamma)
            loss = out.loss.mean() + (c.cpo_alpha * nll if c.cpo_alpha else 0.0)
            extra = (nll.detach() * n,)
        return out, loss, chosen.detach(), rejected.detach(), extra

    def _add(self, sums, out, chosen, rejected, loss, extra):
        margin = out.chosen_rewards - out.rejected_rewards
        n = margin.numel()
        parts = (out.chosen_rewards.sum(), out.rejected_rewards.sum(), (margin > 0).sum(),
                 margin.sum(), chosen.sum(), rejected.sum(), *extra, loss.detach() * n)
        sums[:-1] += torch.stack([p.double() for p in parts]).cpu()  # (one device sync)
        sums[-1] += n

    def __call__(self, model, batch):
        """The micro-batch's loss (the trainer backwards it); its metrics are kept for
        pop_metrics."""
        out, loss, chosen, rejected, extra = self.score(model, batch)
        self._add(self._sums, out, chosen, rejected, loss, extra)
        return loss

    def pop_metrics(self, device=None):
        """The means over the pairs of the micro-batches since the last call on every rank
        (TRL's names); device: where the sums are all-reduced (NCCL's: the GPU)."""
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            sums = sums.to(device)  # (no tp or pp under DPO: the world is the dp ranks)
            torch.distributed.all_reduce(sums)
            sums = sums.cpu()
        n = float(sums[-1])
        return {k: float(v) / n if n else math.nan for k, v in zip(self.metric_names, sums)}

    @torch.no_grad()
    def evaluate(self, model, dataset, batch_size, device, autocast=None, max_batches=0):
        """The held-out pairs (a PreferenceDataset): eval_loss (the training loss's formula,
        mean over pairs), TRL's eval_rewards/* and eval_logps/*, eval_pairs."""
        from fastllm.train.evaluate import eval_batches

        was_training = model.training
        model.eval()
        sums = torch.zeros_like(self._sums)
        try:
            for batch in eval_batches(dataset, batch_size, device, max_batches):
                with autocast if autocast is not None else contextlib.nullcontext():
                    out, loss, chosen, rejected, extra = self.score(model, batch)
                self._add(sums, out, chosen, rejected, loss, extra)
        finally:
            model.train(was_training)
        n = float(sums[-1])
        metrics = {"eval_" + k: float(v) / n if n else math.nan
                   for k, v in zip(self.metric_names, sums)}
        return {"eval_loss": float(sums[-2]) / n if n else math.nan, **metrics,
                "eval_pairs": int(n)}
