"""fastllm.lora's adapter_config.json against PEFT's: the fields it refuses, the pattern keys, the
target_modules it saves, loading into LoRA layers already there, minimal files, and merging a
tied lm_head. Each test failed before its fix (audit of fastllm/lora.py)."""

import dataclasses
import json

import pytest
import torch
from packaging.version import Version

from fastllm import adapter_files, lora
from fastllm.lora import inject_lora, load_adapter, lora_modules, merge_and_unload, merge_lora
from fastllm.lora import save_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _tiny_llama(tie=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager", tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


def _randomise(peft_model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return peft_model.eval()


def _peft_adapter(path, **config):
    config = dict(dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), **config)
    model = _randomise(peft.get_peft_model(_tiny_llama(), peft.LoraConfig(**config)))
    model.save_pretrained(str(path))
    return model


def _edit(path, **change):
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    for key, value in change.items():
        if value is dataclasses.MISSING:
            config.pop(key, None)
        else:
            config[key] = value
    file.write_text(json.dumps(config))


def _assert_same_logits(ours, theirs):
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS).logits, theirs(input_ids=IDS).logits,
                                   rtol=1e-5, atol=1e-5)


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return None if field.default_factory is dataclasses.MISSING else field.default_factory()


def test_every_peft_lora_field_is_read_ignored_or_refused():
    """Every field of the PEFT release adapter_files classifies is read, ignored or refused. A
    newer PEFT's new fields are refused when set (check_lora_config), so such a release cannot
    make an adapter load into something else; but an adapter it saves with its defaults must
    still load: each new field's default must be off (None, False, empty). (Failing on every
    PEFT release would fail CI on a date, not on a change.)"""
    known = adapter_files._READ.keys() | adapter_files._IGNORED | adapter_files._REFUSED.keys()
    new = {f.name: _default(f) for f in dataclasses.fields(peft.LoraConfig)
           if f.name not in known}
    assert all(adapter_files._empty(value) for value in new.values()), new
    if Version(peft.__version__) <= Version(adapter_files.PEFT_CLASSIFIED):
        assert not new


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga",
                                  "astra", "some_new_init"])
def test_base_rewriting_or_unknown_init_is_refused(tmp_path, init):
    _peft_adapter(tmp_path)
    _edit(tmp_path, init_lora_weights=init)
    fresh = _tiny_llama()
    with pytest.raises(ValueError, match=f"init_lora_weights='{init}'"):
        load_adapter(fresh, str(tmp_path))
    assert not lora_modules(fresh)


def test_a_real_pissa_adapter_is_refused(tmp_path):
    _peft_adapter(tmp_path, init_lora_weights="pissa")
    with pytest.raises(ValueError, match="init_lora_weights='pissa'.*base weights"):
        load_adapter(_tiny_llama(), str(tmp_path))


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "mica", "eva", "nora"])
def test_inits_that_only_draw_a_and_b_load(tmp_path, init):
    theirs = _peft_adapter(tmp_path)
    _edit(tmp_path, init_lora_weights=init)
    _assert_same_logits(load_adapter(_tiny_llama(), str(tmp_path)), theirs)


@pytest.mark.parametrize("change,says", [
    ({"alora_invocation_tokens": [7, 8]}, r"alora_invocation_tokens=\[7, 8\]"),
    ({"use_qalora": True}, "use_qalora=True"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters="),
    ({"velora_config": {"num_groups": 2}}, "velora_config="),
    ({"a_future_option": {"k": 1}}, "a_future_option=.*does not know"),
    ({"a_future_switch": True}, "a_future_switch=True"),
    ({"target_modules": "all-linear"}, "all-linear"),
    ({"target_modules": dataclasses.MISSING}, "no target_modules"),
    ({"target_modules": None}, "no target_modules"),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, change, says):
    _peft_adapter(tmp_path)
    _edit(tmp_path, **change)
    fresh = _tiny_llama()
    with pytest.raises(ValueError, match=says):
        load_adapter(fresh, str(tmp_path))
    assert not lora_modules(fresh)


def test_off_values_and_metadata_load(tmp_path):
    theirs = _peft_adapter(tmp_path)
    _edit(tmp_path, a_future_option=None, a_future_switch=False, a_future_list=[],
          ensure_weight_tying=True, revision="main", eva_config={"rho": 2.0}, megatron_core="x",
          exclude_modules=[], layers_pattern=None, peft_version="9.9")
    _assert_same_logits(load_adapter(_tiny_llama(), str(tmp_path)), theirs)


def test_minimal_config_takes_peft_defaults(tmp_path):
    theirs = _peft_adapter(tmp_path, r=8, lora_alpha=8)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"]}))
    ours = load_adapter(_tiny_llama(), str(tmp_path))
    assert {(m.r, m.alpha) for _, m in lora_modules(ours)} == {(8, 8)}
    _assert_same_logits(ours, theirs)
    _assert_same_logits(ours, peft.PeftModel.from_pretrained(_tiny_llama(), str(tmp_path)))


@pytest.mark.parametrize("pattern", [
    {r"layers\.1\..*": 64},                       # a regex over the last components
    {"q_proj|v_proj": 64},                        # an alternation of suffixes
    {"q_proj": 2, r"layers\.0\..*": 64},          # the first matching key wins
    {"model.layers.1.self_attn.q_proj": 64},      # a full name
])
def test_alpha_pattern_keys_match_as_in_peft(tmp_path, pattern):
    _peft_adapter(tmp_path, alpha_pattern=pattern)
    # PEFT's reload, not the model it saved: its json has the keys sorted, which can change
    # the first match (layers\.0\..* before q_proj)
    theirs = peft.PeftModel.from_pretrained(_tiny_llama(), str(tmp_path)).eval()
    ours = load_adapter(_tiny_llama(), str(tmp_path))
    for name, layer in lora_modules(ours):
        assert layer.scaling == theirs.base_model.model.get_submodule(name).scaling["default"]
    _assert_same_logits(ours, theirs)


def test_rank_pattern_regex_matches_as_in_peft(tmp_path):
    theirs = _peft_adapter(tmp_path, rank_pattern={r"layers\.1\.self_attn\..*": 2})
    ours = load_adapter(_tiny_llama(), str(tmp_path))
    assert {n: m.r for n, m in lora_modules(ours)}["model.layers.1.self_attn.v_proj"] == 2
    _assert_same_logits(ours, theirs)


@pytest.mark.parametrize("change,says", [
    ({"lora_alpha": 32}, "alpha=8, the adapter alpha=32"),
    ({"use_rslora": True}, "use_rslora=False, the adapter use_rslora=True"),
    ({"lora_dropout": 0.1}, "dropout=0.0, the adapter dropout=0.1"),
    ({"alpha_pattern": {"v_proj": 4}}, "v_proj has alpha=8, the adapter alpha=4"),
])
def test_load_into_lora_layers_checks_their_settings(tmp_path, change, says):
    _peft_adapter(tmp_path, **change)
    model = inject_lora(_tiny_llama(), target_modules=["q_proj", "v_proj"], r=4, alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=says):
        load_adapter(model, str(tmp_path))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_load_into_lora_layers_with_the_same_settings(tmp_path):
    theirs = _peft_adapter(tmp_path, lora_alpha=32, use_rslora=True,
                           rank_pattern={"model.layers.1.self_attn.q_proj": 2})
    model = inject_lora(_tiny_llama(), target_modules=["q_proj", "v_proj"], r=4, alpha=32,
                        use_rslora=True, rank_pattern={"model.layers.1.self_attn.q_proj": 2})
    _assert_same_logits(load_adapter(model, str(tmp_path)), theirs)


@pytest.mark.parametrize("targets,saved", [
    (["model.layers.0.self_attn.q_proj"], ["model.layers.0.self_attn.q_proj"]),
    # (".*mlp.*" and "model\.layers\.0\.mlp\..*" select LlamaMLP or act_fn: refused by both)
    (r".*mlp\..*_proj", r".*mlp\..*_proj"),
    (["layers.0.mlp.down_proj", "layers.0.mlp.up_proj"], ["model.layers.0.mlp.down_proj",
                                                          "model.layers.0.mlp.up_proj"]),
    (r".*\.layers\.1\.self_attn\.(q|v)_proj", r".*\.layers\.1\.self_attn\.(q|v)_proj"),
    (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
])
def test_saved_target_modules_select_exactly_the_adapted_layers(tmp_path, targets, saved):
    model = inject_lora(_tiny_llama(), target_modules=targets, r=4, alpha=8)
    with torch.no_grad():
        for _, layer in lora_modules(model):
            layer.lora_B.normal_(0, 0.05)
    adapted = sorted(n for n, _ in lora_modules(model))
    save_adapter(model, str(tmp_path), task_type="CAUSAL_LM")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == saved
    again = load_adapter(_tiny_llama(), str(tmp_path))
    assert sorted(n for n, _ in lora_modules(again)) == adapted
    theirs = peft.PeftModel.from_pretrained(_tiny_llama(), str(tmp_path)).eval()
    prefix = "base_model.model."
    assert sorted(n[len(prefix):] for n, m in theirs.named_modules()
                  if isinstance(m, peft.tuners.lora.Linear)) == adapted
    _assert_same_logits(again, model)
    _assert_same_logits(theirs, model)


def test_merge_refuses_a_tied_lm_head():
    model = _tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inject_lora(model, target_modules=["q_proj", "lm_head"], r=4, alpha=8)
    with torch.no_grad():
        for _, layer in lora_modules(model):
            layer.lora_B.normal_(0, 0.05)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for merge in (merge_lora, merge_and_unload):
        with pytest.raises(ValueError, match="lm_head is shared with model.embed_tokens.weight"):
            merge(model)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert not any(m.merged for _, m in lora_modules(model))


# ----- a config or tensors that disagree, refused before the model changes (review s12) -----

def _own_adapter(path, **inject):
    model = inject_lora(_tiny_llama(), **dict(dict(target_modules=["q_proj", "v_proj"], r=4,
                                                    alpha=8), **inject))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    save_adapter(model, str(path))
    return model


def _state(model):
    return ([(n, type(m).__name__) for n, m in model.named_modules()],
            {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()})


def _unchanged(model, before):
    modules, params = _state(model)
    return modules == before[0] and params.keys() == before[1].keys() and all(
        torch.equal(params[k][0], before[1][k][0]) and params[k][1] == before[1][k][1]
        for k in params)


@pytest.mark.parametrize("change", [dict(r=10**12),
                                    dict(rank_pattern={"layers.1.self_attn.v_proj": 10**12}),
                                    dict(target_modules=["q_proj", "v_proj", "k_proj"])])
def test_a_config_disagreeing_with_the_tensors_is_refused_before_injecting(tmp_path, change):
    """A corrupt r allocated (r, in) matrices first: a RuntimeError and a half-injected, frozen
    model. The shapes are checked against the file before any layer is built."""
    _own_adapter(tmp_path)
    _edit(tmp_path, **change)
    model = _tiny_llama().train()
    before = _state(model)
    with pytest.raises(ValueError, match=r"disagree.*lora_A\.weight should be"):
        load_adapter(model, str(tmp_path))
    assert _unchanged(model, before)


def test_any_exception_while_loading_restores_the_model(tmp_path, monkeypatch):
    _own_adapter(tmp_path)
    model = _tiny_llama().train()
    before = _state(model)

    def fails(model, state):
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(lora, "_load_state", fails)
    with pytest.raises(RuntimeError, match="simulated"):
        load_adapter(model, str(tmp_path))
    assert _unchanged(model, before)


def test_inject_failing_midway_restores_the_model():
    built = []

    class FailsSecond(lora.LoRALinear):
        def __init__(self, *args, **kwargs):
            if built:
                raise RuntimeError("simulated out of memory")
            super().__init__(*args, **kwargs)
            built.append(self)

    model = _tiny_llama().train()
    before = _state(model)
    with pytest.raises(RuntimeError, match="simulated"):
        inject_lora(model, target_modules=["q_proj"], layer_cls=FailsSecond)
    assert built and _unchanged(model, before)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8, torch.complex64,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("into", ["plain", "lora", "dora"])
def test_tensors_of_a_non_float_dtype_are_refused(tmp_path, dtype, into):
    """copy_ cast them silently (int64 lora_B rounded, complex dropped its imaginary part)."""
    from safetensors.torch import load_file, save_file

    from fastllm import dora

    src = _own_adapter(tmp_path, layer_cls=dora.DoRALinear if into == "dora" else None)
    file = str(tmp_path / "adapter_model.safetensors")
    tensors = load_file(file)
    key = sorted(tensors)[-1]  # the last: the others are copied first
    good = tensors[key]
    tensors[key] = good.to(dtype)
    save_file(tensors, file)
    model = _tiny_llama()
    if into != "plain":
        inject_lora(model, target_modules=["q_proj", "v_proj"], r=4, alpha=8,
                    layer_cls=dora.DoRALinear if into == "dora" else None)
    before = _state(model)
    loader = dora.load_adapter if into == "dora" else load_adapter
    with pytest.raises(ValueError, match=f"holds {key} as {dtype}"):
        loader(model, str(tmp_path))
    assert _unchanged(model, before)
    tensors[key] = good.to(torch.float16)  # a float dtype loads, cast as PEFT does
    save_file(tensors, file)
    loaded = loader(_tiny_llama(), str(tmp_path))
    assert dict(loaded.named_parameters()).keys() == dict(src.named_parameters()).keys()


@pytest.mark.parametrize("change,says", [
    (dict(rank_pattern=["q_proj"]), r"rank_pattern=\['q_proj'\]; need an object"),
    (dict(alpha_pattern="q_proj"), "alpha_pattern='q_proj'; need an object"),
    (dict(rank_pattern={"(q": 2}), r"rank_pattern key '\(q', which is not a valid regex"),
    (dict(target_modules="(q"), r"target_modules '\(q', which is not a valid regex"),
    (dict(use_rslora="false"), "use_rslora='false'; need true or false"),
])
def test_ill_typed_config_fields_are_refused_by_name(tmp_path, change, says):
    _own_adapter(tmp_path)
    _edit(tmp_path, **change)
    model = _tiny_llama()
    before = _state(model)
    with pytest.raises(ValueError, match="adapter_config.json has " + says):
        load_adapter(model, str(tmp_path))
    assert _unchanged(model, before)


class _Boom:
    def __reduce__(self):  # what an unsafe unpickling would run
        return (exec, ("raise SystemExit('unpickled')",))


def test_an_adapter_model_bin_is_read_with_weights_only(tmp_path):
    """PEFT's safe_serialization=False (older PEFT's default) writes adapter_model.bin: it failed
    with a raw FileNotFoundError for adapter_model.safetensors. Read with weights_only=True: a
    file holding other objects is refused by name, nothing run."""
    theirs = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _randomise(theirs).save_pretrained(str(tmp_path / "a"), safe_serialization=False)
    assert (tmp_path / "a" / "adapter_model.bin").exists()
    assert not (tmp_path / "a" / "adapter_model.safetensors").exists()
    _assert_same_logits(load_adapter(_tiny_llama(), str(tmp_path / "a")), theirs)
    weights = torch.load(tmp_path / "a" / "adapter_model.bin", weights_only=True)
    torch.save({**weights, "extra": _Boom()}, tmp_path / "a" / "adapter_model.bin")
    model = _tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"adapter_model\.bin is not a PyTorch state dict"):
        load_adapter(model, str(tmp_path / "a"))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
