"""fastllm.patch across the families and arguments a user brings: Qwen2 (q/k/v bias), Qwen3
(q_norm/k_norm before the rotation; with sliding-window layers), Mistral with and without a
sliding window, Llama's rope scalings, tied and untied heads, padded, positioned and packed
rows, logits_to_keep, output_attentions, generate; Phi-3 (one qkv and one gate_up projection,
partial rotary, LoRA on them; `fastllm train` on a Phi-3 folder); Gemma (its loss, norms and
GeGLU MLPs; `fastllm train` on a Gemma 3 folder); and the families it does not support (GPT-2,
and SwiGLU-named MLPs with other maths): their outputs unchanged.

Tiny random models (hidden 64, 2 layers, vocabulary 300, 12 tokens); fp32 within 1e-5 on the
loss and logits, 1e-4 on every gradient, against the unpatched model."""

import copy
import importlib
import os

import pytest
import torch

import fastllm
from _model_ops import count_attention_calls, has_attention_kernel

transformers = pytest.importorskip("transformers")

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, attn_implementation="sdpa")


def _model(name="Llama", **over):
    config = getattr(transformers, name + "Config")(**{**BASE, **over})
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: move them so their grads matter
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(b=2, s=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return ids, labels


def _run(model, **kw):
    """(output, {name: grad}) of one forward and backward (of the loss, else of the logits)."""
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    (out.loss if out.loss is not None else out.logits.square().mean()).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ours, theirs):
    (out_a, grads_a), (out_b, grads_b) = ours, theirs
    if out_b.loss is not None:
        torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-5, atol=0)
    if out_a.logits is not None:
        torch.testing.assert_close(out_a.logits, out_b.logits, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_b.items():
        err = (grads_a[name] - g).abs().max().item()
        assert err <= 1e-4 * (g.abs().max().item() + 1e-30), f"{name}: {err:.3g}"


def _pair(model):
    ref = copy.deepcopy(model)
    return fastllm.patch(model), ref


FAMILIES = {
    "qwen2_bias": ("Qwen2", {}),
    "qwen2_sliding_layers": ("Qwen2", dict(use_sliding_window=True, sliding_window=4,
                                           max_window_layers=1)),
    "qwen3_qk_norm": ("Qwen3", dict(tie_word_embeddings=True)),
    "qwen3_sliding_layers": ("Qwen3", dict(use_sliding_window=True, sliding_window=4,
                                           max_window_layers=1)),
    "mistral_sliding": ("Mistral", dict(sliding_window=4)),
    "mistral_full_linear_rope": ("Mistral", dict(
        sliding_window=None, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama3_rope": ("Llama", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8))),
    # max_position_embeddings below the 12 tokens: the dynamic frequencies are recomputed
    "dynamic_rope": ("Llama", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0),
                                   max_position_embeddings=8)),
    "yarn_rope": ("Llama", dict(rope_scaling=dict(rope_type="yarn", factor=8.0,
                                                  original_max_position_embeddings=8))),
    # one qkv_proj and one gate_up_proj; Phi-4-mini's rotary on part of each head, Phi-3-mini's
    # sliding window from its config
    "phi3": ("Phi3", dict(pad_token_id=0)),
    "phi3_partial_rotary_sliding": ("Phi3", dict(pad_token_id=0, partial_rotary_factor=0.5,
                                                 sliding_window=4)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_equals_unpatched(family):
    """In training with labels (the fused loss): left-padded rows with their position ids, and
    packed rows (position ids restarting, no mask); in eval without labels: the logits and
    every hidden state. All equal the unpatched model's."""
    name, over = FAMILIES[family]
    model, ref = _pair(_model(name, **over))
    counts = fastllm.patched(model)
    assert counts["rms_norm"] == (9 if name == "Qwen3" else 5) and counts["swiglu"] == 2
    assert counts["rotary"] == 2 and counts["cross_entropy"] == 1  # (Qwen3: its q/k norms too)
    ids, labels = _batch()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(mask == 0, -100),
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    packed = dict(input_ids=ids, labels=labels, use_cache=False, position_ids=torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2], list(range(12))]))
    for kw in (padded, packed):
        ours = _run(model, **kw)
        assert ours[0].logits is None or counts["cross_entropy"] == 0
        _assert_same(ours, _run(ref, **kw))
    model.eval(), ref.eval()
    with torch.no_grad():
        ours, theirs = (m(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                        for m in (model, ref))
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 3
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Qwen3", "Qwen2", "Phi3"])
def test_fastllm_attention_with_packed_rows(name, monkeypatch):
    """fastllm's CPU attention kernel in Qwen3's layers (its q and k normalised, then rotated),
    Qwen2's (q/k/v biases) and Phi-3's (q, k, v views of one projection): packed rows (position
    ids restarting, no mask) give the unpatched model's loss and grads, and the kernel ran in
    every layer."""
    if not has_attention_kernel():
        pytest.skip("no cpp attention kernel")
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "fastllm")
    calls = count_attention_calls(monkeypatch)
    # (Phi-3-mini-4k's window of 2047, longer than the rows: it masks nothing, the kernel runs)
    over = {"pad_token_id": 0, "sliding_window": 2047} if name == "Phi3" else {}
    model, ref = _pair(_model(name, **over).train())
    ids, labels = _batch()
    kw = dict(input_ids=ids, labels=labels, use_cache=False, position_ids=torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2], list(range(12))]))
    _assert_same(_run(model, **kw), _run(ref, **kw))
    assert len(calls) == 2


def test_qwen3_with_fastllm_lora_on_qkv():
    """fastllm.lora on Qwen3's q/k/v (the patch runs them through lora_linear_multi, whose q and
    k are strided views of one product) before its q/k norms: LoRA grads equal unpatched."""
    model = _model("Qwen3")
    fastllm.lora.inject_lora(model, ["q_proj", "k_proj", "v_proj"], r=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model, ref = _pair(model.train())
    ids, labels = _batch()
    _assert_same(_run(model, input_ids=ids, labels=labels), _run(ref, input_ids=ids,
                                                                   labels=labels))


def _mlp_cases():
    """(module, class, config class, config kwargs, what differs from Llama's SwiGLU)."""
    size = dict(hidden_size=64, intermediate_size=96)
    return [
        ("falcon_h1", "FalconH1MLP", "FalconH1Config", dict(size, mlp_multipliers=[2.0, 0.5])),
        ("seed_oss", "SeedOssMLP", "SeedOssConfig", dict(size, residual_dropout=0.5)),
        ("deepseek_v4", "DeepseekV4MLP", "DeepseekV4Config", dict(size, swiglu_limit=0.05)),
        ("inkling", "InklingMLP", "InklingTextConfig", size),
    ]


@pytest.mark.parametrize("module,cls,config_cls,kw", _mlp_cases(),
                         ids=[c[1] for c in _mlp_cases()])
def test_swiglu_named_mlps_with_other_maths_keep_their_forward(module, cls, config_cls, kw):
    """MLPs with gate/up/down_proj and silu whose forward is not down(silu(gate) * up): FalconH1
    scales gate and output, SeedOss drops out the output in training, DeepseekV4 clamps gate and
    up, Inkling multiplies by a learnt scale. Patching them swapped in plain SwiGLU (silently
    wrong outputs); they keep their own forward. With linear=False nothing in them changes:
    output and grads bitwise the unpatched copy's. By default their nn.Linear children are
    swapped, as every nn.Linear is: fastllm.ops.linear, whose fp32 products on AMD AVX-512 CPUs
    are oneDNN's (fastllm/_gemm.py), the same sums in another order: within 1e-5 of the largest
    value (about 6e-7 measured at K = 64 and 96, no further from fp64 than ATen's)."""
    try:
        mlp_cls = getattr(importlib.import_module(
            f"transformers.models.{module}.modeling_{module}"), cls)
        config = getattr(transformers, config_cls)(**kw)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {cls}")
    torch.manual_seed(0)
    mlp = mlp_cls(config).train()
    with torch.no_grad():
        for n, p in mlp.named_parameters():
            if "scale" in n:
                p.fill_(3.0)
    x = 4.0 * torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))

    def run(m):
        torch.manual_seed(3)  # the same dropout mask on every side
        y = m(x)
        return [y] + list(torch.autograd.grad(y.square().sum(), list(m.parameters())))

    theirs = run(mlp)
    linears = sum(type(c) is torch.nn.Linear for c in mlp.modules())
    for linear in (False, True):
        patched = fastllm.patch(copy.deepcopy(mlp), linear=linear)
        counts = fastllm.patched(patched)
        assert "forward" not in patched.__dict__ and counts["swiglu"] == 0
        assert counts["linear"] == (linears if linear else 0)
        for a, b in zip(run(patched), theirs):
            if linear:
                err = (a - b).abs().max().item()
                assert err <= 1e-5 * b.abs().max().item(), f"{err:.3g}"
            else:
                assert torch.equal(a, b)


def _subclassed(case):
    """A tiny Llama as a user subclasses it here (outside transformers): `aux_loss`, an auxiliary
    loss over LlamaForCausalLM's; `halved_attention`, LlamaAttention subclasses that halve their
    output; `plain_attention`, LlamaAttention subclasses that keep transformers' forward."""
    from transformers.models.llama import modeling_llama

    class AuxLossLlamaForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, labels=labels, **kwargs)
            if labels is not None:
                out.loss = out.loss + self.lm_head.weight.abs().mean()
            return out

    class HalvedAttention(modeling_llama.LlamaAttention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return 0.5 * out, weights

    class PlainAttention(modeling_llama.LlamaAttention):
        pass

    model = _model()
    if case == "aux_loss":
        torch.manual_seed(0)
        return AuxLossLlamaForCausalLM(model.config)
    cls = HalvedAttention if case == "halved_attention" else PlainAttention
    for layer in model.model.layers:
        old = layer.self_attn
        layer.self_attn = cls(model.config, old.layer_idx)
        layer.self_attn.load_state_dict(old.state_dict())
    return model


@pytest.mark.parametrize("case,rotary,cross_entropy", [
    ("aux_loss", 2, 0), ("halved_attention", 0, 1), ("plain_attention", 2, 1)])
def test_subclasses_outside_transformers(case, rotary, cross_entropy):
    """A subclass with its own forward keeps it: the patch replaced a causal LM's with Llama's
    (its auxiliary loss silently gone in training), and failed on an attention's with an
    AttributeError (the eager attention looked up in the subclass's module, or, where that
    module had one, replaced its maths). A subclass that keeps transformers' forward is patched
    (it failed the same way). The loss and every grad equal the unpatched model's."""
    model, ref = _pair(_subclassed(case).train())
    ids, labels = _batch()
    _assert_same(_run(model, input_ids=ids, labels=labels), _run(ref, input_ids=ids,
                                                                   labels=labels))
    counts = fastllm.patched(model)
    assert (counts["rotary"], counts["cross_entropy"]) == (rotary, cross_entropy)


@pytest.mark.parametrize("case", ["clamped", "copied"])
def test_rms_norm_subclass_keeps_its_forward(case):
    """An RMSNorm subclass with a forward of its own (here: clamping its output) keeps it; a
    class outside transformers whose forward is LlamaRMSNorm's code (trust-remote-code copies
    it) is swapped. Either way the outputs and grads equal the unpatched model's."""
    import types

    from transformers.models.llama import modeling_llama

    class ClampedRMSNorm(modeling_llama.LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x).clamp(-0.5, 0.5)

    # LlamaRMSNorm's forward as a module of its own compiles it (same code, another module)
    stock = modeling_llama.LlamaRMSNorm.forward
    copied = types.FunctionType(stock.__code__, dict(stock.__globals__, __name__="remote_code"))
    CopiedRMSNorm = type("CopiedRMSNorm", (modeling_llama.LlamaRMSNorm,), {"forward": copied})
    cls = ClampedRMSNorm if case == "clamped" else CopiedRMSNorm
    model = _model()
    norms = [(parent, name) for parent in model.modules() for name, child in
             parent.named_children() if isinstance(child, modeling_llama.LlamaRMSNorm)]
    for parent, name in norms:
        old = getattr(parent, name)
        new = cls(old.weight.numel(), eps=old.variance_epsilon)
        new.load_state_dict(old.state_dict())
        setattr(parent, name, new)
    with torch.no_grad():  # not the ones of a fresh init: a clamp must have work to do
        for parent, name in norms:
            getattr(parent, name).weight.normal_(1.0, 2.0)
    model, ref = _pair(model.train())
    ids, labels = _batch()
    _assert_same(_run(model, input_ids=ids, labels=labels), _run(ref, input_ids=ids,
                                                                   labels=labels))
    assert fastllm.patched(model)["rms_norm"] == (0 if case == "clamped" else len(norms))


def test_logits_to_keep_with_labels_in_training():
    """logits_to_keep=k with labels in training: transformers' loss is over the last k positions'
    logits (labels of length k); the patch's fused loss ignored k (a loss over every token, or an
    error for k labels). Now the same loss, logits and grads as unpatched, and the same error
    for labels of the full length; without labels the kept logits equal (int or indices)."""
    model, ref = _pair(_model())
    ids, labels = _batch()
    kw = dict(input_ids=ids, labels=labels[:, -5:], logits_to_keep=5)
    ours, theirs = _run(model, **kw), _run(ref, **kw)
    assert ours[0].logits.shape == (2, 5, VOCAB)
    _assert_same(ours, theirs)
    for m in (model, ref):
        with pytest.raises(ValueError):
            m(input_ids=ids, labels=labels, logits_to_keep=5)
    for keep in (1, torch.tensor([0, 7, 11])):
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=keep).logits,
                                   ref(input_ids=ids, logits_to_keep=keep).logits,
                                   rtol=1e-5, atol=1e-5)


def test_generate_left_padded_past_the_sliding_window():
    """Greedy generate (the KV cache path) with Mistral's sliding window of 4 from a left-padded
    batch, 12 tokens in all: the unpatched model's tokens."""
    model, ref = _pair(_model("Mistral", sliding_window=4).eval())
    ids, _ = _batch(s=6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        ours, theirs = (m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   pad_token_id=0) for m in (model, ref))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("train", [True, False])
def test_output_attentions(train):
    """output_attentions=True: with eager attention the weights, loss and grads equal the
    unpatched model's (in training the fused loss); with sdpa both give none, as transformers
    says."""
    model, ref = _pair(_model(attn_implementation="eager").train(train))
    ids, labels = _batch()
    kw = dict(input_ids=ids, labels=labels, output_attentions=True)
    ours, theirs = _run(model, **kw), _run(ref, **kw)
    _assert_same(ours, theirs)
    assert len(ours[0].attentions) == len(theirs[0].attentions) == 2
    for a, b in zip(ours[0].attentions, theirs[0].attentions):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model, ref = _pair(_model().train(train))
    ours, theirs = (m(**kw).attentions for m in (model, ref))
    assert len(ours) == len(theirs) == 0


def test_output_attentions_from_the_config():
    """config.output_attentions=True and no argument: transformers 5 records the weights with
    hooks and tells the layers nothing, so the patched layers ran fastllm's attention, which
    has none to give (an empty tuple where the unpatched model gave every layer's)."""
    model, ref = _pair(_model(attn_implementation="eager", output_attentions=True).train())
    ids, labels = _batch()
    ours, theirs = _run(model, input_ids=ids, labels=labels), _run(ref, input_ids=ids,
                                                                    labels=labels)
    _assert_same(ours, theirs)
    assert len(ours[0].attentions) == len(theirs[0].attentions) == 2


@pytest.mark.parametrize("adapters", ["fastllm", "peft"])
def test_phi3_with_lora_on_its_fused_projections_and_generate(adapters):
    """Phi-3's qkv_proj and gate_up_proj adapted (fastllm.lora or PEFT, as their users target
    them), rotary on half of each head: loss and grads equal unpatched; greedy generation from a
    left-padded batch (the KV cache) gives the unpatched model's tokens."""
    model = _model("Phi3", pad_token_id=0, partial_rotary_factor=0.5)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    if adapters == "fastllm":
        fastllm.lora.inject_lora(model, targets, r=4)
    else:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model, ref = _pair(model.train())
    assert fastllm.patched(model)["swiglu"] == 2 and fastllm.patched(model)["rotary"] == 2
    ids, labels = _batch()
    _assert_same(_run(model, input_ids=ids, labels=labels), _run(ref, input_ids=ids,
                                                                   labels=labels))
    mask = torch.ones_like(ids[:, :6])
    mask[0, :2] = 0
    model.eval(), ref.eval()
    with torch.no_grad():
        ours, theirs = (m.generate(input_ids=ids[:, :6], attention_mask=mask, max_new_tokens=6,
                                   do_sample=False, pad_token_id=0) for m in (model, ref))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name,over", [("Llama", {}),
                                       ("Phi3", dict(pad_token_id=0, partial_rotary_factor=0.5))])
def test_patched_step_on_the_triton_kernels(name, over, monkeypatch):
    """The patched model's ops forced to their Triton kernels (the GPU's path; here Triton's
    interpreter): Phi-3's rotary on strided views of its qkv projection's first half of each
    head, the SwiGLU of gate_up_proj's halves. Loss and grads equal the unpatched model's, and
    the Triton kernels ran."""
    kernels = {"rotary_embedding": ["rotary_embedding_triton"],
               "swiglu": ["swiglu_fwd_triton", "swiglu_bwd_triton"],
               "rms_norm": ["rms_norm_fwd_triton", "rms_norm_bwd_triton"],
               "fused_linear_cross_entropy": ["row_pass_triton"]}
    ran = set()
    for module, names in kernels.items():
        mod = importlib.import_module(f"fastllm.kernels.{module}")
        for fn in names:
            real = getattr(mod, fn)
            monkeypatch.setattr(mod, fn, lambda *a, _f=fn, _r=real, **k: ran.add(_f) or _r(*a, **k))
    model, ref = _pair(_model(name, **over).train())
    ids, labels = _batch()
    with fastllm._backend.use_backend("triton"):
        ours = _run(model, input_ids=ids, labels=labels)
    _assert_same(ours, _run(ref, input_ids=ids, labels=labels))
    assert ran == {fn for names in kernels.values() for fn in names}


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("family", ["Gemma", "GPT2"])
def test_partly_supported_families_train_as_unpatched(family):
    """Gemma (its (1 + weight) norms, attention, tanh-GELU MLPs and loss patched) and GPT-2
    (Conv1D, LayerNorm: only lm_head's Linear): no rotary, MLP or loss swap but Gemma's, and
    training loss and every grad equal the unpatched model's."""
    if family == "GPT2":
        model = _gpt2()
    else:
        model = _model(family, head_dim=16)
    model, ref = _pair(model.train())
    counts = fastllm.patched(model)
    assert (counts["rotary"], counts["cross_entropy"], counts["swiglu"]) == (
        (2, 1, 2) if family == "Gemma" else (0, 0, 0))
    assert counts["rms_norm"] == (0 if family == "GPT2" else 5)
    ids, labels = _batch()
    _assert_same(_run(model, input_ids=ids, labels=labels), _run(ref, input_ids=ids,
                                                                   labels=labels))


def test_patch_twice_unpatch_and_save_round_trip(tmp_path):
    """Patching twice changes nothing; unpatch leaves the model's modules, their __dict__ and
    its logits exactly as before patch; save_pretrained / from_pretrained then round-trips."""
    model = _model("Qwen2").eval()
    ref = copy.deepcopy(model)
    dicts = {n: set(m.__dict__) for n, m in model.named_modules()}
    ids, _ = _batch()
    fastllm.patch(model)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    counts = fastllm.patched(model)
    fastllm.patch(model)
    assert fastllm.patched(model) == counts
    assert all(m.__dict__.get("forward") is forwards[n] for n, m in model.named_modules())
    fastllm.unpatch(model)
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == dicts
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_forward_hooks_on_projections_still_fire_when_patched():
    """The patch reads q/k/v's and gate/up's weights to project once (lora_linear_multi): a
    forward hook on one of them was skipped. Such layers are called: the output is the
    unpatched model's, with the hook's change."""
    from test_patch import _batch, _model

    model = _model().eval()
    fastllm.lora.inject_lora(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], r=4)
    ref = copy.deepcopy(model)
    calls = []

    def hook(module, args, out):
        calls.append(module)
        return out * 2

    for m in (model, ref):
        attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
        attn.q_proj.register_forward_hook(hook)
        mlp.up_proj.register_forward_hook(hook)
    ids, labels = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        fastllm.patch(model)
        got = model(input_ids=ids).logits
    assert len(calls) == 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_patched_model_on_the_meta_device_trains_as_the_unpatched_one(dtype):
    """A model built under torch.device("meta") (shapes only, as for planning memory or before
    FSDP's to_empty) runs forward and backward unpatched; patched, the direct kernel calls read
    labels on the host ("Tensor.item() cannot be called on meta tensors"), and the MLP asked
    autocast about the meta device. Now the ops' fake kernels run, LoRA and AdamW included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def model():
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(
                hidden_size=32, intermediate_size=48, vocab_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)).to(dtype)

    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    theirs, ours = model(), fastllm.patch(model())
    for m in (theirs, ours):
        fastllm.lora.inject_lora(m, r=2, target_modules=["q_proj", "v_proj"])
        out = m(input_ids=ids, labels=ids)
        assert out.loss.is_meta and out.loss.shape == ()
        out.loss.backward()
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = named[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert p.grad.is_meta and p.grad.shape == q.grad.shape and p.grad.dtype == q.grad.dtype
    opt = fastllm.optim.AdamW([p for p in ours.parameters() if p.requires_grad])
    opt.step()
    assert all(t.is_meta for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_fastllm_train_on_a_folder_trains_as_unpatched(tmp_path, family):
    """`fastllm train` on a Gemma 3 folder (softcapped logits, GeGLU MLPs, tied head) or a Phi-3
    one (one qkv and one gate_up projection, LoRA on them, rotary on half of each head) patches
    its loss, norms, attention and MLPs (kernels=fastllm, the default) and trains LoRA as the
    unpatched model does (kernels=none): the same losses and grad norms."""
    from pydoc_data.topics import topics

    from fastllm.train import TrainConfig, Trainer
    from fastllm.train.metrics import read_metrics

    from _tiny_tokenizer import tiny_bpe

    folder = str(tmp_path / family)
    tiny_bpe().save_pretrained(folder)
    shape = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(**shape, head_dim=8, final_logit_softcapping=5.0)
        transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
        extra = []
        want_counts = (4 * 2 + 1 + 2 * 2, 2, 2, 1)  # per layer 4 norms and q/k norms; the final
    else:
        config = transformers.Phi3Config(**shape, pad_token_id=0, partial_rotary_factor=0.5)
        transformers.Phi3ForCausalLM(config).save_pretrained(folder)
        extra = ["lora.target_modules=[qkv_proj,o_proj,gate_up_proj,down_proj]"]
        want_counts = (2 * 2 + 1, 2, 2, 1)
    data = tmp_path / "train.txt"
    data.write_text("\n".join(topics[k] for k in sorted(topics))[:8000])
    runs, threads = {}, torch.get_num_threads()
    try:
        for kernels in ("fastllm", "none"):
            out = str(tmp_path / kernels)
            trainer = Trainer(TrainConfig.from_args([
                f"model={folder}", f"data.path={data}", "data.seq_len=16", "micro_batch_size=4",
                "global_batch_size=4", "max_steps=3", "lr=1e-2", "warmup_steps=1", "threads=1",
                "log_interval=1000", "checkpoint.interval=0", f"output_dir={out}",
                f"data.cache_dir={tmp_path / 'cache'}", "finetune=lora", f"kernels={kernels}",
                *extra]))
            trainer.train()
            runs[kernels] = (fastllm.patched(trainer.module),
                             read_metrics(os.path.join(out, "metrics.jsonl")))
    finally:
        torch.set_num_threads(threads)
    counts = runs["fastllm"][0]
    assert (counts["rms_norm"], counts["rotary"], counts["swiglu"],
            counts["cross_entropy"]) == want_counts
    assert not any(runs["none"][0].values())
    got, want = runs["fastllm"][1], runs["none"][1]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in got], [r[key] for r in want], rtol=1e-4,
                                   atol=0)
