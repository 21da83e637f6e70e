"""fastllm train's options mean what Hugging Face's TrainingArguments of the same name mean
(tiny model, one thread, one process)."""

import pytest
import torch

from fastllm.parallel import ParallelLayout
from fastllm.train import TrainConfig, Trainer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token-cache"))


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny(cache_dir, output_dir, *extra):
    return ["model=tiny", "data.seq_len=32", "micro_batch_size=4", "lr=1e-2", "warmup_steps=1",
            "threads=1", "log_interval=1000", "track_memory=false",
            f"data.cache_dir={cache_dir}", f"output_dir={output_dir}", *extra]


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
