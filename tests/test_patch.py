"""fastllm.patch / unpatch on tiny random Hugging Face models shaped like SmolLM2 (Llama, GQA,
tied embeddings), and on Qwen2 and Mistral: the patched model's loss, logits and every gradient
equal the unpatched model's (fp32: 1e-5 on the loss, 1e-4 on grads), with PEFT, fastllm.lora
(through lora_linear_multi), gradient checkpointing and torch.compile."""

import copy
import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm import _hf
from fastllm.ops.lora_linear_multi import lora_linear_multi

from _model_ops import count_attention_calls, count_varlen_calls, has_attention_kernel

transformers = pytest.importorskip("transformers")


def _config(family="llama", **over):
    kw = dict(vocab_size=123, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="sdpa")
    kw.update(over)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family]
    return cls(**kw)


def _model(family="llama", **over):
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[family]
    model = cls(_config(family, **over))
    with torch.no_grad():  # HF initialises norms to 1: make them differ so dweight is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(b=2, s=11, vocab=123):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return ids, labels


def _loss_and_grads(model, ids, labels, run=None):
    model.zero_grad(set_to_none=True)
    out = (model if run is None else run)(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def _assert_same(ours, theirs, loss_rtol=1e-5, grad_rtol=1e-4):
    (out_a, grads_a), (out_b, grads_b) = ours, theirs
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=loss_rtol, atol=0)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        scale = grads_b[name].abs().max().item() + 1e-30
        err = (grads_a[name] - grads_b[name]).abs().max().item()
        assert err <= grad_rtol * scale, f"{name}: {err:.3g} vs {scale:.3g}"


def test_patched_llama_equals_unpatched():
    model = _model()
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    logits = model(input_ids=ids).logits
    fastllm.patch(model)
    assert fastllm.patched(model) == {"rms_norm": 5, "rotary": 2, "swiglu": 2,
                                      "cross_entropy": 1, "linear": 15}
    ours = _loss_and_grads(model, ids, labels)
    assert ours[0].logits is None  # the loss came from hidden states, as Liger's does
    _assert_same(ours, theirs)
    torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
    # HF's num_items_in_batch (gradient accumulation): sum / count
    n = (labels[:, 1:] != -100).sum()
    a = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    fastllm.unpatch(model)
    assert fastllm.patched(model) == dict.fromkeys(fastllm.patch_kinds, 0)
    assert not any("forward" in m.__dict__ for m in model.modules())
    b = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


@pytest.mark.parametrize("packed,checkpointing", [(False, False), (True, False), (True, True)])
def test_fastllm_attention_equals_unpatched(packed, checkpointing, monkeypatch):
    """fastllm's CPU attention in a patched model: plain causal rows, and packed rows (position
    ids restarting, no attention_mask: transformers' block-diagonal mask on the unpatched side)
    give the unpatched model's loss and grads; a 2-D attention_mask keeps PyTorch's attention."""
    if not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "fastllm")
    model = _model()
    ids, labels = _batch(s=13)
    # with gradient checkpointing, use_cache left to the config: transformers turns the cache off
    # in training, and so looks for packed rows
    kw = {} if checkpointing else dict(use_cache=False)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    if packed:
        kw["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4],
                                           [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]])
        labels[0, [5, 8]] = -100
        labels[1, 10] = -100
    run = lambda **a: model(**a, **kw)  # noqa: E731
    theirs = _loss_and_grads(model, ids, labels, run)
    fastllm.patch(model)
    calls = count_attention_calls(monkeypatch)
    _assert_same(_loss_and_grads(model, ids, labels, run), theirs)
    assert len(calls) == (4 if checkpointing else 2)  # each layer again in its recomputation
    calls.clear()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    model(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False)
    assert not calls
    model(input_ids=ids, labels=labels, use_cache=False, is_causal=False)  # bidirectional
    assert not calls


def test_fastllm_attention_reads_the_caches_k_and_v_in_a_training_forward(monkeypatch):
    """A training forward with use_cache (the config's default without gradient checkpointing)
    hands each layer's k and v to the cache, which keeps copies: fastllm's attention reads those
    copies in place, so that one copy of each is kept for the backward, as transformers'
    attention keeps (it kept both: 6 MiB a layer at SmolLM2's 8 x 512 tokens in fp32). Loss and
    grads equal the unpatched model's."""
    if not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "fastllm")
    model = _model().train()
    ids, labels = _batch(s=13)
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    calls = count_attention_calls(monkeypatch)
    cached, given, real = [], [], _hf.cache_update

    def update(*args):
        given.extend(args[1:3])
        cached.extend(real(*args))
        return cached[-2:]

    monkeypatch.setattr(_hf, "cache_update", update)
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=labels)
    assert len(calls) == 2 and len(cached) == 4 and out.past_key_values is not None
    assert all(t.untyped_storage().data_ptr() in saved for t in cached)
    assert not any(t.untyped_storage().data_ptr() in saved for t in given)  # one copy, not two
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    _assert_same((out, grads), theirs)


def test_packed_rows_with_a_cache_are_plain_rows_to_the_policy(monkeypatch):
    """A layer with a cache attends plain causal rows (transformers ignores restarting position
    ids there), so the policy for plain rows decides, not the packed rows' rule: on a CPU whose
    route keeps PyTorch's attention for plain rows, fastllm's kernel is not called."""
    if not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.delenv("FASTLLM_CPU_ATTENTION", raising=False)
    monkeypatch.setattr(sys.modules["fastllm.ops.attention"]._gemm, "route", lambda: "aten")
    model = _model().train()
    fastllm.patch(model)
    calls = count_attention_calls(monkeypatch)
    ids, labels = _batch(s=8)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]).expand(2, -1)
    model(input_ids=ids, labels=labels, position_ids=position_ids)  # use_cache: the config's
    assert not calls
    model(input_ids=ids, labels=labels, position_ids=position_ids, use_cache=False)
    assert len(calls) == 2  # without a cache the rows are packed: the kernel's at any length


@pytest.mark.parametrize("cross_entropy", [True, False])
def test_fastllm_attention_when_the_backbone_is_called_directly(cross_entropy, monkeypatch):
    """The decoder stack called directly in training (TRL's fused LM head does so; so does a
    model patched with cross_entropy=False): its attention layers get the attention plan too
    (packed rows), with the unpatched model's output and grads. In eval one is made for rows
    scored without a cache (use_cache=False: fastllm.preference's packed rows), none where the
    model may keep a cache (generation's prefill)."""
    if not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "fastllm")
    model = _model().train()
    ids, _ = _batch(s=9)
    kw = dict(input_ids=ids, use_cache=False,
              position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], list(range(9))]))
    seed = torch.randn(2, 9, 64)

    def run(m):
        m.zero_grad(set_to_none=True)
        out = m.model(**kw).last_hidden_state
        (out * seed).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                              if p.grad is not None}

    theirs = run(model)
    fastllm.patch(model, cross_entropy=cross_entropy)
    assert "forward" in model.model.__dict__  # the decoder stack (not a kind patched() counts)
    calls = count_attention_calls(monkeypatch)
    ours = run(model)
    assert len(calls) == 2  # both layers
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for name, grad in theirs[1].items():
        err, scale = (ours[1][name] - grad).abs().max().item(), grad.abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, f"{name}: {err:.3g} vs {scale:.3g}"
    calls.clear()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.model(**kw).last_hidden_state, theirs[0], rtol=1e-5,
                                   atol=1e-5)
        assert len(calls) == 2
        calls.clear()
        model.model(**dict(kw, use_cache=True))
    assert not calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_packed_rows_through_varlen(checkpointing, monkeypatch):
    """On a GPU, bf16 packed rows (position ids restarting, no attention_mask) run PyTorch's
    varlen flash attention in every layer (one host sync per forward: the segments are computed
    once) and land as close to the fp32 unpatched model as the unpatched bf16 model does
    (transformers' SDPA with its block-diagonal mask)."""
    attention_module = sys.modules["fastllm.ops.attention"]
    if attention_module._varlen_kernel() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    model = _model().cuda()
    ids, labels = (t.cuda() for t in _batch(s=13))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4],
                        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]], device="cuda")
    labels[0, [5, 8]] = -100
    labels[1, 10] = -100
    kw = dict(position_ids=pos)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    else:
        kw["use_cache"] = False
    run = lambda m: lambda **a: m(**a, **kw)  # noqa: E731
    ref = _loss_and_grads(model, ids, labels, run(model))
    lp = copy.deepcopy(model).to(torch.bfloat16)
    theirs = _loss_and_grads(lp, ids, labels, run(lp))
    fastllm.patch(lp)
    calls, segments = count_varlen_calls(monkeypatch, attention_module), []
    real = attention_module.document_segments
    monkeypatch.setattr(attention_module, "document_segments",
                        lambda *a: segments.append(1) or real(*a))
    ours = _loss_and_grads(lp, ids, labels, run(lp))
    assert len(calls) == (4 if checkpointing else 2) and len(segments) == 1
    err = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    assert err(ours[0].loss, ref[0].loss) <= 2 * err(theirs[0].loss, ref[0].loss) + 1e-3
    for name, g in ref[1].items():
        bound = 2 * err(theirs[1][name], g) + 1e-3 * g.abs().max().item()
        assert err(ours[1][name], g) <= bound, name


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_qwen2_and_mistral(family):
    over = {"sliding_window": 4} if family == "mistral" else {}
    model = _model(family, **over)
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    assert fastllm.patched(model)["rotary"] == 2
    _assert_same(_loss_and_grads(model, ids, labels), theirs)


@pytest.mark.parametrize("attention", ["torch", "fastllm"])
@pytest.mark.parametrize("mode", ["fp32", "native"])
def test_bf16_loss_and_grads_close_to_fp32(mode, attention, monkeypatch):
    """bf16 end to end, with the CPU's bf16 matmuls widened to fp32 (fastllm/_lowp.py) or not,
    and the attention PyTorch's or fastllm's: the patched model's loss and every gradient are no
    further from the fp32 model's than twice the unpatched bf16 model's are; widened, PyTorch's
    attention runs through the fp32 flash kernel."""
    if attention == "fastllm" and not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", mode)
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", attention)
    model = _model()
    ids, labels = _batch()
    ref = _loss_and_grads(model, ids, labels)
    lp = copy.deepcopy(model).to(torch.bfloat16)
    theirs = _loss_and_grads(lp, ids, labels)
    fastllm.patch(lp)
    calls = []
    wide = fastllm._lowp.scaled_dot_product_attention
    monkeypatch.setattr(fastllm._lowp, "scaled_dot_product_attention",
                        lambda *a: calls.append(1) or wide(*a))
    kernel_calls = count_attention_calls(monkeypatch)
    ours = _loss_and_grads(lp, ids, labels)
    assert len(calls) == (2 if mode == "fp32" and attention == "torch" else 0)
    assert len(kernel_calls) == (2 if attention == "fastllm" else 0)
    err = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    assert err(ours[0].loss, ref[0].loss) <= 2 * err(theirs[0].loss, ref[0].loss) + 1e-3
    for name, g in ref[1].items():
        assert ours[1][name].dtype == torch.bfloat16
        bound = 2 * err(theirs[1][name], g) + 1e-3 * g.abs().max().item()
        assert err(ours[1][name], g) <= bound, name


def test_with_fastllm_lora_and_gradient_checkpointing():
    """fastllm.lora on q/k/v and gate/up (the patch then runs them through lora_linear_multi),
    with HF's gradient checkpointing: LoRA grads equal the unpatched model's."""
    model = _model()
    fastllm.lora.inject_lora(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], r=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    _assert_same(_loss_and_grads(model, ids, labels), theirs)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dora_layers_run_their_own_forward(monkeypatch, dropout):
    """DoRA on q/k/v (a LoRALinear subclass with a magnitude): the patch leaves them to their own
    forward instead of the fused multi-projection LoRA; a DoRA down_proj runs over silu(gate) *
    up through swiglu_lora_linear with its scale; the loss and every grad (the magnitudes'
    included) equal the unpatched model's, dropout masks included (the same seeds drawn)."""
    import fastllm.ops.swiglu_lora_linear as ops
    from fastllm.dora import inject_dora

    model = _model()
    inject_dora(model, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], r=4,
                dropout=dropout)
    scales, real = [], ops.swiglu_lora_linear
    monkeypatch.setattr(ops, "swiglu_lora_linear",
                        lambda *a, **k: scales.append(k["scale"]) or real(*a, **k))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "magnitude" in n:
                p.add_(0.1 * torch.randn_like(p))
    ids, labels = _batch()
    torch.manual_seed(5)
    theirs = _loss_and_grads(model.train(), ids, labels)
    fastllm.patch(model)
    torch.manual_seed(5)
    ours = _loss_and_grads(model, ids, labels)
    assert len(scales) == len(model.model.layers) and all(s is not None for s in scales)
    assert sum("mlp.down_proj.lora_magnitude" in n for n in ours[1]) == len(scales)
    _assert_same(ours, theirs)


def test_with_peft():
    peft = pytest.importorskip("peft")
    model = _model()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    assert fastllm.patched(model)["cross_entropy"] == 1
    _assert_same(_loss_and_grads(model, ids, labels), theirs)


def test_torch_compile():
    model = _model()
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    compiled = torch.compile(model, backend="aot_eager")
    _assert_same(_loss_and_grads(model, ids, labels, run=compiled), theirs)


def test_per_block_compile_is_one_graph_for_all_layers():
    """torchtitan's per-block compile (`layer.compile()` for each decoder layer) of a patched
    model: one graph for every layer (each patched forward bound to its module, which dynamo
    guards by function; a functools.partial per module was guarded by identity and compiled
    again per layer) and the unpatched model's loss and grads."""
    from torch._dynamo.utils import counters

    model = _model(num_hidden_layers=3)
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels, lambda **kw: model(**kw, use_cache=False))
    fastllm.patch(model)
    torch._dynamo.reset()
    counters.clear()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    ours = _loss_and_grads(model, ids, labels, lambda **kw: model(**kw, use_cache=False))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    _assert_same(ours, theirs)


def test_torch_compile_fullgraph_with_packed_position_ids():
    """Packed rows (position ids restarting) through a fullgraph compile of the patched model:
    no host read of the documents while tracing (the attention plan decides as for plain rows
    there), the unpatched model's loss and grads."""
    model = _model()
    ids, labels = _batch(s=9)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], list(range(9))])
    theirs = _loss_and_grads(model, ids, labels, lambda **kw: model(**kw, position_ids=pos,
                                                                     use_cache=False))
    fastllm.patch(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    ours = _loss_and_grads(model, ids, labels, lambda **kw: compiled(**kw, position_ids=pos,
                                                                      use_cache=False))
    _assert_same(ours, theirs)


def test_lora_linear_multi_matches_separate_layers():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(o, 24, dtype=torch.float64) for o in (16, 8, 8)]
    bs = [torch.randn(16, dtype=torch.float64, requires_grad=True), None, None]
    a_s = [torch.randn(4, 24, dtype=torch.float64, requires_grad=True), None,
           torch.randn(2, 24, dtype=torch.float64, requires_grad=True)]
    b_s = [torch.randn(16, 4, dtype=torch.float64, requires_grad=True), None,
           torch.randn(8, 2, dtype=torch.float64, requires_grad=True)]
    scal = [2.0, 1.0, 0.5]
    inputs = [x, bs[0], a_s[0], a_s[2], b_s[0], b_s[2]]
    torch.autograd.gradcheck(
        lambda x, b0, a0, a2, bb0, bb2: tuple(lora_linear_multi(
            x, ws, [a0, None, a2], [bb0, None, bb2], scal, [b0, None, None])), inputs)
    outs = lora_linear_multi(x, ws, a_s, b_s, scal, bs)
    for i, y in enumerate(outs):
        want = x @ ws[i].T + (0 if bs[i] is None else bs[i])
        if a_s[i] is not None:
            want = want + scal[i] * (x @ a_s[i].T) @ b_s[i].T
        torch.testing.assert_close(y, want)


def test_train_config_kernels():
    from fastllm.train.config import ConfigError, TrainConfig

    assert TrainConfig.from_args([]).kernels == "fastllm"
    assert TrainConfig.from_args(["kernels=none"]).kernels == "none"
    with pytest.raises(ConfigError, match="kernels must be fastllm or none"):
        TrainConfig.from_args(["kernels=liger"])


def test_kv_cache_and_generate_equal_unpatched():
    """Decoding through the KV cache (prefill, then one token at a time; generate) gives the
    unpatched model's logits and tokens: the patched forwards hand the cache on under the
    keyword the installed transformers names it by (`past_key_values`, or `cache` in newer
    releases)."""
    model = _model().eval()
    ids, _ = _batch(b=1, s=7)

    def decode(m):
        with torch.no_grad():
            out = m(input_ids=ids[:, :5], use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            assert cache is not None and cache.get_seq_length() == 5
            nxt = m(input_ids=ids[:, 5:], use_cache=True, **_hf.cache_kwargs(m, cache))
            tokens = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        return nxt.logits, tokens

    theirs = decode(model)
    fastllm.patch(model)
    ours = decode(model)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[1], theirs[1])
    with torch.no_grad():  # and the cached step equals the full sequence's last logits
        full = model(input_ids=ids, use_cache=False).logits[:, 5:]
    torch.testing.assert_close(ours[0], full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,cls,patched", [
    ("gemma", "GemmaRMSNorm", True), ("gemma2", "Gemma2RMSNorm", True),
    ("gemma3", "Gemma3RMSNorm", True), ("gemma3n", "Gemma3nRMSNorm", False),
    ("gemma4", "Gemma4RMSNorm", False)])
def test_gemma_norms_patched_by_what_they_compute(family, cls, patched):
    """Gemma 1-3's RMSNorms scale by (1 + weight) and get that kernel; Gemma3n's and Gemma4's
    scale by weight alone and are left alone: every output equals the unpatched norm's."""
    import importlib

    try:
        norm_cls = getattr(importlib.import_module(
            f"transformers.models.{family}.modeling_{family}"), cls)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {cls}")
    torch.manual_seed(0)
    norm = norm_cls(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(16))
    x = torch.randn(3, 5, 16)
    want = norm(x)
    fastllm.patch(norm)
    assert fastllm.patched(norm)["rms_norm"] == int(patched)
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,cls", [("qwen3", "Qwen3RMSNorm"), ("gemma3", "Gemma3RMSNorm")])
def test_norm_with_an_fp32_weight_on_bf16_activations(family, cls):
    """Qwen3's and Gemma3's q/k norms under autocast get bf16 activations and keep an fp32
    weight: the output has the unpatched norm's dtype (Qwen3: the promoted fp32; Gemma: x's) and
    the weight's grad fp32 accuracy (it was rounded to bf16: 1.6e-3 off against fp64)."""
    import importlib

    norm_cls = getattr(importlib.import_module(
        f"transformers.models.{family}.modeling_{family}"), cls)
    torch.manual_seed(0)
    norm = norm_cls(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(16))
    x = torch.randn(3, 5, 16).bfloat16()
    want_dtype = norm(x).dtype
    dy = torch.randn(3, 5, 16).to(want_dtype).float()  # (a bf16 output's grad arrives in bf16)
    exact = copy.deepcopy(norm).double()
    (exact(x.double()) * dy.double()).sum().backward()
    fastllm.patch(norm)
    assert fastllm.patched(norm)["rms_norm"] == 1
    y = norm(x)
    assert y.dtype == want_dtype
    (y.float() * dy).sum().backward()
    assert norm.weight.grad.dtype == torch.float32
    torch.testing.assert_close(norm.weight.grad.double(), exact.weight.grad, rtol=1e-5,
                               atol=1e-5)


def test_low_precision_policy_traces_under_compile(monkeypatch):
    """The default (auto) policy asks oneDNN whether bf16 GEMMs are native, which dynamo cannot
    trace: a patched bf16 model failed torch.compile(fullgraph=True); it is read once."""
    from fastllm import _lowp

    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", "auto")
    x = torch.randn(4).bfloat16()
    fn = torch.compile(lambda t: t * 2 if _lowp.widen(t) else t + 1, fullgraph=True,
                       backend="eager")
    torch.testing.assert_close(fn(x), x * 2 if _lowp.widen(x) else x + 1)


def _gemma(family, softcap):
    """A tiny random Gemma 1, 2 or 3 (text) causal LM, its tied head scaled x40 so that its
    logits are as large as a trained model's and the softcap bends them."""
    name = {"gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3Text"}[family]
    over = {} if family == "gemma" else dict(final_logit_softcapping=softcap)
    if family == "gemma3_text":  # a window shorter than the rows: its sliding layers mask
        over.update(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    config = getattr(transformers, name + "Config")(
        vocab_size=123, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        **over)
    cls = "Gemma3ForCausalLM" if family == "gemma3_text" else name + "ForCausalLM"
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).train()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.mark.parametrize("family,softcap", [("gemma", None), ("gemma2", 30.0),
                                            ("gemma3_text", None), ("gemma3_text", 20.0)])
def test_gemma_loss_is_fused_with_its_softcap(family, softcap):
    """Gemma 1-3's loss is the fused loss, Gemma 2's and 3's final_logit_softcapping inside it
    (their vocabularies are 256K: the logits are the largest tensor of a step), their
    tanh-GELU MLPs fastllm.ops.geglu, and Gemma 1's and 3's attention the rotary kernel (Gemma
    3's after its q/k norms, a sliding and a full layer): in training no logits, and loss and
    every grad equal the unpatched model's."""
    model = _gemma(family, softcap)
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    if softcap is not None:  # the cap changes the loss here: a fused loss without it would fail
        model.config.final_logit_softcapping = None
        uncapped = _loss_and_grads(model, ids, labels)[0].loss
        model.config.final_logit_softcapping = softcap
        assert (uncapped - theirs[0].loss).abs() > 0.05 * theirs[0].loss.abs()
    fastllm.patch(model)
    counts = fastllm.patched(model)
    assert counts["cross_entropy"] == 1 and counts["swiglu"] == 2  # (its GeGLU MLPs too)
    # the rotary kernel in Gemma 1's and 3's attention; Gemma 2's softcaps its scores: its own
    assert counts["rotary"] == (0 if family == "gemma2" else 2)
    ours = _loss_and_grads(model, ids, labels)
    assert ours[0].logits is None
    _assert_same(ours, theirs)


@pytest.mark.parametrize("family", ["gemma", "gemma3_text"])
def test_gemma_attention_with_padding_and_generate_equal_unpatched(family):
    """Gemma 1's and 3's patched attention (the rotary kernel; Gemma 3's q/k norms and its
    sliding layer of window 4) on left-padded rows: eval logits equal the unpatched model's, and
    greedy decoding through the cache, 8 tokens past the window, gives its tokens. A
    sliding_window key in Gemma 1's config, which its forward never reads, is not applied."""
    model = _gemma(family, 20.0).eval()
    if family == "gemma":
        model.config.sliding_window = 3
    ids, _ = _batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding

    def run():
        with torch.no_grad():
            return (model(input_ids=ids, attention_mask=mask).logits,
                    model.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0))

    outs, windows = {}, {}  # per side: (logits, tokens), the sliding_window its calls got
    real = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pytest.MonkeyPatch.context() as m:
        m.setitem(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS, "sdpa",
                  lambda *a, **kw: seen.add(kw.get("sliding_window")) or real(*a, **kw))
        for side in ("theirs", "ours"):
            if side == "ours":
                fastllm.patch(model)
                assert fastllm.patched(model)["rotary"] == 2
            seen = windows[side] = set()
            outs[side] = run()
    assert windows["ours"] == windows["theirs"] == ({None} if family == "gemma" else {None, 4})
    (logits, tokens), (want_logits, want_tokens) = outs["ours"], outs["theirs"]
    torch.testing.assert_close(logits[mask.bool()], want_logits[mask.bool()], rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("family,layers", [("gemma", 2), ("gemma3_text", 1)])
def test_gemma_attention_runs_fastllms_kernel_on_packed_rows(family, layers, monkeypatch):
    """Gemma's decoder stack hands its patched attention layers the attention plan, as Llama's
    does: fastllm's CPU attention runs in Gemma 1's layers and Gemma 3's full-attention one (its
    sliding layer stays transformers'), packed rows (position ids restarting) give the unpatched
    model's loss and grads."""
    if not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "fastllm")
    calls = count_attention_calls(monkeypatch)
    model = _gemma(family, None)
    ref = copy.deepcopy(model)
    fastllm.patch(model)
    ids, labels = _batch()
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1], list(range(11))])
    ours = _loss_and_grads(model, ids, labels,
                           lambda **kw: model(**kw, position_ids=pos, use_cache=False))
    assert len(calls) == layers
    _assert_same(ours, _loss_and_grads(ref, ids, labels,
                                       lambda **kw: ref(**kw, position_ids=pos, use_cache=False)))


@pytest.mark.parametrize("family", ["granite", "mixtral"])
def test_other_causal_lms_keep_their_own_loss(family):
    """Models whose loss is not the plain cross-entropy of lm_head's logits (Granite's
    logits_scaling, Mixtral's router aux loss) keep their own forward: in training, loss and
    every grad equal the unpatched model's."""
    over = {"granite": dict(logits_scaling=8.0),
            "mixtral": dict(num_local_experts=4, num_experts_per_tok=2,
                            output_router_logits=True, router_aux_loss_coef=0.5)}[family]
    name = {"granite": "Granite", "mixtral": "Mixtral"}[family]
    config = getattr(transformers, name + "Config")(
        vocab_size=123, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **over)
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(config).train()
    with torch.no_grad():  # logits as large as a trained model's, where the softcap matters
        model.lm_head.weight.mul_(40.0)
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    assert fastllm.patched(model)["cross_entropy"] == 0
    _assert_same(_loss_and_grads(model, ids, labels), theirs)


@pytest.mark.parametrize("how", ["loss_function", "loss_type"])
def test_a_models_own_loss_function_is_kept(how):
    """`model.loss_function = fn` (transformers' setter) or another loss_type: the patched
    training forward computed the default cross-entropy anyway, while evaluation (the original
    forward) used the model's."""
    model = _model().train()
    if how == "loss_function":
        def smoothed(logits, labels, vocab_size, **kwargs):
            shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
            return F.cross_entropy(logits.float().view(-1, vocab_size), shifted.reshape(-1),
                                   label_smoothing=0.2)

        model.loss_function = smoothed
    else:
        model.loss_type = "ForMaskedLM"
    ids, labels = _batch()
    theirs = _loss_and_grads(model, ids, labels)
    fastllm.patch(model)
    _assert_same(_loss_and_grads(model, ids, labels), theirs)


def test_logits_in_eval_and_under_no_grad(monkeypatch):
    """Logits are skipped only in training with grad (Liger-Kernel's rule): in eval and under
    no_grad the labelled forward gives HF's loss and logits (Trainer.evaluate's
    compute_metrics), and return_dict=False keeps HF's (loss, logits, cache) positions. The
    fused path hands the cache on without transformers' deprecation warning."""
    from transformers.utils import generic

    model = _model()
    ref = copy.deepcopy(model)
    fastllm.patch(model)
    ids, labels = _batch()
    for train, grad in ((False, True), (False, False), (True, False)):
        for m in (model, ref):
            m.train(train)
        with torch.set_grad_enabled(grad):
            ours, theirs = (m(input_ids=ids, labels=labels, return_dict=False)
                            for m in (model, ref))
            forced = model(input_ids=ids, labels=labels, skip_logits=True)
        assert len(ours) == len(theirs) == 3 and forced.logits is None
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(forced.loss, theirs[0], rtol=1e-5, atol=0)
    for m in (model, ref):
        m.train()
    ours, theirs = (m(input_ids=ids, labels=labels, return_dict=False) for m in (model, ref))
    assert len(ours) == len(theirs) and ours[1] is None  # the fused loss: no logits
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=ids, skip_logits=True)  # (Liger refuses it too: no silent logits)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=0)
    assert model(input_ids=ids, labels=labels, skip_logits=False).logits is not None
    said = []  # transformers 5.2x warns (once a process) on reading output.past_key_values
    monkeypatch.setattr(generic.logger, "warning_once", lambda *a, **k: said.append(a))
    out = model(input_ids=ids, labels=labels)
    # the output's cache field: `cache` from transformers 5.2x, `past_key_values` before (5.17)
    field = "cache" if "cache" in {f.name for f in dataclasses.fields(out)} else "past_key_values"
    assert getattr(out, field) is not None and not said


def test_instance_forward_refused_or_restored():
    """An instance `forward` that some wrapper put on a module is refused (nothing patched, the
    wrapper kept); the class's forward as an instance attribute (what accelerate's
    remove_hook_from_module leaves) is patched and put back by unpatch; a patched forward
    wrapped afterwards makes unpatch refuse rather than drop the wrapper."""
    import types

    model = _model()
    norm = model.model.norm
    norm.forward = wrapper = lambda x: type(norm).forward(norm, x)  # noqa: E731
    with pytest.raises(ValueError, match=r"model\.norm \(LlamaRMSNorm\)"):
        fastllm.patch(model)
    assert fastllm.patched(model) == dict.fromkeys(fastllm.patch_kinds, 0)
    assert norm.forward is wrapper
    norm.forward = bound = types.MethodType(type(norm).forward, norm)
    fastllm.patch(model)
    assert fastllm.patched(model)["rms_norm"] == 5
    fastllm.unpatch(model)
    assert norm.__dict__["forward"] is bound and fastllm.patched(model)["rms_norm"] == 0
    fastllm.patch(model)
    patched = norm.forward
    norm.forward = lambda x: patched(x)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"model\.norm"):
        fastllm.unpatch(model)
    assert fastllm.patched(model)["rms_norm"] == 5


def test_accelerate_hooks_kept():
    """Under accelerate's hooks (cpu_offload: weights on meta until each module's hook loads
    them) the patch swaps the `_old_forward` each hook calls: the same logits and loss as
    unpatched; unpatch puts the hooks' forwards back, and a hook added after patch() still
    fires after unpatch()."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = _model().eval()
    ref = copy.deepcopy(model)
    ids, labels = _batch()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels)
        for _ in range(2):
            fastllm.patch(model)
            assert fastllm.patched(model)["rms_norm"] == 5
            out = model(input_ids=ids, labels=labels)
            torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
            # the fused loss would read lm_head's weight around its hook (on meta here)
            out = model(input_ids=ids, labels=labels, skip_logits=True)
            torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
            fastllm.unpatch(model)
            assert not any("forward" in m.__dict__ and "_hf_hook" not in m.__dict__
                           for m in model.modules())
            out = model(input_ids=ids, labels=labels)
            torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)

    calls = []

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    model = fastllm.patch(_model().eval())
    add_hook_to_module(model.model.norm, Count())
    fastllm.unpatch(model)
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 1


def test_bf16_widened_attention_honours_is_causal(monkeypatch):
    """bf16 with the CPU's matmuls widened to fp32 (PyTorch's attention in fp32): a forward
    with is_causal=False (bidirectional) is no further from the fp32 model's than twice the
    unpatched bf16 model's is."""
    monkeypatch.setenv("FASTLLM_CPU_LOWP_MATMUL", "fp32")
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "torch")
    model = _model().eval()
    lp = copy.deepcopy(model).to(torch.bfloat16)
    ids, _ = _batch()
    with torch.no_grad():
        ref, theirs = (m(input_ids=ids, is_causal=False).logits.double() for m in (model, lp))
        fastllm.patch(lp)
        calls = []
        wide = fastllm._lowp.scaled_dot_product_attention
        monkeypatch.setattr(fastllm._lowp, "scaled_dot_product_attention",
                            lambda *a: calls.append(1) or wide(*a))
        ours = lp(input_ids=ids, is_causal=False).logits.double()
    assert len(calls) == 2
    err = lambda a: (a - ref).abs().max().item()  # noqa: E731
    assert err(ours) <= 2 * err(theirs) + 1e-3 * ref.abs().max().item()


def test_patched_model_pickles_and_deep_copies():
    """torch.save / torch.load(weights_only=False) and copy.deepcopy of a patched model give a
    patched model whose forwards are its own modules': the same loss and grads, and unpatch
    works on it."""
    import io

    model = fastllm.patch(_model())
    ids, labels = _batch()
    want = _loss_and_grads(model, ids, labels)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        assert fastllm.patched(other) == fastllm.patched(model)
        assert other.lm_head.forward.__self__ is other.lm_head
        _assert_same(_loss_and_grads(other, ids, labels), want)
        fastllm.unpatch(other)
        assert not any("forward" in m.__dict__ for m in other.modules())
        _assert_same(_loss_and_grads(other, ids, labels), want)
    assert fastllm.patched(model)["cross_entropy"] == 1
    shallow = copy.copy(model)  # (its forward runs the model's: they share every submodule)
    torch.testing.assert_close(shallow(input_ids=ids, labels=labels).loss, want[0].loss,
                               rtol=0, atol=0)
    # a patched forward pickled alone (sent to a worker, say): bound to the module's copy; other
    # bound methods pickle as Python's own rule does (getattr of the unpickled object)
    import pickle

    forward = pickle.loads(pickle.dumps(model.lm_head.forward))
    assert type(forward.__self__) is type(model.lm_head) and forward.__self__ is not model.lm_head
    assert forward.__self__.forward.__func__ is forward.__func__
    assert pickle.loads(pickle.dumps(model.lm_head.extra_repr))() == model.lm_head.extra_repr()


def test_model_pickled_with_partial_forwards_is_recognised():
    """A model pickled by fastllm before 2026-12-07 carries functools.partials of the
    replacements over their modules: patched() counts them, patch() leaves them, unpatch()
    removes them."""
    import functools

    model = fastllm.patch(_model())
    ids, labels = _batch()
    want = _loss_and_grads(model, ids, labels)
    counts = fastllm.patched(model)
    for m in model.modules():
        if "forward" in m.__dict__:
            m.forward = functools.partial(m.forward.__func__, m)
    assert fastllm.patched(model) == counts
    fastllm.patch(model)
    assert all(type(m.__dict__.get("forward", functools.partial(id))) is functools.partial
               for m in model.modules())
    _assert_same(_loss_and_grads(model, ids, labels), want)
    fastllm.unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
