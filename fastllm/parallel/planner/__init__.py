"""The planner: which dp x tp x pp layout (ZeRO stage, micro-batch, recomputation, schedule)
trains a model fastest on a cluster, from an analytic cost model.

    catalog.py   model shapes (MODELS, ModelSpec, a config.json) and accelerators (GPUS, GPUSpec)
    memory.py    what a decoder layer keeps for its backward, and LoRA's adapter sizes
    cost.py      a layout (Layout, RuntimeSpec), its price (estimate) and the search (plan)
    cli.py       the `fastllm plan` command and its table (format_plan)

The probes that measure this machine for the cost model are benchmark code: bench/probes.py.
"""

from fastllm.parallel.layout import bubble_fraction
from fastllm.parallel.planner.catalog import (
    GPUS,
    MODELS,
    GiB,
    GPUSpec,
    ModelSpec,
    gpu_from_dict,
    model_from_hf_config,
)
from fastllm.parallel.planner.cost import (
    FASTLLM,
    MEGATRON,
    Layout,
    RuntimeSpec,
    check_layout,
    estimate,
    plan,
    sync_cost,
)
from fastllm.parallel.planner.cli import format_plan
from fastllm.parallel.planner.memory import activation_bytes_per_layer

__all__ = ["FASTLLM", "GPUS", "GPUSpec", "GiB", "Layout", "MEGATRON", "MODELS", "ModelSpec",
           "RuntimeSpec", "activation_bytes_per_layer", "bubble_fraction", "check_layout",
           "estimate", "format_plan", "gpu_from_dict", "model_from_hf_config", "plan",
           "sync_cost"]
