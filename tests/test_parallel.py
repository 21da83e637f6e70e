"""3D parallel layouts against one process: one 4-rank Gloo world (spawned once for the module)
trains the same tiny Llama in tp2, pp2 (GPipe, 1F1B, interleaved 1F1B), dp2 x tp2 (with
activation checkpointing, with fastllm's AdamW), pp2 x dp2 (also LoRA), pp2 x tp2, sequence
parallelism (tp2, dp2 x tp2, pp2 x tp2), LoRA under tp (tp2, and dp2 x tp2 with sequence
parallelism), a tiny Qwen3 (tp2, and patched in dp2 x tp2 with sequence parallelism), resumes
a DCP checkpoint saved at dp2 x tp2 in other layouts; `fastllm train`'s sharded checkpoints
(FSDP2, pipeline stages) keep fastllm AdamW's own entry. Each rank runs one thread."""

import importlib
import os
import pickle
import socket
import tempfile
import time
from collections import OrderedDict
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastllm.parallel import build_mesh, build_schedule, split_layers
from parallel_train import train

STEPS = 6  # (CI time: each step is one for every layout in the 4-process run)
SAVE_AT = 3
WORLD = 4
TIMEOUT_S = 600


def _layouts(ckpt):
    """name -> (mesh shape, mesh dim names, train() kwargs)."""
    return {
        # a "rep" dimension runs two identical copies: tp2 and pp2 on 2 ranks each
        "tp2": ((2, 2), ("rep", "tp"), {}),
        "pp2_gpipe": ((2, 2), ("rep", "pp"), {"schedule": "gpipe", "n_microbatches": 4}),
        "pp2_1f1b": ((2, 2), ("rep", "pp"), {"schedule": "1f1b", "n_microbatches": 2}),
        "pp2_interleaved": ((2, 2), ("rep", "pp"),
                            {"schedule": "interleaved", "n_microbatches": 2}),
        "dp2_tp2": ((1, 2, 2), ("pp", "dp", "tp"), {"save_dir": ckpt, "save_at": SAVE_AT}),
        "dp2_tp2_recompute": ((1, 2, 2), ("pp", "dp", "tp"), {"activation_checkpointing": True}),
        "dp2_tp2_fastllm_adamw": ((1, 2, 2), ("pp", "dp", "tp"), {"optimizer": "fastllm"}),
        # fastllm.optim.AdamW(max_grad_norm=...) over FSDP2 x TP grads (_StridedShard placements)
        "dp2_tp2_fastllm_clip": ((1, 2, 2), ("pp", "dp", "tp"), {"optimizer": "fastllm_clip"}),
        "pp2_dp2": ((2, 2, 1), ("pp", "dp", "tp"), {"schedule": "1f1b"}),
        "pp2_tp2": ((2, 1, 2), ("pp", "dp", "tp"), {"schedule": "gpipe"}),
        "pp2_dp2_lora": ((2, 2, 1), ("pp", "dp", "tp"), {"lora_rank": 4}),
        # sequence parallel: norms on sequence shards, their replicated weights' grads reduced
        "tp2_sp": ((2, 2), ("rep", "tp"), {"sequence_parallel": True}),
        "dp2_tp2_sp": ((1, 2, 2), ("pp", "dp", "tp"), {"sequence_parallel": True}),
        # stage boundaries: each stage takes its sequence shard and gathers it at its end
        "pp2_tp2_sp": ((2, 1, 2), ("pp", "dp", "tp"), {"schedule": "gpipe",
                                                        "sequence_parallel": True}),
        # LoRA adapters sharded with their column/row-parallel projections; fastllm's AdamW
        # clips and steps on the local shards of the adapters' reduced grads
        "tp2_lora": ((2, 2), ("rep", "tp"), {"lora_rank": 4, "optimizer": "fastllm_clip"}),
        "dp2_tp2_sp_lora": ((1, 2, 2), ("pp", "dp", "tp"), {"lora_rank": 4,
                                                             "sequence_parallel": True}),
    }


QWEN3 = {  # a Qwen3 (q_norm/k_norm on each head): name -> (mesh, dim names, patched, kwargs)
    "qwen3_tp2": ((2, 2), ("rep", "tp"), False, {}),
    # patched, FSDP2 and sequence parallel: the norms' kernels on DTensors' local rows
    "qwen3_dp2_tp2_sp_patched": ((1, 2, 2), ("pp", "dp", "tp"), True, {"sequence_parallel": True}),
}


def _qwen3_train(mesh=None, patch=False, **parallel):
    """A tiny Qwen3 (hidden 64, 4 query / 2 kv heads of 16), 3 AdamW steps on batches of 4 x 16:
    {"losses", "grads" (first step), "params" (after), "norm_calls" (DTensor args per call)}."""
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import fastllm
    from fastllm.parallel import loss_backward, mesh_size, parallelize
    from fastllm.parallel import vocab_parallel_cross_entropy as loss_fn
    from parallel_train import make_batches

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        attn_implementation="sdpa"))
    with torch.no_grad():  # norms start at 1: make each head's q/k norm weight differ
        for p in (p for name, p in model.named_parameters() if "norm" in name):
            p.add_(0.1 * torch.randn_like(p))
    parallelize(fastllm.patch(model) if patch else model, mesh, **parallel)
    dp = mesh_size(mesh, "dp")  # dp ranks take alternate rows
    rows = slice(mesh["dp"].get_local_rank() if dp > 1 else 0, None, dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out, ops = {"losses": []}, importlib.import_module("fastllm.ops.rms_norm")
    with mock.patch.object(ops, "rms_norm", wraps=ops.rms_norm) as kernel:
        for ids, labels in make_batches(3, 4, 16, 128):
            loss = loss_fn(model(input_ids=ids[rows]).logits, labels[rows])
            loss_backward(loss)
            loss = whole(loss)
            if dp > 1:
                dist.all_reduce(loss, group=mesh["dp"].get_group())
            out["losses"].append(loss.item() / dp)
            out.setdefault("grads", {n: whole(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    out["norm_calls"] = [any(isinstance(t, DTensor) for t in c.args) for c in kernel.call_args_list]
    out["params"] = {n: whole(p) for n, p in model.named_parameters()}
    return out


def _saved_bytes(model, ids, labels):
    """Bytes autograd saves for backward in one forward (each storage once, parameters not)."""
    from torch.distributed.tensor import DTensor

    from fastllm.parallel import vocab_parallel_cross_entropy

    def storage(t):
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    params = {storage(p).data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        try:
            key, nbytes = storage(t).data_ptr(), storage(t).nbytes()
        except RuntimeError:  # a view DTensor keeps without a storage of its own
            key, nbytes = ("view", id(t)), t.numel() * t.element_size()
        if key not in params:
            saved[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_cross_entropy(model(input_ids=ids).logits, labels)
    return sum(saved.values())


def _tp2_memory(sequence_parallel=False):
    """(measured, planned) bytes per rank of activations and of weights, tensor parallel 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fastllm.parallel import parallelize
    from fastllm.parallel.planner import GPUSpec, Layout, ModelSpec, estimate
    from parallel_train import make_batches, tiny_llama

    shape = {"layers": 3, "hidden": 96, "heads": 6, "kv_heads": 2, "ffn": 256, "vocab": 200}
    model = tiny_llama(**shape)
    parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "tp")),
                sequence_parallel=sequence_parallel)
    ids, labels = make_batches(1, 4, 48, 200)[0]
    acts = _saved_bytes(model, ids, labels)
    weights = 4 * sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                      for p in model.parameters())
    cpu = GPUSpec("cpu", 24e9, 60e9, 30e9, 10e9, 10e9, reserved=0, dtype_bytes=4)
    est = estimate(ModelSpec("tiny", 3, 96, 6, 2, 256, 200),
                   Layout(tp=2, micro_batch=4, sequence_parallel=sequence_parallel), 48, 4, cpu)
    return acts, est["memory"]["activations"], weights, est["memory"]["weights"]


def _clip_partial():
    """clip_grad_norm_ over a Partial (unreduced) and a Replicate grad on the tp mesh:
    (returned norm, norm of the reduced grads, max error of the clipped Partial grad)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fastllm.parallel import clip_grad_norm_

    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "tp"))["tp"]
    parts = [torch.randn(5, 3, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    rep = torch.arange(4.0)
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(5, 3), tp, [Replicate()]))
    p.grad = DTensor.from_local(parts[tp.get_local_rank()].clone(), tp, [Partial()])
    q = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), tp, [Replicate()]))
    q.grad = DTensor.from_local(rep.clone(), tp, [Replicate()])
    norm = clip_grad_norm_([p, q], max_norm=1.0)
    full = parts[0] + parts[1]
    expected = torch.cat([full.flatten(), rep]).norm()
    err = (p.grad.full_tensor() - full / (expected + 1e-6)).abs().max()
    return norm.item(), expected.item(), err.item()


def _lora_sp_trainable():
    """Names of the trainable parameters of a LoRA model after dp2 x tp2 + sequence parallel."""
    from fastllm.lora import inject_lora
    from fastllm.parallel import parallelize
    from parallel_train import tiny_llama

    model = inject_lora(tiny_llama(layers=2), ["q_proj", "v_proj", "o_proj", "down_proj"], r=2)
    parallelize(model, build_mesh(dp=2, tp=2), sequence_parallel=True)
    return sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad})


def _lora_tp_disabled():
    """Max |logits - the base model's| of a dp2 x tp2 LoRA model (B random) inside
    fastllm.adapters.disable_adapters, and outside it: (disabled, enabled)."""
    from torch.distributed.tensor import DTensor

    from fastllm.adapters import disable_adapters
    from fastllm.lora import inject_lora
    from fastllm.parallel import parallelize
    from parallel_train import tiny_llama

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(input_ids=ids).logits
        inject_lora(model, ["q_proj", "v_proj", "o_proj", "down_proj"], r=2)
        g = torch.Generator().manual_seed(4)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    parallelize(model, build_mesh(dp=2, tp=2), vocab_parallel_logits=False)

    def diff():
        with torch.no_grad():
            out = model(input_ids=ids).logits
        out = out.full_tensor() if isinstance(out, DTensor) else out
        return (out - base).abs().max().item()

    enabled = diff()
    with disable_adapters(model):
        disabled = diff()
    return disabled, enabled


def _optimizer_extras():
    """fastllm AdamW's 'fastllm' entry (skip count, stochastic-rounding seed and calls) through
    fastllm train's sharded checkpoints: FSDP2 over the 4 ranks (checkpoint_layout.full_state,
    load_full), and two pipeline stages each FSDP2 over dp 2 (gather_stages). Every rank's
    {layout: (the trained optimizer's entry, the checkpoint's, a fresh optimizer's after loading
    the checkpoint without it (as one written before it was carried), and after loading it)},
    on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastllm.optim import AdamW
    from fastllm.train import checkpoint_layout as layout

    names = ["0.weight", "1.weight", "0.bias", "1.bias"]  # the whole model's param_order
    sizes = ((8, 16), (16, 4))

    def build(layers, mesh, seed):
        """Linear 0 (8 -> 16) then Linear 1 (16 -> 4), or a stage's of them, sharded."""
        module = torch.nn.Sequential(OrderedDict((str(i), torch.nn.Linear(*sizes[i]))
                                                 for i in layers))
        fully_shard(module, mesh=mesh)
        decay, no_decay = layout.param_order(module)
        torch.manual_seed(seed)  # alike on every rank (as fastllm train's): draws sr_seed
        return module, AdamW([{"params": [p for _, p in decay]},
                              {"params": [p for _, p in no_decay], "weight_decay": 0.0}],
                             stochastic_rounding=True, max_grad_norm=1.0)

    def train(module, opt, layers):
        for step in range(3):  # the second step's grads are inf on every rank: skipped
            loss = module(torch.ones(2, sizes[layers[0]][0])).sum()
            (loss * (float("inf") if step == 1 else 1.0)).backward()
            opt.step()
            opt.zero_grad()
        return dict(opt.state_dict()["fastllm"])

    def resume(saved, layers, mesh):
        box = [saved]
        dist.broadcast_object_list(box, src=0)  # every rank reads rank 0's optimizer.pt
        module, opt = build(layers, mesh, seed=1)
        without = {k: v for k, v in box[0].items() if k != "fastllm"}
        layout.load_full(module, opt, None, without, names)
        old = dict(opt.state_dict()["fastllm"])
        layout.load_full(module, opt, None, box[0], names)
        return box[0].get("fastllm"), old, dict(opt.state_dict()["fastllm"])

    out = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    module, opt = build((0, 1), mesh, seed=0)
    trained = train(module, opt, (0, 1))
    out["fsdp"] = (trained,) + resume(layout.full_state(module, opt, names)[1], (0, 1), mesh)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = (mesh["pp"].get_local_rank(),)
    module, opt = build(stage, mesh["dp"], seed=0)
    trained = train(module, opt, stage)
    saved = layout.gather_stages(module, opt, names, 2, mesh["pp"].get_group(),
                                 mesh["dp"].get_local_rank() == 0)[1]
    out["pipeline"] = (trained,) + resume(saved, stage, mesh["dp"])
    every = [None] * WORLD if dist.get_rank() == 0 else None
    dist.gather_object(out, every, dst=0)
    return every


def _worker(rank, port, out_path, ckpt):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    try:
        for name, (shape, names, kwargs) in _layouts(ckpt).items():
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            results[name] = train(mesh=mesh, steps=STEPS, **kwargs)
        for name, (shape, names, patch, kwargs) in QWEN3.items():
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            results[name] = _qwen3_train(mesh, patch, **kwargs)
        # resume the dp2 x tp2 checkpoint in other layouts
        resume = {"resume_dp4": (4, 1, 1, "1f1b"), "resume_pp2_dp2": (2, 1, 2, "1f1b"),
                  "resume_pp2_dp2_interleaved": (2, 1, 2, "interleaved")}
        for name, (dp, tp, pp, schedule) in resume.items():
            results[name] = train(dp=dp, tp=tp, pp=pp, schedule=schedule, steps=STEPS - SAVE_AT,
                                  load_dir=ckpt, start_step=SAVE_AT)
        results["tp2_memory"] = _tp2_memory()
        results["tp2_sp_memory"] = _tp2_memory(sequence_parallel=True)
        results["clip_partial"] = _clip_partial()
        results["optimizer_extras"] = _optimizer_extras()
        results["lora_sp_trainable"] = _lora_sp_trainable()
        results["lora_tp_disabled"] = _lora_tp_disabled()
        errors = {}
        try:
            build_mesh(dp=3, tp=1, pp=1)
        except ValueError as e:
            errors["mesh"] = str(e)
        try:
            train(dp=2, tp=2, global_batch=7, steps=1)
        except ValueError as e:
            errors["batch"] = str(e)
        try:
            train(dp=2, tp=2, seq_len=15, steps=1, sequence_parallel=True)
        except ValueError as e:
            errors["seq"] = str(e)
        results["errors"] = errors
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.pkl")
        ckpt = os.path.join(tmp, "ckpt")
        ctx = mp.start_processes(_worker, args=(_free_port(), out_path, ckpt), nprocs=WORLD,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {WORLD}-rank run did not finish in {TIMEOUT_S} s")
        with open(out_path, "rb") as f:
            results = pickle.load(f)
        torch.set_num_threads(1)
        results["single"] = train(steps=STEPS)
        results["single_lora"] = train(steps=STEPS, lora_rank=4)
        results["resume_single"] = train(steps=STEPS - SAVE_AT, load_dir=ckpt, start_step=SAVE_AT)
        results["qwen3_single"] = _qwen3_train()
        yield results


def _close(actual, expected):
    # fp32, sums reordered across ranks: observed differences are a few 1e-6 relative
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("layout", ["tp2", "pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "dp2_tp2",
                                    "dp2_tp2_recompute", "dp2_tp2_fastllm_adamw",
                                    "dp2_tp2_fastllm_clip", "pp2_dp2",
                                    "pp2_tp2", "pp2_dp2_lora", "tp2_sp", "dp2_tp2_sp",
                                    "pp2_tp2_sp", "tp2_lora", "dp2_tp2_sp_lora"])
def test_layout_matches_one_process(runs, layout):
    single = runs["single_lora" if "lora" in layout else "single"]
    assert len(runs[layout]["losses"]) == STEPS
    # the model learns: a layout that silently skipped the update would fail this too
    assert single["losses"][-1] < single["losses"][0]
    _close(runs[layout]["losses"], single["losses"])
    # clipping by the true global norm: the pre-clip norm over all shards and stages
    _close(runs[layout]["grad_norms"], single["grad_norms"])


@pytest.mark.parametrize("layout", list(QWEN3))
def test_qwen3_matches_one_process(runs, layout):
    # q_norm/k_norm see each rank's heads: their weights' grads must be summed over tp
    got, want = runs[layout], runs["qwen3_single"]
    # fastllm's kernel on local tensors, 9 norms a step: 2 layers x (2 + q_norm + k_norm) + 1
    assert got["norm_calls"] == [False] * (9 * 3 if QWEN3[layout][2] else 0)
    for kind, rtol, atol in (("grads", 1e-4, 0.0), ("params", 0.0, 1e-4)):
        for name, w in want[kind].items():
            err = (got[kind][name] - w).abs().max().item()
            # Adam carries rounding of near-zero grads into updates (~1e-5); a wrong step: ~lr
            assert err <= rtol * w.abs().max().item() + atol, f"{kind} {name}: {err:.3g}"
    _close(got["losses"], want["losses"])


@pytest.mark.parametrize("layout", ["resume_dp4", "resume_pp2_dp2", "resume_pp2_dp2_interleaved",
                                    "resume_single"])
def test_checkpoint_moves_between_layouts(runs, layout):
    # saved at dp2 x tp2 after step SAVE_AT; the steps after it in another layout equal the
    # unbroken run
    _close(runs[layout]["losses"], runs["single"]["losses"][SAVE_AT:])
    _close(runs[layout]["grad_norms"], runs["single"]["grad_norms"][SAVE_AT:])


@pytest.mark.parametrize("layout", ["fsdp", "pipeline"])
def test_sharded_checkpoint_keeps_the_optimizer_entry(runs, layout):
    # fastllm train's sharded checkpoints carry fastllm AdamW's 'fastllm' entry, as one
    # process's do: a resumed run keeps its stochastic-rounding stream and skip count
    for rank, every in enumerate(runs["optimizer_extras"]):
        trained, saved, old, loaded = every[layout]
        assert trained["skipped_steps"] == 1 and trained["sr_calls"] == 3
        assert saved == trained and loaded == trained, (rank, saved, loaded)
        # a checkpoint without the entry loads as before: the fresh optimizer's seed, no skips
        assert old["sr_seed"] != trained["sr_seed"] and old["skipped_steps"] == 0


def test_planner_memory_matches_tp2_rank(runs):
    # the planner's per-GPU activations and weights against one tp2 rank's real tensors
    acts, planned_acts, weights, planned_weights = runs["tp2_memory"]
    assert planned_acts == pytest.approx(acts, rel=0.10)
    assert planned_weights == pytest.approx(weights, rel=0.10)


def test_sequence_parallel_shards_activations(runs):
    # the norms keep sequence shards: fewer saved bytes per rank than plain tp2, as planned
    acts, planned_acts, _, _ = runs["tp2_sp_memory"]
    assert acts < runs["tp2_memory"][0]
    assert planned_acts == pytest.approx(acts, rel=0.10)


def test_clip_reduces_partial_grads(runs):
    norm, expected, err = runs["clip_partial"]
    assert norm == pytest.approx(expected, rel=1e-6)
    assert err < 1e-6


def test_lora_tp_trains_only_adapters(runs):
    # SequenceParallel re-creates the (frozen) norm weights; they must stay frozen
    assert runs["lora_sp_trainable"] == ["lora_A", "lora_B"]


def test_lora_tp_disable_adapters_gives_the_base_model(runs):
    # the tensor-parallel LoRA layers' own forwards honour disable_adapters (DPO's reference)
    disabled, enabled = runs["lora_tp_disabled"]
    assert disabled < 1e-5 and enabled > 1e-3, (disabled, enabled)


def test_clear_errors(runs):
    errors = runs["errors"]
    assert "parallel.dp=3" in errors["mesh"] and "world size is 4" in errors["mesh"]
    assert "global_batch_size=7" in errors["batch"] and "parallel.dp=2" in errors["batch"]
    assert "sequence length (15)" in errors["seq"] and "parallel.tp=2" in errors["seq"]


def test_split_layers_balances_cost():
    assert split_layers([1.0] * 4, 2) == [0, 2, 4]
    # a head as costly as 2 layers moves two layers off the last stage
    assert split_layers([1.0] * 6, 2, last_cost=2.0) == [0, 4, 6]
    assert split_layers([1.0, 1.0, 4.0, 1.0], 3) == [0, 2, 3, 4]
    with pytest.raises(ValueError, match="parallel.pp=5.*num_hidden_layers=4"):
        split_layers([1.0] * 4, 5)


def test_schedule_errors():
    class FakeStage:
        num_stages = 2

    with pytest.raises(ValueError, match="not divisible by n_microbatches=3"):
        build_schedule(FakeStage(), 3, None, "gpipe", batch_size=8)
    with pytest.raises(ValueError, match="needs at least parallel.pp=2 micro-batches per step, "
                                         "got n_microbatches=1"):
        build_schedule(FakeStage(), 1, None, "1f1b", batch_size=8)
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_schedule(FakeStage(), 2, None, "zigzag")


@pytest.mark.parametrize("engine,release", [("FSDP2", "2.8.0"), ("tensor parallel", "2.9.1"),
                                            ("pipeline parallel", "2.9.1")])
def test_engines_refuse_cpu_meshes_of_torch_releases_that_failed(monkeypatch, engine, release):
    """Below the oldest torch each engine passed with on Gloo, FSDP2, tensor parallel and the
    pipeline refuse a CPU mesh with the release and what it did, before wrapping anything; the
    same calls on a GPU mesh and on the oldest passing release get past the check."""
    from torch.torch_version import TorchVersion

    from fastllm.parallel import _torch_support, pipeline, tensor_parallel
    from parallel_train import tiny_llama

    class Mesh:
        def __init__(self, device_type):
            self.device_type = device_type

        def size(self):
            return 2

    class Wrapped(Exception):
        pass

    def wrapping(*args, **kwargs):
        raise Wrapped

    monkeypatch.setattr(tensor_parallel, "fully_shard", wrapping)
    monkeypatch.setattr(tensor_parallel, "parallelize_module", wrapping)
    monkeypatch.setattr(pipeline, "LlamaStage", wrapping)
    config = dict(layers=2)
    calls = {
        "FSDP2": lambda device: tensor_parallel.apply_fsdp(tiny_llama(**config), Mesh(device)),
        "tensor parallel": lambda device: tensor_parallel.apply_tensor_parallel(
            tiny_llama(**config), Mesh(device)),
        "pipeline parallel": lambda device: pipeline.build_pipeline_stage(
            tiny_llama(**config), 0, 2, device=device),
    }
    monkeypatch.setattr(_torch_support, "TORCH", TorchVersion(release))
    minimum = ".".join(map(str, _torch_support.MINIMUM_ON_CPU[engine][0]))
    with pytest.raises(RuntimeError, match=rf"{engine} on CPU \(Gloo\) needs torch >= "
                                           rf"{minimum}, this is {release}"):
        calls[engine]("cpu")
    with pytest.raises(Wrapped):
        calls[engine]("cuda")
    monkeypatch.setattr(_torch_support, "TORCH", TorchVersion(minimum + ".0"))
    with pytest.raises(Wrapped):
        calls[engine]("cpu")


def test_layout_sizes_ranks_and_rules():
    from fastllm.parallel import ParallelLayout

    lay = ParallelLayout.resolve(8, tp=2, pp=2)
    assert (lay.dp, lay.world_size, lay.stages, lay.describe()) == (2, 8, 2, "dp 2 x tp 2 x pp 2")
    # init_device_mesh's row-major order over (pp, dp, tp)
    assert [lay.coords(r) for r in range(8)] == [(p, d, t) for p in range(2) for d in range(2)
                                                 for t in range(2)]
    assert ParallelLayout(pp=2, schedule="interleaved").stages == 4
    with pytest.raises(ValueError, match="parallel.dp must be a positive integer, got 0"):
        ParallelLayout(dp=0)
    with pytest.raises(ValueError, match="parallel.sequence_parallel needs parallel.tp > 1"):
        ParallelLayout(sequence_parallel=True)


def test_tp_head_count_error():
    from parallel_train import tiny_llama
    from fastllm.parallel import ParallelLayout

    with pytest.raises(ValueError, match="parallel.tp=4 does not divide num_key_value_heads=2"):
        ParallelLayout(tp=4).check_model(tiny_llama().config, vocab_parallel=True)


class _FakeMesh:
    """Named dims of given sizes, enough for parallelize's checks (no process group)."""

    def __init__(self, **dims):
        self.dims, self.mesh_dim_names = dims, tuple(dims)

    def __getitem__(self, name):
        mesh = _FakeMesh()
        mesh.size, mesh.device_type = (lambda: self.dims[name]), "cpu"
        return mesh


def test_custom_plan_leaves_the_vocabulary_alone(monkeypatch):
    """A custom plan shards decoder-layer submodules only: tied embeddings and a vocabulary
    tp does not divide are accepted; the per-layer rules (heads, kv heads, ffn) still hold, and
    every dimension the plan splits must divide, checked before any layer changes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fastllm.parallel import parallelize, tensor_parallel
    from parallel_train import tiny_llama

    sharded = []
    monkeypatch.setattr(tensor_parallel, "parallelize_module",
                        lambda module, mesh, plan: sharded.append((type(module).__name__,
                                                                   sorted(plan))))
    plan = {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    odd = tiny_llama(layers=2)  # layer 1's gate_proj: 161 outputs, which the config cannot say
    odd.model.layers[1].mlp.gate_proj = torch.nn.Linear(64, 161, bias=False)
    with pytest.raises(ValueError, match=r"tp=2 does not divide mlp.gate_proj.out_features=161, "
                                         r"which the plan's ColwiseParallel on mlp.gate_proj"):
        parallelize(odd, _FakeMesh(tp=2), plan=plan)
    assert sharded == []  # refused before the first layer was changed
    tied = tiny_llama(layers=2)
    tied.config.tie_word_embeddings = True
    for model in (tied, tiny_llama(layers=2, vocab=129)):
        sharded.clear()
        parallelize(model, _FakeMesh(tp=2), plan=plan)
        assert sharded == [("LlamaDecoderLayer", sorted(plan))] * 2
    with pytest.raises(ValueError, match="parallel.tp=4 does not divide num_key_value_heads=2"):
        parallelize(tiny_llama(layers=2), _FakeMesh(tp=4), plan=plan)


@pytest.mark.parametrize("mesh", [None, _FakeMesh(dp=1), _FakeMesh(dp=2, tp=1)])
def test_sequence_parallel_without_tp_is_refused(monkeypatch, mesh):
    from fastllm.parallel import parallelize, tensor_parallel
    from parallel_train import tiny_llama

    monkeypatch.setattr(tensor_parallel, "fully_shard", lambda *a, **k: None)
    with pytest.raises(ValueError, match="sequence_parallel=True needs a mesh with a \"tp\" "
                                         "dimension of size > 1"):
        parallelize(tiny_llama(layers=1), mesh, sequence_parallel=True)


@pytest.mark.parametrize("sizes,says", [
    (dict(tp=0), "parallel.tp must be a positive integer, got 0"),
    (dict(pp=0), "parallel.pp must be a positive integer, got 0"),
    (dict(tp=-2), "parallel.tp must be a positive integer, got -2"),
    (dict(tp=2.0), "parallel.tp must be a positive integer, got 2.0"),
    (dict(pp=None), "parallel.pp must be a positive integer, got None"),
    (dict(dp=2.0, tp=2), "parallel.dp must be an integer"),
])
def test_layout_resolve_names_the_bad_size(sizes, says):
    from fastllm.parallel import ParallelLayout

    with pytest.raises(ValueError, match=says):
        ParallelLayout.resolve(4, **sizes)


def test_example_checkpoint_keeps_the_optimizer_entry(tmp_path):
    """examples/parallel_train.py's DCP checkpoint carries fastllm AdamW's 'fastllm' entry (DCP
    keeps only 'state' and 'param_groups') in a JSON file beside it, and resuming loads it."""
    import json

    from parallel_train import EXTRAS_FILE

    torch.set_num_threads(1)
    ckpt = str(tmp_path / "ckpt")
    train(steps=2, optimizer="fastllm_clip", save_dir=ckpt, save_at=1, distributed=False)
    path = os.path.join(ckpt, EXTRAS_FILE)
    with open(path) as f:
        extras = json.load(f)
    assert extras["fastllm"]["skipped_steps"] == 0
    extras["fastllm"]["skipped_steps"] = 7  # as if 7 non-finite steps had been skipped
    with open(path, "w") as f:
        json.dump(extras, f)
    resumed = train(steps=1, optimizer="fastllm_clip", load_dir=ckpt, start_step=1,
                    distributed=False)
    assert resumed["skipped_steps"] == 7


def test_clip_takes_one_tensor_as_torch_does():
    """torch.nn.utils.clip_grad_norm_ takes a Tensor or an iterable of them; so does this one
    (one tensor was iterated by rows, which have no .grad: nothing clipped)."""
    from fastllm.parallel import clip_grad_norm_

    p = torch.ones(3, 4, requires_grad=True)
    p.grad = torch.full((3, 4), 2.0)
    q = p.detach().clone().requires_grad_()
    q.grad = p.grad.clone()
    torch.testing.assert_close(clip_grad_norm_(p, max_norm=1.0),
                               torch.nn.utils.clip_grad_norm_(q, max_norm=1.0))
    torch.testing.assert_close(p.grad, q.grad)


def test_clip_takes_torchs_arguments_in_torchs_order():
    """clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach) as torch's: the
    third positional argument was pp_group (a float reached the process-group code)."""
    from fastllm.parallel import clip_grad_norm_

    p = torch.ones(3, requires_grad=True)
    p.grad = torch.tensor([3.0, 4.0, 12.0])
    q = p.detach().clone().requires_grad_()
    q.grad = p.grad.clone()
    torch.testing.assert_close(clip_grad_norm_([p], 1.0, 2.0, False, True),
                               torch.nn.utils.clip_grad_norm_([q], 1.0, 2.0, False, True))
    torch.testing.assert_close(p.grad, q.grad)
    p.grad = torch.tensor([float("inf"), 1.0, 1.0])
    before = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert torch.equal(p.grad, before)


class _PPMesh:  # what Pipeline and build_pipeline read of mesh["pp"], without a process group
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def get_local_rank(self):
        return 0

    def get_group(self):
        return None

    def __getitem__(self, name):
        return self


def test_pipeline_refuses_a_batch_that_does_not_split_before_the_schedule_runs():
    from fastllm.parallel.pipeline import Pipeline

    class Schedule:
        def step(self, *args, **kwargs):
            raise AssertionError("the schedule ran")

    pipe = Pipeline(torch.nn.Identity(), Schedule(), _PPMesh(2), n_microbatches=2, chunks=1)
    with pytest.raises(ValueError, match="3 rows .* n_microbatches=2"):
        pipe.step(torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))


def test_interleaved_pipeline_names_the_pp_the_user_set():
    from types import SimpleNamespace

    from fastllm.parallel.pipeline import build_pipeline

    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"parallel.pp=2 runs 4 stages.*num_hidden_layers=2"):
        build_pipeline(model, _PPMesh(2), n_microbatches=4, schedule="interleaved")
