"""fastllm train refuses or handles what would otherwise train wrongly: optimizer_in_backward with
accumulation or a non-finite loss, options that do not apply, HF's max_steps over
num_train_epochs, data of fewer rows than a global batch, bad data refused before
overwrite_output_dir deletes anything, overwrite_output_dir (a checkpoint set aside by an
interrupted save included), a resume with another layout or precision (not a LoRA
target_modules reordered), a failed summary.json write, --compare torch with a fastllm-only
option, the step-0 evaluation redone after a restart and the evaluations of steps a rollback
discarded; and options that mean what Hugging Face's TrainingArguments of the same name mean
(gradient_accumulation_steps under pipeline parallel, BAdam's weight decay split) (tiny model,
one thread, a few steps each)."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from fastllm.parallel import ParallelLayout
from fastllm.train import TrainConfig, Trainer
from fastllm.train import checkpoint as ckpt
from fastllm.train.config import ConfigError
from fastllm.train.metrics import read_metrics
from fastllm.train.run_dir import RunDirError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token-cache"))


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(cache_dir, output_dir, *extra):
    return ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "lr=1e-2", "warmup_steps=1",
            "threads=1", "log_interval=1000", "track_memory=false",
            f"data.cache_dir={cache_dir}", f"output_dir={output_dir}", *extra]


def run(cache_dir, output_dir, *extra, log=None):
    return Trainer(TrainConfig.from_args(tiny(cache_dir, output_dir, *extra)),
                   log=log or (lambda text: None)).train()


def metrics(output_dir):
    return read_metrics(os.path.join(output_dir, "metrics.jsonl"))


@pytest.mark.parametrize("overrides,says", [
    # each backward steps every parameter: accumulation would step once per micro-batch
    (["optimizer_in_backward=true", "max_grad_norm=0", "gradient_accumulation_steps=2"],
     "optimizer_in_backward .* cannot accumulate gradients: set gradient_accumulation_steps=1"),
    (["optimizer_in_backward=true", "max_grad_norm=0", "micro_batch_size=2",
      "global_batch_size=4"], "optimizer_in_backward .* global_batch_size=4"),
    # text data has no held-out split: these were silently ignored
    (["data.eval_fraction=0.1"], "data.eval_fraction hold out JSONL .* is text data"),
    (["data.eval_path=held.jsonl"], "data.eval_path and data.eval_fraction hold out JSONL"),
    (["data=3"], "data is a section: set its keys"),
    (["num_train_epochs=inf"], "num_train_epochs must be finite"),
    (["output_dir="], "output_dir is empty"),
    (["seed=99999999999999"], r"seed must be in \[0, 2\*\*32\)"),
    (["max_steps=0"], "max_steps must be >= 1"),
    # the tokenizer's ids index the embedding: a smaller table was an IndexError mid-step
    (["model_config.vocab_size=100"], "model_config.vocab_size=100: the vocabulary is the "
                                      "tokenizer's"),
    # tensor parallel: another strategy was ignored, torch's fused AdamW crashed at the first
    # step; DoRA was refused by fastllm.parallel after the run had started
    (["parallel.tp=2", "parallel.strategy=zero1"], "parallel.tp > 1 shards data parallel with "
                                                   "FSDP2: .* got zero1"),
    (["parallel.tp=2", "backend=torch"], "parallel.tp > 1 runs with backend=fastllm"),
    (["parallel.tp=2", "finetune=lora", "lora.use_dora=true"], "lora.use_dora=true with "
                                                               "parallel.tp > 1"),
    # PEFT saves an adapted lm_head's frozen base weight, sharded under FSDP2: it raised at the
    # first checkpoint
    (["finetune=lora", "backend=torch", "parallel.strategy=fsdp",
      "lora.target_modules=q_proj,lm_head"], r"backend=torch and parallel.strategy=fsdp cannot "
                                             r"save an adapter of \['lm_head'\]"),
    # ZeRO with torch's AdamW trained each rank on its own grads (or raised at the first
    # accumulation)
    (["parallel.strategy=zero2", "backend=torch"], "parallel.strategy=zero2 is fastllm's "
                                                   "DistributedOptimizer"),
    # a checkpointed layer drops the KV cache holding the prefix: a size mismatch at step 1
    (["finetune=prefix", "checkpoint_ratio=0.5"], r"finetune=prefix does not work with "
                                                  r"activation checkpointing \(checkpoint_ratio"),
])
def test_config_refuses_before_anything_runs(overrides, says):
    with pytest.raises(ConfigError, match=says):
        TrainConfig.from_args(overrides)


def test_a_badam_block_matching_nothing_is_refused_before_the_run_folder_is_written(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(["model=tiny", "finetune=badam", "badam.blocks=[[nope]]",
                                 f"output_dir={out}"])
    with pytest.raises(ConfigError, match=r"badam.blocks\[0\] \['nope'\] matches no"):
        Trainer(cfg).train()
    assert not out.exists()


def test_an_unknown_model_is_refused_before_the_run_folder_is_written(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="model='no-such-model' is neither a built-in"):
        Trainer(TrainConfig.from_args(["model=no-such-model", f"output_dir={out}"])).train()
    assert not out.exists()


def test_max_steps_overrides_num_train_epochs_as_in_hf():
    from fastllm.train.config import DEFAULT_MAX_STEPS
    from fastllm.train.sft_data import max_steps

    data = SimpleNamespace(num_sequences=10)

    def steps(*overrides):
        return max_steps(TrainConfig.from_args(list(overrides)), data, 2)

    assert steps("num_train_epochs=1", "max_steps=2") == 2
    assert steps("num_train_epochs=1") == 5
    assert steps("max_steps=7") == 7
    assert steps() == DEFAULT_MAX_STEPS == 300  # README: `make train` runs 300 steps


def test_data_of_fewer_rows_than_one_global_batch_is_refused():
    """Every step takes a global batch of rows: 16 short examples packed into 2 rows at a global
    batch of 8 trained each row 4 times in one step."""
    from fastllm.train.sft_data import max_steps

    cfg = TrainConfig.from_args(["num_train_epochs=1", "micro_batch_size=2", "warmup_steps=0",
                                 "gradient_accumulation_steps=2"])
    packed = SimpleNamespace(num_sequences=2, spans=[(0, 4)] * 16, packing=True)
    with pytest.raises(ValueError, match=r"16 examples in 2 rows of data.seq_len=128 tokens "
                                         r"\(packed\), fewer than the global batch of 8 rows "
                                         r"\(micro_batch_size=2 x 2 accumulation x 2 data "
                                         r"parallel\).* at most 2 rows a step"):
        max_steps(cfg, packed, 8, dp=2)
    with pytest.raises(ValueError, match="3 windows of data.seq_len=128 tokens, fewer than"):
        max_steps(cfg, SimpleNamespace(num_sequences=3), 4)
    assert max_steps(cfg, SimpleNamespace(num_sequences=8), 8, dp=2) == 1


def test_optimizer_in_backward_nan_loss_leaves_the_weights_and_checkpoints_finite(cache_dir,
                                                                                 tmp_path):
    out = str(tmp_path)
    s = run(cache_dir, out, "max_steps=3", "max_grad_norm=0", "optimizer_in_backward=true",
            "nan_batches=[1]", "checkpoint.interval=1", "checkpoint.keep_last=3")
    recs = metrics(out)
    assert [r["skipped"] for r in recs] == [False, True, False] and s["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in (recs[0], recs[2]))
    # max_grad_norm=0 still logs the (unclipped) norm
    assert recs[0]["grad_norm"] is not None and recs[0]["grad_norm"] > 0
    weights = {step: ckpt.load_file(os.path.join(path, "model.pt"))
               for step, path in ckpt.list_checkpoints(out)}
    assert sorted(weights) == [1, 2, 3]
    for name, w in weights[1].items():
        assert torch.equal(weights[2][name], w), name  # the skipped step changed nothing
        assert torch.isfinite(weights[3][name]).all(), name


def test_overwrite_output_dir_starts_fresh_under_auto_resume(cache_dir, tmp_path):
    out = str(tmp_path)
    run(cache_dir, out, "max_steps=2", "checkpoint.interval=0")
    s = run(cache_dir, out, "max_steps=2", "checkpoint.interval=0", "overwrite_output_dir=true",
            "lr=1e-3")
    assert s["resumed_from"] is None
    recs = metrics(out)
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["lr"] == pytest.approx(1e-3)


def test_overwrite_output_dir_clears_a_checkpoint_set_aside_by_an_interrupted_save(tmp_path):
    from fastllm.train import run_dir

    def cfg(auto_resume, overwrite):
        return SimpleNamespace(output_dir=str(tmp_path), overwrite_output_dir=overwrite,
                               checkpoint=SimpleNamespace(auto_resume=auto_resume))

    def leave():  # a crash between save()'s two renames, and one inside a write
        for name in ("checkpoint-8.old-deadbeef", ".tmp-checkpoint-9-cafef00d"):
            os.makedirs(tmp_path / name, exist_ok=True)

    leave()
    run_dir.release(run_dir.prepare(cfg(True, False), log=lambda text: None))
    assert sorted(os.listdir(tmp_path)) == [".lock", "checkpoint-8"]  # a resume puts it back
    shutil.rmtree(tmp_path / "checkpoint-8")
    leave()
    with pytest.raises(run_dir.RunDirError, match=r"holds another run \(checkpoint-8.old-dead"):
        run_dir.prepare(cfg(False, False), log=lambda text: None)
    # a fresh run deletes it with the rest of the previous run: put back, it would be resumed
    run_dir.release(run_dir.prepare(cfg(True, True), log=lambda text: None))
    assert sorted(os.listdir(tmp_path)) == [".lock"]


def test_resume_with_another_layout_names_the_key(cache_dir, tmp_path):
    out = str(tmp_path)
    run(cache_dir, out, "max_steps=1", "checkpoint.interval=0")
    for extra, says in ((["finetune=lora"], "trained with finetune=full, this run has "
                                            "finetune=lora"),
                        (["model=mini"], "trained with model=tiny, this run has model=mini"),
                        (["optimizer_in_backward=true", "max_grad_norm=0"],
                         "optimizer_in_backward=False, this run has optimizer_in_backward=True"),
                        # bf16 weights train through fp32 masters in optimizer.pt, which fp32
                        # dropped (and fp16's loss scale failed naming no key)
                        (["precision=bf16"], "trained with precision=fp32, this run has "
                                             "precision=bf16: .*fp32 master weights")):
        with pytest.raises(ConfigError, match=says):
            run(cache_dir, out, "max_steps=1", *extra)
    said = []
    s = run(cache_dir, out, "max_steps=1", "seed=5", log=said.append)
    assert s["resumed_from"].endswith("checkpoint-1")
    assert any("trained with seed=0, this run has seed=5" in line for line in said)


def test_a_lora_resume_takes_target_modules_in_any_order(cache_dir, tmp_path):
    from safetensors.torch import load_file

    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    args = ("max_steps=2", "checkpoint.interval=1", "finetune=lora")
    run(cache_dir, ref, *args, "lora.target_modules=[q_proj,v_proj]")
    shutil.copytree(ref, out, ignore=shutil.ignore_patterns(".lock", "checkpoint-2"))
    with pytest.raises(ConfigError, match=r"lora.target_modules=\['q_proj', 'v_proj'\], this"):
        run(cache_dir, out, *args, "lora.target_modules=[q_proj]")
    # the layers are wrapped, and their optimizer state indexed, in model order: step 2 redone
    # from checkpoint-1 is step 2 of the run that never stopped
    s = run(cache_dir, out, *args, "lora.target_modules=[v_proj,q_proj]")
    assert s["resumed_from"].endswith("checkpoint-1")
    assert [(r["loss"], r["grad_norm"]) for r in metrics(out)] == [
        (r["loss"], r["grad_norm"]) for r in metrics(ref)]
    saved = [load_file(os.path.join(d, "checkpoint-2", "adapter", "adapter_model.safetensors"))
             for d in (ref, out)]
    assert saved[0].keys() == saved[1].keys()
    for name, t in saved[0].items():
        assert torch.equal(saved[1][name], t), name


def test_compare_torch_refuses_a_fastllm_only_option_before_training(cache_dir, tmp_path):
    from fastllm.cli import main

    out = tmp_path / "c"
    with pytest.raises(SystemExit, match="finetune=galore is fastllm's optimizer"):
        main(["train", "--compare", "torch", *tiny(cache_dir, str(out), "max_steps=1",
                                                    "finetune=galore")])
    assert not out.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: [1\n")
    with pytest.raises(SystemExit, match="bad.yaml is not valid YAML"):
        main(["train", "--config", str(bad)])


def test_a_restart_before_the_first_checkpoint_writes_step_0_samples_once(cache_dir, tmp_path):
    out = str(tmp_path)
    args = ("max_steps=1", "eval.prompts=[hi]", "eval.max_new_tokens=2")
    run(cache_dir, out, *args)
    shutil.rmtree(os.path.join(out, "checkpoint-1"))  # as a kill before it was written
    run(cache_dir, out, *args)
    with open(os.path.join(out, "samples.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1]


def test_a_rollback_drops_the_evaluations_of_the_discarded_steps(cache_dir, tmp_path):
    from fastllm.train.metrics import MetricsWriter

    out = str(tmp_path / "run")
    # steps 5 and 6 are non-finite: rolled back to checkpoint-4 after the evaluation of step 6
    s = run(cache_dir, out, "max_steps=8", "global_batch_size=8", "eval.prompts=[hi]",
            "eval.max_new_tokens=2", "eval_interval=2", "nan_batches=[4,5]",
            "max_bad_steps=2", "checkpoint.interval=2")
    assert s["rollbacks"] == 1
    with open(os.path.join(out, "samples.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 2, 4, 6, 8]
    # metrics.jsonl's evaluation lines (a held-out set's) go with the steps' lines
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 4}, {"eval_step": 4}, {"step": 5}, {"step": 6}, {"eval_step": 6})))
    writer = MetricsWriter(SimpleNamespace(log_interval=1, report_to="none"), str(tmp_path),
                           True, 8, 6)
    writer.rewind(4)
    writer.close()
    assert path.read_text().splitlines() == ['{"step": 4}', '{"eval_step": 4}']


# --- options mean what Hugging Face's TrainingArguments of the same name mean -------------
def test_gradient_accumulation_steps_is_the_accumulation_under_pipeline_parallel(
        cache_dir, tmp_path, monkeypatch):
    """HF's effective batch is per_device x gradient_accumulation_steps x world; under pp the
    accumulation micro-batches are the pipeline's (config.py), not pp times as many."""
    from fastllm.train.model import build_model
    from fastllm.train.strategies import pipeline

    cfg = TrainConfig.from_args(tiny(cache_dir, tmp_path, "parallel.pp=2", "micro_batch_size=2",
                                     "gradient_accumulation_steps=4"))
    trainer = Trainer(cfg, log=lambda text: None)
    trainer.layout = ParallelLayout.from_config(cfg.parallel, 2)  # dp 1 x pp 2
    trainer.rank, trainer.world, trainer.device = 0, 1, torch.device("cpu")
    trainer._build_data()
    assert trainer.global_batch == 2 * 4  # was 16: 8 micro-batches a step
    # and the schedule splits the step into those micro-batches (the logged loss divides the
    # summed micro-batch losses by them)
    built = {}

    def build_pipeline(model, mesh, n_microbatches, *args):
        built["n"] = n_microbatches
        raise StopIteration

    monkeypatch.setattr(pipeline, "build_pipeline", build_pipeline)
    monkeypatch.setattr(ParallelLayout, "build_mesh", lambda self, device_type: None)
    strategy = pipeline.Pipeline(cfg, trainer.layout, torch.device("cpu"), 0)
    with pytest.raises(StopIteration):
        strategy.wrap(build_model(cfg, 257, torch.float32), None)
    assert built["n"] == 4


def test_badam_leaves_biases_and_norm_weights_undecayed(cache_dir, tmp_path):
    """finetune=badam decays what the other optimizers decay (HF's decay/no-decay split): its
    inner optimizers put the norm weights in a weight_decay 0 group, kept at 0 when the outer
    group's hyperparameters (what a scheduler sets) are synced into them."""
    from fastllm.optim import BAdam
    from fastllm.train import optimizers
    from fastllm.train.model import build_model

    cfg = TrainConfig.from_args(tiny(cache_dir, tmp_path, "finetune=badam", "weight_decay=0.5",
                                     "badam.switch_block_every=1"))
    model = build_model(cfg, 64, torch.float32)
    opt, _ = optimizers.build(cfg, model)
    assert isinstance(opt, BAdam)
    norms = {id(p) for n, p in model.named_parameters() if p.dim() < 2}
    seen = set()
    for _ in range(len(opt.blocks)):
        opt._sync_hyperparameters()
        for group in opt.inner.param_groups:
            for p in group["params"]:
                seen.add(id(p))
                assert group["weight_decay"] == (0.0 if id(p) in norms else 0.5)
        opt._switch()
    assert norms and norms <= seen


def _listing(path):
    return {p: open(os.path.join(path, p), "rb").read() if os.path.isfile(os.path.join(path, p))
            else None for p in sorted(os.listdir(path))}


def test_a_batch_that_does_not_divide_is_refused_before_the_run_folder_is_touched(cache_dir,
                                                                                 tmp_path):
    says = r"global_batch_size=6 must be a multiple of micro_batch_size \* data-parallel size"
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match=says):
        run(cache_dir, str(fresh), "max_steps=1", "global_batch_size=6")
    assert not fresh.exists()
    out = str(tmp_path / "old")
    run(cache_dir, out, "max_steps=1", "checkpoint.interval=1")
    before = _listing(out)
    with pytest.raises(ConfigError, match=says):  # overwrite_output_dir must not delete it first
        run(cache_dir, out, "max_steps=1", "global_batch_size=6", "overwrite_output_dir=true")
    assert _listing(out) == before


def test_bad_data_is_refused_before_the_run_folder_is_touched(cache_dir, tmp_path, monkeypatch):
    """The data is read and tokenised before run_dir.prepare: a refused record (or too few rows
    for a batch) makes no folder, and overwrite_output_dir=true leaves the previous run as it
    was (it had deleted it first); a run that starts saves its tokenizer after the clear."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "completion": " a"}\n{"prompt": "q", "completion": 5}\n')
    says = r"bad\.jsonl line 2: key 'completion' must be a string"
    fresh = tmp_path / "fresh"
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9", "completion": " a"}\n')
    for data, why in ((bad, says), (latin, r"latin\.jsonl line 1: not UTF-8")):
        with pytest.raises(ValueError, match=why):
            run(cache_dir, str(fresh), "max_steps=1", f"data.path={data}")
    few = tmp_path / "few.jsonl"
    few.write_text('{"prompt": "q", "completion": " a"}\n' * 3)
    with pytest.raises(ValueError, match="fewer than the global batch of 4 rows"):
        run(cache_dir, str(fresh), "max_steps=1", f"data.path={few}", "data.packing=false")
    assert not fresh.exists()
    text = tmp_path / "text.txt"
    text.write_text("the capital of France is Paris. " * 40)
    out, bpe = str(tmp_path / "old"), ("data.tokenizer=bpe", "data.vocab_size=300")
    run(cache_dir, out, "max_steps=1", f"data.path={text}", *bpe)
    before = _listing(out)
    assert "tokenizer" in before and "checkpoint-1" in before
    with pytest.raises(ValueError, match=says):
        run(cache_dir, out, "max_steps=1", f"data.path={bad}", "overwrite_output_dir=true")
    assert _listing(out) == before

    def refused(*args):  # what a layout the model does not fit raises in strategy.wrap
        raise ValueError("parallel.tp=2 does not divide num_key_value_heads=1")

    with monkeypatch.context() as m:  # (the model is built before the run folder is cleared)
        m.setattr("fastllm.train.strategies.make", refused)
        with pytest.raises(ValueError, match="does not divide"):
            run(cache_dir, out, "max_steps=1", f"data.path={text}", "overwrite_output_dir=true",
                *bpe)
    assert _listing(out) == before
    run(cache_dir, out, "max_steps=1", f"data.path={text}", "overwrite_output_dir=true", *bpe)
    assert os.path.isfile(os.path.join(out, "tokenizer", "tokenizer.json"))


@pytest.mark.parametrize("value,says", [("num_attention_heads=3", "not a multiple of the number "
                                                                  "of attention heads"),
                                        ("hidden_size=abc", "expected int")])
def test_a_bad_model_config_value_is_refused_naming_the_key_before_writing(tmp_path, value,
                                                                           says):
    out = tmp_path / "run"
    key = value.partition("=")[0]
    with pytest.raises(ConfigError, match=f"model_config.{key}=.* {says}"):
        Trainer(TrainConfig.from_args(["model=tiny", f"model_config.{value}",
                                       f"output_dir={out}"])).train()
    assert not out.exists()


@pytest.mark.parametrize("text,says", [
    ("max_steps: 2\nlr: 0.01\nmax_steps: 50\n", "key 'max_steps' is given twice .lines 1 and 3"),
    ("lora:\n  r: 4\nlora:\n  alpha: 8\n", "key 'lora' is given twice .lines 1 and 3"),
    ("lora:\n  r: 4\n  r: 8\n", "key 'r' is given twice .lines 2 and 3"),
    ("weight_decay: yes\n", "weight_decay=True is not a valid float"),
    ("lr: true\n", "lr=True is not a valid float"),
    ("output_dir:\n", "output_dir=None is not a valid str"),
    ("output_dir: [a, b]\n", r"output_dir=\['a', 'b'\] is not a valid str"),
])
def test_a_config_file_misread_by_yaml_is_refused_naming_the_key(tmp_path, text, says):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        TrainConfig.from_args([], str(path))


@pytest.mark.parametrize("finetune", ["freeze", "galore", "prefix"])
def test_compare_hf_refuses_a_mode_hf_lacks_before_training(cache_dir, tmp_path, finetune):
    from fastllm.cli import main

    out = tmp_path / "c"
    with pytest.raises(SystemExit, match=f"finetune={finetune} has no HF Trainer counterpart"):
        main(["train", "--compare", "hf", *tiny(cache_dir, str(out), "max_steps=1",
                                                 f"finetune={finetune}")])
    assert not out.exists()


@pytest.mark.parametrize("where", ["before", "after", "both"])
def test_a_second_config_file_is_refused(tmp_path, where):
    from fastllm.cli import main

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    out = tmp_path / "run"
    a.write_text(f"max_steps: 1\noutput_dir: {out}\n")
    b.write_text(f"max_steps: 2\noutput_dir: {out}\n")
    first, second = ["--config", str(a)], [f"--config={b}"]
    args = {"before": [*first, *second, "seed=1"], "after": [*first, "seed=1", *second],
            "both": ["seed=1", *first, *second]}[where]
    with pytest.raises(SystemExit, match="--config is given twice"):
        main(["train", *args])
    assert not out.exists()


def test_warmup_longer_than_the_run_is_warned_about(cache_dir, tmp_path):
    with pytest.warns(UserWarning, match="warmup_steps=100 is longer than max_steps=1"):
        run(cache_dir, str(tmp_path), "max_steps=1", "warmup_steps=100", "checkpoint.interval=0")


def test_overwrite_output_dir_deletes_the_old_runs_samples(cache_dir, tmp_path):
    out = str(tmp_path)
    run(cache_dir, out, "max_steps=1", "eval.prompts=[old]", "eval.max_new_tokens=2")
    run(cache_dir, out, "max_steps=1", "overwrite_output_dir=true")
    assert not os.path.exists(os.path.join(out, "samples.jsonl"))
    only = tmp_path / "only"  # a run's samples alone are a run too (auto_resume=false refuses)
    only.mkdir()
    (only / "samples.jsonl").write_text('{"step": 0, "prompt": "old", "output": "x"}\n')
    with pytest.raises(RunDirError, match="holds another run .samples.jsonl."):
        run(cache_dir, str(only), "max_steps=1", "checkpoint.auto_resume=false")


def test_a_restart_at_step_0_without_on_start_keeps_no_step_0_samples(cache_dir, tmp_path):
    out = str(tmp_path)
    args = ("max_steps=1", "eval.prompts=[hi]", "eval.max_new_tokens=2")
    run(cache_dir, out, *args)
    shutil.rmtree(os.path.join(out, "checkpoint-1"))  # as a kill before it was written
    run(cache_dir, out, *args, "eval.on_start=false")
    with open(os.path.join(out, "samples.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1]


def test_compare_torch_checks_the_torch_folder_before_training(cache_dir, tmp_path):
    from fastllm.cli import main

    out = tmp_path / "c"
    left = tmp_path / "c-torch"  # a previous compare's torch run
    left.mkdir()
    (left / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _listing(str(left))
    with pytest.raises(SystemExit, match="c-torch holds another run .metrics.jsonl."):
        main(["train", "--compare", "torch", *tiny(cache_dir, str(out), "max_steps=1")])
    assert not out.exists() and _listing(str(left)) == before


def test_a_text_files_byte_order_mark_is_not_text(tmp_path):
    from fastllm.train.data import load_text

    path = tmp_path / "corpus.txt"
    path.write_bytes(b"\xef\xbb\xbfHello\n")
    assert load_text(str(path)) == ["Hello\n"]
    path.write_bytes(b"\xef\xbb\xbfab\xff")  # the byte named is the file's
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 5: b'\\xff'\)"):
        load_text(str(path))


def test_a_model_config_float_in_yaml_exponent_form_is_a_float(tmp_path):
    from fastllm.train.model import _preset_config, check_model

    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\nmodel_config: {rms_norm_eps: 1e-5}\n")  # YAML 1.1: a str
    cfg = TrainConfig.from_args([], str(path))
    check_model(cfg)
    assert _preset_config(cfg, 257).rms_norm_eps == 1e-5
    path.write_text("model_config: {rms_norm_eps: small}\n")
    with pytest.raises(ConfigError, match="model_config.rms_norm_eps='small' is not a valid"):
        TrainConfig.from_args([], str(path))


def test_an_output_dir_under_a_file_is_a_clear_error(tmp_path):
    """os.makedirs raised FileExistsError / NotADirectoryError: a traceback, not the one-line
    error fastllm train gives for its other output_dir problems."""
    from fastllm.train import run_dir

    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(run_dir.RunDirError, match="it or a folder above it is a file"):
            run_dir.lock(str(out))


def test_summary_json_is_json_when_the_losses_are_nan(tmp_path):
    """Every step's loss nan (skipped): summary.json held NaN, which is not JSON (jq and
    JSON.parse refuse it); a nan or inf there is null."""
    from fastllm.train.metrics import FIELDS, write_summary

    record = dict({name: 0.0 for name in FIELDS}, step=1, loss=float("nan"), skipped=True)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    write_summary(str(tmp_path), "done", 1, grad=float("inf"), nested={"x": [float("nan")]})
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    summary = json.loads(text)
    assert summary["grad"] is None and summary["nested"] == {"x": [None]}


def test_a_compiled_runs_summary_times_the_steps_that_compiled_nothing(tmp_path, capsys):
    """torch_compile: the summary's tokens/s and ms/step (the run's, and fastllm report's) leave
    out the steps whose record counts compiled graphs (`compiles`), wherever they fall, as well
    as the first; where every step compiled, the timing is of them all."""
    from fastllm.cli import main
    from fastllm.train.metrics import FIELDS, write_summary

    def write(times, compiles):
        (tmp_path / "metrics.jsonl").write_text("".join(
            json.dumps(dict({name: 0.0 for name in FIELDS}, step=i + 1, loss=1.0, skipped=False,
                            tokens=100, step_time_s=t, **({} if c is None else {"compiles": c})))
            + "\n" for i, (t, c) in enumerate(zip(times, compiles))))

    times = [9.0, 5.0, 1.0, 4.0, 1.0, 1.0]
    for compiles, want in (([None] * 6, 12.0 / 5), ([3, 1, 0, 2, 0, 0], 1.0),
                           ([3, 0, 0, 0, 0, 0], 12.0 / 5), ([3, 1, 1, 1, 1, 1], 12.0 / 5)):
        write(times, compiles)
        summary = write_summary(str(tmp_path), "done", 6)
        assert summary["step_time_s"] == want, compiles
        assert summary["compile_steps"] == [i + 1 for i, c in enumerate(compiles) if c]
        out = capsys.readouterr().out
        assert ("graphs compiled in steps 1, 2, 4 (left out" in out) == (compiles[3] == 2)
        main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")])
        assert f"{want * 1e3:.1f} ms/step" in capsys.readouterr().out


def test_a_failed_summary_write_leaves_the_previous_summary(tmp_path):
    """summary.json was written in place: a write failing midway left it truncated."""
    from fastllm.train.metrics import FIELDS, write_summary

    record = dict({name: 0.0 for name in FIELDS}, step=1, loss=1.0, skipped=False)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    write_summary(str(tmp_path), "done", 1)
    before = (tmp_path / "summary.json").read_text()
    with pytest.raises(TypeError):
        write_summary(str(tmp_path), "done", 1, bad=object())
    assert (tmp_path / "summary.json").read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "summary.json"]


def test_peak_memory_counts_what_the_step_allocates():
    """A view of, or an in-place op on, a tensor made before the step (not tracked) was counted
    as a new allocation of its whole storage; a tracked DTensor raised (its wrapper has no
    storage). Views and in-place ops allocate nothing; a DTensor counts by its local shard."""
    from fastllm.train.memory import PeakMemory

    x = torch.zeros(1 << 20)  # 4 MiB, made before
    with PeakMemory() as mem:
        x.view(-1)[:10].add_(1)
        x.add_(1)
    assert mem.peak_new == 0
    with PeakMemory() as mem:
        y = x * 2  # a new 4 MiB
        del y
    assert mem.peak_new == 4 << 20
    for grow in (lambda: torch.mul(x, 2, out=torch.empty(0)),  # noqa: E731
                 lambda: torch.empty(0).resize_(1 << 20)):
        with PeakMemory() as mem:  # an empty buffer given its bytes by the op: allocated
            grow()
        assert mem.peak_new == 4 << 20


def _dtensor_peak(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastllm.train.memory import PeakMemory

    w = distribute_tensor(torch.zeros(2 * world, 1 << 17), init_device_mesh("cpu", (world,)),
                          [Shard(0)])  # 1 MiB a rank
    with PeakMemory(w) as mem:
        w.add_(1)
        (w * 2).to_local()
    return mem.baseline, mem.peak_new


def test_peak_memory_tracks_a_dtensor_by_its_shard():
    from fastllm.distributed.launch import spawn

    assert spawn(_dtensor_peak, 1, timeout=120) == [(1 << 20, 1 << 20)]
