"""fastllm.lora against PEFT itself: layer outputs and grads, a tiny LlamaForCausalLM fine-tune,
merge/unmerge, and adapters that PEFT and fastllm each load from the other."""

import copy
import json
import os

import pytest
import torch
from torch import nn

from fastllm.lora import (
    LoRALinear,
    inject_lora,
    load_adapter,
    lora_modules,
    merge_and_unload,
    merge_lora,
    save_adapter,
    unload,
    unmerge_lora,
)
from fastllm.ops.lora_linear import lora_dropout_ref, lora_linear_ref, new_dropout_seed

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Tiny(nn.Module):
    def __init__(self, k, n, bias, dtype):
        super().__init__()
        self.q_proj = nn.Linear(k, n, bias=bias, dtype=dtype)
        self.other = nn.Linear(n, 3, dtype=dtype)

    def forward(self, x):
        return self.q_proj(x)


class _SeededDropout(nn.Module):
    """PEFT's lora_dropout replaced by fastllm's mask for one seed: PEFT and fastllm then compute
    the same function, so their outputs and grads can be compared with dropout on."""

    def __init__(self, p, seed):
        super().__init__()
        self.p, self.seed = p, seed

    def forward(self, x):
        k = x.shape[-1]
        return lora_dropout_ref(x.reshape(-1, k), self.p, self.seed).reshape(x.shape)


def _peft_lora_layer(peft_model, name):
    return peft_model.base_model.model.get_submodule(name)


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def _randomise_lora(model, std=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_modules(model):
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g) * std)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * std)


def _err(got, oracle):
    return (got.double() - oracle.double()).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("r,dropout", [(1, 0.0), (16, 0.0), (64, 0.0), (5, 0.2)])
def test_layer_matches_peft(dtype, bias, r, dropout):
    torch.manual_seed(0)
    k, n, alpha = 123, 77, 24
    tiny = Tiny(k, n, bias, dtype)
    ours = inject_lora(copy.deepcopy(tiny), target_modules=["q_proj"], r=r, alpha=alpha,
                       dropout=dropout).train()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj"],
                             lora_dropout=dropout)
    theirs = peft.get_peft_model(copy.deepcopy(tiny), config, autocast_adapter_dtype=False).train()
    layer, peft_layer = ours.q_proj, _peft_lora_layer(theirs, "q_proj")
    torch.manual_seed(7)
    seed = int(new_dropout_seed())  # the seed fastllm's layer draws after the same manual_seed
    if dropout:
        peft_layer.lora_dropout["default"] = _SeededDropout(dropout, seed)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
        peft_layer.lora_A["default"].weight.copy_(layer.lora_A)
        peft_layer.lora_B["default"].weight.copy_(layer.lora_B)
    assert layer.scaling == peft_layer.scaling["default"]

    x = torch.randn(5, 9, k).to(dtype)
    g = torch.randn(5, 9, n).to(dtype)
    results = []
    for model, a, b in ((ours, layer.lora_A, layer.lora_B),
                        (theirs, peft_layer.lora_A["default"].weight,
                         peft_layer.lora_B["default"].weight)):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        y = model(xi)
        results.append([y, *torch.autograd.grad(y, (xi, a, b), g)])
    # PyTorch's own error at this precision: the plain composition, run in `dtype`
    xi, ai, bi = (t.detach().clone().requires_grad_() for t in (x, layer.lora_A, layer.lora_B))
    y_lp = lora_linear_ref(xi, layer.weight, ai, bi, layer.scaling, layer.bias, dropout, seed)
    torch_lp = [y_lp, *torch.autograd.grad(y_lp, (xi, ai, bi), g)]

    x64 = x.double().requires_grad_()
    a64 = layer.lora_A.detach().double().requires_grad_()
    b64 = layer.lora_B.detach().double().requires_grad_()
    bias64 = None if not bias else layer.bias.detach().double()
    y64 = lora_linear_ref(x64, layer.weight.double(), a64, b64, layer.scaling, bias64, dropout,
                          seed)
    oracle = [y64, *torch.autograd.grad(y64, (x64, a64, b64), g.double())]
    for name, u, v, t, o in zip(["y", "dx", "dA", "dB"], *results, torch_lp, oracle):
        scale = o.abs().max().item()
        if dtype == torch.float32:
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5 * scale)
        else:
            # no worse than twice PEFT's error, and than twice PyTorch's plain composition's
            floor = 1e-3 * torch.finfo(dtype).eps * scale
            for who, ref in (("PEFT", v), ("PyTorch", t)):
                assert _err(u, o) <= 2 * _err(ref, o) + floor, (
                    f"{name}: {_err(u, o):.3g} vs {who}'s {_err(ref, o):.3g}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_fp32_adapters_match_peft_autocast_adapter_dtype(dtype, dora):
    """adapter_dtype=torch.float32 on a bf16/fp16 model, as PEFT's get_peft_model does by default
    (autocast_adapter_dtype=True): fp32 adapters and adapter grads, y and dx in the model's dtype,
    each no further from PEFT run in fp64 than twice PEFT's own error (LoRA with dropout, DoRA
    with the magnitude's grad); DoRA with dropout against PEFT on the same mask."""
    from fastllm.dora import inject_dora

    torch.manual_seed(0)
    k, n, r, alpha, dropout = 123, 77, 5, 10, 0.2
    tiny = Tiny(k, n, True, dtype)
    inject = inject_dora if dora else inject_lora
    ours = inject(copy.deepcopy(tiny), target_modules=["q_proj"], r=r, alpha=alpha,
                  dropout=0.0 if dora else dropout, adapter_dtype=torch.float32).train()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj"], use_dora=dora,
                             lora_dropout=0.0 if dora else dropout)
    theirs = peft.get_peft_model(copy.deepcopy(tiny), config).train()  # fp32 adapters
    layer, peft_layer = ours.q_proj, _peft_lora_layer(theirs, "q_proj")
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
    assert peft_layer.lora_A["default"].weight.dtype == torch.float32
    torch.manual_seed(7)
    seed = int(new_dropout_seed())
    if not dora:
        peft_layer.lora_dropout["default"] = _SeededDropout(dropout, seed)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
        peft_layer.lora_A["default"].weight.copy_(layer.lora_A)
        peft_layer.lora_B["default"].weight.copy_(layer.lora_B)
        if dora:
            layer.lora_magnitude_vector.mul_(1.1)
            peft_layer.lora_magnitude_vector["default"].weight.copy_(layer.lora_magnitude_vector)
    wide = copy.deepcopy(theirs).double()  # the oracle: PEFT in fp64, the same mask
    wide_layer = _peft_lora_layer(wide, "q_proj")

    def params(model_layer, peft_side):
        if not peft_side:
            extra = [model_layer.lora_magnitude_vector] if dora else []
            return [model_layer.lora_A, model_layer.lora_B, *extra]
        extra = [model_layer.lora_magnitude_vector["default"].weight] if dora else []
        return [model_layer.lora_A["default"].weight, model_layer.lora_B["default"].weight,
                *extra]

    x = torch.randn(5, 9, k).to(dtype)
    g = torch.randn(5, 9, n).to(dtype)
    results = []
    for model, model_layer, peft_side, wide_side in ((ours, layer, False, False),
                                                      (theirs, peft_layer, True, False),
                                                      (wide, wide_layer, True, True)):
        xi = (x.double() if wide_side else x.clone()).requires_grad_()
        torch.manual_seed(7)
        y = model(xi)
        gi = g.double() if wide_side else g
        results.append([y, *torch.autograd.grad(y, (xi, *params(model_layer, peft_side)), gi)])
    names = ["y", "dx", "dA", "dB"] + (["dmagnitude"] if dora else [])
    dtypes = [dtype, dtype] + [torch.float32] * (3 if dora else 2)
    for name, u, v, o, dt in zip(names, *results, dtypes):
        assert u.dtype == v.dtype == dt, name
        floor = 1e-3 * torch.finfo(dtype).eps * o.abs().max().item()
        assert _err(u, o) <= 2 * _err(v, o) + floor, (
            f"{name}: {_err(u, o):.3g} vs PEFT's {_err(v, o):.3g}")
    if dora:  # with dropout: the same torch.manual_seed gives both sides the same mask
        layer.dropout = 0.2
        peft_layer.lora_dropout["default"] = torch.nn.Dropout(0.2)
        outs = []
        for model, model_layer, peft_side in ((ours, layer, False), (theirs, peft_layer, True)):
            xi = x.clone().requires_grad_()
            torch.manual_seed(3)
            y = model(xi)
            outs.append([y, *torch.autograd.grad(y, (xi, *params(model_layer, peft_side)), g)])
        for name, u, v in zip(names, *outs):
            scale = v.double().abs().max().item()
            assert _err(u, v) <= 4 * torch.finfo(dtype).eps * scale, name
    with pytest.raises(ValueError, match=r"adapter_dtype must be None .* or torch.float32 on a "
                                         r"bf16/fp16 base; got torch\.(b?float16) on"):
        inject_lora(copy.deepcopy(tiny), target_modules=["q_proj"], adapter_dtype=torch.float16
                    if dtype == torch.bfloat16 else torch.bfloat16)


def test_inject_freezes_everything_else_and_rejects_no_match():
    model = _tiny_llama()
    inject_lora(model, target_modules=["q_proj", "v_proj"], r=4, alpha=8)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A" in n or ".lora_B" in n for n in names)
    assert len(lora_modules(model)) == 4  # 2 layers x (q, v)
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoRALinear)
    assert not isinstance(model.model.layers[0].self_attn.k_proj, LoRALinear)
    with pytest.raises(ValueError, match="no nn.Linear"):
        inject_lora(_tiny_llama(), target_modules=["nope"])


@pytest.mark.parametrize("targets,says", [
    (["q_proj", "embed_tokens"], r"'embed_tokens' selects model.embed_tokens \(Embedding\)"),
    (r".*\.(q_proj|embed_tokens)", r"selects model.embed_tokens \(Embedding\)"),
    (["q_proj", "mlp"], r"'mlp' selects model.layers.0.mlp \(LlamaMLP\) \(and 1 more"),
    (r".*mlp.*", r"selects model.layers.0.mlp \(LlamaMLP\) \(and 3 more"),
])
def test_inject_refuses_a_target_that_selects_a_module_it_cannot_adapt(targets, says):
    # PEFT adapts embed_tokens (an nn.Embedding): fastllm left it out without a word and saved
    # target_modules ['q_proj']; PEFT refuses a LlamaMLP, which fastllm skipped
    model = _tiny_llama()
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=f"fastllm.lora.inject_lora: target_modules entry .*{says}.*"
                                         "nn.Linear layers only"):
        inject_lora(model, target_modules=targets, r=4, alpha=8)
    after = dict(model.named_parameters())
    assert not lora_modules(model) and after.keys() == before.keys()
    assert all(torch.equal(after[n], w) and after[n].requires_grad == g
               for n, (w, g) in before.items())
    if "mlp" in str(targets):
        with pytest.raises(ValueError, match="(?s)LlamaMLP.* is not supported"):
            peft.get_peft_model(_tiny_llama(), peft.LoraConfig(target_modules=targets))


def test_train_config_target_modules_naming_an_embedding_is_refused(tmp_path):
    from fastllm.train.config import ConfigError, TrainConfig
    from fastllm.train.model import apply_finetune, build_model
    from fastllm.train.preflight import check_lora_targets

    cfg = TrainConfig.from_dict(dict(model="tiny", finetune="lora", output_dir=str(tmp_path),
                                     lora=dict(target_modules=["q_proj", "embed_tokens"])))
    with pytest.raises(ConfigError, match="no nn.Linear in the model matches 'embed_tokens'"):
        check_lora_targets(cfg)  # before the run writes anything
    model = build_model(cfg, 257, torch.float32)
    with pytest.raises(ValueError, match=r"selects model.embed_tokens \(Embedding\)"):
        apply_finetune(model, cfg)  # the trainer's own check, for callers that skip preflight
    assert not lora_modules(model)


def test_tiny_llama_finetune_loss_falls_and_only_lora_changes():
    model = _tiny_llama()
    inject_lora(model, target_modules=["q_proj", "v_proj"], r=8, alpha=16, dropout=0.05)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 24))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(20):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses  # a fixed batch: the LoRA layers fit it
    assert sum(losses[10:]) < sum(losses[:10]), losses
    for n, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[n])
        assert changed == (".lora_A" in n or ".lora_B" in n), n


def test_merge_unmerge_and_refusal():
    model = _tiny_llama()
    inject_lora(model, target_modules=["q_proj", "v_proj", "down_proj"], r=4, alpha=8)
    _randomise_lora(model, std=0.2)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        merge_lora(model)
        merged = model(input_ids=ids).logits
        assert all(m.merged for _, m in lora_modules(model))
        torch.testing.assert_close(merged, ref, rtol=1e-4, atol=1e-4)
        unmerge_lora(model)
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p, weights[n], rtol=0, atol=1e-6)

        # One layer whose merge overflows: nothing may change, in any layer.
        last = lora_modules(model)[-1][1]
        last.lora_B.fill_(1e30)
        last.lora_A.fill_(1e30)
        snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match="non-finite"):
            merge_lora(model)
        for n, p in model.named_parameters():
            assert torch.equal(p, snapshot[n]), n
        assert not any(m.merged for _, m in lora_modules(model))


def test_fastllm_adapter_loads_in_peft(tmp_path):
    model = _tiny_llama()
    inject_lora(model, target_modules=["q_proj", "v_proj"], r=4, alpha=8)
    _randomise_lora(model)
    save_adapter(model, str(tmp_path), task_type="CAUSAL_LM")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj"]

    peft_model = peft.PeftModel.from_pretrained(_tiny_llama(), str(tmp_path)).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    plain = _tiny_llama()(input_ids=ids).logits
    assert not torch.allclose(ours, plain, atol=1e-3)  # the adapter actually does something


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_adapter_loads_in_fastllm(tmp_path, use_rslora):
    config = peft.LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "o_proj", "up_proj"],
                             lora_dropout=0.1, use_rslora=use_rslora,
                             rank_pattern={"model.layers.1.self_attn.o_proj": 2},
                             task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(_tiny_llama(), config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.save_pretrained(str(tmp_path))
    assert os.path.exists(tmp_path / "adapter_model.safetensors")

    model = load_adapter(_tiny_llama(), str(tmp_path)).eval()
    layers = dict(lora_modules(model))
    assert len(layers) == 6 and layers["model.layers.1.self_attn.o_proj"].r == 2
    assert all(m.use_rslora == use_rslora and m.dropout == 0.1 for m in layers.values())
    ids = torch.randint(0, 128, (2, 16))
    peft_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)

    # and back: fastllm saves it again, PEFT reads the round trip with the same outputs
    out = tmp_path / "again"
    save_adapter(model, str(out), task_type="CAUSAL_LM")
    again = peft.PeftModel.from_pretrained(_tiny_llama(), str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_load_adapter_rejects_mismatch(tmp_path):
    model = _tiny_llama()
    inject_lora(model, target_modules=["q_proj"], r=4)
    save_adapter(model, str(tmp_path))
    other = inject_lora(_tiny_llama(), target_modules=["v_proj"], r=4)
    with pytest.raises(ValueError, match="disagree"):
        load_adapter(other, str(tmp_path))


@pytest.mark.parametrize("change,says", [
    ({"r": 0}, "r must be an integer >= 1"),
    ({"r": 2.5}, "r must be an integer >= 1"),
    ({"lora_alpha": float("inf")}, "alpha must be a finite number"),
    ({"lora_dropout": 1.0}, "dropout must be in"),
    ({"rank_pattern": {"v_proj": 0}}, "v_proj: r must be an integer"),
])
def test_refused_adapter_config_leaves_the_model_unchanged(tmp_path, change, says):
    model = _tiny_llama()
    inject_lora(model, target_modules=["q_proj", "v_proj"], r=4)
    save_adapter(model, str(tmp_path))
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(change)
    path.write_text(json.dumps(config))
    fresh = _tiny_llama()
    before = {n: (p.requires_grad, p.detach().clone()) for n, p in fresh.named_parameters()}
    modules = [n for n, _ in fresh.named_modules()]
    with pytest.raises(ValueError, match=says):
        load_adapter(fresh, str(tmp_path))
    assert [n for n, _ in fresh.named_modules()] == modules  # nothing injected
    for n, p in fresh.named_parameters():
        assert p.requires_grad == before[n][0] and torch.equal(p, before[n][1]), n


def _saved_activation_bytes(module, x):
    params = {p.data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        # activations only: not parameters, not x, not 0-dim scalars (fastllm's dropout seed)
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr() and t.dim() > 0:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_activations_no_more_than_peft(dropout):
    """Beyond x itself (kept by the caller anyway), fastllm keeps only the r-wide xa."""
    tiny = Tiny(256, 192, True, torch.float32)
    ours = inject_lora(copy.deepcopy(tiny), ["q_proj"], r=8, dropout=dropout).train()
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], lora_dropout=dropout)
    theirs = peft.get_peft_model(copy.deepcopy(tiny), config).train()
    x = torch.randn(64, 256, requires_grad=True)
    ours_bytes = _saved_activation_bytes(ours, x)
    peft_bytes = _saved_activation_bytes(theirs, x)
    assert ours_bytes == 64 * 8 * 4  # xa (64 x 8 fp32)
    assert ours_bytes <= peft_bytes


# Defects found using fastllm inside real clients (issue 11, item 9): each test failed before.


def test_inject_twice_says_already_injected():
    model = inject_lora(_tiny_llama(), target_modules=["q_proj"], r=4)
    for targets in (["q_proj"], r".*q_proj.*"):  # the regex would also match q_proj.base_layer
        with pytest.raises(ValueError, match="already injected"):
            inject_lora(model, target_modules=targets, r=4)
    assert len(lora_modules(model)) == 2
    assert not any(isinstance(m.base_layer, LoRALinear) for _, m in lora_modules(model))


def test_save_adapter_keeps_a_regex_target(tmp_path, recwarn):
    regex = r".*layers\.0\.self_attn\.q_proj"
    model = inject_lora(_tiny_llama(), target_modules=regex, r=4, alpha=8)
    _randomise_lora(model)
    assert [n for n, _ in lora_modules(model)] == ["model.layers.0.self_attn.q_proj"]
    save_adapter(model, str(tmp_path), task_type="CAUSAL_LM")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == regex

    peft_model = peft.PeftModel.from_pretrained(_tiny_llama(), str(tmp_path)).eval()
    adapted = [n for n, m in peft_model.named_modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert adapted == ["base_model.model.model.layers.0.self_attn.q_proj"]
    assert not [w for w in recwarn if "missing" in str(w.message).lower()]
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    # and fastllm reads its own regex back onto the same single layer
    again = load_adapter(_tiny_llama(), str(tmp_path))
    assert [n for n, _ in lora_modules(again)] == ["model.layers.0.self_attn.q_proj"]


@pytest.mark.parametrize("wrap", ["compile", "data_parallel"])
def test_a_wrapped_model_saves_and_loads_peft_names(tmp_path, recwarn, wrap):
    """`model = torch.compile(model)` (or DDP / DataParallel) puts `_orig_mod.` (`module.`)
    before every module name: save_adapter wrote those into the keys, PEFT loaded none of them
    (a warning, the base model's outputs) and load_adapter refused fastllm's own file. Both now
    work on the model inside; load_adapter returns the wrapper it was given."""
    def wrapped(model):
        if wrap == "compile":
            return torch.compile(model, backend="eager")
        return nn.DataParallel(model)

    model = inject_lora(_tiny_llama(), target_modules=["q_proj", "v_proj"], r=4, alpha=8)
    _randomise_lora(model)
    save_adapter(wrapped(model), str(tmp_path), task_type="CAUSAL_LM")
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "adapter_model.safetensors")) == sorted(
        f"base_model.model.{n}.lora_{ab}.weight" for n, _ in lora_modules(model) for ab in "AB")
    peft_model = peft.PeftModel.from_pretrained(_tiny_llama(), str(tmp_path)).eval()
    assert not [w for w in recwarn if "missing" in str(w.message).lower()]
    fresh = wrapped(_tiny_llama())
    assert load_adapter(fresh, str(tmp_path)) is fresh
    inner = fresh._orig_mod if wrap == "compile" else fresh.module
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inner(input_ids=ids).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("merge", [True, False], ids=["merge_and_unload", "unload"])
def test_merge_and_unload_gives_the_plain_model(tmp_path, merge):
    plain = _tiny_llama()
    model = inject_lora(_tiny_llama(), target_modules=["q_proj", "v_proj"], r=4, alpha=8)
    _randomise_lora(model, std=0.2)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        with_lora = model(input_ids=ids).logits
        out = merge_and_unload(model) if merge else unload(model)
        assert out is model and not lora_modules(model)
        assert sorted(model.state_dict()) == sorted(plain.state_dict())  # no base_layer, no lora_
        assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
        got = model(input_ids=ids).logits
        if merge:
            torch.testing.assert_close(got, with_lora, rtol=1e-4, atol=1e-4)
        else:
            for n, p in model.state_dict().items():
                assert torch.equal(p, plain.state_dict()[n]), n
        # a plain from_pretrained of the saved model starts from these weights, not random ones
        model.save_pretrained(str(tmp_path))
        reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, got, rtol=1e-5, atol=1e-5)
    inject_lora(model, target_modules=["q_proj"], r=2)  # and LoRA can be injected again


def test_merge_and_unload_of_an_already_merged_model():
    model = inject_lora(_tiny_llama(), target_modules=["q_proj"], r=4)
    _randomise_lora(model, std=0.2)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        merge_lora(model)
        merge_and_unload(model)  # merges nothing twice
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-4, atol=1e-4)


def test_load_adapter_accepts_peft_lm_head(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    peft_model = peft.get_peft_model(_tiny_llama(), config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    with pytest.warns(UserWarning, match="embedding"):
        peft_model.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.base_layer.weight" in saved  # what made it fail before

    model = load_adapter(_tiny_llama(), str(tmp_path)).eval()
    assert "lm_head" in dict(lora_modules(model))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits,
                                   peft_model.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_load_adapter_refusal_leaves_the_model_unchanged(tmp_path):
    model = inject_lora(_tiny_llama(), target_modules=["q_proj"], r=4)
    save_adapter(model, str(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["r"] = 3  # the weights say 4
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    fresh = _tiny_llama()
    with pytest.raises(ValueError, match="in the adapter"):
        load_adapter(fresh, str(tmp_path))
    assert not lora_modules(fresh)
    assert all(p.requires_grad for p in fresh.parameters())


def test_all_linear_targets_what_peft_targets():
    """target_modules="all-linear" (PEFT's shorthand): every nn.Linear but the LM head, the same
    layers PEFT adapts; fastllm train's lora.target_modules=[all-linear] takes the same."""
    from fastllm.train.config import TrainConfig
    from fastllm.train.model import apply_finetune

    theirs = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(target_modules="all-linear"))
    want = sorted(n.removeprefix("base_model.model.") for n, m in theirs.named_modules()
                  if hasattr(m, "lora_A") and isinstance(m.base_layer, nn.Linear))
    assert len(want) == 14 and not any("lm_head" in n for n in want)
    ours = inject_lora(_tiny_llama(), target_modules="all-linear")
    assert sorted(n for n, _ in lora_modules(ours)) == want
    cfg = TrainConfig.from_args(["model=tiny", "finetune=lora", "lora.target_modules=[all-linear]"])
    trained = apply_finetune(_tiny_llama(), cfg)
    assert sorted(n for n, _ in lora_modules(trained)) == want


@pytest.mark.parametrize("kwargs,says", [
    (dict(target_modules=None), "target_modules=None; need a regex or a list of names"),
    (dict(target_modules=["q_proj", 5]), r"target_modules=\['q_proj', 5\]; need a regex"),
    (dict(target_modules="(q"), r"target_modules '\(q', which is not a valid regex"),
    (dict(rank_pattern=["q_proj"]), r"rank_pattern=\['q_proj'\]; need an object"),
    (dict(rank_pattern={"(q": 2}), r"rank_pattern key '\(q', which is not a valid regex"),
    (dict(use_rslora="false"), "use_rslora='false'; need true or false"),
])
def test_inject_refuses_ill_typed_arguments_by_name(kwargs, says):
    """Before: a bare TypeError or re.error naming no argument, or use_rslora="false" turning
    rsLoRA on (and saved as true)."""
    model = _tiny_llama()
    with pytest.raises(ValueError, match="fastllm.lora.inject_lora: " + says):
        inject_lora(model, **{"target_modules": ["q_proj"], **kwargs})
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())
    if "use_rslora" in kwargs:
        with pytest.raises(ValueError, match="use_rslora must be True or False, got 'false'"):
            LoRALinear(nn.Linear(4, 4), use_rslora="false")
