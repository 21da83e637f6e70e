"""fastllm train takes what the user wrote, and a resume or a cache keeps nothing stale: numbers
with exponents are whole or refused, list items are trimmed and prompts keep their commas; a
resume applies this run's optimizer hyperparameters (the checkpoint's param groups brought back
their own) and refuses another GaLore rank before anything is written; a tokenizer folder's
token cache follows its files, not its path; TensorBoard's events are purged after a resume's or
a rollback's step, as metrics.jsonl's lines are; the length-grouped order is the same at any
micro_batch_size; train() leaves the caller's config as given, and config.yaml keeps its
max_steps; model_config takes what LlamaConfig takes (rope_theta) (tiny model, one thread, a few
steps)."""

import copy
import json
import os
import random
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import yaml

from fastllm.train import TrainConfig, Trainer
from fastllm.train.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def run(cache_dir, output_dir, *extra, log=None):
    args = ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "lr=1e-2", "warmup_steps=1",
            "threads=1", "log_interval=1000", "track_memory=false", "checkpoint.interval=0",
            f"data.cache_dir={cache_dir}", f"output_dir={output_dir}", *extra]
    return Trainer(TrainConfig.from_args(args), log=log or (lambda text: None)).train()


@pytest.mark.parametrize("value", ["5e-1", "2.5e0", "1e400", "1.5"])
def test_an_int_key_refuses_a_fraction_or_overflow(value):
    with pytest.raises(ConfigError, match=f"checkpoint.interval='{value}' is not a valid int"):
        TrainConfig.from_args([f"checkpoint.interval={value}"])


def test_list_items_are_trimmed_and_a_prompt_keeps_its_commas():
    cfg = TrainConfig.from_args(["lora.target_modules=q_proj, v_proj", "max_steps=1e3",
                                 "eval.prompts=What is 2, 3?"])
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.max_steps == 1000
    assert cfg.eval.prompts == ["What is 2, 3?"]
    assert TrainConfig.from_args(['eval.prompts=["a, b", c]']).eval.prompts == ["a, b", "c"]


def test_resume_applies_new_hyperparameters_and_refuses_another_galore_rank(tmp_path):
    cache, out = str(tmp_path / "cache"), str(tmp_path / "run")
    gal = ("finetune=galore", "galore.rank=4")
    run(cache, out, "max_steps=1", *gal)
    with pytest.raises(ConfigError, match="trained with galore.rank=4, this run has galore.rank=8"):
        run(cache, out, "max_steps=2", "finetune=galore", "galore.rank=8")
    with open(os.path.join(out, "config.yaml")) as f:  # the refused run wrote nothing
        assert yaml.safe_load(f)["galore"]["rank"] == 4
    said = []
    s = run(cache, out, "max_steps=2", *gal, "weight_decay=0.5", "betas=[0.8,0.9]",
            log=said.append)
    assert s["resumed_from"].endswith("checkpoint-1")
    assert any("with weight_decay=0.5 (it was trained with 0.1)" in line for line in said), said
    groups = torch.load(os.path.join(out, "checkpoint-2", "optimizer.pt"),
                        weights_only=True)["param_groups"]
    assert [g["weight_decay"] for g in groups][:1] == [0.5] and 0.0 in [
        g["weight_decay"] for g in groups]  # the no-decay group stays undecayed
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)


def _bpe_folder(folder, seed):
    """A 300-token byte-level BPE saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([" ".join(words)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        folder)


def test_a_tokenizer_folder_cache_follows_its_files(tmp_path):
    from fastllm.train.data import build_tokenizer, tokenize_to_file

    folder, docs = str(tmp_path / "tok"), ["some text to tokenize, twice over"]
    made = []
    for seed in (0, 1):  # two tokenizers of one size, saved in turn into one folder
        _bpe_folder(folder, seed)
        tok = build_tokenizer(folder, docs, 0, str(tmp_path / "cache"))
        made.append((tok.vocab_size, tokenize_to_file(docs, tok, str(tmp_path / "cache"))))
    assert made[0][0] == made[1][0] and made[0][1] != made[1][1]


def test_tensorboard_events_after_a_resumed_or_rewound_step_are_purged(tmp_path, monkeypatch):
    from fastllm.train import run_dir
    from fastllm.train.metrics import MetricsWriter

    opened = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            opened.append(purge_step)

        def close(self):
            pass

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    cfg = SimpleNamespace(log_interval=1, report_to="tensorboard")
    writer = MetricsWriter(cfg, str(tmp_path), True, 10, 3)  # resumed at step 3
    writer.rewind(5)  # a rollback to step 5
    writer.close()
    assert opened == [4, 6]
    os.makedirs(tmp_path / "tensorboard")
    assert "tensorboard" in run_dir.previous_run(str(tmp_path))  # overwrite_output_dir clears it


def _saved_state():
    return {"step": 3, "data": {"position": 24, "global_batch": 8},
            "rng": [{"torch": torch.get_rng_state(), "python": random.getstate()}],
            "counters": {"skipped": 0, "bad_in_a_row": 0, "rollbacks": 0}}


@pytest.mark.parametrize("edit,says", [
    (lambda s: s.pop("counters"), "counters needs int skipped"),
    (lambda s: s["data"].update(position="24"), "data needs int position"),
    (lambda s: s["data"].update(position=-8), "data position -8 < 0"),
    (lambda s: s.update(step=-1), "no step count"),
    (lambda s: s.pop("rng"), "no rng states"),
    # each was a bare KeyError or RuntimeError at restore_rng, or (a string) taken as the
    # states of another world size
    (lambda s: s.update(rng="abc"), "rng is a str, not a list of per-rank states"),
    (lambda s: s.update(rng=[]), "rng is an empty list"),
    (lambda s: s.update(rng=[{}]), "rng of rank 0: it has no torch or python state"),
    (lambda s: s["rng"].append(3), "rng of rank 1: it is a int, not a mapping"),
    (lambda s: s["rng"][0].update(torch=torch.zeros(5, dtype=torch.uint8)),
     "rng of rank 0: its torch state cannot be restored .*size"),
    (lambda s: s["rng"][0].update(torch=torch.get_rng_state().float()),
     "rng of rank 0: its torch state is not a uint8 tensor"),
    (lambda s: s["rng"][0].update(python=(3, (1, 2), None)),
     "rng of rank 0: its python state cannot be restored"),
])
def test_a_malformed_trainer_state_is_refused_naming_the_file(edit, says):
    from fastllm.train import checkpoint_layout

    state = _saved_state()
    checkpoint_layout.check_trainer_state(state, "ckpt", 8)  # what save_checkpoint writes
    edit(state)
    before = torch.get_rng_state(), random.getstate()
    with pytest.raises(ValueError, match=f"ckpt/trainer_state.pt is malformed: {says}"):
        checkpoint_layout.check_trainer_state(state, "ckpt", 8)
    # the states were tried on scratch generators: this process's streams are untouched
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    with pytest.raises(ValueError, match="is malformed: a list"):
        checkpoint_layout.check_trainer_state([1], "ckpt", 8)
    with pytest.raises(ValueError, match="global_batch_size=8, this run has 16"):
        checkpoint_layout.check_trainer_state(_saved_state(), "ckpt", 16)


def test_a_state_that_does_not_fit_is_refused_before_loading(tmp_path):
    """A ZeRO checkpoint (one param group) into a two-group optimizer is refused by name before
    anything loads; any other misfit names the files."""
    from fastllm.train import checkpoint_layout

    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    loads = []
    strategy = SimpleNamespace(
        optimizer=torch.optim.AdamW([{"params": [p]}, {"params": [q], "weight_decay": 0.0}]),
        load=lambda model, optim: loads.append(optim) or strategy.optimizer.load_state_dict(
            optim))
    one_group = {"state": {}, "param_groups": [dict(strategy.optimizer.param_groups[0],
                                                    params=[0, 1])]}
    with pytest.raises(ConfigError, match="holds 1 param groups, this run's optimizer 2: .*zero"):
        checkpoint_layout.load_state(strategy, None, one_group, "ckpt", print)
    assert loads == []
    with pytest.raises(ValueError, match="ckpt: optimizer.pt does not fit"):
        checkpoint_layout.load_state(strategy, None, {"state": 1, "param_groups": [{}, {}]},
                                     "ckpt", print)
    # groups that differ only by an empty one pair up (ZeRO keeps only groups with params: a LoRA
    # run's [decayed] against the other strategies' [decayed, []]), both ways
    two = torch.optim.AdamW([{"params": [p]}, {"params": [], "weight_decay": 0.0}])
    one = torch.optim.AdamW([p])
    for saver, loader in ((one, two), (two, one)):
        p.grad = torch.ones(3)
        saver.step()
        strategy.optimizer, loads[:] = loader, []
        checkpoint_layout.load_state(strategy, None, copy.deepcopy(saver.state_dict()), "ckpt",
                                     print)
        assert len(loads) == 1
        assert torch.equal(loader.state[p]["exp_avg"], saver.state[p]["exp_avg"])


def test_the_length_grouped_order_is_the_same_at_any_micro_batch_size(tmp_path):
    """data.packing=false groups rows by length in mega-batches, which were micro_batch_size x 32
    rows: a resume with another micro_batch_size (same global batch, allowed) indexed another
    order, so the rest of the epoch repeated some examples and skipped others."""
    from fastllm.train.data import ByteTokenizer
    from fastllm.train.sft_data import build_sft_data

    records = [("text", "x" * (1 + (i * 7) % 23)) for i in range(80)]
    orders = []
    for micro in (2, 4):
        cfg = TrainConfig.from_args(["data.packing=false", "data.seq_len=32", "global_batch_size=8",
                                     f"micro_batch_size={micro}", f"data.cache_dir={tmp_path}"])
        ds, _ = build_sft_data(cfg, ByteTokenizer(), records, log=lambda text: None)
        orders.append([ds.row(s) for s in range(2 * ds.num_sequences)])  # two epochs
    assert orders[0] == orders[1]
    assert sorted(orders[0][:80]) == list(range(80))


def test_a_small_length_grouped_dataset_is_reshuffled_every_epoch_and_seed(tmp_path):
    """data.packing=false on fewer rows than one 512-row mega-batch: the whole epoch was one
    sort, longest first, so every epoch and every seed gave the same order. Mega-batches are now a
    quarter of the rows (as HF's LengthGroupedSampler on small data), each longest first."""
    from fastllm.train.data import ByteTokenizer
    from fastllm.train.sft_data import build_sft_data

    records = [("text", "x" * (2 + i)) for i in range(40)]  # 40 lengths, one a row
    orders = {}
    for seed in (0, 1):
        cfg = TrainConfig.from_args(["data.packing=false", "data.seq_len=64", f"seed={seed}",
                                     f"data.cache_dir={tmp_path}"])
        ds, _ = build_sft_data(cfg, ByteTokenizer(), records, log=lambda text: None)
        for epoch in (0, 1):
            order = [ds.row(s) for s in range(epoch * 40, (epoch + 1) * 40)]
            assert sorted(order) == list(range(40))
            for k in range(0, 40, 10):  # 4 mega-batches of 10, each longest first
                assert order[k:k + 10] == sorted(order[k:k + 10], reverse=True), (seed, epoch)
            orders[seed, epoch] = order
    assert len({tuple(order) for order in orders.values()}) == 4, orders


def test_sequence_parallel_pads_sft_batches_to_a_multiple_of_tp(tmp_path):
    """parallel.sequence_parallel splits the sequence over the tp ranks; an SFT batch is as wide
    as its longest row (27 tokens, say), which the first forward refused mid-run although
    data.seq_len divides by tp. Batches are padded to a multiple of tp (padding: no target, a
    segment of its own), packed or not, eval rows too."""
    from fastllm.train.data import ByteTokenizer
    from fastllm.train.sft_data import IGNORE_INDEX, build_sft_data

    records = [("completion", ("q" * (1 + i % 5), "a" * (2 + (i * 3) % 7))) for i in range(12)]
    for packing, tp in (("true", 4), ("false", 2), ("false", 1)):
        cfg = TrainConfig.from_args([f"data.packing={packing}", "data.seq_len=32",
                                     "data.eval_fraction=0.25", f"data.path={tmp_path}/d.jsonl",
                                     f"data.cache_dir={tmp_path}"] +
                                    ([f"parallel.tp={tp}", "parallel.sequence_parallel=true"]
                                     if tp > 1 else []))
        train, held = build_sft_data(cfg, ByteTokenizer(), records, log=lambda text: None)
        widths = set()
        for ds in (train, held):
            for k in range(0, ds.num_sequences, 2):
                b = ds.batch(list(range(k, min(k + 2, ds.num_sequences))))
                longest = max(int((row != IGNORE_INDEX).nonzero().max()) + 1
                              for row in b["labels"])
                widths.add(b["input_ids"].shape[1])
                assert b["input_ids"].shape[1] % tp == 0 and b["input_ids"].shape[1] < longest + tp
        assert any(w % 2 for w in widths) == (tp == 1), widths  # (unpadded: odd widths occur)


def test_train_leaves_the_callers_config_and_records_max_steps_as_given(tmp_path, monkeypatch):
    """train() set the caller's cfg.max_steps to the steps num_train_epochs gave, and config.yaml
    kept that number: the same config with num_train_epochs=2 still ran one epoch. config.yaml
    names the tokenizer folder by its absolute path (for export and generate from anywhere),
    though the run was given a relative one."""
    from _tiny_tokenizer import tiny_bpe

    tiny_bpe(pad="<|im_end|>").save_pretrained(str(tmp_path / "tok"))
    monkeypatch.chdir(tmp_path)
    data, out = tmp_path / "d.jsonl", str(tmp_path / "run")
    data.write_text("".join(json.dumps({"prompt": f"Q{i}", "completion": " A"}) + "\n"
                            for i in range(8)))
    cfg = TrainConfig.from_args(["model=tiny", "data.seq_len=32", "micro_batch_size=4",
                                 "global_batch_size=8", "threads=1", "track_memory=false",
                                 "num_train_epochs=1", "data.packing=false", f"data.path={data}",
                                 "data.tokenizer=tok", f"data.cache_dir={tmp_path / 'cache'}",
                                 f"output_dir={out}"])
    given, threads = cfg.to_dict(), torch.get_num_threads()
    torch.set_num_threads(2)  # (threads=1 in the config: the caller's count comes back)
    try:
        assert Trainer(cfg, log=lambda text: None).train()["steps"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert cfg.to_dict() == given
    for folder in (out, os.path.join(out, "checkpoint-1")):
        with open(os.path.join(folder, "config.yaml")) as f:
            saved = yaml.safe_load(f)
        assert saved["max_steps"] == -1 and saved["data"]["tokenizer"] == str(tmp_path / "tok")
    again = TrainConfig.from_args(["num_train_epochs=2"], os.path.join(out, "config.yaml"))
    s = Trainer(again, log=lambda text: None).train()
    assert s["steps"] == 2 and s["resumed_from"].endswith("checkpoint-1")
    # a resume refused for another tokenizer leaves the run's tokenizer/ and config.yaml (which
    # fastllm export reads) as they were: the refusal came after the new tokenizer was saved
    tiny_bpe(pad="<|im_end|>", words="other words entirely").save_pretrained(str(tmp_path / "t2"))
    kept = {name: (tmp_path / "run" / name).read_bytes()
            for name in ("tokenizer/tokenizer.json", "config.yaml")}
    other = TrainConfig.from_args(["num_train_epochs=3", "data.tokenizer=t2"],
                                  os.path.join(out, "config.yaml"))
    with pytest.raises(ConfigError, match="this run has data.tokenizer="):
        Trainer(other, log=lambda text: None).train()
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept


def test_a_precision_change_is_refused_where_the_state_depends_on_it(tmp_path):
    """backend=fastllm keeps fp32 masters for bf16/fp16 weights, fp16 a loss scale: a resume at
    another precision is refused by name; backend=torch trains fp32 params under autocast, so
    bf16 <-> fp32 resumes there (it was refused too)."""
    from fastllm.train import checkpoint_layout

    def resume(saved, now):
        TrainConfig.from_args(saved).save(str(tmp_path))
        checkpoint_layout.check_resume_config(str(tmp_path), TrainConfig.from_args(now), print)

    resume(["backend=torch", "precision=bf16"], ["backend=torch", "precision=fp32"])
    for saved, now in ((["precision=bf16"], ["precision=fp32"]),
                       (["backend=torch", "precision=fp16"], ["backend=torch", "precision=bf16"])):
        with pytest.raises(ConfigError, match="trained with precision=.*fp32 master weights"):
            resume(saved, now)
    # a backend change at bf16/fp16: torch.optim.AdamW kept fastllm's fp32 masters untouched,
    # and returning to backend=fastllm loaded them stale (the steps between were lost)
    resume(["backend=torch"], ["backend=fastllm"])  # (fp32: one state layout)
    for saved, now in ((["precision=bf16"], ["backend=torch", "precision=bf16"]),
                       (["backend=torch", "precision=fp16"], ["precision=fp16"])):
        with pytest.raises(ConfigError, match=r"trained with backend=.*fp32 master weights"):
            resume(saved, now)


def test_model_config_takes_the_llama_arguments_construction_moves(tmp_path):
    """transformers 5 keeps rope_theta in rope_parameters; LlamaConfig(rope_theta=...) still
    takes it, and model_config refused it as not a LlamaConfig field. A typo is refused."""
    from fastllm.train.model import _preset_config, check_model

    cfg = TrainConfig.from_args(["model=tiny", "model_config.rope_theta=50000"])
    check_model(cfg)
    assert _preset_config(cfg, 257).rope_parameters["rope_theta"] == 50000
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\nmodel_config: {rope_theta: 5e4, rms_norm_eps: 1e-6}\n")
    cfg = TrainConfig.from_args([], str(path))  # YAML 1.1 reads 5e4 as a string: a float here
    assert cfg.model_config == {"rope_theta": 50000.0, "rms_norm_eps": 1e-6}
    with pytest.raises(ConfigError, match=r"unknown model_config key\(s\) \['rope_thta'\]"):
        TrainConfig.from_args(["model=tiny", "model_config.rope_thta=50000"])
