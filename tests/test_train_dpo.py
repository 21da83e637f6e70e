"""`fastllm train objective=dpo`: preference pairs through the trainer (tiny models, CPU): the step
against TRL's formulas over materialised logits, the reference (adapters off, or a frozen copy of
the model as built), evaluation, metrics, resume, DDP, the CLI's --compare torch, and the
refusals."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastllm.parallel import _torch_support
from fastllm.train import TrainConfig, Trainer
from fastllm.train.config import ConfigError, DPOConfig
from fastllm.train.data import ByteTokenizer
from fastllm.train.metrics import read_metrics
from fastllm.train.preference_data import PreferenceDataset, encode_pair, read_pairs
from fastllm.train.preference_step import PreferenceObjective

from _tiny_tokenizer import tiny_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _pairs(path, n=16, chat=False, lengths=2):
    with open(path, "w") as f:
        for i in range(n):
            prompt, good, bad = (f"What is the capital of France? {i}",
                                 "Paris." * (1 + i % lengths),
                                 "The capital is Paris, in France.")
            if chat:
                rec = {"prompt": [{"role": "user", "content": prompt}],
                       "chosen": [{"role": "assistant", "content": good}],
                       "rejected": [{"role": "assistant", "content": bad}]}
            else:
                rec = {"prompt": prompt, "chosen": " " + good, "rejected": " " + bad}
            f.write(json.dumps(rec) + "\n")
    return str(path)


def _args(tmp_path, data, *extra, out="run"):
    return ["model=tiny", "objective=dpo", "finetune=lora", f"data.path={data}",
            "data.seq_len=48", "micro_batch_size=2", "global_batch_size=4", "max_steps=4",
            "lr=1e-2", "min_lr=1e-3", "warmup_steps=0", "threads=1", "log_interval=1000",
            "track_memory=false", f"data.cache_dir={tmp_path / 'cache'}",
            f"output_dir={tmp_path / out}", *extra]


def _cfg(tmp_path, data, *extra, out="run"):
    return TrainConfig.from_args(_args(tmp_path, data, *extra, out=out))


def _metrics(run):
    return read_metrics(os.path.join(run, "metrics.jsonl"))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    tiny_bpe(CHATML, pad="<|im_end|>").save_pretrained(path)
    return path


def test_chat_pairs_lora_run_evaluates_logs_trl_metrics_and_resumes_bitwise(tmp_path, tok_dir,
                                                                           capsys):
    from fastllm.train.evaluate import read_eval

    data = _pairs(tmp_path / "pairs.jsonl", chat=True)
    kw = ("data.eval_fraction=0.25", f"data.tokenizer={tok_dir}", "eval_interval=2",
          "checkpoint.interval=2")
    Trainer(_cfg(tmp_path, data, *kw)).train()
    run = str(tmp_path / "run")
    recs = _metrics(run)
    # LoRA's B starts at 0: the policy is the reference, every reward 0, the loss log 2
    assert recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert recs[0]["rewards/chosen"] == recs[0]["rewards/rejected"] == 0.0
    for r in recs:
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"],
                                                     abs=1e-6)
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
        assert r["logps/chosen"] < 0 and r["logps/rejected"] < 0
    assert recs[-1]["loss"] < recs[0]["loss"] and recs[-1]["rewards/margins"] > 0
    evals = read_eval(os.path.join(run, "metrics.jsonl"))
    assert [e["eval_step"] for e in evals] == [0, 2, 4]
    assert all(e["eval_pairs"] == 4 for e in evals)  # 16 x 0.25 held out
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert os.path.isfile(os.path.join(run, "checkpoint-4", "adapter", "adapter_config.json"))
    # resume from checkpoint-2: steps 3-4 and their evaluation again, bitwise
    shutil.rmtree(os.path.join(run, "checkpoint-4"))
    Trainer(_cfg(tmp_path, data, *kw)).train()
    again = _metrics(run)
    keys = ("loss", "grad_norm", "rewards/margins", "logps/chosen", "eval_loss")
    assert [[r.get(k) for k in keys] for r in again] == [[r.get(k) for k in keys] for r in recs]
    from fastllm.cli import main

    main(["report", run, "--out", str(tmp_path / "r.png")])
    assert "reward accuracy" in capsys.readouterr().out


def _logits_logps(model, batch):
    """TRL's: the model's logits, log_softmax, the labels' entries summed per row."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    logp = logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, labels.where(keep, 0)[..., None])[..., 0].where(keep, 0.0).sum(-1)


def test_describe_says_the_route_the_scoring_takes():
    """The start line said "fused, no logits" for any model with fastllm's kernels on, while a
    family fastllm.patch does not know (GPT-2 here) is scored from its logits: it says so now."""
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=1, n_head=4, n_positions=32)).eval()
    objective = PreferenceObjective(DPOConfig(), gpt2, adapters=False, fused=True)
    assert "from the logits" in objective.describe() and not objective.fused
    with pytest.raises(ValueError, match="data.padding_free=true takes the families"):
        PreferenceObjective(DPOConfig(), gpt2, adapters=False, fused=True, padding_free=True)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    assert "fused, no logits" in PreferenceObjective(DPOConfig(), llama, adapters=False,
                                                     fused=True).describe()


@pytest.mark.parametrize("loss_type,rpo", [("sigmoid", 0.0), ("ipo", 0.5)])
@pytest.mark.parametrize("fused", [True, False])
def test_step_equals_trl_formula_over_logits_with_a_frozen_reference(tmp_path, loss_type, rpo,
                                                                    fused):
    """finetune=full: the objective's loss and grads against the formulas written out on the
    logits of the policy and of an untouched copy (TRL's ref_model), pairs of unequal lengths,
    one with an empty prompt (its completion from position 0: IPO divides by all its tokens, as
    TRL's completion mask counts them, the first one included)."""
    from fastllm.train.model import build_model

    data = _pairs(tmp_path / "p.jsonl")
    with open(data, "a") as f:
        f.write(json.dumps({"prompt": "", "chosen": "ab", "rejected": "abcd"}) + "\n")
    cfg = _cfg(tmp_path, data, "finetune=full")
    model = build_model(cfg, ByteTokenizer().vocab_size, torch.float32)
    frozen = build_model(cfg, ByteTokenizer().vocab_size, torch.float32)
    frozen.load_state_dict(model.state_dict())
    dpo = DPOConfig(beta=0.3, loss_type=loss_type, rpo_alpha=rpo)
    objective = PreferenceObjective(dpo, model, adapters=False, fused=fused)
    with torch.no_grad():  # the policy moves away from the reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pairs, wheres = read_pairs(cfg.data.path)
    enc = [encode_pair(p, ByteTokenizer(), w) for p, w in zip(pairs, wheres)]
    data = PreferenceDataset(enc, wheres, 40, 0, 0)
    batch = data.batch(None, rows=[0, 1, 16])
    batch.pop("num_tokens")
    assert batch["labels"][2, 0] != -100  # (the empty prompt's pair)
    loss = objective(model, batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logps = _logits_logps(model, batch)
    with torch.no_grad():
        ref = _logits_logps(frozen, batch)
    n = (batch["labels"][:, 1:] != -100).sum(-1)
    c, r = logps.chunk(2)
    rc, rr = ref.chunk(2)
    nc, nr = n.chunk(2)
    if loss_type == "sigmoid":
        want = -F.logsigmoid(0.3 * ((c - rc) - (r - rr))).mean()
    else:  # IPO: TRL's length-averaged log ratios, over its (unshifted) completion mask
        lc, lr = (batch["labels"] != -100).sum(-1).chunk(2)
        want = (((c - rc) / lc - (r - rr) / lr) - 1 / (2 * 0.3)).pow(2).mean()
    want = want + rpo * (-c.sum() / nc.sum())
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the reference is the model as it was handed over, frozen
    for (name, a), b in zip(objective.reference.named_parameters(), frozen.parameters()):
        assert not a.requires_grad and torch.equal(a, b), name
    metrics = objective.pop_metrics()
    torch.testing.assert_close(metrics["logps/chosen"], float(c.detach().mean()), rtol=1e-5,
                               atol=1e-5)
    assert objective.pop_metrics()["rewards/chosen"] != objective.pop_metrics()["rewards/chosen"]


def test_full_finetune_reference_stays_the_built_model_across_resume(tmp_path):
    data = _pairs(tmp_path / "p.jsonl")
    t = Trainer(_cfg(tmp_path, data, "finetune=full", "checkpoint.interval=2"))
    t.train()
    from fastllm.train.model import build_model

    built = build_model(t.cfg, ByteTokenizer().vocab_size, torch.float32).state_dict()
    moved = t.module.state_dict()
    ref = t.objective.reference.state_dict()
    assert all(torch.equal(ref[k], built[k]) for k in built)
    assert any(not torch.equal(moved[k], built[k]) for k in built)
    run = str(tmp_path / "run")
    full = _metrics(run)
    shutil.rmtree(os.path.join(run, "checkpoint-4"))
    again = Trainer(_cfg(tmp_path, data, "finetune=full", "checkpoint.interval=2"))
    again.train()
    assert [r["loss"] for r in _metrics(run)] == [r["loss"] for r in full]
    ref = again.objective.reference.state_dict()
    assert all(torch.equal(ref[k], built[k]) for k in built)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_precomputed_reference_trains_alike_frees_the_copy_and_resumes_bitwise(tmp_path,
                                                                               finetune):
    """dpo.precompute_ref_log_probs (TRL's): the reference scored once before step 1, in the
    data's order, served in the batches; the same losses as scoring it every step, the frozen
    copy freed, and a resume (which scores it again) bitwise."""
    data = _pairs(tmp_path / "p.jsonl")
    kw = (f"finetune={finetune}", "data.eval_fraction=0.25", "eval_interval=2",
          "checkpoint.interval=2", "track_memory=true")
    Trainer(_cfg(tmp_path, data, *kw, out="every")).train()
    t = Trainer(_cfg(tmp_path, data, *kw, "dpo.precompute_ref_log_probs=true"))
    t.train()
    assert t.objective.reference is None and t.objective.precomputed
    if finetune == "full":  # (no copy was made: the model itself was scored before step 1)
        assert t.objective.describe().count("the model as built") == 1
    assert t.dataset.ref_logps.shape == (12, 2) and t.eval_dataset.ref_logps.shape == (4, 2)
    # (the train set's pairs are scored in batches of another make-up: rounding apart)
    every, pre = _metrics(str(tmp_path / "every")), _metrics(str(tmp_path / "run"))
    for key in ("loss", "grad_norm", "rewards/chosen", "eval_loss"):
        torch.testing.assert_close([r.get(key) for r in pre], [r.get(key) for r in every],
                                   rtol=1e-5, atol=1e-6, msg=key)
    # the step's tensor peak counts the frozen copy while it is held
    weights = sum(p.numel() * p.element_size() for p in t.module.parameters())
    freed = every[0]["peak_mem_bytes"] - pre[0]["peak_mem_bytes"]
    assert freed >= weights if finetune == "full" else freed >= 0
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    Trainer(_cfg(tmp_path, data, *kw, "dpo.precompute_ref_log_probs=true")).train()
    again = _metrics(str(tmp_path / "run"))
    assert [(r.get("loss"), r.get("eval_loss")) for r in again] == [
        (r.get("loss"), r.get("eval_loss")) for r in pre]


def test_eval_path_and_epochs(tmp_path):
    """data.eval_path holds the held-out pairs out of data.path; num_train_epochs counts pairs."""
    data = _pairs(tmp_path / "p.jsonl", n=10)
    held = _pairs(tmp_path / "held.jsonl", n=3, chat=False)
    t = Trainer(_cfg(tmp_path, data, f"data.eval_path={held}", "max_steps=-1",
                     "num_train_epochs=2", "eval_interval=0"))
    t.train()
    assert t.dataset.num_sequences == 10 and t.eval_dataset.num_sequences == 3
    from fastllm.train.evaluate import read_eval

    assert [r["step"] for r in _metrics(str(tmp_path / "run"))] == [1, 2, 3, 4, 5]  # 2 x 10 / 4
    evals = read_eval(str(tmp_path / "run" / "metrics.jsonl"))
    assert [(e["eval_step"], e["eval_pairs"]) for e in evals] == [(0, 3), (5, 3)]


def test_resuming_another_objective_is_refused(tmp_path):
    Trainer(TrainConfig.from_args(["model=tiny", "max_steps=2", "data.seq_len=32",
                                   "micro_batch_size=2", "threads=1", "track_memory=false",
                                   f"data.cache_dir={tmp_path / 'cache'}",
                                   f"output_dir={tmp_path / 'run'}"])).train()
    with pytest.raises(ConfigError, match="trained with objective=lm, this run has objective=dpo"):
        Trainer(_cfg(tmp_path, _pairs(tmp_path / "p.jsonl"), "finetune=full")).train()


def test_without_adapters_a_batch_needs_its_precomputed_reference(tmp_path):
    from fastllm.train.model import build_model

    cfg = _cfg(tmp_path, _pairs(tmp_path / "p.jsonl"), "finetune=full")
    model = build_model(cfg, ByteTokenizer().vocab_size, torch.float32)
    objective = PreferenceObjective(DPOConfig(precompute_ref_log_probs=True), model,
                                    adapters=False, fused=True)
    assert objective.reference is None  # (no copy: the model is scored before step 1)
    pairs, wheres = read_pairs(cfg.data.path)
    data = PreferenceDataset([encode_pair(p, ByteTokenizer(), w) for p, w in zip(pairs, wheres)],
                             wheres, 40, 0, 0)
    batch = data.batch(None, rows=[0, 1])
    batch.pop("num_tokens")
    with pytest.raises(RuntimeError, match="were not precomputed"):
        objective(model, batch)


def test_dataset_orders_pairs_per_epoch_truncates_and_drops(tmp_path):
    tok = ByteTokenizer()
    pairs, wheres = read_pairs(_pairs(tmp_path / "p.jsonl", n=6))
    enc = [encode_pair(p, tok, w) for p, w in zip(pairs, wheres)]
    prompt_len = len(tok.encode(json.loads(open(tmp_path / "p.jsonl").readline())["prompt"]))
    data = PreferenceDataset(enc, wheres, 64, seed=3, pad_id=0)
    assert data.num_sequences == 6 and data.dropped == 0
    for epoch in range(2):
        assert sorted(data.row(epoch * 6 + i) for i in range(6)) == list(range(6))
    b = data.batch([0, 1, 2])
    assert b["input_ids"].shape[0] == 6 and b["input_ids"].shape[1] <= 64
    assert int(b["num_tokens"]) == int(b["attention_mask"].sum())
    # chosen rows first: row k and row k + 3 share their prompt
    i = b["input_ids"]
    assert torch.equal(i[0, :prompt_len], i[3, :prompt_len])
    # a side cut to no completion token is dropped (prompt i has len(str(i)) more characters)
    short = PreferenceDataset(enc, wheres, prompt_len + 1, seed=3, pad_id=0)
    assert short.num_sequences == 6 and short.truncated == 6
    none = PreferenceDataset(enc, wheres, prompt_len, seed=3, pad_id=0)
    assert none.num_sequences == 0 and none.dropped == 6


@pytest.mark.parametrize("extra,match", [
    (["objective=ppo"], "objective must be one of"),
    (["objective=lm", "dpo.beta=0.2", "data.path=null"], "dpo.beta set but objective=lm"),
    (["dpo.loss_type=sigmod"], "dpo.loss_type must be one of"),
    (["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"], "sigmoid and robust only"),
    (["dpo.beta=nan"], "dpo.beta must be finite"),
    (["dpo.rpo_alpha=-1"], "dpo.rpo_alpha must be"),
    (["finetune=prefix"], "finetune=prefix"),
    (["parallel.tp=2"], "one process, DDP, ZeRO-1/2 or FSDP for now .*got tp=2 pp=1"),
    (["data.train_on_prompt=true"], "train_on_prompt must be false"),
    (["objective=lm", "data.path=null", "data.padding_free=true"],
     "data.padding_free is for objective=dpo"),
    (["lora.dropout=0.05"], "set lora.dropout=0, or dpo.disable_dropout=false"),
    (["objective=orpo", "lora.dropout=0.1"], "orpo.disable_dropout=false to train with"),
])
def test_config_refusals_name_the_key(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, _pairs(tmp_path / "p.jsonl"), *extra)


def test_dropout_is_off_as_in_trl_unless_asked_for(tmp_path, tok_dir):
    """TRL's disable_dropout (its default): every nn.Dropout of the model p=0, so at step 1
    (the policy is the reference) DPO's rewards are 0 and its loss log 2; with the model's
    dropout on (Phi-3's resid_pdrop) they were noise. dpo.disable_dropout=false keeps it."""
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    folder = str(tmp_path / "phi3")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=128, resid_pdrop=0.1, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)).save_pretrained(folder)
    data = _pairs(tmp_path / "p.jsonl", n=4)
    for disable in ("true", "false"):
        out = f"run_{disable}"
        Trainer(_cfg(tmp_path, data, f"model={folder}", "finetune=full", "max_steps=1",
                     f"dpo.disable_dropout={disable}", out=out)).train()
        first = _metrics(str(tmp_path / out))[0]
        off = abs(first["loss"] - math.log(2)) < 1e-6 and first["rewards/margins"] == 0
        assert off == (disable == "true"), (disable, first["loss"], first["rewards/margins"])


def test_bad_data_is_refused_before_the_run_folder_is_written(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("plain text " * 50)
    with pytest.raises(ConfigError, match="preference records"):
        _cfg(tmp_path, str(text))
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"})
    bad.write_text(good + "\n" + json.dumps({"prompt": "a", "chosen": " b"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl line 2.*'rejected'"):
        Trainer(_cfg(tmp_path, str(bad))).train()
    assert not os.path.exists(tmp_path / "run")
    # every pair cut to no completion token by data.seq_len
    with pytest.raises(ValueError, match="raise data.seq_len"):
        Trainer(_cfg(tmp_path, _pairs(tmp_path / "p.jsonl"), "data.seq_len=8")).train()
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_padding_free_trains_as_padded(tmp_path, objective, capsys):
    """data.padding_free=true scores each micro-batch's rows as one row without padding: the
    same run, step for step (ORPO: the per-token path, its NLL over the chosen rows)."""
    data = _pairs(tmp_path / "p.jsonl")
    extra = (f"objective={objective}", "max_steps=3")
    runs = []
    for free in ("false", "true"):
        Trainer(_cfg(tmp_path, data, *extra, f"data.padding_free={free}", out=free)).train()
        runs.append(_metrics(str(tmp_path / free)))
    assert "without padding (data.padding_free)" in capsys.readouterr().err
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"):
        torch.testing.assert_close([r[key] for r in runs[1]], [r[key] for r in runs[0]],
                                   rtol=1e-4, atol=1e-6, msg=key)
    assert runs[0][-1]["loss"] != runs[0][0]["loss"]  # (it trained)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_torch_compile_trains_as_eager(tmp_path, finetune):
    """torch_compile=true compiles the decoder layers the pairs' scoring runs (no graph break,
    no graph per step): the eager run's losses, grads and log-probabilities. A full fine-tune's
    frozen reference copy has its layers compiled too."""
    from torch._dynamo.utils import counters

    from fastllm.parallel import decoder_layers

    data = _pairs(tmp_path / "p.jsonl")
    runs = []
    for compiled in ("false", "true"):
        torch._dynamo.reset()
        counters.clear()
        trainer = Trainer(_cfg(tmp_path, data, "max_steps=3", f"torch_compile={compiled}",
                               f"finetune={finetune}", out=compiled))
        trainer.train()
        assert not counters["graph_break"], dict(counters["graph_break"])
        reference = trainer.objective.reference
        assert (reference is None) == (finetune == "lora")
        for layer in decoder_layers(reference) if reference is not None else ():
            assert (layer._compiled_call_impl is not None) == (compiled == "true")
        # lora: the first layer (its input off the frozen embedding needs no grad) and the
        # second in the step, both in the reference's no-grad scoring: 3 whatever the number of
        # steps (5 while disabling the adapters left a flag in the LoRA layers' __dict__); full:
        # the step's layers, and the frozen copy's in eval mode without grad (1 while it ran
        # eagerly)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == (0 if compiled == "false" else 3 if finetune == "lora" else 2), graphs
        runs.append(_metrics(str(tmp_path / compiled)))
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
        torch.testing.assert_close([r[key] for r in runs[1]], [r[key] for r in runs[0]],
                                   rtol=1e-4, atol=1e-6, msg=key)


def test_torch_compile_keeps_every_layer_graph_it_needs(tmp_path, monkeypatch):
    """LoRA DPO compiled, with half the layers checkpointed, held-out pairs evaluated and pairs of
    several lengths: the decoder layers (one code object) need a graph for each mix of
    checkpointing, grad mode, train/eval mode, the first layer's input, the adapters disabled and
    static/dynamic lengths, more than dynamo's default limit of 8, past which it ran the layers
    eagerly (fastllm train raises it for the run): the eager run's metrics. A second compiled run
    in the process (bf16, no dynamo reset) gets its share of graphs over the first run's, which
    stay on the same code object (as in --compare torch)."""
    from torch._dynamo.utils import counters

    import fastllm.train.model

    # (a run's share of graphs, lowered so that the first run's 16 would use up the second's)
    monkeypatch.setattr(fastllm.train.model, "LAYER_GRAPHS", 20)
    data = _pairs(tmp_path / "p.jsonl", n=40, lengths=7)
    runs = []
    torch._dynamo.reset()
    for compiled in ("false", "true", "bf16"):
        counters.clear()
        extra = ("precision=bf16",) if compiled == "bf16" else ()
        # (aot_eager: dynamo's graphs and limits as inductor's, without inductor's codegen)
        if compiled != "false":
            extra += ("torch_compile_backend=aot_eager",)
        Trainer(_cfg(tmp_path, data, "max_steps=4", "data.eval_fraction=0.2", "eval_interval=2",
                     "checkpoint_ratio=0.5", f"torch_compile={compiled != 'false'}", *extra,
                     out=compiled)).train()
        assert not counters["graph_break"], dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 8 if compiled != "false" else graphs == 0, graphs  # (16 in torch 2.13)
        runs.append(_metrics(str(tmp_path / compiled)))
    assert any("eval_loss" in r for r in runs[0])
    for key in ("loss", "grad_norm", "eval_loss"):
        torch.testing.assert_close([r[key] for r in runs[1] if key in r],
                                   [r[key] for r in runs[0] if key in r], rtol=1e-4, atol=1e-6,
                                   msg=key)


def test_compare_torch_runs_peft_on_the_logits(tmp_path, capsys):
    from fastllm.cli import main

    data = _pairs(tmp_path / "p.jsonl")
    out = str(tmp_path / "c")
    main(["train", "--compare", "torch", "model=tiny", "objective=dpo", "finetune=lora",
          f"data.path={data}", "data.seq_len=48", "micro_batch_size=4", "max_steps=3",
          "warmup_steps=0", "lr=1e-2", "threads=1", f"output_dir={out}",
          f"data.cache_dir={tmp_path / 'cache'}"])
    assert "fastllm / torch tokens/s" in capsys.readouterr().out
    ours, peft = _metrics(out), _metrics(out + "-torch")
    for recs in (ours, peft):
        assert recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        # a reference left with its adapters on would keep the loss at log 2
        assert recs[-1]["loss"] < math.log(2) - 0.01
    # PEFT's A matrices drawn as fastllm's (fastllm.train.model): the same run step for step
    for key in ("loss", "logps/chosen", "rewards/margins"):
        torch.testing.assert_close([r[key] for r in peft], [r[key] for r in ours], rtol=1e-4,
                                   atol=1e-6, msg=key)
    with pytest.raises(SystemExit, match="TRL's DPOTrainer"):
        main(["train", "--compare", "hf", "model=tiny", "objective=dpo", f"data.path={data}",
              f"output_dir={tmp_path / 'h'}"])


def test_zero_keeps_the_preference_scoring_fused(tmp_path):
    """Under ZeRO the objective's log-probabilities stay fused (no logits): DistributedOptimizer
    gathers the params at once after a step, where its overlapped gather's forward pre-hooks
    (objective=lm) made fastllm.preference fall back to the whole logits, unseen."""
    import torch.distributed as dist

    from fastllm.preference import _fused_route
    from fastllm.train import optimizers
    from fastllm.train.model import build_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        routes = {}
        for objective in ("dpo", "lm"):
            extra = () if objective == "dpo" else ("data.path=null",)
            cfg = _cfg(tmp_path, _pairs(tmp_path / "p.jsonl"), f"objective={objective}",
                       "parallel.strategy=zero2", *extra)
            model = build_model(cfg, 300, torch.float32)
            optimizers.build(cfg, model, "cpu", 2, True)
            routes[objective] = _fused_route(model) is not None
        assert routes == {"dpo": True, "lm": False}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy,finetune,precompute,objective", [
    ("ddp", "lora", False, "dpo"), ("ddp", "full", True, "dpo"), ("fsdp", "lora", True, "dpo"),
    ("fsdp", "full", False, "dpo"),
    pytest.param("fsdp", "qlora", False, "orpo", marks=pytest.mark.skipif(
        _torch_support.TORCH < _torch_support.FSDP2_INTEGER_PARAMS,
        reason="this torch's FSDP2 cannot shard integer parameters (fastllm refuses it)")),
    ("zero2", "lora", True, "dpo"), ("zero2", "full", False, "dpo"),
    ("zero1", "full", False, "cpo")])
def test_two_processes_train_as_one_and_resume_in_one(tmp_path, strategy, finetune, precompute,
                                                      objective):
    """DDP and FSDP wrap the pairs' scoring (DDP's reducer and FSDP's root see its forward; FSDP
    shards the frozen reference copy alike, and precomputes the reference in equal shares);
    ZeRO-1/2 leave the model unwrapped, DistributedOptimizer reducing the scoring's grads:
    two ranks of 2 pairs a micro-batch give one process's losses and metrics at the same global
    batch, and their checkpoint resumes in one process (DPO, and reference-free ORPO over a
    4-bit base whose codes FSDP2 shards: FSDP-QLoRA)."""
    data = _pairs(tmp_path / "p.jsonl")
    qlora = ("lora.quantize_base=nf4",) if finetune == "qlora" else ()
    finetune = "lora" if qlora else finetune
    kw = (f"finetune={finetune}", *qlora, "checkpoint.interval=2", f"objective={objective}",
          "data.eval_fraction=0.25", "eval_interval=2") + (
        ("dpo.precompute_ref_log_probs=true",) if precompute else ())
    Trainer(_cfg(tmp_path, data, *kw, out="one")).train()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port",
           str(29500 + (os.getpid() + 37 + len(strategy + finetune + objective)) % 1000),
           "-m", "fastllm", "train", *_args(tmp_path, data, *kw, f"parallel.strategy={strategy}",
                                            out="two")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert f"strategy={strategy}" in done.stderr.decode()
    if qlora:  # (the start line: each rank holds its share of the 4-bit base)
        assert "MiB on this rank)" in done.stderr.decode()
    one, two = _metrics(str(tmp_path / "one")), _metrics(str(tmp_path / "two"))

    def close(a, b):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "eval_loss"):
            torch.testing.assert_close([r.get(key) for r in a], [r.get(key) for r in b],
                                       rtol=1e-4, atol=1e-6, msg=key)

    close(two, one)
    shutil.rmtree(tmp_path / "two" / "checkpoint-4")
    Trainer(_cfg(tmp_path, data, *kw, out="two")).train()
    close(_metrics(str(tmp_path / "two")), one)
