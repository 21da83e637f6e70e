"""3D parallelism (data x tensor x pipeline) on PyTorch's engines, and the planner.

    mesh = fastllm.parallel.build_mesh(dp=2, tp=2, pp=1)            # DeviceMesh ("pp", "dp", "tp")
    fastllm.parallel.parallelize(model, mesh)                      # TP over "tp", FSDP2 over "dp"
    loss = fastllm.parallel.causal_lm_loss(model, ids, labels)     # vocabulary-parallel loss
    best, _ = fastllm.parallel.plan("llama3-70b", 8192, 1024, "H100", 512)

Pipeline: `build_pipeline_stage` + `build_schedule` (GPipe, 1F1B, interleaved 1F1B).
`python -m fastllm.parallel.run` trains a tiny Llama in any layout under torchrun.
"""

from fastllm.parallel.clip import clip_grad_norm_
from fastllm.parallel.loss import causal_lm_loss, loss_backward, vocab_parallel_cross_entropy
from fastllm.parallel.mesh import build_mesh, mesh_size
from fastllm.parallel.pipeline import (
    LlamaStage,
    build_pipeline_stage,
    build_schedule,
    split_layers,
)
from fastllm.parallel.planner import (
    GPUS,
    MODELS,
    GPUSpec,
    Layout,
    ModelSpec,
    bubble_fraction,
    estimate,
    model_from_hf_config,
    plan,
)
from fastllm.parallel.tensor_parallel import llama_tp_plan, parallelize, parallelize_from_config

__all__ = [
    "GPUS", "GPUSpec", "Layout", "LlamaStage", "MODELS", "ModelSpec", "bubble_fraction",
    "build_mesh", "build_pipeline_stage", "build_schedule", "causal_lm_loss", "clip_grad_norm_",
    "estimate", "llama_tp_plan", "loss_backward", "mesh_size", "model_from_hf_config",
    "parallelize", "parallelize_from_config", "plan", "split_layers",
    "vocab_parallel_cross_entropy",
]
