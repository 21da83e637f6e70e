"""The `fastllm plan` command: a model and a cluster in, the fastest layouts that fit out."""

import dataclasses
import json
import math
import os

from fastllm.parallel.planner.catalog import (GPUS, MODELS, GiB, gpu_from_dict,
                                              model_from_hf_config)
from fastllm.parallel.planner.cost import plan


def format_plan(best, model, seq_len, global_batch, gpu, n_gpus, node_size):
    """The table `fastllm plan` prints."""
    lines = [f"{model.name}: {model.params() / 1e9:.2f}B params, {model.layers} layers, hidden "
             f"{model.hidden}, heads {model.heads}/{model.kv_heads} kv, ffn {model.ffn}, vocab "
             f"{model.vocab}; seq {seq_len}, global batch {global_batch}; {n_gpus} x {gpu.name} "
             f"({node_size} per node)"]
    if not best:
        lines.append("no layout fits in memory: add GPUs, recompute, ZeRO, LoRA, or QLoRA "
                     "(--qlora)")
        return "\n".join(lines)
    header = ("layout", "mem/GPU GiB", "step s", "tokens/s", "MFU", "comm", "bubble", "warnings")
    rows = [header]
    for r in best:
        rows.append((r["layout"].describe(), f"{r['memory_total'] / GiB:.1f}",
                     f"{r['step_time']:.3f}", f"{r['tokens_per_s']:,.0f}",
                     f"{100 * r['mfu']:.1f}%", f"{100 * r['comm_share']:.1f}%",
                     f"{100 * r['bubble_share']:.1f}%", "; ".join(r["warnings"]) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_plan_arguments(p):
    p.add_argument("--model", required=True,
                   help=f"a name ({', '.join(MODELS)}) or a Hugging Face config.json")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--gpu", default="H100", help=f"{', '.join(GPUS)} or a JSON file (see "
                   "fastllm.parallel.planner.gpu_from_dict)")
    p.add_argument("--gpus", type=int, required=True, help="GPU count")
    p.add_argument("--node-size", type=int, default=8, help="GPUs per node (NVLink domain)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA of this rank on all "
                   "linear layers instead of full training")
    p.add_argument("--qlora", action="store_true", help="with --lora: the frozen linear weights "
                   "in 4-bit NF4 (fastllm train lora.quantize_base=nf4)")
    p.add_argument("--double-quant", action="store_true", help="with --qlora: their absmax "
                   "double-quantised (lora.double_quant=true)")
    p.add_argument("--no-flash", action="store_true", help="attention without a fused kernel")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="price tensor parallel with sequence parallelism "
                        "(parallel.sequence_parallel in fastllm train)")
    p.add_argument("--dp-overlap", type=float, default=0.5,
                   help="fraction of data-parallel communication hidden behind backward")


def check_plan_args(args):
    """Refuse `fastllm plan` arguments out of range, naming the option (SystemExit)."""
    for option, value, low in (("--seq-len", args.seq_len, 1), ("--global-batch",
                                                               args.global_batch, 1),
                               ("--gpus", args.gpus, 1), ("--node-size", args.node_size, 1),
                               ("--top", args.top, 1), ("--lora", args.lora, 0)):
        if value < low:
            raise SystemExit(f"fastllm plan: {option} must be >= {low}, got {value}")
    if args.qlora and not args.lora:
        raise SystemExit("fastllm plan: --qlora quantises LoRA's frozen base: give --lora RANK")
    if args.double_quant and not args.qlora:
        raise SystemExit("fastllm plan: --double-quant double-quantises QLoRA's absmax: give "
                         "--qlora")
    if not 0.0 <= args.dp_overlap <= 1.0:
        raise SystemExit(f"fastllm plan: --dp-overlap must be in [0, 1], got {args.dp_overlap}")


def load_json_spec(path, option, build):
    """build(the JSON object in `path`), any missing key or bad value of the file refused as
    SystemExit naming the option, the file and the problem (not a KeyError later)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"fastllm plan: {option} {path}: cannot read it as JSON: {e}")
    if not isinstance(data, dict):
        raise SystemExit(f"fastllm plan: {option} {path}: expected a JSON object, got "
                         f"{type(data).__name__}")
    try:
        spec = build(data)
    except KeyError as e:
        raise SystemExit(f"fastllm plan: {option} {path}: missing key {e}")
    except (TypeError, ValueError) as e:
        raise SystemExit(f"fastllm plan: {option} {path}: {e}")
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.type in (str, bool, tuple):  # (flags; sync_costs: gpu_from_dict checks it)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SystemExit(f"fastllm plan: {option} {path}: {field.name} must be a number, "
                             f"got {value!r}")
        if field.type is int and not isinstance(value, int):
            raise SystemExit(f"fastllm plan: {option} {path}: {field.name} must be an "
                             f"integer, got {value!r}")
        ok = math.isfinite(value) and (value > 0 or (value == 0 and field.name in (
            "reserved", "latency", "op_overhead", "dtensor_overhead", "cores")))
        if not ok:
            raise SystemExit(f"fastllm plan: {option} {path}: {field.name} must be a finite "
                             f"number > 0, got {value}")
        if field.name in ("matmul_efficiency", "comm_efficiency") and value > 1:
            # a share of the peak: 70 or 7 is a percent typed for 0.7, and would price a step
            # faster than the hardware
            raise SystemExit(f"fastllm plan: {option} {path}: {field.name} is a fraction of the "
                             f"peak and must be in (0, 1] (e.g. 0.7 for 70%), got {value}")
    # hidden % heads is ModelSpec's check: needed only when the config gives no head_dim
    if hasattr(spec, "heads") and spec.heads % spec.kv_heads:
        raise SystemExit(f"fastllm plan: {option} {path}: {spec.heads} heads and "
                         f"{spec.kv_heads} key/value heads do not divide")
    return spec


def plan_command(args):
    """Entry point of `fastllm plan`; returns the printed text."""
    check_plan_args(args)
    if args.model in MODELS:
        model = MODELS[args.model]
    elif os.path.isfile(args.model):
        model = load_json_spec(args.model, "--model",
                               lambda d: model_from_hf_config(d, name=os.path.basename(
                                   os.path.dirname(os.path.abspath(args.model))) or "model"))
    else:
        raise SystemExit(f"fastllm plan: --model {args.model!r} is neither a known name "
                         f"({', '.join(MODELS)}) nor a config.json file")
    if args.gpu in GPUS:
        gpu = GPUS[args.gpu]
    elif os.path.isfile(args.gpu):
        gpu = load_json_spec(args.gpu, "--gpu", gpu_from_dict)
    else:
        raise SystemExit(f"fastllm plan: --gpu {args.gpu!r} is neither {', '.join(GPUS)} nor a "
                         "JSON file")
    try:
        best, _ = plan(model, args.seq_len, args.global_batch, gpu, args.gpus, args.node_size,
                       args.top, args.lora, not args.no_flash, args.dp_overlap,
                       sequence_parallel=args.sequence_parallel, nf4=args.qlora,
                       double_quant=args.double_quant)
    except ValueError as e:
        raise SystemExit(f"fastllm plan: {e}")
    text = format_plan(best, model, args.seq_len, args.global_batch, gpu, args.gpus,
                       args.node_size)
    print(text)
    return text
