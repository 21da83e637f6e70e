"""Config keys the pipeline stage and the planner must read, single-process.

- Sliding-window attention (Mistral's `sliding_window`; Qwen2/Qwen3's `use_sliding_window`,
  `sliding_window`, `max_window_layers` -> `layer_types`): each layer of a pipeline stage gets
  the mask of its kind, so stages chained give the plain model's logits and gradients.
- Qwen3's `head_dim` (heads x head_dim != hidden) and its q/k norms: the planner's parameter
  count is the model's own.
"""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastllm.parallel.pipeline import LlamaStage, llama_layer_costs  # noqa: E402
from fastllm.parallel.planner import MODELS, model_from_hf_config  # noqa: E402

SEQ, WINDOW = 13, 4  # longer than the window, odd


def _config(family, attn="sdpa", layers=4, tied=False):
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    if family == "llama":
        cfg = transformers.LlamaConfig(**shape)
    elif family == "mistral":  # every layer windowed
        cfg = transformers.MistralConfig(**shape, sliding_window=WINDOW)
    elif family == "qwen2":  # layers >= max_window_layers windowed
        cfg = transformers.Qwen2Config(**shape, use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1)
    else:  # qwen3: 4 heads of 16 on a hidden of 32
        cfg = transformers.Qwen3Config(**shape, head_dim=16, use_sliding_window=True,
                                       sliding_window=WINDOW, max_window_layers=2)
    cfg._attn_implementation = attn
    return cfg


def _model(cfg):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=cfg._attn_implementation)


def _run_stages(model, bounds, ids):
    """Cut deep copies of `model` at `bounds` and run the stages one after the other."""
    stages = [LlamaStage(copy.deepcopy(model), lo, hi, i == 0, i == len(bounds) - 2)
              for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    h = ids
    for st in stages:
        h = st(h)
    return h, stages


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_pipeline_stages_match_the_model_with_sliding_windows(family, attn):
    model = _model(_config(family, attn))
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(1))
    kept = ids.clone()
    want = model(ids).logits
    want.float().pow(2).mean().backward()
    # a stage mixing full and sliding layers (qwen3: 0-1 full, 2-3 windowed)
    got, stages = _run_stages(model, [0, 1, 3, 4], ids)
    torch.testing.assert_close(got, want)
    got.float().pow(2).mean().backward()
    grads = {n: p.grad for st in stages for n, p in st.named_parameters()}
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    assert torch.equal(ids, kept)


def test_stage_reads_layer_kinds_before_layers_are_wrapped():
    """parallelize_fn may wrap the layers (activation checkpointing): the windowed layers keep
    their mask."""
    from fastllm.parallel.tensor_parallel import wrap_activation_checkpointing

    model = _model(_config("qwen3"))
    ids = torch.randint(0, 96, (1, SEQ), generator=torch.Generator().manual_seed(2))
    want = model(ids).logits
    stage = wrap_activation_checkpointing(LlamaStage(copy.deepcopy(model), 0, 4, True, True))
    torch.testing.assert_close(stage(ids), want)


@pytest.mark.parametrize("kind", ["granite", "gemma", "llama_subclass"])
def test_pipeline_stage_refuses_a_forward_it_does_not_reproduce(kind):
    """Granite multiplies its embeddings and divides its logits, Gemma scales its embeddings, a
    subclass may compute more: Llama's forward on their stages trained to other losses, with
    no error. Refused by model type before the model is cut; the families it runs pass."""
    from fastllm.parallel.pipeline import build_pipeline_stage, check_pipeline_model

    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if kind == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **shape, embedding_multiplier=12.0, logits_scaling=8.0))
    elif kind == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**shape, head_dim=8))
    else:
        class Scaled(transformers.LlamaForCausalLM):
            def forward(self, *args, **kwargs):
                return super().forward(*args, **kwargs) * 2

        model = Scaled(transformers.LlamaConfig(**shape))
    layers = model.model.layers
    name = {"granite": "'granite'", "gemma": "'gemma'", "llama_subclass": "'llama', a forward"}
    with pytest.raises(ValueError, match=f"pipeline parallel .* {type(model).__name__} "
                                         f"\\(model_type {name[kind]}"):
        build_pipeline_stage(model, 0, 2)
    assert model.model.layers is layers
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        check_pipeline_model(_model(_config(family, layers=1)))


def test_full_attention_under_sdpa_builds_no_mask():
    """Llama (no window) and sequences within the window keep SDPA's own causal flag: no
    (seq x seq) mask is materialised."""
    from fastllm.parallel.pipeline import _causal_masks

    h, pos = torch.zeros(2, SEQ, 32), torch.arange(SEQ).unsqueeze(0)
    assert _causal_masks(_config("llama"), h, pos, {"full_attention"}) == {"full_attention": None}
    n = WINDOW - 1
    short = _causal_masks(_config("qwen3"), h[:, :n], pos[:, :n], {"sliding_attention"})
    assert short == {"sliding_attention": None}
    long = _causal_masks(_config("qwen3"), h, pos, {"sliding_attention"})["sliding_attention"]
    assert long.shape[-2:] == (SEQ, SEQ)


def _meta_params(cfg):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    layer = model.model.layers[0]
    linear = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    return sum(p.numel() for p in model.parameters()), linear


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("mistral", False),
                                         ("qwen3", False), ("qwen3", True)])
def test_planner_counts_the_models_parameters(family, tied):
    cfg = _config(family, layers=3, tied=tied)
    spec = model_from_hf_config(cfg.to_dict())
    total, linear = _meta_params(cfg)
    assert spec.params() == total
    assert spec.layer_linear_params() == linear
    assert spec.q_dim == cfg.num_attention_heads * cfg.head_dim
    if family == "qwen3":
        assert spec.q_dim == 2 * cfg.hidden_size
        costs, _, _ = llama_layer_costs(cfg, SEQ)
        # attention's scores and weighted sum run over heads x head_dim, not hidden
        assert costs[0] == 2 * SEQ * linear + 4 * SEQ * SEQ * spec.q_dim


def test_catalog_qwen3_0_6b_is_its_config():
    # Qwen/Qwen3-0.6B config.json; its model card: 0.6B parameters, 0.44B without embeddings
    cfg = transformers.Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    spec = MODELS["qwen3-0.6b"]
    assert spec == model_from_hf_config(cfg.to_dict(), name="qwen3-0.6b")
    assert spec.params() == _meta_params(cfg)[0]
    assert round(spec.params() / 1e9, 2) == 0.6
    assert round((spec.params() - spec.embedding_params()) / 1e9, 2) == 0.44


# --- biases, head_dim without hidden % heads, Qwen3's q/k norms in the cost model ---------------

@pytest.mark.parametrize("family,biases", [
    ("qwen2", {}),  # q/k/v biases whatever the config says
    ("qwen2", dict(attention_bias=True, mlp_bias=True)),
    ("llama", dict(attention_bias=True)), ("llama", dict(mlp_bias=True)),
    ("llama", dict(attention_bias=True, mlp_bias=True)),
    ("mistral", dict(attention_bias=True, mlp_bias=True)),  # Mistral builds no bias
    ("qwen3", dict(attention_bias=True, mlp_bias=True)),  # Qwen3: attention only
])
def test_planner_counts_biases(family, biases):
    cfg = _config(family, layers=2)
    for key, value in biases.items():
        setattr(cfg, key, value)
    spec = model_from_hf_config(cfg.to_dict())
    total, linear = _meta_params(cfg)
    with torch.device("meta"):
        layer = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0]
    assert spec.params() == total
    assert spec.layer_params() == sum(p.numel() for p in layer.parameters())
    assert spec.layer_linear_params() == linear  # the matmuls' FLOPs: weights, no biases
    assert spec.layer_tensors() == len(list(layer.parameters()))


def test_plan_cli_takes_head_dim_without_hidden_divisible_by_heads(tmp_path, capsys):
    from fastllm.cli import main

    # Qwen3 builds 3 heads of 16 on a hidden of 40
    shape = dict(vocab_size=96, hidden_size=40, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=3, num_key_value_heads=1)
    cfg = transformers.Qwen3Config(**shape, head_dim=16)
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(cfg.to_json_string())
    args = ["plan", "--model", str(path), "--seq-len", "16", "--global-batch", "2",
            "--gpus", "1", "--gpu", "A100"]
    main(args)
    assert "tiny: 0.00B params, 2 layers, hidden 40, heads 3/1 kv" in capsys.readouterr().out
    assert model_from_hf_config(str(path)).params() == _meta_params(cfg)[0]
    # without head_dim, hidden must split over the heads
    path.write_text(json.dumps(dict(shape, model_type="llama")))
    with pytest.raises(SystemExit, match="hidden size 40 and 3 heads do not divide.*head_dim"):
        main(args)


def _saved_bytes(cfg, dtype):
    """Bytes autograd saves for a forward of `cfg`'s model (one count per storage)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).logits.float().pow(2).mean()
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_count_qwen3_qk_norms(dtype):
    """What Qwen3's q/k norms add to a layer's saved activations, against the same shape in
    Llama (4 heads of 16 on a hidden of 32 in both)."""
    from fastllm.parallel.planner import activation_bytes_per_layer

    qwen3 = _config("qwen3", layers=2)
    qwen3.use_sliding_window, qwen3.layer_types = False, ["full_attention"] * 2
    llama = _config("llama", layers=2)
    llama.head_dim = qwen3.head_dim
    e = dtype.itemsize
    added = _saved_bytes(qwen3, dtype) - _saved_bytes(llama, dtype)
    planned = [activation_bytes_per_layer(model_from_hf_config(c.to_dict()), 2, SEQ, e)
               for c in (qwen3, llama)]
    # equal on transformers 5.25; a tolerance, as the bytes autograd keeps inside transformers'
    # eager code may move a little between releases (a fused norm, another upcast)
    assert added > 0 and 2 * (planned[0] - planned[1]) == pytest.approx(added, rel=0.1)


def test_optimizer_host_cost_counts_each_layers_tensors():
    """The optimizer's per-tensor host cost (a CPU's op_overhead) counts the q/k norms' and the
    biases' tensors: 9 in a Llama layer, 11 in Qwen3's, 12 in Qwen2's."""
    from fastllm.parallel.planner import FASTLLM, GPUSpec, Layout, estimate

    host = GPUSpec("host", 1e12, 1e12, 1e30, 1e9, 1e9, op_overhead=1.0)
    for family, tensors in (("llama", 9), ("qwen3", 11), ("qwen2", 12)):
        spec = model_from_hf_config(_config(family, layers=2).to_dict())
        r = estimate(spec, Layout(), SEQ, 1, host, runtime=FASTLLM)
        # two layers, and the embedding, final norm and head
        assert r["time_optimizer"] == pytest.approx((2 * tensors + 3) * FASTLLM.ops_param)


def test_stage_runs_on_meta_inputs():
    """torch < 2.13's pipelining infers a stage's output shapes by running it on meta tensors:
    the masks must not read values back (transformers' packed-sequence check would)."""
    for family, attn in (("qwen3", "sdpa"), ("mistral", "eager")):
        with torch.device("meta"):
            model = _model(_config(family, attn))
        stage = LlamaStage(model, 1, 3, False, False)
        out = stage(torch.empty(2, SEQ, 32, device="meta"))
        assert out.shape == (2, SEQ, 32) and out.device.type == "meta"


class _Mesh:
    """A tp dimension of size 2 for parallelize's checks (no process group)."""

    def __init__(self, name=None):
        self.mesh_dim_names, self.device_type = ("tp",), "cpu"

    def __getitem__(self, name):
        return self

    def size(self):
        return 2


def test_custom_plan_keeps_frozen_weights_frozen(monkeypatch):
    """torch's parallel styles re-create the weights they place as new Parameters that require
    grad (SequenceParallel on Qwen3's q/k norms, added to a custom plan): under LoRA the frozen
    base weights must stay frozen."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fastllm.parallel import parallelize, tensor_parallel

    def place(module, mesh, plan):  # what the styles do to requires_grad, without a mesh
        for name in plan:
            sub = module.get_submodule(name)
            sub.weight = torch.nn.Parameter(sub.weight.detach())

    monkeypatch.setattr(tensor_parallel, "parallelize_module", place)
    monkeypatch.setattr(tensor_parallel, "_hook_grad_layouts", lambda model: None)
    model = _model(_config("qwen3", layers=2))
    model.requires_grad_(False)
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}
    parallelize(model, _Mesh(), plan=plan)
    assert not [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """The default process group, world 1 (one made here unless one already exists), for a
    pp=1 mesh."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_of_one_stage_computes_the_loss(world1, schedule):
    """pp=1: the one rank is first and last stage, so it feeds the inputs and takes the labels;
    the micro-batches' losses and the gradients are the plain model's."""
    from fastllm.parallel.layout import build_mesh
    from fastllm.parallel.pipeline import build_pipeline, pipeline_loss

    cfg = _config("llama", layers=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (4, 7), generator=g)
    labels = torch.randint(0, 96, (4, 7), generator=g)
    ref = _model(cfg)
    want = [pipeline_loss(ref(input_ids=ids[i:i + 2]).logits, labels[i:i + 2]) for i in (0, 2)]
    (sum(want) / 2).backward()
    pipe = build_pipeline(_model(cfg), build_mesh(pp=1), n_microbatches=2, schedule=schedule)
    losses = pipe.step(ids, labels)
    torch.testing.assert_close(torch.stack(losses).detach(), torch.stack(want).detach())
    grads = {n: p.grad for n, p in ref.named_parameters()}
    got = dict(pipe.module.named_parameters())
    assert got.keys() == grads.keys()
    for name, p in got.items():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


@pytest.mark.parametrize("n", [0, -2, True, 1.5])
def test_pipeline_refuses_a_micro_batch_count_below_one(world1, n):
    """Refused by name before the batch is divided by it and before the model is cut up."""
    import types

    from fastllm.parallel.layout import build_mesh
    from fastllm.parallel.pipeline import build_pipeline, build_schedule, pipeline_loss

    model = _model(_config("llama", layers=2))
    layers = model.model.layers
    for batch_size in (None, 4):
        with pytest.raises(ValueError, match=rf"n_microbatches must be an int >= 1, got {n!r}"):
            build_pipeline(model, build_mesh(pp=1), n_microbatches=n, schedule="gpipe",
                           batch_size=batch_size)
        assert model.model.layers is layers and len(layers) == 2
        stage = types.SimpleNamespace(num_stages=1)
        with pytest.raises(ValueError, match=rf"n_microbatches must be an int >= 1, got {n!r}"):
            build_schedule(stage, n, pipeline_loss, "gpipe", batch_size)


@pytest.mark.parametrize("what", ["merged", "dora"])
def test_tensor_parallel_refuses_lora_it_cannot_shard_before_sharding_anything(world1, what):
    """A merged LoRA layer or a DoRA layer was refused by its own style, after the embedding,
    the head and the layers before it had been sharded: a caller catching the error held a
    half-sharded model."""
    from torch.distributed.device_mesh import init_device_mesh

    from fastllm.dora import inject_dora
    from fastllm.lora import inject_lora, merge_lora
    from fastllm.parallel.tensor_parallel import apply_tensor_parallel

    model = _model(_config("llama", layers=2))
    if what == "dora":
        inject_dora(model, target_modules=["o_proj"], r=2)
    else:
        inject_lora(model, target_modules=["o_proj"], r=2)
        merge_lora(model)
    with pytest.raises((ValueError, NotImplementedError), match=what if what == "merged"
                       else "DoRA"):
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


@pytest.mark.parametrize("moe", [{"model_type": "mixtral", "num_local_experts": 8},
                                 {"model_type": "qwen3_moe", "num_experts": 128,
                                  "moe_intermediate_size": 768},
                                 {"model_type": "qwen2_moe"}], ids=["mixtral", "qwen3", "type"])
def test_plan_refuses_a_mixture_of_experts_config(moe):
    """A Mixtral / Qwen3-MoE config.json was planned as its dense skeleton (Mixtral-8x7B as
    7.24B params, not 46.7B), every memory estimate 6x short."""
    from fastllm.parallel.planner.catalog import model_from_hf_config

    dense = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    model_from_hf_config(dict(dense, model_type="llama", num_experts=0))  # (0: dense)
    with pytest.raises(ValueError, match="mixture-of-experts config .* dense decoders only"):
        model_from_hf_config(dict(dense, **moe))


def test_plan_gpu_memory_is_the_cards_gib():
    """The catalog's H100 had 80e9 bytes (74.5 GiB) against the 79.6 GiB nvidia-smi reports:
    layouts needing 74.5-79.5 GiB were dropped as not fitting."""
    from fastllm.parallel.planner.catalog import GPUS, GiB

    assert 79.5 < GPUS["H100"].memory / GiB < 80 and GPUS["A100"].memory == 80 * GiB
    assert 140 < GPUS["H200"].memory / GiB < 141
