"""3D parallelism (data x tensor x pipeline) on PyTorch's engines, and the planner.

    layout = fastllm.parallel.ParallelLayout.resolve(world_size, tp=2)  # sizes, ranks, rules
    mesh = layout.build_mesh("cpu")                                # DeviceMesh ("pp", "dp", "tp")
    fastllm.parallel.parallelize(model, mesh)                      # TP over "tp", FSDP2 over "dp"
    loss = fastllm.parallel.causal_lm_loss(model, ids, labels)     # vocabulary-parallel loss
    best, _ = fastllm.parallel.plan("llama3-70b", 8192, 1024, "H100", 512)

Pipeline: `build_pipeline` (this rank's stages and the GPipe, 1F1B or interleaved 1F1B
schedule), on `build_pipeline_stage` + `build_schedule`. examples/parallel_train.py trains a
tiny Llama in any layout under torchrun.
"""

from fastllm.parallel.clip import clip_grad_norm_
from fastllm.parallel.layout import ParallelLayout, bubble_fraction, build_mesh, mesh_size
from fastllm.parallel.loss import causal_lm_loss, loss_backward, vocab_parallel_cross_entropy
from fastllm.parallel.pipeline import (
    LlamaStage,
    Pipeline,
    build_pipeline,
    build_pipeline_stage,
    build_schedule,
    pipeline_loss,
    split_layers,
)
from fastllm.parallel.planner import (
    GPUS,
    MODELS,
    GPUSpec,
    Layout,
    ModelSpec,
    estimate,
    model_from_hf_config,
    plan,
)
from fastllm.parallel.tensor_parallel import (
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tensor_parallel,
    decoder_layers,
    llama_tp_plan,
    parallelize,
    wrap_activation_checkpointing,
)

__all__ = [
    "GPUS", "GPUSpec", "Layout", "LlamaStage", "MODELS", "ModelSpec", "ParallelLayout",
    "Pipeline", "apply_activation_checkpointing", "apply_fsdp", "apply_tensor_parallel",
    "bubble_fraction", "build_mesh", "build_pipeline", "build_pipeline_stage", "build_schedule",
    "causal_lm_loss", "clip_grad_norm_", "decoder_layers", "estimate", "llama_tp_plan",
    "loss_backward", "mesh_size", "model_from_hf_config", "parallelize", "pipeline_loss", "plan",
    "split_layers", "vocab_parallel_cross_entropy", "wrap_activation_checkpointing",
]
