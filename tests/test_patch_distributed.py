"""fastllm.patch under FSDP2, tensor parallel and sequence parallel: one 2-rank Gloo world, spawned
once for the module (fastllm.distributed.launch.spawn: one thread per rank, a timeout on the
join), runs each layout on a patched tiny SmolLM2-shaped Llama (GQA; tied embeddings, or untied
where the head is split on the vocabulary), returns its loss, every gradient gathered and which
fastllm kernels ran on what (QLoRA too: NF4 bases FSDP2-sharded), then runs `fastllm train` with
parallel.tp=2, and QLoRA with parallel.strategy=fsdp, on a Hugging Face folder.
Each test compares with the unpatched model in this process (fp32: 1e-5 on the loss, 1e-4 on
grads, as tests/test_patch.py; bf16: no further from fp32 than twice unpatched bf16)."""

import collections
import os

import pytest
import torch

import fastllm
from fastllm import _gemm
from fastllm.distributed.launch import spawn
from fastllm.parallel import _torch_support

transformers = pytest.importorskip("transformers")

WORLD = 2
SPAWN_TIMEOUT = 600  # about 15 s of CPU per rank; the machine may be shared
STEPS = 3  # fastllm.optim.AdamW steps under FSDP2
LR = 1e-2
TRAIN_STEPS = 3  # fastllm train steps
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (_model kwargs, how it is parallelised)
LAYOUTS = {
    # FSDP2 per decoder layer and at the root; each rank its half of the batch
    "fsdp2": (dict(tied=True), "fsdp"),
    # ... untied, through fastllm.parallel.apply_fsdp: the input embedding an FSDP2 unit of its
    # own (the head stays in the root)
    "fsdp2_untied": (dict(tied=False), "fsdp_apply"),
    # ... with transformers' activation checkpointing: the patched layer recomputed in backward
    "fsdp2_recompute": (dict(tied=True), "fsdp_recompute"),
    # fastllm.parallel.parallelize on a tp mesh of 2: vocabulary-parallel embedding and head
    "tp2": (dict(tied=False, vocab=128), "tp"),
    "tp2_sp": (dict(tied=False, vocab=128), "tp_sp"),
    # what `fastllm train` does with parallel.tp=2 for a tied model whose vocab tp does not
    # divide: the embedding and head whole on every rank
    "tp2_sp_whole_head": (dict(tied=True), "tp_sp_whole_head"),
    # FSDP2 over tp + sequence parallel on a 1 x 2 (dp x tp) mesh: FSDP2's 2-D path (the units
    # unshard to tp DTensors; it reduces the norms' partial grads itself) with a dp of 1
    "dp1_tp2_sp": (dict(tied=False, vocab=128), "dp_tp_sp"),
    # fastllm.lora under tp + sequence parallel: the adapters sharded with their projections
    "tp2_sp_lora": (dict(tied=False, vocab=128, lora=True), "tp_sp"),
    # QLoRA: fastllm.lora over NF4 bases (fastllm.quant), the 4-bit codes and absmax made
    # shardable (fastllm.quant.shardable_nf4) and split over the ranks with their layer
    "fsdp2_qlora": (dict(tied=True, lora=True, nf4=True), "fsdp"),
    # bf16 with the CPU's bf16 matmuls widened to fp32 (FASTLLM_CPU_LOWP_MATMUL=fp32)
    "tp2_sp_bf16": (dict(tied=False, vocab=128, dtype=torch.bfloat16), "tp_sp"),
}
# FSDP-QLoRA needs a torch whose FSDP2 shards integer parameters (fastllm refuses it below)
FSDP2_NF4 = _torch_support.TORCH >= _torch_support.FSDP2_INTEGER_PARAMS
if not FSDP2_NF4:
    del LAYOUTS["fsdp2_qlora"]
KERNELS = {
    "rms_norm": "fastllm.ops.rms_norm",
    "rotary_embedding": "fastllm.ops.rotary_embedding",
    "swiglu": "fastllm.ops.swiglu",
    "swiglu_linear": "fastllm.ops.swiglu",
    "swiglu_mlp": "fastllm.ops.gated_mlp",
    "fused_linear_cross_entropy": "fastllm.ops.fused_linear_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy": "fastllm.ops.vocab_parallel_cross_entropy",
    "linear": "fastllm.ops.linear",
    "scaled_dot_product_attention": "fastllm._lowp",
    "attention": "fastllm.ops.attention",
    "nf4_lora_linear_multi": "fastllm.quant",
    "nf4_swiglu_lora_linear": "fastllm.quant",
}


def _model(tied=True, vocab=123, lora=False, dtype=torch.float32, nf4=False):
    """tests/test_patch.py's SmolLM2-shaped Llama: hidden 64, 2 layers, 4 query / 2 kv heads
    (`nf4`: its linears but the head in NF4, fastllm.quant.quantize_nf4)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1: make them differ so dweight is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if nf4:
        fastllm.quant.quantize_nf4(model)
    if lora:
        fastllm.lora.inject_lora(model, LORA_TARGETS, r=4)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model.to(dtype)


def _batch(step=0, vocab=123):
    """4 sequences of 12 tokens (sequence parallel splits 12 over 2 ranks); the same prompt
    masked in sequences 0 and 2 so both halves of the batch hold as many labelled tokens."""
    g = torch.Generator().manual_seed(1 + step)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    labels = ids.clone()
    labels[0::2, :3] = -100
    return ids, labels


def _grads(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def _params(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _nf4_bytes(model):
    """(bytes this rank holds, bytes in all) of the model's NF4 codes and absmax."""
    return fastllm.quant.nf4_bytes(model, held=True), fastllm.quant.nf4_bytes(model)


def _counting_kernels(calls):
    """Wrap fastllm's kernels (patch.py imports them when each forward runs) to count their calls
    and the DTensors among their tensor arguments (fastllm.patch must hand them local tensors)."""
    import importlib

    from torch.distributed.tensor import DTensor

    originals = []
    for name, module_name in KERNELS.items():
        module = importlib.import_module(module_name)
        fn = getattr(module, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            calls["dtensor_args"] += sum(isinstance(a, DTensor)
                                         for a in (*args, *kwargs.values()))
            return _fn(*args, **kwargs)

        setattr(module, name, counted)
        originals.append((module, name, fn))
    return originals


def _parallelize(model, how, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastllm.parallel import (apply_activation_checkpointing, apply_fsdp,
                                  apply_tensor_parallel, parallelize)

    if how.startswith("fsdp"):
        if how == "fsdp_recompute":
            apply_activation_checkpointing(model)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        if how == "fsdp_apply":
            apply_fsdp(model, mesh)
            return slice(rank * 2, rank * 2 + 2)
        fastllm.quant.shardable_nf4(model)  # (before a fully_shard of one's own)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return slice(rank * 2, rank * 2 + 2)  # this rank's half of the batch
    if how == "dp_tp_sp":
        mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)
        apply_fsdp(model, mesh["dp"])  # parallelize() skips a dp of 1
        return slice(None)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    if how == "tp_sp_whole_head":
        apply_tensor_parallel(model, mesh["tp"], vocab_parallel_logits=False,
                              vocab_parallel=False, sequence_parallel=True)
    else:
        parallelize(model, mesh, sequence_parallel=how == "tp_sp")
    return slice(None)  # tensor parallel ranks read the same batch


def _run_layout(name, rank):
    import torch.distributed as dist

    kwargs, how = LAYOUTS[name]
    model = _model(**kwargs)
    fastllm.patch(model)
    part = _parallelize(model, how, rank)
    model.train()
    ids, labels = _batch(vocab=model.config.vocab_size)
    calls = collections.Counter()
    originals = _counting_kernels(calls)
    try:
        loss = model(input_ids=ids[part], labels=labels[part]).loss
        loss.backward()
    finally:
        for module, fn_name, fn in originals:
            setattr(module, fn_name, fn)
    from torch.distributed.fsdp import FSDPModule

    out = {"calls": dict(calls), "grads": _grads(model), "nf4_bytes": _nf4_bytes(model),
           "embedding_unit": isinstance(model.get_input_embeddings(), FSDPModule)}
    losses = [loss.detach().clone()]
    if how in ("fsdp", "fsdp_apply"):
        opt = fastllm.optim.AdamW(model.parameters(), lr=LR)
        for step in range(1, STEPS + 1):
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == STEPS:
                break
            ids, labels = _batch(step, vocab=model.config.vocab_size)
            loss = model(input_ids=ids[part], labels=labels[part]).loss
            loss.backward()
            losses.append(loss.detach().clone())
        out["params"] = _params(model)
    if how.startswith("fsdp"):  # the mean over the ranks' halves (equal label counts)
        losses = torch.stack(losses)
        dist.all_reduce(losses)
        losses = list(losses / WORLD)
    out["losses"] = [float(x) for x in losses]
    return out


def _hf_folder(path):
    """A Hugging Face folder (the SmolLM2-shaped tied Llama, a byte-level BPE of 300 tokens) and
    train.txt, some 16 KB of English from the standard library, for `fastllm train`."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = "\n".join(topics[k] for k in sorted(topics))[:16000]
    with open(os.path.join(path, "train.txt"), "w") as f:
        f.write(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                         eos_token="<|endoftext|>").save_pretrained(path)
    _model(vocab=300).save_pretrained(path)


def _train_args(folder, output_dir, *extra):
    return [f"model={folder}", f"data.path={os.path.join(folder, 'train.txt')}",
            "data.seq_len=16", "micro_batch_size=4", "global_batch_size=4",
            f"max_steps={TRAIN_STEPS}", "lr=1e-2", "warmup_steps=1", "threads=1",
            "log_interval=1000", "checkpoint.interval=0", f"output_dir={output_dir}",
            f"data.cache_dir={os.path.join(folder, 'cache')}", *extra]


def _train_tp(rank, folder):
    """`fastllm train` on the folder with parallel.tp=2 and sequence parallel (the run joins
    this process group): what it patched."""
    from fastllm.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig.from_args(_train_args(
        folder, os.path.join(folder, "tp2"), "parallel.tp=2", "parallel.sequence_parallel=true")))
    trainer.train()
    return fastllm.patched(trainer.module)


COMPILED_ARGS = ("checkpoint_ratio=0.5", "torch_compile=true")
QLORA_ARGS = ("finetune=lora", "lora.quantize_base=nf4", "lora.target_modules=all-linear",
              "micro_batch_size=2", f"checkpoint.interval={TRAIN_STEPS}")
# QDoRA: weight norms from NF4; q/v only: the other NF4 layers, with no adapter, save their
# gathered codes for backward across FSDP2's reshard and re-gather (and their absmax
# double-quantised: one uint8 tensor sharded as the codes are)
QLORA_RUNS = {"qlora": (), "qdora": ("lora.use_dora=true",),
              "qlora_qv": ("lora.target_modules=q_proj,v_proj", "lora.double_quant=true")}
QLORA_RUNS = QLORA_RUNS if FSDP2_NF4 else {}


def _train_compiled(rank, folder, name, *extra):
    """A `fastllm train` run (joining this process group) with extra args: its graph breaks and
    graphs."""
    from torch._dynamo.utils import counters

    from fastllm.train import TrainConfig, Trainer

    torch._dynamo.reset()
    counters.clear()
    Trainer(TrainConfig.from_args(_train_args(folder, os.path.join(folder, name), *extra))).train()
    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


# torch_compile=true under tensor parallel (each decoder layer compiled before tensor parallel
# shards it), the pipeline's two stages (the built-in tiny model, untied and unpatched: its
# checkpointed layer's attention sets and resets a context variable, on which dynamo broke the
# graph until fastllm train let the recomputation skip it), DDP and ZeRO-2 (whose overlapped
# param gather's pre-hooks inside the compiled layers broke their graphs: gathered at once under
# compile); half the layers checkpointed. Each run beside its eager twin (tp2: _train_tp's; ddp:
# the data-parallel runs', ZeRO-2's within Adam's rounding of DDP's).
PP_ARGS = ("model=tiny", "parallel.pp=2", "micro_batch_size=1")
COMPILED_RUNS = {"tp2_compiled": ("parallel.tp=2", "parallel.sequence_parallel=true",
                                  *COMPILED_ARGS),
                 "pp2": (*PP_ARGS, COMPILED_ARGS[0]), "pp2_compiled": (*PP_ARGS, *COMPILED_ARGS),
                 "ddp": ("parallel.strategy=ddp", "micro_batch_size=2", COMPILED_ARGS[0])}
COMPILED_RUNS.update({f"{dp}_compiled": (f"parallel.strategy={dp}", "micro_batch_size=2",
                                         *COMPILED_ARGS) for dp in ("ddp", "zero2")})


def _train_qlora_fsdp(rank, folder, run):
    """`fastllm train` QLoRA (or QDoRA) with parallel.strategy=fsdp (the run joins this process
    group): the bytes of 4-bit weights this rank held, and in all, and whether their absmax is
    double-quantised."""
    from fastllm.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig.from_args(_train_args(
        folder, os.path.join(folder, f"{run}_fsdp"), *QLORA_ARGS, *QLORA_RUNS[run],
        "parallel.strategy=fsdp")))
    trainer.train()
    layers = [m for m in trainer.module.modules() if isinstance(m, fastllm.quant.NF4Linear)]
    return (*_nf4_bytes(trainer.module), bool(layers) and all(m.double_quant for m in layers))


def _nf4_mixed_precision_refused():
    """apply_fsdp with a param_dtype on a model of NF4 layers: (its error, whether anything was
    sharded or made shardable)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fastllm.parallel import apply_fsdp

    model = _model(nf4=True)
    try:
        apply_fsdp(model, init_device_mesh("cpu", (WORLD,)), param_dtype=torch.bfloat16)
    except ValueError as e:
        changed = any(isinstance(p, DTensor) for p in model.parameters()) or any(
            "weight_packed" in n for n, _ in model.named_parameters())
        return str(e), changed
    return None, True


def _train_fsdp_compiled(rank, folder):
    """`fastllm train parallel.strategy=fsdp torch_compile=true` (the run joins this process
    group): each decoder layer compiled, then sharded; its graph breaks and graphs."""
    from torch._dynamo.utils import counters

    from fastllm.parallel import decoder_layers
    from fastllm.train import TrainConfig, Trainer

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(TrainConfig.from_args(_train_args(
        folder, os.path.join(folder, "fsdp_compiled"), *COMPILED_ARGS,
        "parallel.strategy=fsdp", "micro_batch_size=2")))
    trainer.train()
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(trainer.module))
    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


def _worker(rank, world_size, folder):
    # widen bf16 matmuls on every CPU, as tests/test_patch.py does (fp32 runs are unaffected)
    os.environ["FASTLLM_CPU_LOWP_MATMUL"] = "fp32"
    # fastllm's CPU attention on every CPU (auto takes it on some CPUs and shapes only)
    os.environ["FASTLLM_CPU_ATTENTION"] = "fastllm"
    out = {name: _run_layout(name, rank) for name in LAYOUTS}
    out["train_tp2_sp"] = _train_tp(rank, folder)
    out["train_fsdp_compiled"] = _train_fsdp_compiled(rank, folder)
    for name, extra in COMPILED_RUNS.items():
        out[f"train_{name}"] = _train_compiled(rank, folder, name, *extra)
    for run in QLORA_RUNS:
        out[f"train_{run}_fsdp"] = _train_qlora_fsdp(rank, folder, run)
    out["nf4_mixed_precision"] = _nf4_mixed_precision_refused()
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-llama"))
    _hf_folder(path)
    return path


@pytest.fixture(scope="module")
def runs(folder):
    return spawn(_worker, WORLD, args=(folder,), timeout=SPAWN_TIMEOUT)


def _reference(name, **over):
    """The unpatched model in this process on the whole batch: losses, first grads, and for
    the FSDP2 layout the params after STEPS fastllm.optim.AdamW steps."""
    kwargs, how = LAYOUTS[name]
    model = _model(**{**kwargs, **over})
    losses, grads = [], None
    opt = fastllm.optim.AdamW(model.parameters(), lr=LR) if how in ("fsdp", "fsdp_apply") else None
    for step in range(STEPS if opt else 1):
        ids, labels = _batch(step, vocab=model.config.vocab_size)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(float(loss.detach()))
        grads = grads or _grads(model)
        if opt:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": _params(model)}


def _assert_grads_close(got, want, rtol=1e-4):
    assert got.keys() == want.keys() and want
    for name in want:
        scale = want[name].abs().max().item() + 1e-30
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rtol * scale, f"{name}: {err:.3g} vs {scale:.3g}"


# kernel calls in one forward of the 2-layer model: 5 norms, 2 attentions, 2 MLPs, 1 loss;
# fastllm.ops.linear only where fastllm/_gemm.py routes fp32 CPU matmuls (see _expected_calls;
# a DTensor weight always takes DTensor's F.linear)
EXPECTED_CALLS = {
    # FSDP2: unsharded plain parameters inside each unit; down_proj fused with the SwiGLU
    "fsdp2": {"rms_norm": 5, "rotary_embedding": 2, "swiglu_linear": 2,
              "fused_linear_cross_entropy": 1},
    "fsdp2_untied": {"rms_norm": 5, "rotary_embedding": 2, "swiglu_linear": 2,
                     "fused_linear_cross_entropy": 1},
    # each layer's recomputation in backward runs its kernels again
    "fsdp2_recompute": {"rms_norm": 9, "rotary_embedding": 4, "swiglu_linear": 4,
                        "fused_linear_cross_entropy": 1},
    # QLoRA on the gathered 4-bit bases: q/k/v and gate/up with x read once for every LoRA A,
    # down_proj over the SwiGLU without keeping its product
    "fsdp2_qlora": {"rms_norm": 5, "rotary_embedding": 2, "nf4_lora_linear_multi": 4,
                    "nf4_swiglu_lora_linear": 2, "fused_linear_cross_entropy": 1},
    # tp: local head / ffn shards; the row-parallel down_proj runs as itself after swiglu; the
    # head split on the vocabulary: the vocabulary-parallel fused loss
    "tp2": {"rms_norm": 5, "rotary_embedding": 2, "swiglu": 2,
            "vocab_parallel_fused_linear_cross_entropy": 1},
    "tp2_sp": {"rms_norm": 5, "rotary_embedding": 2, "swiglu": 2,
               "vocab_parallel_fused_linear_cross_entropy": 1},
    "tp2_sp_whole_head": {"rms_norm": 5, "rotary_embedding": 2, "swiglu": 2,
                          "fused_linear_cross_entropy": 1},
    "dp1_tp2_sp": {"rms_norm": 5, "rotary_embedding": 2, "swiglu": 2,
                   "vocab_parallel_fused_linear_cross_entropy": 1},
    "tp2_sp_lora": {"rms_norm": 5, "rotary_embedding": 2, "swiglu": 2,
                    "vocab_parallel_fused_linear_cross_entropy": 1},
    # bf16: the attention's widened flash path on the local heads
    "tp2_sp_bf16": {"rms_norm": 5, "rotary_embedding": 2, "swiglu": 2,
                    "scaled_dot_product_attention": 2,
                    "vocab_parallel_fused_linear_cross_entropy": 1},
}


# FSDP2 hands the projections plain unsharded weights: on a CPU where fastllm routes fp32 matmuls
# through oneDNN (fastllm/_gemm.py), q/k/v/o/gate/up of both layers go to fastllm.ops.linear
# (down_proj is fused with the SwiGLU), again in each recomputation
ROUTED_LINEAR_CALLS = {"fsdp2": 12, "fsdp2_untied": 12, "fsdp2_recompute": 24}


# the workers set FASTLLM_CPU_ATTENTION=fastllm: where the extension has the kernel, every
# layout's attention (on local heads under tp) is fastllm.ops.attention, in place of the widened
# flash path
ATTENTION_CALLS = {"fsdp2_recompute": 4}


def _attention_kernel():
    ext = fastllm._extension
    return ext.has_cpp() and hasattr(ext.extension(), "attention_cpu")


def _expected_calls(layout):
    want = dict(EXPECTED_CALLS[layout])
    if layout in ROUTED_LINEAR_CALLS and _gemm.routes("cpu", torch.float32):
        want["linear"] = ROUTED_LINEAR_CALLS[layout]
    elif "swiglu_linear" in want:
        # F.linear is what the plain fp32 projections run here: each MLP is one node
        # (fastllm.ops.gated_mlp), as on a GPU
        want["swiglu_mlp"] = want.pop("swiglu_linear")
    if _attention_kernel():
        want.pop("scaled_dot_product_attention", None)
        want["attention"] = ATTENTION_CALLS.get(layout, 2)
    return want


def _assert_kernels_ran(runs, layout):
    # every replaced module ran its fastllm kernel, and on local tensors only
    for rank, got in enumerate(runs):
        calls = got[layout]["calls"]
        assert calls == {**_expected_calls(layout), "dtensor_args": 0}, (rank, calls)


@pytest.mark.parametrize("layout", [name for name, (kw, _) in LAYOUTS.items()
                                    if "dtype" not in kw])
def test_patched_layout_equals_unpatched_single_process(runs, layout):
    _assert_kernels_ran(runs, layout)
    held = [got[layout]["nf4_bytes"][0] for got in runs]
    total = runs[0][layout]["nf4_bytes"][1]
    if LAYOUTS[layout][0].get("nf4"):  # each rank holds its half of the 4-bit weights
        assert total > 0 and sum(held) == total and max(held) <= 0.51 * total, (held, total)
    kwargs, how = LAYOUTS[layout]
    # (apply_fsdp: an untied embedding is a unit of its own; a tied one stays in the root)
    sharded = how.startswith("fsdp") or how == "dp_tp_sp"
    assert runs[0][layout]["embedding_unit"] == (sharded and not kwargs.get("tied"))
    want = _reference(layout)
    for got in runs:
        got = got[layout]
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                   torch.tensor(want["losses"], dtype=torch.float64),
                                   rtol=1e-5, atol=0)
        _assert_grads_close(got["grads"], want["grads"])
        if "params" in got:  # fastllm.optim.AdamW steps on the FSDP2 shards
            # Adam divides each grad by its own size, so entries whose grads are near zero carry
            # their rounding differences into the update (seen: lr / 1000); a wrong step: ~lr
            for name, p in want["params"].items():
                err = (got["params"][name] - p).abs().max().item()
                assert err <= LR / 100, f"{name}: {err:.3g} after {STEPS} steps of lr {LR}"


def test_bf16_tensor_parallel_close_to_fp32(runs):
    """bf16 under tp2 + sequence parallel: loss and every grad no further from the fp32 model's
    than twice the unpatched bf16 model's in one process are (plus 1e-3 of the largest)."""
    _assert_kernels_ran(runs, "tp2_sp_bf16")
    exact = _reference("tp2_sp_bf16", dtype=torch.float32)
    theirs = _reference("tp2_sp_bf16")

    def err(a, b):
        return (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max().item()

    for got in runs:
        got = got["tp2_sp_bf16"]
        assert err(got["losses"], exact["losses"]) <= 2 * err(theirs["losses"],
                                                               exact["losses"]) + 1e-3
        for name, g in exact["grads"].items():
            assert got["grads"][name].dtype == torch.bfloat16
            bound = 2 * err(theirs["grads"][name], g) + 1e-3 * g.abs().max().item()
            assert err(got["grads"][name], g) <= bound, name


def test_fastllm_train_patches_under_tensor_parallel(runs, folder):
    """`fastllm train` on a Hugging Face folder with parallel.tp=2 and sequence parallel patches
    the model (kernels=fastllm, the default) and trains as the unpatched model does in one
    process (kernels=none): the same losses and global grad norms (tests/test_parallel_train.py's
    tolerance)."""
    from fastllm.train import TrainConfig, Trainer
    from fastllm.train.metrics import read_metrics

    for counts in runs:
        assert counts["train_tp2_sp"] == {"rms_norm": 5, "rotary": 2, "swiglu": 2,
                                          "cross_entropy": 1, "linear": 15}
    single = os.path.join(folder, "single")
    threads = torch.get_num_threads()
    try:
        Trainer(TrainConfig.from_args(_train_args(folder, single, "kernels=none"))).train()
    finally:
        torch.set_num_threads(threads)
    got, want = (read_metrics(os.path.join(d, "metrics.jsonl"))
                 for d in (os.path.join(folder, "tp2"), single))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(
        range(1, TRAIN_STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in got], [r[key] for r in want], rtol=1e-4,
                                   atol=0)


def test_fsdp_mixed_precision_over_nf4_is_refused_first(runs):
    for got in runs:
        message, changed = got["nf4_mixed_precision"]
        assert message and "would cast the fp32 absmax of the NF4 layers" in message
        assert not changed


@pytest.mark.parametrize("run", list(QLORA_RUNS))
def test_fastllm_train_qlora_under_fsdp_trains_as_one_process(runs, folder, run):
    """`fastllm train lora.quantize_base=nf4 parallel.strategy=fsdp` (and QDoRA): each rank
    holds half the 4-bit base, and two ranks of 2 rows give one process's losses, grad norms and
    adapter at the same global batch."""
    from safetensors.torch import load_file

    from fastllm.train import TrainConfig, Trainer
    from fastllm.train.metrics import read_metrics

    held = [got[f"train_{run}_fsdp"][0] for got in runs]
    total, double_quant = runs[0][f"train_{run}_fsdp"][1:]
    assert total > 0 and sum(held) == total and max(held) <= 0.51 * total, (held, total)
    assert double_quant == ("lora.double_quant=true" in QLORA_RUNS[run])
    single = os.path.join(folder, f"{run}_one")
    threads = torch.get_num_threads()
    try:
        Trainer(TrainConfig.from_args(_train_args(folder, single, *QLORA_ARGS,
                                                  *QLORA_RUNS[run]))).train()
    finally:
        torch.set_num_threads(threads)
    got, want = (read_metrics(os.path.join(d, "metrics.jsonl"))
                 for d in (os.path.join(folder, f"{run}_fsdp"), single))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(
        range(1, TRAIN_STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in got], [r[key] for r in want], rtol=1e-4,
                                   atol=0)
    adapter = os.path.join(f"checkpoint-{TRAIN_STEPS}", "adapter", "adapter_model.safetensors")
    got, want = (load_file(os.path.join(d, adapter))
                 for d in (os.path.join(folder, f"{run}_fsdp"), single))
    # A and B (and DoRA's magnitude) of each target in 2 layers
    targets = 2 if run == "qlora_qv" else 7
    assert got.keys() == want.keys() and len(want) == 2 * targets * (3 if run == "qdora" else 2)
    for name in want:  # (Adam's rounding rule, as for the FSDP2 layouts above; lr 1e-2)
        err = (got[name] - want[name]).abs().max().item()
        assert err <= 1e-2 / 100, f"{name}: {err:.3g} after {TRAIN_STEPS} steps"


def test_fastllm_train_torch_compile_trains_as_eager(runs, folder):
    """`fastllm train torch_compile=true` compiles each decoder layer in place, as torchtitan
    does (fastllm's kernels are custom ops in the graph; the layers share one graph: patch binds
    each forward to its module, which dynamo guards by function), with no graph break (the first
    step's peak-memory tracker, a dispatch mode, made dynamo break at every fastllm op), no
    recompilation per step, and trains as the eager run does: the same losses and grad norms, in
    one process and with the compiled layers sharded by FSDP2 over two ranks; under tensor
    parallel (+ sequence parallel), in a two-stage pipeline, under DDP and ZeRO-2, the eager
    run's of that layout."""
    from torch._dynamo.utils import counters

    from fastllm.parallel import decoder_layers
    from fastllm.train import TrainConfig, Trainer
    from fastllm.train.metrics import read_metrics

    threads = torch.get_num_threads()
    runs_here = {}
    try:
        # (the compiled run also generates eval samples, before the first step and after the
        # last: eagerly, or their KV-cache decoding compiled the layers again per layer index,
        # filling dynamo's limit before the first step, which then ran uncompiled)
        prompts = ("eval.prompts=[hello world]", "eval.max_new_tokens=3")
        for name, extra in (("eager", COMPILED_ARGS[:1]), ("compiled", COMPILED_ARGS + prompts)):
            torch._dynamo.reset()
            counters.clear()
            out = os.path.join(folder, name)
            trainer = Trainer(TrainConfig.from_args(_train_args(folder, out, *extra)))
            trainer.train()
            assert all((layer._compiled_call_impl is not None) == (name == "compiled")
                       for layer in decoder_layers(trainer.module))
            assert fastllm.patched(trainer.module)["rms_norm"] == 5
            assert not counters["graph_break"], dict(counters["graph_break"])
            # one graph for both layers, or two (the checkpointed layer's, under another torch
            # or transformers)
            graphs = counters["stats"]["unique_graphs"]
            assert (1 <= graphs <= 2) if name == "compiled" else graphs == 0, graphs
            runs_here[name] = read_metrics(os.path.join(out, "metrics.jsonl"))
    finally:
        torch.set_num_threads(threads)
    for got in runs:
        breaks, graphs = got["train_fsdp_compiled"]
        assert 1 <= graphs <= 2 and not breaks, (graphs, breaks)
        # (under tensor parallel the layer's graph sees its DTensor params, 3 in torch 2.13;
        # a pipeline stage holds one layer: 1)
        for name in ("tp2_compiled", "pp2_compiled", "ddp_compiled", "zero2_compiled"):
            breaks, graphs = got[f"train_{name}"]
            assert 1 <= graphs <= 4 and not breaks, (name, graphs, breaks)
    ran = {name: read_metrics(os.path.join(folder, name, "metrics.jsonl"))
           for name in ("fsdp_compiled", "tp2", *COMPILED_RUNS)}
    for got, want in ((runs_here["compiled"], runs_here["eager"]),
                      (ran["fsdp_compiled"], runs_here["eager"]),
                      (ran["tp2_compiled"], ran["tp2"]), (ran["pp2_compiled"], ran["pp2"]),
                      (ran["ddp_compiled"], ran["ddp"]), (ran["zero2_compiled"], ran["ddp"])):
        assert [r["step"] for r in got] == [r["step"] for r in want] == list(
            range(1, TRAIN_STEPS + 1))
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close([r[key] for r in got], [r[key] for r in want],
                                       rtol=1e-4, atol=0)


def test_train_config_torch_compile():
    from fastllm.train.config import ConfigError, TrainConfig

    assert TrainConfig.from_args(["torch_compile=true"]).torch_compile is True
    assert TrainConfig.from_args(["torch_compile=true", "parallel.strategy=fsdp"]).torch_compile
    for layout in ("parallel.tp=2", "parallel.pp=2"):
        assert TrainConfig.from_args(["torch_compile=true", layout]).torch_compile
    with pytest.raises(ConfigError, match="torch_compile=.yes please. is not a valid bool"):
        TrainConfig.from_args(["torch_compile=yes please"])
