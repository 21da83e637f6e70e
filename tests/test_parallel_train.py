"""`fastllm train parallel.tp=2`: the training runtime with fastllm.parallel's tensor parallel,
two processes (torchrun, Gloo, one thread each) against the same run in one process."""

import os
import subprocess
import sys

import pytest
import torch

from fastllm.train import TrainConfig, Trainer
from fastllm.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10


def _args(cache_dir, output_dir, *extra):
    return ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "global_batch_size=8",
            "lr=1e-2", "min_lr=1e-3", "warmup_steps=2", "threads=1", "log_interval=1000",
            f"max_steps={STEPS}", "max_grad_norm=0.5", f"data.cache_dir={cache_dir}",
            f"output_dir={output_dir}", *extra]


def _metric(output_dir, key):
    return [r[key] for r in read_metrics(os.path.join(output_dir, "metrics.jsonl"))]


def test_tp2_matches_one_process(tmp_path):
    cache = str(tmp_path / "cache")
    ref = str(tmp_path / "ref")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(TrainConfig.from_args(_args(cache, ref))).train()
    finally:
        torch.set_num_threads(old)
    out = str(tmp_path / "tp2")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(29500 + (os.getpid() + 17) % 1000), "-m", "fastllm", "train",
           *_args(cache, out, "parallel.tp=2")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-3000:]
    assert "strategy=fsdp" in done.stderr.decode()
    ref_losses, tp_losses = _metric(ref, "loss"), _metric(out, "loss")
    assert len(tp_losses) == STEPS
    assert ref_losses[-1] < ref_losses[0]
    # the same samples, the matmuls split over two ranks: fp32 rounding apart
    torch.testing.assert_close(tp_losses, ref_losses, rtol=1e-4, atol=0)
    # fastllm AdamW clips by the norm over both ranks' shards: the one-process norm
    torch.testing.assert_close(_metric(out, "grad_norm"), _metric(ref, "grad_norm"), rtol=1e-4,
                               atol=0)


def test_pp_in_trainer_is_refused_clearly(tmp_path):
    from fastllm.parallel import parallelize_from_config

    cfg = TrainConfig.from_args(_args(str(tmp_path), str(tmp_path), "parallel.pp=2"))
    with pytest.raises(NotImplementedError, match="parallel.pp > 1"):
        parallelize_from_config(None, cfg, 2, torch.device("cpu"))
