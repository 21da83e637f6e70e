"""Reference-free preference losses: fastllm.preference.cpo_loss (CPO, SimPO) and orpo_loss (ORPO)
against the formulas written out and against TRL's CPOTrainer / ORPOTrainer where trl is
installed (CI has none and skips that part), their grads in fp64, their refusals; and `fastllm
train objective=cpo|orpo`: the step against the formulas over materialised logits, a LoRA run
that keeps no reference, evaluates and resumes, and the config's refusals."""

import math
import shutil
import types

import pytest
import torch
import torch.nn.functional as F

from fastllm.preference import CPO_LOSS_TYPES, cpo_loss, orpo_loss
from fastllm.train import TrainConfig, Trainer
from fastllm.train.config import ConfigError, CPOConfig, DPOConfig, ORPOConfig
from fastllm.train.data import ByteTokenizer
from fastllm.train.preference_data import PreferenceDataset, encode_pair, read_pairs
from fastllm.train.preference_step import PreferenceObjective

from test_train_dpo import _args, _logits_logps, _metrics, _pairs


def _logps(n=6, dtype=torch.float64, seed=0):
    """Mean token log-probabilities of n pairs (negative, as a completion's are)."""
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(n, generator=g, dtype=dtype) * 3 - 0.05,
            -torch.rand(n, generator=g, dtype=dtype) * 3 - 0.05)


def _cpo_formula(c, r, beta, loss_type, ls, gamma):
    d = c - r
    if loss_type == "simpo":
        d = d - gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        return -(1 - ls) * torch.log(torch.sigmoid(beta * d)) - ls * torch.log(
            torch.sigmoid(-beta * d))
    if loss_type == "hinge":
        return torch.clamp(1 - beta * d, min=0)
    return (d - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize("loss_type", CPO_LOSS_TYPES)
def test_cpo_loss_is_the_formula(loss_type):
    c, r = _logps()
    ls = 0.1 if loss_type in ("sigmoid", "simpo") else 0.0
    out = cpo_loss(c, r, beta=0.3, loss_type=loss_type, label_smoothing=ls, simpo_gamma=0.4)
    torch.testing.assert_close(out.loss, _cpo_formula(c, r, 0.3, loss_type, ls, 0.4),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, 0.3 * c)
    torch.testing.assert_close(out.rejected_rewards, 0.3 * r)
    assert not out.chosen_rewards.requires_grad


def test_orpo_loss_is_the_odds_ratio_and_differentiates_near_zero():
    c, r = _logps()
    c[0] = -1e-9  # log(1 - e^c) near its pole: the expm1 branch keeps it finite
    out = orpo_loss(c, r, beta=0.25)
    odds = lambda x: torch.log(-torch.expm1(x)) if x > -0.69 else torch.log1p(-torch.exp(x))
    log_odds = (c - r) - torch.stack([odds(x) - odds(y) for x, y in zip(c, r)])
    torch.testing.assert_close(out.loss, -0.25 * F.logsigmoid(log_odds), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out.loss).all()
    x = torch.stack(_logps(4)).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: orpo_loss(t[0], t[1], beta=0.3).loss, (x,))
    assert torch.autograd.gradcheck(
        lambda t: cpo_loss(t[0], t[1], beta=0.3, loss_type="simpo").loss, (x,))


def test_the_losses_are_trls():
    """TRL 1.16's own CPOTrainer.cpo_loss and ORPOTrainer.odds_ratio_loss, called on a stand-in
    for the trainer (its attributes only)."""
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    c, r = _logps(dtype=torch.float32)
    acc = types.SimpleNamespace(device=torch.device("cpu"))
    for loss_type in CPO_LOSS_TYPES:
        ls = 0.2 if loss_type in ("sigmoid", "simpo") else 0.0
        trainer = types.SimpleNamespace(beta=0.2, label_smoothing=ls, loss_type=loss_type,
                                        simpo_gamma=0.7, alpha=0.0, accelerator=acc)
        theirs = cpo.CPOTrainer.cpo_loss(trainer, c, r)
        ours = cpo_loss(c, r, beta=0.2, loss_type=loss_type, label_smoothing=ls,
                        simpo_gamma=0.7)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=loss_type)
    trainer = types.SimpleNamespace(beta=0.2, accelerator=acc)
    losses, chosen, rejected, _, _ = orpo.ORPOTrainer.odds_ratio_loss(trainer, c, r)
    ours = orpo_loss(c, r, beta=0.2)
    torch.testing.assert_close(ours.loss, -losses)  # (TRL's term is subtracted from the NLL)
    torch.testing.assert_close(ours.chosen_rewards, chosen)
    torch.testing.assert_close(ours.rejected_rewards, rejected)


@pytest.mark.parametrize("call,match", [
    (lambda c, r: cpo_loss(c, r, loss_type="alphapo"), "unknown loss_type 'alphapo'"),
    (lambda c, r: cpo_loss(c, r, beta=0.0), "beta must be a finite number > 0"),
    (lambda c, r: cpo_loss(c, r, loss_type="hinge", label_smoothing=0.1),
     "used by loss_type 'sigmoid' and 'simpo' only"),
    (lambda c, r: cpo_loss(c, r, loss_type="simpo", simpo_gamma=math.inf), "simpo_gamma"),
    (lambda c, r: cpo_loss(c, r[:-1]), "rejected_logps has 5 pairs"),
    (lambda c, r: orpo_loss(c[:, None], r), "chosen_logps must be a 1-d floating tensor"),
    (lambda c, r: orpo_loss(c, r, beta=math.nan), "beta must be a finite number > 0"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call(*_logps())


@pytest.mark.parametrize("name,section", [
    ("cpo", CPOConfig(beta=0.3, cpo_alpha=0.5)),
    ("cpo", CPOConfig(beta=2.0, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.8,
                      label_smoothing=0.1)),
    ("orpo", ORPOConfig(beta=0.4)),
])
@pytest.mark.parametrize("fused", [True, False])
def test_step_equals_trl_formula_over_logits(tmp_path, name, section, fused):
    """The objective's loss, grads and metrics against TRL's step written out on the model's
    logits (pairs of unequal lengths): CPO on the sums plus cpo_alpha x the chosen completions'
    mean token NLL, SimPO on the completions' means, ORPO the chosen rows' NLL over prompt and
    completion (TRL's cross-entropy over every attended token) plus its odds-ratio term on the
    completions' means."""
    from fastllm.train.model import build_model

    cfg = TrainConfig.from_args(_args(tmp_path, _pairs(tmp_path / "p.jsonl"), "finetune=full",
                                      f"objective={name}"))
    model = build_model(cfg, ByteTokenizer().vocab_size, torch.float32)
    objective = PreferenceObjective(DPOConfig(), model, adapters=False, fused=fused,
                                    name=name, section=section)
    assert objective.reference is None and objective.reference_scorer is None
    pairs, wheres = read_pairs(cfg.data.path)
    enc = [encode_pair(p, ByteTokenizer(), w) for p, w in zip(pairs, wheres)]
    batch = PreferenceDataset(enc, wheres, 40, 0, 0).batch(None, rows=[0, 1, 2])
    batch.pop("num_tokens")
    loss = objective(model, batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    c, r = _logits_logps(model, batch).chunk(2)
    nc, nr = (batch["labels"][:, 1:] != -100).sum(-1).chunk(2)
    nll = -c.sum() / nc.sum()
    if name == "orpo":  # TRL's ORPO: labels = input_ids wherever attended, prompt included
        ids, mask = batch["input_ids"][:3], batch["attention_mask"][:3]
        logits = model(input_ids=ids, attention_mask=mask).logits
        whole = ids.where(mask.bool(), -100)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), whole[:, 1:].flatten())
        assert abs(nll + c.sum() / nc.sum()) > 1e-2  # (the prompts' tokens count: another mean)
    if name == "orpo" or section.loss_type == "simpo":
        c, r = c / nc, r / nr
    if name == "orpo":
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        want = nll - (section.beta * F.logsigmoid(log_odds)).mean()
    else:
        want = _cpo_formula(c, r, section.beta, section.loss_type, section.label_smoothing,
                            section.simpo_gamma).mean() + section.cpo_alpha * nll
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    metrics = objective.pop_metrics()
    torch.testing.assert_close(metrics["logps/chosen"], float(c.detach().mean()), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(metrics["rewards/margins"],
                               float(section.beta * (c - r).detach().mean()), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(metrics["nll_loss"], float(nll.detach()), rtol=1e-5, atol=1e-6)
    if name == "orpo":  # TRL's log_odds_chosen and log_odds_ratio
        log_odds = ((c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))).detach()
        torch.testing.assert_close(metrics["log_odds_chosen"], float(log_odds.mean()),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(metrics["log_odds_ratio"],
                                   float(F.logsigmoid(log_odds).mean()), rtol=1e-5, atol=1e-6)


def test_orpo_lora_run_keeps_no_reference_evaluates_and_resumes(tmp_path):
    data = _pairs(tmp_path / "p.jsonl")
    kw = ("objective=orpo", "orpo.beta=0.2", "checkpoint.interval=2", "data.eval_fraction=0.25",
          "eval_interval=2")
    trainer = Trainer(TrainConfig.from_args(_args(tmp_path, data, *kw)))
    trainer.train()
    assert trainer.objective.reference is None and trainer.objective.describe().startswith(
        "objective=orpo (beta=0.2; no reference")
    recs = _metrics(str(tmp_path / "run"))
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[-1]["loss"] < recs[0]["loss"]
    evals = [r for r in recs if r.get("eval_loss") is not None]
    assert len(evals) == 2 and all(r["eval_pairs"] == 4 for r in evals)
    # ORPO's are per-token means: about -log(vocab) for the tiny model (its sums: 5-15x that)
    assert all(-2 * math.log(257) < r["logps/chosen"] < 0 for r in recs), recs
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    Trainer(TrainConfig.from_args(_args(tmp_path, data, *kw))).train()
    again = _metrics(str(tmp_path / "run"))
    keys = ("loss", "grad_norm", "rewards/margins", "eval_loss")
    assert [[r.get(k) for k in keys] for r in again] == [[r.get(k) for k in keys] for r in recs]


@pytest.mark.parametrize("extra,match", [
    (["objective=dpo", "cpo.beta=0.2"], "cpo.beta set but objective=dpo"),
    (["objective=cpo", "orpo.beta=0.2"], "orpo.beta set but objective=cpo"),
    (["objective=orpo", "dpo.rpo_alpha=1"], "dpo.rpo_alpha set but objective=orpo"),
    (["objective=cpo", "cpo.loss_type=alphapo"], "cpo.loss_type must be one of"),
    (["objective=cpo", "cpo.loss_type=ipo", "cpo.label_smoothing=0.1"],
     "sigmoid and simpo only"),
    (["objective=cpo", "cpo.cpo_alpha=-1"], "cpo.cpo_alpha must be"),
    (["objective=orpo", "orpo.beta=0"], "orpo.beta must be finite and > 0"),
    (["objective=orpo", "parallel.pp=2"], "objective=orpo runs on one process, DDP, ZeRO-1/2 or "
                                          "FSDP for now .*got tp=1 pp=2"),
    (["objective=cpo", "finetune=prefix"], "objective=cpo with finetune=prefix: not supported"),
])
def test_config_refusals_name_the_key(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_args(_args(tmp_path, _pairs(tmp_path / "p.jsonl"), *extra))
