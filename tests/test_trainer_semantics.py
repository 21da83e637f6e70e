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
