"""`fastllm train` with fastllm.parallel: tensor parallel (tp2), pipeline parallel with data
parallel (pp2 x dp2, 1F1B), a pipeline resuming a one-process checkpoint (pp2, GPipe) and an
interleaved pipeline (pp2, 2 stages per rank), each launched once by torchrun (Gloo, one thread
per rank) and compared with the same run in one process: same samples, losses and global grad
norms within fp32 rounding."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from fastllm.train import TrainConfig, Trainer
from fastllm.train import checkpoint as ckpt
from fastllm.train.config import ConfigError
from fastllm.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10


def _args(cache_dir, output_dir, *extra):
    return ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "global_batch_size=8",
            "lr=1e-2", "min_lr=1e-3", "warmup_steps=2", "threads=1", "log_interval=1000",
            f"max_steps={STEPS}", "max_grad_norm=0.5", f"data.cache_dir={cache_dir}",
            "checkpoint.interval=5", "checkpoint.keep_last=2", "data.log_indices=true",
            f"output_dir={output_dir}", *extra]


def _metric(output_dir, key):
    return [r[key] for r in read_metrics(os.path.join(output_dir, "metrics.jsonl"))]


def _in_process(args):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(TrainConfig.from_args(args)).train()
    finally:
        torch.set_num_threads(old)


TORCHRUN_TIMEOUT_S = 300


def _torchrun(nproc, args, port_offset, fails=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(29500 + (os.getpid() + port_offset) % 1000), "-m", "fastllm",
           "train", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # A hung run: SIGTERM lets torchrun stop its workers, which run in sessions of their
        # own (a SIGKILL of torchrun, subprocess.run's timeout, left them spinning).
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n"
                    + stderr.decode()[-3000:])
    assert (proc.returncode != 0) == fails, stdout.decode()[-3000:] + stderr.decode()[-3000:]
    return stderr.decode()


# Weights after the same steps summed in another order: Adam divides each grad by its own running
# RMS, so an element whose grads are near its rounding error moves by up to a few thousandths of
# one lr (1e-2) step apart (3.5e-6 seen with torch 2.11's CPU GEMMs); a wrong micro-batch or a
# lost step moves weights by ~lr.
WEIGHT_ATOL = 1e-5


def _assert_same_run(out, ref, first_step=1):
    """Steps first_step.. of `out` against the reference: the same samples and token counts,
    losses and global grad norms within fp32 rounding (the same sums in another order)."""
    skip = first_step - 1
    assert _metric(out, "step") == list(range(first_step, STEPS + 1))
    assert _metric(out, "samples") == _metric(ref, "samples")[skip:]
    assert _metric(out, "tokens") == _metric(ref, "tokens")[skip:]
    torch.testing.assert_close(_metric(out, "loss"), _metric(ref, "loss")[skip:], rtol=1e-4,
                               atol=0)
    torch.testing.assert_close(_metric(out, "grad_norm"), _metric(ref, "grad_norm")[skip:],
                               rtol=1e-4, atol=0)


def _assert_same_optimizer_state(out, ref, step):
    """optimizer.pt of checkpoint-<step> in `out` against `ref`'s: the same param groups (by
    index), the same state to fp32 rounding."""
    want = torch.load(os.path.join(ref, f"checkpoint-{step}", "optimizer.pt"))
    got = torch.load(os.path.join(out, f"checkpoint-{step}", "optimizer.pt"))
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in
                                                          want["param_groups"]]
    torch.testing.assert_close(got["state"], want["state"], rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 8 = 4 x 2 accumulation; checkpoints at steps 5 and 10."""
    root = tmp_path_factory.mktemp("parallel-train")
    cache, ref = str(root / "cache"), str(root / "ref")
    _in_process(_args(cache, ref))
    assert _metric(ref, "loss")[-1] < _metric(ref, "loss")[0]
    return cache, ref


def test_tp2_matches_one_process(reference, tmp_path):
    cache, ref = reference
    out = str(tmp_path / "tp2")
    # the default global batch is micro_batch_size x dp (1 here), not x world size (2)
    log = _torchrun(2, _args(cache, out, "parallel.tp=2", "micro_batch_size=8",
                             "global_batch_size=0"), 17)
    assert "strategy=tp" in log and "global batch 8 = 8 x 1 accumulation x 1 data" in log
    # fastllm AdamW clips by the norm over both ranks' shards: the one-process norm
    _assert_same_run(out, ref)


def test_tp2_sequence_parallel_matches_one_process(reference, tmp_path):
    cache, ref = reference
    out = str(tmp_path / "tp2sp")
    _torchrun(2, _args(cache, out, "parallel.tp=2", "parallel.sequence_parallel=true"), 23)
    # norms and residual stream sharded on the sequence: the same sums, the same run
    _assert_same_run(out, ref)


def test_pp2_dp2_matches_one_process_and_resumes_in_one(reference, tmp_path):
    cache, ref = reference
    out = str(tmp_path / "pp2dp2")
    # global batch by default: micro_batch_size 2 x dp 2 x pp 2 micro-batches = 8
    log = _torchrun(4, _args(cache, out, "parallel.pp=2", "parallel.dp=2", "micro_batch_size=2",
                             "global_batch_size=0", "parallel.schedule=1f1b"), 29)
    assert "strategy=pipeline" in log and "dp 2 x tp 1 x pp 2" in log
    assert "global batch 8 = 2 x 2 accumulation x 2 data parallel" in log
    _assert_same_run(out, ref)
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    # 1F1B with 2 stages and 2 micro-batches idles (2 - 1) / (2 + 2 - 1) of the schedule
    assert all(r["bubble_s"] == pytest.approx((r["bubble_s"] + r["fwd_bwd_s"]) / 3)
               for r in records)
    # the pipeline's checkpoint is one process's layout: resume step 5 in one process
    for step, path in ckpt.list_checkpoints(out):
        if step > 5:
            shutil.rmtree(path)
    s = _in_process(_args(cache, out))
    assert s["resumed_from"].endswith("checkpoint-5") and s["world_size"] == 1
    _assert_same_run(out, ref)


def test_pp2_gpipe_resumes_a_one_process_checkpoint(reference, tmp_path):
    cache, ref = reference
    out = str(tmp_path / "pp2")
    os.makedirs(out)
    shutil.copytree(os.path.join(ref, "checkpoint-5"), os.path.join(out, "checkpoint-5"))
    log = _torchrun(2, _args(cache, out, "parallel.pp=2", "parallel.schedule=gpipe"), 41)
    assert "resumed from" in log and "pipeline gpipe, 2 micro-batches" in log
    _assert_same_run(out, ref, first_step=6)
    # rank 0 wrote the whole model, in the layout of one process
    want = torch.load(os.path.join(ref, "checkpoint-10", "model.pt"))
    got = torch.load(os.path.join(out, "checkpoint-10", "model.pt"))
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=WEIGHT_ATOL)


def test_pp2_interleaved_matches_one_process(reference, tmp_path):
    cache, _ = reference
    # interleaved 1F1B: 4 layers in 4 stages, rank r holds stages r and r + 2
    extra = ("model_config.num_hidden_layers=4", "max_steps=4", "checkpoint.interval=0")
    ref = str(tmp_path / "ref")
    _in_process(_args(cache, ref, *extra))
    out = str(tmp_path / "interleaved")
    log = _torchrun(2, _args(cache, out, *extra, "parallel.pp=2",
                             "parallel.schedule=interleaved"), 53)
    assert "pipeline interleaved, 2 micro-batches, rank 0 holds 2/4 layers" in log
    assert _metric(out, "samples") == _metric(ref, "samples")
    torch.testing.assert_close(_metric(out, "loss"), _metric(ref, "loss"), rtol=1e-4, atol=0)
    torch.testing.assert_close(_metric(out, "grad_norm"), _metric(ref, "grad_norm"), rtol=1e-4,
                               atol=0)
    # the checkpoint holds the layers of both of rank 0's stages and of rank 1's, by name
    want = torch.load(os.path.join(ref, "checkpoint-4", "model.pt"))
    got = torch.load(os.path.join(out, "checkpoint-4", "model.pt"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=WEIGHT_ATOL)
    _assert_same_optimizer_state(out, ref, 4)


# ----- adapters on sharded parameters (FSDP2, tensor parallel) -----

ADAPTER_STEPS = ("max_steps=6", "checkpoint.interval=3", "checkpoint.keep_last=3")


def _adapter_tensors(out, step):
    from safetensors.torch import load_file

    folder = os.path.join(out, f"checkpoint-{step}", "adapter")
    return {f: load_file(os.path.join(folder, f)) for f in sorted(os.listdir(folder))
            if f.endswith(".safetensors")}


@pytest.mark.parametrize("mode,layout,strategy,port", [
    ("finetune=lora", "parallel.strategy=fsdp", "fsdp", 61),
    ("finetune=prefix", "parallel.strategy=fsdp", "fsdp", 67),
    ("finetune=lora", "parallel.tp=2", "tp", 71),
    ("finetune=lora", "parallel.pp=2", "pipeline", 73)])
def test_adapter_on_sharded_params_resumes_and_saves_as_one_process(reference, tmp_path, mode,
                                                                     layout, strategy, port):
    """An adapter run under FSDP2, tensor parallel or a pipeline resumes a one-process
    checkpoint (each rank keeps its shards, each stage its layers, of the whole adapter) and
    saves the whole adapter from them: the same losses, and the same adapter files and
    optimizer state as the one-process run (all three were refused before)."""
    cache, _ = reference
    one = str(tmp_path / "one")
    _in_process(_args(cache, one, mode, *ADAPTER_STEPS))
    out = str(tmp_path / "sharded")
    os.makedirs(out)
    shutil.copytree(os.path.join(one, "checkpoint-3"), os.path.join(out, "checkpoint-3"))
    batch = ("micro_batch_size=8",) if "tp" in layout else ()
    log = _torchrun(2, _args(cache, out, mode, *ADAPTER_STEPS, layout, *batch), port)
    assert "resumed from" in log and f"strategy={strategy}" in log
    assert _metric(out, "step") == [4, 5, 6]
    assert _metric(out, "samples") == _metric(one, "samples")[3:]
    torch.testing.assert_close(_metric(out, "loss"), _metric(one, "loss")[3:], rtol=1e-4, atol=0)
    want, got = _adapter_tensors(one, 6), _adapter_tensors(out, 6)
    assert want and {f: sorted(t) for f, t in got.items()} == {f: sorted(t) for f, t in
                                                                want.items()}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=WEIGHT_ATOL)
    _assert_same_optimizer_state(out, one, 6)
    if mode == "finetune=lora":  # the same config (target_modules, r, alpha, ...)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert os.path.isfile(os.path.join(out, "checkpoint-6", "adapter", f))
        with open(os.path.join(one, "checkpoint-6", "adapter", "adapter_config.json")) as f:
            want = f.read()
        with open(os.path.join(out, "checkpoint-6", "adapter", "adapter_config.json")) as f:
            assert f.read() == want
    # no base weights in an adapter run's checkpoint, from any layout
    assert sorted(os.listdir(os.path.join(out, "checkpoint-6"))) == sorted(
        os.listdir(os.path.join(one, "checkpoint-6")))


def test_freeze_under_a_pipeline_resumes_and_saves_as_one_process(reference, tmp_path):
    """finetune=freeze at pp2 (refused before) resumes a one-process checkpoint: the same
    losses, model.pt and optimizer state; freeze.layers=2 trains a layer on each stage."""
    cache, _ = reference
    extra = ("finetune=freeze", "freeze.layers=2", "max_steps=6", "checkpoint.interval=3")
    one = str(tmp_path / "one")
    _in_process(_args(cache, one, *extra))
    out = str(tmp_path / "pp2")
    os.makedirs(out)
    shutil.copytree(os.path.join(one, "checkpoint-3"), os.path.join(out, "checkpoint-3"))
    log = _torchrun(2, _args(cache, out, *extra, "parallel.pp=2"), 83)
    assert "resumed from" in log and "strategy=pipeline" in log
    torch.testing.assert_close(_metric(out, "loss"), _metric(one, "loss")[3:], rtol=1e-4, atol=0)
    want = torch.load(os.path.join(one, "checkpoint-6", "model.pt"))
    got = torch.load(os.path.join(out, "checkpoint-6", "model.pt"))
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=WEIGHT_ATOL)
    _assert_same_optimizer_state(out, one, 6)


def test_a_pipeline_stage_without_adapted_layers_is_refused_on_every_rank(reference, tmp_path):
    """lora.layers=1 adapts the last layer only, which pp2 puts on stage 1: stage 0 would have
    nothing to train (its rank refused alone, with a message for the whole model, and the other
    died on a closed connection)."""
    cache, _ = reference
    log = _torchrun(2, _args(cache, str(tmp_path / "run"), "finetune=lora", "lora.layers=1",
                             "parallel.pp=2", "max_steps=1"), 79, fails=True)
    says = "a pipeline stage holds no trainable parameter (rank {}'s has {})"
    assert says.format(0, "none") in log
    assert says.format(1, "some") in log


def test_a_pipeline_stage_checks_the_adapter_against_every_layer(tmp_path):
    """A resumed adapter is checked against the whole model on every stage: a setting or shape
    of a layer another stage holds refuses it here too (one stage refused, the others went on
    into the first step's sends)."""
    import json

    from fastllm.lora import save_adapter
    from fastllm.train.adapter_checkpoint import _load_stage, adapter_layout
    from fastllm.train.model import apply_finetune, build_model

    cfg = TrainConfig.from_args(["model=tiny", "finetune=lora", "lora.r=4"])
    model = apply_finetune(build_model(cfg, 97, torch.float32), cfg)
    layout = adapter_layout(model)
    path = str(tmp_path / "adapter")
    save_adapter(model, path, task_type="CAUSAL_LM")
    stage = model
    del stage.model.layers[1]  # stage 0 of two: layer 1 lives on another rank
    _load_stage(stage, path, *layout)  # the whole model's adapter loads into the stage
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    config["alpha_pattern"] = {"model.layers.1.self_attn.q_proj": 8.0}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"layers.1.self_attn.q_proj has alpha=.*the adapter "
                                         r"alpha=8.0"):
        _load_stage(stage, path, *layout)
    config["alpha_pattern"] = {}
    config["use_dora"] = True
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="holds a DoRA adapter, this run trains a LoRA one"):
        _load_stage(stage, path, *layout)


def test_pipeline_settings_refused_clearly(tmp_path):
    from types import SimpleNamespace

    from fastllm.parallel import ParallelLayout

    def cfg(*extra):
        return TrainConfig.from_args(["model=tiny", "parallel.pp=2", *extra])

    def check_pipeline(c, num_layers, dp):
        """(micro-batches per step, chunks) as the runtime checks them."""
        lay = ParallelLayout.resolve(dp * c.parallel.tp * c.parallel.pp, dp, c.parallel.tp,
                                     c.parallel.pp, schedule=c.parallel.schedule)
        lay.check_model(SimpleNamespace(num_attention_heads=4, num_hidden_layers=num_layers))
        gb = c.global_batch_size or lay.default_global_batch(c.micro_batch_size)
        return lay.micro_batches(gb, c.micro_batch_size), lay.chunks

    def data_parallel_size(c, world):
        return ParallelLayout.from_config(c.parallel, world).dp

    with pytest.raises(ValueError, match=r"parallel.pp=4 needs at least 4 decoder layers; the "
                                         r"model has num_hidden_layers=2"):
        check_pipeline(cfg("parallel.pp=4", "global_batch_size=16"), 2, 1)
    with pytest.raises(ValueError, match="parallel.schedule=interleaved .* num_hidden_layers=2"):
        check_pipeline(cfg("parallel.schedule=interleaved"), 2, 1)
    with pytest.raises(ValueError, match=r"global_batch_size=8 must be a multiple of "
                                         r"micro_batch_size \* data-parallel size = 3 \* 1"):
        check_pipeline(cfg("micro_batch_size=3", "global_batch_size=8"), 2, 1)
    with pytest.raises(ValueError, match=r"parallel.schedule=1f1b needs at least parallel.pp=2 "
                                         r"micro-batches per step, got .* = 1"):
        check_pipeline(cfg("micro_batch_size=4", "global_batch_size=8"), 2, 2)
    with pytest.raises(ValueError, match="interleaved needs the micro-batches per step .* = 3"):
        check_pipeline(cfg("parallel.schedule=interleaved", "micro_batch_size=4",
                           "global_batch_size=12"), 4, 1)
    assert check_pipeline(cfg("parallel.schedule=gpipe", "micro_batch_size=4",
                              "global_batch_size=8"), 2, 2) == (1, 1)
    assert check_pipeline(cfg("parallel.schedule=interleaved"), 4, 1) == (2, 2)
    with pytest.raises(ValueError, match=r"parallel.tp=1 x parallel.pp=2 = 2 does not divide "
                                         r"the world size 3"):
        data_parallel_size(cfg(), 3)
    with pytest.raises(ValueError, match=r"parallel.dp=2 x parallel.tp=1 x parallel.pp=2 = 4 "
                                         r"ranks, but the world size is 2"):
        data_parallel_size(cfg("parallel.dp=2"), 2)
    assert data_parallel_size(cfg("parallel.tp=2"), 8) == 2
    for bad, says in ((["finetune=galore"], "finetune=full, freeze or lora, got "
                                            "finetune=galore"),
                      (["precision=fp16"], "precision fp32 or bf16"),
                      (["parallel.strategy=zero2"], "parallel.strategy must be auto or fsdp"),
                      (["parallel.schedule=zb"], "parallel.schedule must be one of"),
                      (["parallel.tp=2", "parallel.sequence_parallel=true"],
                       "sequence_parallel is not supported with parallel.pp > 1"),
                      (["parallel.pp=1", "parallel.sequence_parallel=true"],
                       "sequence_parallel needs parallel.tp > 1"),
                      (["parallel.pp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "data.seq_len=33"], r"data.seq_len \(33\) divisible by parallel.tp")):
        with pytest.raises(ConfigError, match=says):
            cfg(*bad)
    # one process cannot hold two stages: refused before anything is written
    out = tmp_path / "one"
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        Trainer(cfg(f"output_dir={out}")).train()
    assert not out.exists()
